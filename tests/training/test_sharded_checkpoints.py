"""Sharded checkpoints (``checkpoint_format=sharded``, FSDP2) in one process: the trainer's code path at
world size 1 (a mesh of one rank). Folders of DCP shards plus ``meta.pt``, health read without the shards,
bitwise resume, one-process reading in the form of a full file, async saves, atomicity, rotation, SIGTERM
and the never-save-damage rule. The 2-process runs are tests/distributed/test_fsdp_sharded.py."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch

from conftest import tiny_lm
from stabletrain.errors import ConfigError
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.runfiles.checkpoint import (
    DCP_INDEX,
    META_NAME,
    CheckpointError,
    is_checkpoint,
    list_checkpoints,
    load_checkpoint,
    newest_healthy,
    read_checkpoint_health,
    remove_temporaries,
    unreadable_reason,
)
from stabletrain.safety.interrupts import TrainingInterrupted
from stabletrain.safety.net import NonFiniteCheckpointError
from stabletrain.training.loop import train

FSDP = tiny_lm(strategy="fsdp", accelerator="cpu", devices=1, steps=6, checkpoint_every_num_steps=2,
               max_checkpoints_to_keep=1, num_workers=0)


@pytest.fixture(scope="module", autouse=True)
def _process_group(fsdp_in_process):
    """Fabric's process group of one for FSDP2 in this process, ended after the module."""
    yield


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "run"
    train(out=out, **FSDP)
    return out


def _rows(out):
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl")[0]}


def _assert_same_tensors(a, b):
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _assert_same_optimizer(a, b):
    assert sorted(a["state"]) == sorted(b["state"])
    for i, st in a["state"].items():
        for key, value in st.items():
            assert torch.equal(value, b["state"][i][key]), (i, key)


def test_each_checkpoint_is_a_folder_of_shards_with_its_metadata(sharded):
    folder = sharded / "checkpoints"
    # Periodic after steps 2 and 4 (max_checkpoints_to_keep=1 rotates step 2 away), last.ckpt after step 6.
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step_000004.ckpt"]
    for name in ("last.ckpt", "step_000004.ckpt"):
        files = sorted(p.name for p in (folder / name).iterdir())
        assert files == [DCP_INDEX, "__0_0.distcp", META_NAME], files
    meta = torch.load(folder / "last.ckpt" / META_NAME, weights_only=True)
    assert meta["layout"] == "sharded" and meta["step"] == 6 and meta["world_size"] == 1
    assert "model" not in meta and "optimizer" not in meta, "meta.pt holds no tensors of the model"
    assert meta["files"] == {p.name: p.stat().st_size for p in (folder / "last.ckpt").iterdir() if p.name != META_NAME}
    assert [c.step for c in list_checkpoints(folder)] == [4, 6] and newest_healthy(folder).step == 6


def test_health_is_read_without_the_shards_and_a_missing_shard_is_named(sharded, tmp_path):
    copy = tmp_path / "checkpoints"
    shutil.copytree(sharded / "checkpoints", copy)
    (copy / "step_000004.ckpt" / "__0_0.distcp").unlink()
    step, health = read_checkpoint_health(copy / "step_000004.ckpt")  # meta.pt only
    assert step == 4 and health["healthy"] is True
    assert unreadable_reason(copy / "step_000004.ckpt") == "the shard file __0_0.distcp is missing"
    with pytest.raises(CheckpointError, match=r"the shard file __0_0.distcp is missing\. The newest healthy "
                                              r"checkpoint is .*last\.ckpt \(step 6\)"):
        load_checkpoint(copy / "step_000004.ckpt")
    # A shard cut short (a copy that did not finish) is named with both sizes.
    shard = copy / "last.ckpt" / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    assert unreadable_reason(copy / "last.ckpt") == (
        f"the shard file __0_0.distcp holds {size // 2:,} bytes, {size:,} were written")


def test_the_weight_norm_is_summed_from_the_shards(sharded):
    state = load_checkpoint(sharded / "checkpoints" / "last.ckpt")
    weights = torch.cat([t.flatten().double() for t in state["model"].values() if t.is_floating_point()])
    assert state["health"]["weight_norm"] == pytest.approx(float(weights.norm()), rel=1e-6)


def test_one_process_reads_it_as_the_full_file_of_the_same_run(sharded, tmp_path):
    """No process group: DCP's single-process load gives the model keys and torch's positional optimizer
    state, bitwise those of the same run saved as one full file."""
    full = tmp_path / "full"
    train(out=full, **{**FSDP, "checkpoint_format": "full"})
    assert (full / "checkpoints" / "last.ckpt").is_file()
    a = load_checkpoint(sharded / "checkpoints" / "last.ckpt")
    b = load_checkpoint(full / "checkpoints" / "last.ckpt")
    _assert_same_tensors(a["model"], b["model"])
    _assert_same_optimizer(a["optimizer"], b["optimizer"])
    assert a["optimizer"]["param_groups"][0]["params"] == b["optimizer"]["param_groups"][0]["params"]
    # Without the optimizer (what diagnose reads of each checkpoint): the model only.
    assert "optimizer" not in load_checkpoint(sharded / "checkpoints" / "last.ckpt", optimizer=False)


