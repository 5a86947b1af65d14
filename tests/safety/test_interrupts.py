"""SIGINT and SIGTERM: the step finishes, a checkpoint is written, the printed command continues
the run bitwise exactly on the CPU, and the exit code is 130 / 143; also with two DDP ranks."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import cli_env, tiny_lm
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.training.loop import train

TINY_CLI = [
    "model_args.n_layers=1", "model_args.n_heads=2", "model_args.dim=32", "model_args.context_length=16",
    "model_args.dropout=0.1", "model_args.warmup_steps=2", "batch_size=8", "log_every_num_steps=1",
    "checkpoint_every_num_steps=1000", "loggers.tensorboard.enabled=false",
]
STEPS = 150


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "stabletrain", "train", f"out={out}", f"steps={STEPS}", *TINY_CLI, *extra]


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return read_metrics(path)[0] if path.exists() else []


def _interrupt(tmp_path: Path, out: Path, sig: int, *extra: str, group: bool = False, after_rows: int = 6):
    proc = subprocess.Popen(_command(out, *extra), cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while len(_rows(out)) < after_rows:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "training did not start in time"
        time.sleep(0.05)
    (os.killpg if group else os.kill)(proc.pid, sig)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("hung after the signal") from None
    return proc.returncode, stdout, stderr


def _continue_command(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("Continue with: ")]
    assert len(lines) == 1, stdout[-3000:]
    return lines[0][len("Continue with: "):]


def _check_resumed_bitwise(reference: Path, out: Path, stopped_steps: int) -> None:
    ref = {r["step"]: r for r in _rows(reference)}
    rows, events = read_metrics(out / "metrics.jsonl")
    assert [(e["event"], e["step"]) for e in events if e["event"] == "resume"] == [("resume", stopped_steps)]
    resumed = rows[[i for i, r in enumerate(rows) if r["step"] == stopped_steps][-1]:]
    assert [r["step"] for r in resumed] == list(range(stopped_steps, STEPS))
    for r in resumed:
        assert r["loss"] == ref[r["step"]]["loss"] and r["gradient_norm"] == ref[r["step"]]["gradient_norm"], r["step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("signals")
    out = folder / "reference"
    done = subprocess.run(_command(out), cwd=folder, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_checkpoints_and_the_printed_command_continues_bitwise(
    tmp_path, reference, sig, code
):
    out = tmp_path / "run"
    rc, stdout, stderr = _interrupt(tmp_path, out, sig)
    name = signal.Signals(sig).name
    assert rc == code, (rc, stderr[-3000:])
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    steps = int(state["step"])
    assert 6 <= steps < STEPS and state["health"]["healthy"]
    last = out / "checkpoints" / "last.ckpt"
    assert f"{name}: stopped after step {steps - 1}; checkpoint {last} holds {steps} steps." in stdout
    assert [r["step"] for r in _rows(out)][-1] == steps - 1, "the step in progress finished and was logged"
    command = _continue_command(stdout)
    assert command.startswith(f"stabletrain train out={out} ") and command.endswith(" resume_interrupted=true")
    # Pasted in another folder (paths in it are absolute).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    exe = Path(sys.executable).with_name("stabletrain")
    shell = command if exe.exists() else command.replace("stabletrain train", f"{sys.executable} -m stabletrain train")
    resumed = subprocess.run(shell, shell=True, cwd=elsewhere, env=cli_env(), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from step {steps}: {out / 'checkpoints' / 'last.ckpt'} (healthy: " in resumed.stdout
    _check_resumed_bitwise(reference, out, steps)


def test_a_signal_stop_is_said_once(tmp_path, capsys):
    """SIGINT sent to this process between steps (in-process): one message says the run stopped."""
    from stabletrain.safety.interrupts import TrainingInterrupted

    class Signal:
        def on_step_start(self, trainer, *, step):
            if step == 2:
                os.kill(os.getpid(), signal.SIGINT)

    out = tmp_path / "run"
    with pytest.raises(TrainingInterrupted):
        train(out=out, callbacks=[Signal()], **tiny_lm(steps=5))
    printed = capsys.readouterr().out
    assert f"SIGINT: stopped after step 2; checkpoint {out / 'checkpoints' / 'last.ckpt'} holds 3 steps." in printed
    stops = [line for line in printed.splitlines() if "stopped after step" in line.lower()]
    assert len(stops) == 1, stops
    log = (out / "train.log").read_text()
    assert log.lower().count("stopped after step") == 1, log[-2000:]


def test_a_signal_inside_a_blow_up_continues_from_the_healthy_checkpoint_with_the_change(tmp_path, capsys):
    """SIGINT while the loss explodes (SGD at lr 3: from step 5): the checkpoint written is not healthy.
    The message named the healthy one with the lr that blew up (the same explosion again), then ended
    "Continue with: ... resume_interrupted=true", the unhealthy state unchanged. Now its command is the
    healthy checkpoint with the lower lr, and continuing as it is, is said as such."""
    from stabletrain.safety.interrupts import TrainingInterrupted

    class Signal:
        def on_step_start(self, trainer, *, step):
            if step == 8:
                os.kill(os.getpid(), signal.SIGINT)

    out = tmp_path / "run"
    with pytest.raises(TrainingInterrupted) as info:
        train(out=out, callbacks=[Signal()], **tiny_lm(steps=40, checkpoint_every_num_steps=2,
                                                         model_args={"optimizer": "sgd", "lr": 3.0,
                                                                     "warmup_steps": 10}))
    printed = capsys.readouterr().out
    healthy = out / "checkpoints" / "step_000004.ckpt"
    assert "It is not healthy (gradient_norm is exploding (steps 5-8)" in printed
    assert f"resume_from='{healthy}') with model_args.lr=0.6" in info.value.command
    assert printed.rstrip().endswith(f"Continue with: {info.value.command}")
    assert "It carries model_args.lr=0.6 instead of 3" in printed
    assert "To continue the interrupted run as it is anyway (the same settings from a state that is not healthy): " \
        in printed


def test_a_keyboard_interrupt_inside_a_blow_up_does_not_continue_the_unhealthy_checkpoint(tmp_path, capsys):
    class Interrupt:
        def on_step_start(self, trainer, *, step):
            if step == 9:
                raise KeyboardInterrupt

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(out=out, callbacks=[Interrupt()], **tiny_lm(steps=40, checkpoint_every_num_steps=2,
                                                            model_args={"optimizer": "sgd", "lr": 3.0,
                                                                        "warmup_steps": 10}))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Interrupted during step 9"))
    assert f"The last checkpoint ({out / 'checkpoints' / 'last.ckpt'}, 8 steps) is not healthy (" in line
    assert f"resume_from='{out / 'checkpoints' / 'step_000004.ckpt'}') with model_args.lr=0.6" in line
    assert "Continue from the last checkpoint" not in line


def test_interrupted_before_any_checkpoint_suggests_overwrite(tmp_path, capsys):
    """A KeyboardInterrupt in the middle of a step (not a signal between steps: no checkpoint)."""

    class Interrupt:
        def on_step_start(self, trainer, *, step):
            if step == 2:
                raise KeyboardInterrupt

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(out=out, callbacks=[Interrupt()], **tiny_lm(steps=5))
    printed = capsys.readouterr().out
    assert "Interrupted during step 2, before any checkpoint was written: start again with overwrite=true" in printed
    assert not (out / "checkpoints").exists()
    assert train(out=out, overwrite=True, **tiny_lm(steps=5)).steps_done == 5


@pytest.mark.slow
def test_sigterm_to_one_of_two_ddp_ranks_stops_both_and_continues_bitwise(tmp_path_factory):
    """Only the launching process (rank 0) gets SIGTERM; rank 1 agrees at the end of the step."""
    folder = tmp_path_factory.mktemp("ddp_signals")
    ddp = ["devices=2", "strategy=ddp", "accelerator=cpu"]
    reference = folder / "reference"
    done = subprocess.run(_command(reference, *ddp), cwd=folder, env=cli_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = folder / "run"
    rc, stdout, stderr = _interrupt(folder, out, signal.SIGTERM, *ddp)
    assert rc == 143, (rc, stderr[-3000:])
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    steps = int(state["step"])
    assert len(state["rng"]) == 2 and 6 <= steps < STEPS
    assert all(math.isfinite(r["loss"]) for r in _rows(out))
    command = _continue_command(stdout)
    assert "devices=2" in command and command.endswith(" resume_interrupted=true")
    shell = command.replace("stabletrain train", f"{sys.executable} -m stabletrain train", 1)
    resumed = subprocess.run(shell, shell=True, cwd=folder, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _check_resumed_bitwise(reference, out, steps)
