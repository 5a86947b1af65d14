"""The capture file's schema on its own: written by ``write_capture_file``, read back and checked by
``read_capture_file``, found by ``capture_files``; damaged entries are named (no training run here)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from stabletrain.debug.nan_capture import (
    FILE_NAME,
    FORMAT,
    UNSHARDED_VERSION,
    VERSION,
    NaNCaptureError,
    capture_files,
    read_capture_file,
    schema_problems,
    write_capture_file,
)
from stabletrain.utils.rng import raw_rng_state


def _write(path: Path, **overrides):
    """A two-microbatch capture of a 3 -> 2 linear layer, the second microbatch holding an unstorable object."""
    torch.manual_seed(0)
    weight, bias = torch.randn(2, 3), torch.randn(2)
    batches = [{"x": torch.randn(4, 3), "y": torch.tensor([0, 1, 0, 1])}, {"x": object()}]
    rngs = []
    for _ in batches:
        rngs.append(raw_rng_state())
        random.random()  # the second state differs from the first
    entries = dict(
        step=7, rank=1, world_size=2, reason="nonfinite_loss", precision="16-mixed", device="cpu",
        loss_scale=1024.0, consecutive_skipped_steps=3, gradient_accumulation_steps=2,
        params=[("weight", weight), ("bias", bias)], buffers=[("running", torch.ones(2))],
        microbatches=batches, indices=[[3, 1, 4, 1], None], step_args=[[0], [1]], rng=rngs,
        losses=[torch.tensor(0.25), torch.tensor(float("nan"))], nan_param_names=["weight"],
        largest_gradients=[("weight", 3.5e19)], settings=None, model_meta=None, model_class="m.Net",
        step_fn="m.step", replay_command="stabletrain replay x --model m.py:Net", extra={"note": "kept"},
    )
    entries.update(overrides)
    return write_capture_file(path, **entries), weight, bias, batches, rngs


def test_a_written_capture_reads_back_entry_by_entry(tmp_path):
    path, weight, bias, batches, rngs = _write(tmp_path / "rank1" / FILE_NAME)
    cap = read_capture_file(path)
    assert (cap.step, cap.rank, cap.world_size, cap.reason) == (7, 1, 2, "nonfinite_loss")
    assert (cap.precision, cap.device, cap.loss_scale) == ("16-mixed", "cpu", 1024.0)
    assert cap.gradient_accumulation_steps == 2
    assert torch.equal(cap.params["weight"], weight) and torch.equal(cap.params["bias"], bias)
    assert torch.equal(cap.buffers["running"], torch.ones(2))
    assert torch.equal(cap.microbatches[0]["x"], batches[0]["x"])
    assert torch.equal(cap.microbatches[0]["y"], batches[0]["y"])
    assert cap.microbatches[1] is None, "an object that would need pickle is not stored"
    assert len(cap.raw["unstorable"]) == 1 and "microbatch 1" in cap.raw["unstorable"][0]
    assert cap.indices[0].tolist() == [3, 1, 4, 1] and cap.indices[0].dtype == torch.long and cap.indices[1] is None
    assert cap.step_args == [[0], [1]]
    assert cap.rng[0]["python"]["internal"] != cap.rng[1]["python"]["internal"], "each microbatch's own RNG state"
    assert torch.equal(cap.rng[0]["torch"], rngs[0][0]), "the torch state as taken"
    assert float(cap.losses[0]) == 0.25 and torch.isnan(cap.losses[1])
    assert cap.nan_param_names == ["weight"] and cap.largest_gradients == [("weight", 3.5e19)]
    assert cap.model_class == "m.Net" and cap.raw["step_fn"] == "m.step" and cap.raw["note"] == "kept"
    # Unsharded captures keep version 1 (readable by every stabletrain); only sharded ones are version 2.
    assert (cap.raw["format"], cap.raw["version"], cap.raw["consecutive_skipped_steps"]) == (FORMAT, UNSHARDED_VERSION, 3)
    assert cap.sharded is False and cap.params_layout is None and "sharded" not in cap.raw
    assert cap.microbatch_size(0) == 4, "from the stored dataset indices"
    # The file is safe to load with weights_only=True: nothing in it needs pickle.
    assert torch.load(path, weights_only=True)["step"] == 7


def test_writing_where_no_file_can_be_written_says_where(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(NaNCaptureError, match="cannot write the NaN capture to") as info:
        _write(blocker / "rank0" / FILE_NAME)
    assert info.value.path == blocker / "rank0" / FILE_NAME


def test_schema_problems_name_each_damaged_entry(tmp_path):
    path, *_ = _write(tmp_path / FILE_NAME)
    state = torch.load(path, weights_only=True)
    assert schema_problems(state) == []

    no_step = {k: v for k, v in state.items() if k != "step"}
    assert schema_problems(no_step) == ["step (expected int, got NoneType)"]
    assert schema_problems({**state, "rng": state["rng"][:1]}) == [
        "per-microbatch entries disagree (2 microbatches, 1 RNG states, 2 index lists, 2 losses)"
    ]
    assert schema_problems({**state, "params": {**state["params"], "w2": [1.0]}}) == [
        "params/buffers that are not tensors: ['w2']"
    ]
    assert schema_problems({**state, "step_args": [[0]]}) == ["step_args (expected one list per microbatch, 2 in all)"]
    older = {k: v for k, v in state.items() if k not in ("step_args", "largest_gradients")}
    assert schema_problems(older) == [], "entries added later may be absent"

    torch.save({**state, "losses": "oops"}, tmp_path / "bad.pt")
    damaged = r"damaged NaN capture: missing or invalid losses \(expected list, got str\)"
    with pytest.raises(NaNCaptureError, match=damaged):
        read_capture_file(tmp_path / "bad.pt")
    torch.save({**state, "version": VERSION + 1}, tmp_path / "newer.pt")
    with pytest.raises(NaNCaptureError, match=f"reads up to version {VERSION}: upgrade stabletrain"):
        read_capture_file(tmp_path / "newer.pt")
    torch.save({"format": "something.else"}, tmp_path / "other.pt")
    with pytest.raises(NaNCaptureError, match="not a stabletrain NaN capture"):
        read_capture_file(tmp_path / "other.pt")


def test_capture_files_finds_a_file_a_rank_folder_the_ranks_in_order_and_a_run_folder(tmp_path):
    run = tmp_path / "run"
    ranks = run / "debug" / "nan_capture"
    for r in (10, 2, 0):  # rank10 sorts after rank2 by number, not by name
        _write(ranks / f"rank{r}" / FILE_NAME, rank=r, world_size=11)
    (ranks / "rank3").mkdir()  # a rank folder without a file is skipped
    expected = [ranks / f"rank{r}" / FILE_NAME for r in (0, 2, 10)]
    assert capture_files(ranks) == expected
    assert capture_files(run) == expected
    assert capture_files(ranks / "rank2") == [ranks / "rank2" / FILE_NAME]
    assert capture_files(expected[0]) == [expected[0]]
    with pytest.raises(NaNCaptureError, match="no NaN capture in"):
        capture_files(tmp_path / "run" / "debug")
    with pytest.raises(NaNCaptureError, match="no such file or folder"):
        capture_files(tmp_path / "missing")