def test_resume_is_bitwise_and_the_unsharded_trainer_reads_it_too(sharded, tmp_path):
    straight = _rows(sharded)
    resumed = tmp_path / "resumed"
    shutil.copytree(sharded / "checkpoints", tmp_path / "from")
    train(out=resumed, **{**FSDP, "resume_from": str(tmp_path / "from" / "step_000004.ckpt")})
    rows = _rows(resumed)
    assert sorted(rows) == [4, 5]
    for step in (4, 5):
        assert rows[step]["loss"] == straight[step]["loss"] and rows[step]["gradient_norm"] == straight[step][
            "gradient_norm"]
    _assert_same_tensors(load_checkpoint(resumed / "checkpoints" / "last.ckpt")["model"],
                         load_checkpoint(sharded / "checkpoints" / "last.ckpt")["model"])
    # A run without FSDP reads the folder in its one process and continues from it.
    plain = tmp_path / "plain"
    settings = {k: v for k, v in FSDP.items() if k != "strategy"}
    train(out=plain, **{**settings, "resume_from": str(tmp_path / "from" / "step_000004.ckpt")})
    assert "Resumed from step 4" in (plain / "train.log").read_text()
    assert (plain / "checkpoints" / "last.ckpt").is_file(), "a run without FSDP writes a full file"
    assert _rows(plain)[4]["loss"] == pytest.approx(straight[4]["loss"], rel=1e-6)


def test_async_saves_write_the_same_checkpoints(sharded, tmp_path):
    out = tmp_path / "async"
    train(out=out, **{**FSDP, "checkpoint_async": True})
    for name in ("last.ckpt", "step_000004.ckpt"):
        a = load_checkpoint(out / "checkpoints" / name)
        b = load_checkpoint(sharded / "checkpoints" / name)
        _assert_same_tensors(a["model"], b["model"])
        _assert_same_optimizer(a["optimizer"], b["optimizer"])
        assert a["health"]["healthy"] is True and a["step"] == b["step"]
    assert not list((out / "checkpoints").glob(".*")), "no temporary folder left"


class _PlantNaN:
    """NaN into the weights after the optimizer step of ``step``: only the checkpoint's check sees it."""

    def __init__(self, step):
        self.step = step

    def on_after_optimizer_step(self, trainer, *, step):
        if step == self.step:
            with torch.no_grad():
                trainer.model.head.weight.to_local()[0, 0] = float("nan")


def test_a_nonfinite_sharded_state_is_never_written(tmp_path):
    out = tmp_path / "nan"
    with pytest.raises(NonFiniteCheckpointError) as info:
        train(out=out, **{**FSDP, "guard": {"enabled": False}, "callbacks": [_PlantNaN(2)]})
    assert str(info.value).startswith("Refused to write the checkpoint after step 3")
    # Step 3 ran from the NaN weight: every weight is NaN by now; the entries are read from the shards.
    assert "NaN/Inf in model tok_emb.weight, model pos_emb.weight" in str(info.value)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step_000002.ckpt"], "the damaged state was not written, nothing temporary left"
    assert load_checkpoint(out / "checkpoints" / "last.ckpt")["step"] == 2


def test_an_incomplete_folder_is_never_used_and_an_interrupted_replacement_is_undone(sharded, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(sharded, out)
    folder = out / "checkpoints"
    # A write killed before meta.pt: no checkpoint, even under its final name.
    shutil.copytree(folder / "step_000004.ckpt", folder / "step_000008.ckpt")
    (folder / "step_000008.ckpt" / META_NAME).unlink()
    assert not is_checkpoint(folder / "step_000008.ckpt")
    assert [c.step for c in list_checkpoints(folder)] == [4, 6]
    # Killed while writing (the temporary folder), and between the two renames that replace last.ckpt.
    shutil.copytree(folder / "step_000004.ckpt", folder / ".step_000010.ckpt.tmp")
    (folder / "last.ckpt").rename(folder / ".last.ckpt.old")
    assert [c.step for c in list_checkpoints(folder)] == [4]
    removed = remove_temporaries(out)
    assert [p.name for p in removed] == [".step_000010.ckpt.tmp"]
    assert [c.step for c in list_checkpoints(folder)] == [4, 6], "the old last.ckpt is back"


class _Signal:
    def __init__(self, step):
        self.step = step

    def on_step_start(self, trainer, *, step):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_writes_a_complete_sharded_checkpoint_that_resumes_bitwise(sharded, tmp_path):
    out = tmp_path / "term"
    with pytest.raises(TrainingInterrupted) as info:
        train(out=out, **{**FSDP, "callbacks": [_Signal(2)]})
    assert info.value.step == 3 and "resume_interrupted=True" in info.value.command
    assert load_checkpoint(out / "checkpoints" / "last.ckpt", tensors=False)["step"] == 3
    train(out=out, **{**FSDP, "resume_interrupted": True})
    rows, straight = _rows(out), _rows(sharded)
    for step in (3, 4, 5):
        assert rows[step]["loss"] == straight[step]["loss"], step


def test_the_settings_that_need_fsdp_are_refused_without_it(tmp_path):
    with pytest.raises(ConfigError) as info:
        train(out=tmp_path / "x", **tiny_lm(checkpoint_format="sharded", checkpoint_async=True))
    problems = info.value.problems
    assert any(p.startswith("checkpoint_format: sharded needs strategy=fsdp") for p in problems)
    assert any(p.startswith("checkpoint_async: asynchronous saves are for sharded checkpoints") for p in problems)
    assert not (tmp_path / "x").exists()
