"""nancapture under FSDP2 (issue 13): a NaN planted in one rank's shard of the weights at a known step is
captured on every rank, each rank writing only its shard; the shards put back together in one process are
the model the step started from, and replay and diagnose of all ranks' microbatches find the fault."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_common import ACCUM, build_lm, free_port, global_batch, microbatches
from fsdp_nc_worker import FAULT_RANK, FAULT_STEP, FAULT_TOKEN, OVERFLOW

from stabletrain.debug.nan_capture import FILE_NAME, VERSION, NaNCaptureError, read_capture_file
from stabletrain.debug.replay import load_nan_capture

pytestmark = pytest.mark.slow

WORLD = 2
WORKER = Path(__file__).with_name("fsdp_nc_worker.py")
FSDP_COMMON = Path(__file__).with_name("fsdp_common.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One torchrun of the worker (2 CPU processes); every test below reads its files."""
    from conftest import cli_env

    out = tmp_path_factory.mktemp("fsdp_nc")
    env = cli_env()
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(WORKER), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return out, seen


def test_every_rank_stops_at_the_fault_and_names_the_same_parameters(run):
    _, seen = run
    for rank, s in enumerate(seen):
        raised = s["raised"]
        assert raised is not None, f"rank {rank} did not raise NaNDetectedError"
        assert (raised["step"], raised["rank"]) == (FAULT_STEP, rank)
        # The global norm's names, bitwise the same on every rank: the averaged gradient is NaN everywhere.
        assert raised["names"] == s["global_nonfinite_names"] == seen[0]["raised"]["names"]
        assert "tok_emb.weight" in raised["names"]
    # Only rank 1's first microbatch holds the token whose embedding row is NaN: its loss is the only NaN one.
    losses = {(r, step, i): v for r, s in enumerate(seen) for step, i, v in s["losses"]}
    nan_losses = [k for k, v in losses.items() if v != v]
    assert nan_losses == [(FAULT_RANK, FAULT_STEP, 0)]
    # So rank 1 stops on its loss, rank 0 on the gradient; replay takes the step's reason from rank 0.
    assert [s["raised"]["reason"] for s in seen] == ["nonfinite_gradients", "nonfinite_loss"]
    assert "rank 1 of 2" in seen[1]["raised"]["message"] and "Microbatch losses: nan" in seen[1]["raised"]["message"]


def test_overflowing_gradients_are_told_from_nonfinite_ones_across_shards(run):
    _, seen = run
    expected = sorted(((name, value) for name, value in OVERFLOW.values()), key=lambda nv: -nv[1])
    for s in seen:
        over = s["overflow"]
        assert over["norm_finite"] is False and over["names"] == [], "every element is finite"
        # Each rank holds one of the two huge elements; both ranks list both, largest first.
        assert [n for n, _ in over["largest"][:2]] == [n for n, _ in expected]
        assert [v for _, v in over["largest"][:2]] == pytest.approx([v for _, v in expected], rel=1e-6)
        assert over["largest"][2][1] == 0.0


def test_each_rank_writes_only_its_shard(run):
    out, seen = run
    full_bytes = seen[0]["global_numel"] * 4  # float32
    sizes = []
    for rank, s in enumerate(seen):
        path = out / "nan_capture" / f"rank{rank}" / FILE_NAME
        assert Path(s["raised"]["path"]) == path
        part = read_capture_file(path)
        assert (part.raw["version"], part.sharded, part.rank, part.world_size) == (VERSION, True, rank, WORLD)
        assert set(part.params) == set(part.params_layout) == {n for n, _ in build_lm(0).named_parameters()}
        assert sum(t.numel() for t in part.params.values()) == s["local_numel"]
        # 65 embedding rows: 33 on rank 0, 32 on rank 1.
        assert part.params["tok_emb.weight"].shape == ((33, 32) if rank == 0 else (32, 32))
        assert part.params_layout["tok_emb.weight"] == {"shape": [65, 32], "offset": [33 * rank, 0], "sharded": True}
        sizes.append(path.stat().st_size)
        print(f"rank {rank}: {s['local_numel']} of {s['global_numel']} parameters, file {sizes[-1]} bytes")
    assert seen[0]["local_numel"] + seen[1]["local_numel"] == seen[0]["global_numel"]
    # The file holds half the parameters (60 KB of 120 KB) plus buffers, microbatches and RNG states.
    for size, s in zip(sizes, seen):
        assert s["local_numel"] * 4 < size < s["local_numel"] * 4 + 0.5 * full_bytes


