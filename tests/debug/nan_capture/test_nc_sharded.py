"""Sharded (FSDP2, version 2) captures without torch.distributed: files written as two ranks would write
their shards, put back together by ``load_nan_capture``, replayed as one step; what is missing or does not
fit is named. The real 2-process run is tests/distributed/test_fsdp_capture.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from stabletrain.debug.nan_capture import (
    FILE_NAME,
    VERSION,
    NaNCaptureError,
    read_capture_file,
    schema_problems,
    write_capture_file,
)
from stabletrain.debug.replay import load_nan_capture
from stabletrain.utils.rng import raw_rng_state


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 5)
        self.register_buffer("seen", torch.zeros(1))

    def training_step(self, batch):
        return (self.lin(batch["x"]) ** 2).mean()


def _full_state():
    torch.manual_seed(0)
    return {"lin.weight": torch.randn(5, 3), "lin.bias": torch.randn(5)}


def _batches(rank: int):
    g = torch.Generator().manual_seed(rank)
    return [{"x": torch.randn(2, 3, generator=g)} for _ in range(2)]


def _write_rank(folder: Path, rank: int, *, buffer: float = 0.0, offset_shift: int = 0) -> Path:
    """Rank ``rank`` of 2: rows 0..2 (rank 0) or 3..4 (rank 1) of each parameter, as FSDP2 shards dim 0."""
    full = _full_state()
    start, stop = (0, 3) if rank == 0 else (3, 5)
    params = {n: t[start:stop].clone() for n, t in full.items()}
    layout = {n: {"shape": list(t.shape), "offset": [start + offset_shift] + [0] * (t.ndim - 1), "sharded": True}
              for n, t in full.items()}
    batches = _batches(rank)
    return write_capture_file(
        folder / f"rank{rank}" / FILE_NAME, step=4, rank=rank, world_size=2, reason="nonfinite_gradients",
        precision="32-true", device="cpu", loss_scale=None, consecutive_skipped_steps=0,
        gradient_accumulation_steps=2, params=params.items(), buffers=[("seen", torch.tensor([buffer]))],
        microbatches=batches, indices=[None, None], step_args=[[], []], rng=[raw_rng_state(), raw_rng_state()],
        losses=[], nan_param_names=[], largest_gradients=[], settings=None, model_meta=None,
        model_class="tests.Tiny", step_fn=None, replay_command="stabletrain replay x", params_layout=layout,
    )


def test_a_sharded_file_is_version_2_with_its_layout(tmp_path):
    path = _write_rank(tmp_path, 1)
    part = read_capture_file(path)
    assert (part.raw["version"], part.sharded) == (VERSION, True) and VERSION == 2
    assert part.params["lin.weight"].shape == (2, 3), "only this rank's rows"
    assert part.params_layout["lin.weight"] == {"shape": [5, 3], "offset": [3, 0], "sharded": True}
    # A damaged layout is named, as any damaged entry.
    state = torch.load(path, weights_only=True)
    assert schema_problems(state) == []
    assert any("params_layout" in p for p in schema_problems({**state, "params_layout": {"lin.weight": {}}}))
    assert any("sharded" in p for p in schema_problems({**state, "sharded": False}))


def test_the_ranks_are_put_back_together_and_replayed_as_one_step(tmp_path):
    for rank in (0, 1):
        _write_rank(tmp_path, rank, buffer=float(rank))
    cap = load_nan_capture(tmp_path / "rank1", model=Tiny())  # one rank's folder: its sibling is read too
    full = _full_state()
    assert cap.sharded and [r.rank for r in cap.ranks] == [0, 1]
    for part in cap.ranks:
        assert all(torch.equal(part.params[n], full[n]) for n in full)
    # FSDP synchronises no buffers: each rank keeps its own, and the ones that differ are named.
    assert [float(r.buffers["seen"]) for r in cap.ranks] == [0.0, 1.0] and cap.buffer_mismatches == ["seen"]
    result = cap.forward_backward()
    # The step's gradient is the mean over ranks of each rank's accumulated gradient (what FSDP's
    # averaging reduce-scatter gives), computed here in float64 from the full weights.
    ref = Tiny().double()
    ref.lin.weight.data, ref.lin.bias.data = full["lin.weight"].double(), full["lin.bias"].double()
    for rank in (0, 1):
        for mb in _batches(rank):
            (ref.training_step({"x": mb["x"].double()}) / (2 * 2)).backward()
    got = dict(result.model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name].grad.double(), p.grad, rtol=1e-5, atol=1e-7)


def test_a_missing_rank_is_named(tmp_path):
    _write_rank(tmp_path, 0)
    with pytest.raises(NaNCaptureError, match=r"Missing: .*rank1.nan_capture\.pt \(ranks \[1\]\)") as info:
        load_nan_capture(tmp_path, model=Tiny())
    assert "sharded (FSDP) run of 2 processes" in str(info.value)


def test_shards_that_do_not_tile_the_tensor_are_refused(tmp_path):
    _write_rank(tmp_path, 0)
    _write_rank(tmp_path, 1, offset_shift=-1)  # overlaps rank 0's last row, leaves row 4 in no shard
    with pytest.raises(NaNCaptureError, match=r"cannot put the sharded capture .* back together: lin.weight: 3 of 15"):
        load_nan_capture(tmp_path, model=Tiny())


def test_a_sharded_rank_beside_an_unsharded_one_is_refused(tmp_path):
    _write_rank(tmp_path, 0)
    _write_rank(tmp_path / "other", 1)
    state = torch.load(tmp_path / "other" / "rank1" / FILE_NAME, weights_only=True)
    state = {k: v for k, v in state.items() if k not in ("sharded", "params_layout")}
    state["version"], state["params"] = 1, _full_state()
    (tmp_path / "rank1").mkdir()
    torch.save(state, tmp_path / "rank1" / FILE_NAME)
    shutil.rmtree(tmp_path / "other")
    with pytest.raises(NaNCaptureError, match="mix a sharded .* with unsharded files"):
        load_nan_capture(tmp_path, model=Tiny())
