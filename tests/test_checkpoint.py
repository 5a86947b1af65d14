"""Checkpoints: exact resume, changed settings on resume, atomic writes, safe loading."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from stabletrain.checkpoint import CheckpointError, load_checkpoint
from stabletrain.errors import ConfigError
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.trainer import train

from conftest import cli_env, tiny_lm

# Dropout on and accumulation 2, so that RNG and data position both matter.
RESUME = tiny_lm(
    steps=12,
    checkpoint_every_num_steps=4,
    gradient_accumulation_steps=2,
    model_args={"dropout": 0.2},
)


class InterruptAt:
    def __init__(self, step):
        self.step = step

    def on_step_start(self, trainer, *, step):
        if step == self.step:
            raise KeyboardInterrupt


def test_interrupted_then_resumed_run_is_bitwise_identical(tmp_path):
    full, broken = tmp_path / "full", tmp_path / "broken"
    train(out=full, **RESUME)
    with pytest.raises(KeyboardInterrupt):
        train(out=broken, callbacks=[InterruptAt(10)], **RESUME)  # between checkpoints 8 and 12
    assert load_checkpoint(broken / "checkpoints" / "last.ckpt")["step"] == 8
    train(out=broken, resume_interrupted=True, **RESUME)

    ref = {r["step"]: r for r in read_metrics(full / "metrics.jsonl")[0]}
    rows, events = read_metrics(broken / "metrics.jsonl")
    assert [e["event"] for e in events] == ["resume"] and events[0]["step"] == 8
    assert [r["step"] for r in rows] == list(range(10)) + [8, 9, 10, 11]
    resumed = rows[10:]
    for r in resumed:
        assert r["loss"] == ref[r["step"]]["loss"], "bitwise equal losses"
        assert r["gradient_norm"] == ref[r["step"]]["gradient_norm"]
        assert r["lr"] == ref[r["step"]]["lr"]
    a = load_checkpoint(full / "checkpoints" / "last.ckpt")
    b = load_checkpoint(broken / "checkpoints" / "last.ckpt")
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["data"] == b["data"] and a["step"] == b["step"] == 12


def test_resume_with_lower_lr_and_more_steps(tmp_path):
    out = tmp_path / "run"
    train(out=out, **tiny_lm(steps=4, model_args={"lr": 0.01, "lr_schedule": "constant", "warmup_steps": 0}))
    train(
        out=out,
        resume_interrupted=True,
        **tiny_lm(steps=7, model_args={"lr": 0.001, "lr_schedule": "constant", "warmup_steps": 0}),
    )
    rows, events = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in rows] == [0.01] * 4 + [0.001] * 3
    assert load_checkpoint(out / "checkpoints" / "last.ckpt")["step"] == 7


class OptimizerGroups:
    def on_train_start(self, trainer):
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]


@pytest.mark.parametrize(
    "optimizer, before, after",
    [("sgd", {"momentum": 0.9}, {"momentum": 0.5}), ("adamw", {"betas": (0.9, 0.95)}, {"betas": (0.8, 0.9)})],
)
def test_resume_uses_the_new_optimizer_hyperparameters(tmp_path, optimizer, before, after):
    """model_args.momentum and betas changed on resume take effect (they were silently
    replaced by the checkpoint's), while the optimizer's state is resumed."""
    out = tmp_path / "run"
    base = {"optimizer": optimizer, "lr_schedule": "constant", "warmup_steps": 0}
    train(out=out, **tiny_lm(steps=3, model_args={**base, **before}))
    saved = load_checkpoint(out / "checkpoints" / "last.ckpt")["optimizer"]
    seen = OptimizerGroups()
    train(out=out, resume_interrupted=True, callbacks=[seen], **tiny_lm(steps=5, model_args={**base, **after}))
    key, value = next(iter(after.items()))
    assert [tuple(g[key]) if key == "betas" else g[key] for g in seen.groups] == [value] * len(seen.groups)
    final = load_checkpoint(out / "checkpoints" / "last.ckpt")["optimizer"]
    assert all((tuple(g[key]) if key == "betas" else g[key]) == value for g in final["param_groups"])
    # The state (momentum buffers, Adam moments and step counts) came from the checkpoint and went on.
    assert saved["state"] and final["state"].keys() == saved["state"].keys()
    if optimizer == "adamw":
        assert all(float(final["state"][i]["step"]) == 5 for i in final["state"])


def test_resume_refuses_changed_frozen_settings(tmp_path):
    out = tmp_path / "run"
    train(out=out, **tiny_lm(steps=2))
    with pytest.raises(ConfigError) as info:
        train(out=out, resume_interrupted=True, **tiny_lm(steps=4, batch_size=16, model_args={"dim": 64}))
    text = str(info.value)
    assert "batch_size: the checkpoint was trained with 8, now 16" in text
    assert "model_args.dim: the checkpoint was trained with 32, now 64" in text
    with pytest.raises(ConfigError, match="the checkpoint already holds 2 steps"):
        train(out=out, resume_interrupted=True, **tiny_lm(steps=2))


def test_checkpoint_loads_safely_and_rejects_bad_files(tmp_path):
    out = tmp_path / "run"
    train(out=out, **tiny_lm(steps=2))
    path = out / "checkpoints" / "last.ckpt"
    torch.load(path, weights_only=True)  # nothing but tensors, numbers, strings, lists, dicts

    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(truncated)

    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    evil = tmp_path / "evil.ckpt"
    torch.save({"format": "stabletrain.checkpoint", "version": 1, "x": Evil()}, evil)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(evil)

    other = tmp_path / "other.ckpt"
    torch.save({"weights": torch.ones(2)}, other)
    with pytest.raises(CheckpointError, match="not a stabletrain checkpoint"):
        load_checkpoint(other)

    newer = tmp_path / "newer.ckpt"
    torch.save({"format": "stabletrain.checkpoint", "version": 99}, newer)
    with pytest.raises(CheckpointError, match="newer stabletrain"):
        load_checkpoint(newer)


WRITER = """
import sys, torch
from stabletrain.utils.io import atomic_torch_save
path = sys.argv[1]
i = 0
while True:
    i += 1
    atomic_torch_save({"i": i, "w": torch.full((2_000_000,), float(i))}, path)
    print(i, flush=True)
"""


def test_killed_writer_never_leaves_a_corrupt_file(tmp_path):
    path = tmp_path / "last.ckpt"
    for delay in (0.6, 0.9, 1.3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=cli_env(), stdout=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.readline()  # at least one complete write
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = torch.load(path, weights_only=True)
        assert torch.all(state["w"] == float(state["i"]))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "last.ckpt"]
    assert all(name.endswith(".tmp") for name in leftovers)  # at most a stray temp file, never a bad last.ckpt


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    from stabletrain.utils import io

    path = tmp_path / "x.ckpt"
    io.atomic_torch_save({"v": 1}, path)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(io.torch, "save", broken_save)
    with pytest.raises(OSError):
        io.atomic_torch_save({"v": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.ckpt"]


def test_settings_json_roundtrip_in_checkpoint(tmp_path):
    out = tmp_path / "run"
    train(out=out, **tiny_lm(steps=2, seed=7))
    state = load_checkpoint(out)
    saved = json.loads(state["settings"])
    assert saved["seed"] == 7 and saved["world_size"] == 1 and saved["task"] == "language_model"