def test_the_shards_reassemble_into_the_model_the_step_started_from(run):
    out, _ = run
    cap = load_nan_capture(out / "nan_capture")
    full = torch.load(out / "full_at_fault.pt", weights_only=True)
    assert cap.sharded and [r.rank for r in cap.ranks] == [0, 1] and cap.missing_ranks == []
    assert list(cap.ranks[0].params) == list(full)
    for name, value in full.items():
        torch.testing.assert_close(cap.ranks[0].params[name], value, rtol=0, atol=0, equal_nan=True)
    assert all(r.params is cap.ranks[0].params for r in cap.ranks), "one full copy, shared by the ranks"
    emb = cap.ranks[0].params["tok_emb.weight"]
    assert emb.isnan().any(dim=1).nonzero().flatten().tolist() == [FAULT_TOKEN]
    assert all(torch.isfinite(v).all() for n, v in cap.ranks[0].params.items() if n != "tok_emb.weight")
    assert cap.buffer_mismatches == []  # the LM has no persistent buffers


def test_replay_in_one_process_reproduces_from_any_rank_folder(run):
    out, seen = run
    # Given one rank's folder, the other ranks' folders beside it are read too: every shard is needed.
    cap = load_nan_capture(out / "nan_capture" / "rank0", model=build_lm(123))
    assert [r.rank for r in cap.ranks] == [0, 1] and cap.reason == "nonfinite_gradients"
    result = cap.replay()
    assert result.reproduced
    assert result.nan_param_names == seen[0]["raised"]["names"]
    assert result.microbatches == [(r, m) for r in range(WORLD) for m in range(ACCUM)]
    captured = [v for r in range(WORLD) for step, _, v in seen[r]["losses"] if step == FAULT_STEP]
    assert result.captured_losses == pytest.approx(captured, nan_ok=True)
    assert result.losses_bitwise_equal is True
    # Rank 1's microbatches alone fail, rank 0's alone do not: the data that reaches the bad row.
    assert result.ranks_reproducing_alone == [FAULT_RANK]


def test_diagnose_cli_finds_the_embedding_row_and_the_sample(run, tmp_path, capsys):
    from stabletrain.cli import main  # in this process: a second interpreter would only add imports

    out, _ = run
    target = tmp_path / "nan_capture"
    shutil.copytree(out / "nan_capture", target)  # diagnose writes its report beside the capture
    assert main(["diagnose", str(target), "--model", f"{FSDP_COMMON}:build_lm"]) == 0
    text = capsys.readouterr().out
    assert "# Diagnosis of step 2 (ranks 0, 1)" in text and "tok_emb" in text
    report = json.loads((target / "diagnosis.json").read_text())
    assert report["ranks"] == [0, 1] and report["matches_capture"] is True
    where = report["where"]
    assert (where["op"], where["module"], where["origin"], where["input_name"]) == (
        "aten.embedding.default", "tok_emb", "weight", "tok_emb.weight")
    assert report["origin"] == "weights"
    # The failing sample: the rows of rank 1's microbatch 0 that hold the token, and only those.
    mb = microbatches(global_batch(FAULT_STEP), FAULT_RANK, WORLD, ACCUM)[0]
    holding = (mb["input_ids"] == FAULT_TOKEN).any(dim=1).nonzero().flatten().tolist()
    assert report["data"]["failing_microbatches"] == [{"rank": FAULT_RANK, "micro_step": 0}]
    assert report["data"]["rows"] == holding


def test_a_missing_rank_folder_is_named(run, tmp_path):
    out, _ = run
    shutil.copytree(out / "nan_capture" / "rank0", tmp_path / "nan_capture" / "rank0")
    for path in (tmp_path / "nan_capture" / "rank0", tmp_path / "nan_capture"):
        with pytest.raises(NaNCaptureError, match=r"sharded \(FSDP\) run of 2 processes") as info:
            load_nan_capture(path, model=build_lm(0))
        assert str(tmp_path / "nan_capture" / "rank1" / FILE_NAME) in str(info.value)
        assert "ranks [1]" in str(info.value)
