"""Sharded checkpoints on 2 CPU processes (FSDP2, ``checkpoint_format=sharded``, the default under fsdp): each
rank writes its own shard file, asynchronously while training goes on; the health is summed from the shards;
a stop names the checkpoint that was still being written; resume is bitwise at the same world size and exact
in its loaded state at world size 1 (DCP reshards); diagnose and report read the folders in one process with
no process group. The same code path in one process: tests/training/test_sharded_checkpoints.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fsdp_train import SHARDED_FAULT
from test_fsdp_trainer import launch

from conftest import run_cli
from stabletrain.runfiles.checkpoint import list_checkpoints, load_checkpoint
from stabletrain.runfiles.history import read_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """8 steps (checkpoints at 3 and 6, asynchronous; a NaN at step 7), then continued from step 3 on 2
    processes and on 1."""
    straight = tmp_path_factory.mktemp("sharded")
    first = launch(straight, "sharded")
    frozen = tmp_path_factory.mktemp("frozen")  # the runs below write checkpoints of their own
    shutil.copytree(straight / "checkpoints", frozen / "checkpoints")
    source = str(frozen / "checkpoints" / "step_000003.ckpt")
    two = tmp_path_factory.mktemp("resumed2")
    launch(two, "sharded_resume", source)
    one = tmp_path_factory.mktemp("resumed1")
    launch(one, "sharded_resume1", source, ranks=1)
    return straight, first, two, one


def _rows(out):
    return {r["step"]: r for r in read_run(out / "metrics.jsonl").rows}


def test_every_rank_writes_its_own_shard_and_nothing_is_gathered(runs):
    straight, _, _, _ = runs
    folder = straight / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step_000003.ckpt", "step_000006.ckpt"]
    for name in ("step_000003.ckpt", "step_000006.ckpt"):
        shards = sorted((folder / name).glob("*.distcp"))
        assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
        a, b = (p.stat().st_size for p in shards)
        # Each rank's file holds its part of every parameter and moment (33 and 32 rows of the 65-row embedding),
        # the tensors every rank holds whole written once, by one of them.
        assert max(a, b) < 0.7 * (a + b), (a, b)
    assert (folder / "last.ckpt" / "__1_0.distcp").samefile(folder / "step_000006.ckpt" / "__1_0.distcp")
    state = load_checkpoint(folder / "step_000006.ckpt")
    assert state["world_size"] == 2 and state["layout"] == "sharded"
    weights = torch.cat([t.flatten().double() for t in state["model"].values()])
    assert state["health"]["healthy"] is True
    assert state["health"]["weight_norm"] == pytest.approx(float(weights.norm()), rel=1e-5), "summed from shards"


def test_the_stop_names_the_checkpoint_that_was_written_asynchronously(runs):
    straight, first, _, _ = runs
    for rank in (0, 1):
        assert first[rank]["ended"] == "NaNDetectedError" and first[rank]["step"] == SHARDED_FAULT
    # Written in the background during steps 6 and 7; committed before the message named it.
    text = (straight / "train.log").read_text()
    assert "step_000006.ckpt" in text or "resume_interrupted=true" in text
    assert [c.step for c in list_checkpoints(straight / "checkpoints")] == [3, 6]
    assert not list((straight / "checkpoints").glob(".*")), "no temporary folder left"


def test_resume_at_the_same_world_size_is_bitwise(runs):
    straight, _, two, _ = runs
    a, b = _rows(straight), _rows(two)
    assert sorted(b)[:4] == [3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        assert b[step]["loss"] == a[step]["loss"] and b[step]["gradient_norm"] == a[step]["gradient_norm"], step
    x = load_checkpoint(straight / "checkpoints" / "step_000006.ckpt")
    y = load_checkpoint(two / "checkpoints" / "step_000006.ckpt")
    for k in x["model"]:
        assert torch.equal(x["model"][k], y["model"][k]), k
    for i, st in x["optimizer"]["state"].items():
        for key, value in st.items():
            assert torch.equal(value, y["optimizer"]["state"][i][key]), (i, key)


def test_a_checkpoint_of_two_ranks_loads_exactly_on_one(runs, tmp_path):
    straight, _, _, one = runs
    saved = load_checkpoint(straight / "checkpoints" / "step_000003.ckpt")
    loaded = torch.load(one / "loaded.pt", weights_only=True)
    assert list(loaded["model"]) == list(saved["model"])
    for name, value in saved["model"].items():
        assert torch.equal(loaded["model"][name], value), name
    assert len(loaded["optimizer"]) == len(saved["optimizer"]["state"])
    for index, st in saved["optimizer"]["state"].items():
        assert sorted(loaded["optimizer"][index]) == sorted(st)
        for key, value in st.items():
            assert torch.equal(loaded["optimizer"][index][key], value), (index, key)
    log = (one / "train.log").read_text()
    assert "Resumed at world size 1 from a checkpoint written at world size 2" in log
    # The same samples per step, summed in another order: close, not bitwise.
    a, b = _rows(straight), _rows(one)
    for step in (3, 4, 5, 6):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step


def test_diagnose_and_report_read_the_folders_in_one_process(runs, tmp_path):
    straight, _, _, _ = runs
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    done = run_cli("diagnose", str(out / "debug" / "nan_capture"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "debug" / "nan_capture" / "diagnosis.json").read_text())
    assert report["step"] == SHARDED_FAULT
    assert "step_000006.ckpt" in done.stdout, done.stdout[-3000:]
    done = run_cli("report", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step_000006.ckpt" in done.stdout or "step 6" in done.stdout, done.stdout[-3000:]
