"""Checkpoints: exact resume, changed settings on resume, atomic writes, safe loading."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import LinearData, cli_env, tiny_lm
from stabletrain.errors import ConfigError
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.runfiles.checkpoint import CheckpointError, load_checkpoint
from stabletrain.training.loop import done_line, train

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
    events = [e for e in events if e["event"] != "mechanism_signals"]  # one per run start: docs/mechanisms.md
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


class _NoisyRegression(torch.nn.Module):
    """Its training_step draws from torch, NumPy and Python's random, as user code may.

    With an odd number of Gaussian draws per step (3 microbatches), NumPy's and Python's
    cached second Gaussian is set at every other checkpoint (every 3 steps), so their whole
    state matters, not just the generator's key.
    """

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same initial weights in every run
            self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch):
        x = batch["x"]
        x = x + 0.1 * torch.randn_like(x)
        noise = np.random.standard_normal(x.numel() + 1)  # odd: 17 for a microbatch of 4
        x = x + 0.1 * torch.from_numpy(noise[:-1].reshape(x.shape)).float()
        scale = random.gauss(1.0, 0.1) + random.random() + 0.1 * float(noise[-1])
        return scale * torch.nn.functional.mse_loss(self.lin(x), batch["y"])




NOISY = {
    "steps": 12,
    "batch_size": 12,
    "gradient_accumulation_steps": 3,
    "checkpoint_every_num_steps": 3,
    "log_every_num_steps": 1,
    "num_workers": 0,
    "model_args": {"lr": 0.01, "warmup_steps": 0},
}


def _next_draws():
    return torch.rand(3).tolist(), np.random.standard_normal(3).tolist(), [random.gauss(0, 1) for _ in range(3)]


class _DrawsAtSave:
    """Records the next draws of every RNG at each checkpoint save, then puts the RNGs back."""

    def __init__(self):
        self.draws = {}

    def on_checkpoint_save(self, trainer, *, step, state):
        saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
        self.draws[step] = _next_draws()
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


def test_checkpoint_rng_state_restores_torch_numpy_and_python_draws(tmp_path):
    from stabletrain.utils.rng import set_rng_state

    recorder = _DrawsAtSave()
    out = tmp_path / "run"
    train(out=out, model=_NoisyRegression(), data=LinearData(48), callbacks=[recorder], **NOISY)
    assert sorted(recorder.draws) == [3, 6, 9, 12]
    state = load_checkpoint(out / "checkpoints" / "last.ckpt")
    assert state["step"] == 12 and len(state["rng"]) == 1, "one RNG entry per rank"
    rng = state["rng"][0]
    cuda_used = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert set(rng) == {"torch", "numpy", "python"} | ({"cuda"} if cuda_used else set())
    assert rng["torch"].dtype == torch.uint8 and rng["torch"].numel() == torch.get_rng_state().numel()
    assert rng["numpy"]["name"] == "MT19937" and rng["numpy"]["keys"].shape == (624,)
    assert isinstance(rng["numpy"]["pos"], int) and rng["numpy"]["has_gauss"] in (0, 1)
    assert rng["python"]["version"] == 3 and len(rng["python"]["internal"]) == 625
    if cuda_used:
        assert len(rng["cuda"]) == torch.cuda.device_count()

    # Scramble every RNG, restore the checkpoint's states: the next draws are those at save time.
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    set_rng_state(rng)
    assert _next_draws() == recorder.draws[12]
    # The same for a periodic checkpoint taken with a Gaussian cached in NumPy and Python.
    periodic = load_checkpoint(out / "checkpoints" / "step_000009.ckpt")["rng"][0]
    assert periodic["numpy"]["has_gauss"] == 1 and periodic["python"]["gauss"] is not None
    set_rng_state(periodic)
    assert _next_draws() == recorder.draws[9] != recorder.draws[12]


def test_resume_is_bitwise_identical_when_the_step_draws_from_numpy_and_random(tmp_path):
    full, broken = tmp_path / "full", tmp_path / "broken"
    train(out=full, model=_NoisyRegression(), data=LinearData(48), **NOISY)
    with pytest.raises(KeyboardInterrupt):
        train(out=broken, model=_NoisyRegression(), data=LinearData(48), callbacks=[InterruptAt(11)], **NOISY)
    train(out=broken, model=_NoisyRegression(), data=LinearData(48), resume_interrupted=True, **NOISY)
    ref = {r["step"]: r for r in read_metrics(full / "metrics.jsonl")[0]}
    rows = read_metrics(broken / "metrics.jsonl")[0]
    assert [r["step"] for r in rows] == list(range(11)) + [9, 10, 11]
    assert rows[8]["loss"] != rows[9]["loss"]
    for r in rows:
        assert r["loss"] == ref[r["step"]]["loss"], f"step {r['step']}: bitwise equal losses"
        assert r["gradient_norm"] == ref[r["step"]]["gradient_norm"]


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


def test_a_resumed_run_says_which_steps_it_ran_and_how_long_they_took(tmp_path, capsys):
    out = tmp_path / "run"
    train(out=out, **tiny_lm(steps=4))
    # The time: decimals under 10 s (done_line's own test), h:mm:ss when a loaded machine made it longer
    # (CI once took 11 s for these 3 steps while the other worker wrote checkpoints); never "0:00:00".
    took = r"(\d\.\d+ s|\d+:\d\d:\d\d)"
    fresh = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Done: ")]
    assert len(fresh) == 1 and re.match(rf"Done: 4 steps in {took}, final loss ", fresh[0]), fresh
    train(out=out, resume_interrupted=True, **tiny_lm(steps=7))
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Done: ")]
    # Not "Done: 7 steps in 0:00:00": 3 steps ran here, from step 4.
    assert len(done) == 1 and re.match(
        rf"Done: steps 4-6 of 7 in {took} \(3 steps in this run, resumed from step 4\), final loss ", done[0]
    ), done
    assert "in 0:00:00" not in fresh[0] + done[0]


def test_done_line_counts_and_times():
    assert done_line(0, 500, 500, 190.4) == "Done: 500 steps in 0:03:10"
    assert done_line(0, 12, 12, 0.04) == "Done: 12 steps in 0.04 s"
    assert done_line(20, 100, 100, 35.2) == (
        "Done: steps 20-99 of 100 in 0:00:35 (80 steps in this run, resumed from step 20)")
    assert done_line(11, 12, 12, 3.14) == "Done: step 11 of 12 in 3.1 s (1 step in this run, resumed from step 11)"
    assert done_line(12, 12, 20, 0.1) == "Done: no step run in 0.10 s (resumed at step 12 of 20)"


class OptimizerGroups:
    def on_train_start(self, trainer):
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]


@pytest.mark.parametrize(
    "optimizer, before, after",
    [
        ("sgd", {"momentum": 0.9}, {"momentum": 0.5}),
        ("adamw", {"betas": (0.9, 0.95)}, {"betas": (0.8, 0.9)}),
        ("adamw", {"eps": 1e-8}, {"eps": 1e-3}),
    ],
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
        train(out=out, resume_interrupted=True, **tiny_lm(steps=4, batch_size=16, model_args={"dim": 64, "qk_norm": True}))
    text = str(info.value)
    assert "model_args.qk_norm: the checkpoint was trained with false, now true" in text
    assert "batch_size: the checkpoint was trained with 8, now 16" in text
    assert "model_args.dim: the checkpoint was trained with 32, now 64" in text
    with pytest.raises(ConfigError, match="the checkpoint already holds 2 steps"):
        train(out=out, resume_interrupted=True, **tiny_lm(steps=2))


def test_a_checkpoint_from_before_qk_norm_existed_resumes_without_it():
    from stabletrain.runfiles.checkpoint import resume_conflicts

    old = {"model_args": {"dim": 32}}  # settings saved before model_args.qk_norm existed
    assert resume_conflicts(old, {"model_args": {"dim": 32, "qk_norm": False}}) == []
    assert resume_conflicts(old, {"model_args": {"dim": 32, "qk_norm": True}}) == [
        "model_args.qk_norm: the checkpoint was trained with false, now true; this setting cannot change on resume "
        "(start a new run in another out folder instead)"
    ]


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
    torch.save({"format": "stabletrain.runfiles.checkpoint", "version": 1, "x": Evil()}, evil)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(evil)

    other = tmp_path / "other.ckpt"
    torch.save({"weights": torch.ones(2)}, other)
    with pytest.raises(CheckpointError, match="not a stabletrain checkpoint"):
        load_checkpoint(other)

    newer = tmp_path / "newer.ckpt"
    torch.save({"format": "stabletrain.runfiles.checkpoint", "version": 99}, newer)
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
