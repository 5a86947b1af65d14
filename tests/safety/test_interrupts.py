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
    # Runaway updates begin at step 3 (docs/mechanisms.md): the checkpoint of step 4 is not healthy either.
    healthy = out / "checkpoints" / "step_000002.ckpt"
    assert "It is not healthy (gradient_norm is exploding (steps 5-8)" in printed
    assert f"resume_from='{healthy}') with model_args.lr=0.3" in info.value.command
    assert printed.rstrip().endswith(f"Continue with: {info.value.command}")
    assert "It carries model_args.lr=0.3 instead of 3" in printed
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
    assert f"resume_from='{out / 'checkpoints' / 'step_000002.ckpt'}') with model_args.lr=0.3" in line
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


# ------------------------------------------------------------------------------------------
# StopSignals, TrainingInterrupted and wait_for_launcher on their own (in-process, fast)
# ------------------------------------------------------------------------------------------


def test_stop_signals_records_the_first_signal_and_a_second_one_stops_at_once():
    from stabletrain.safety.interrupts import StopSignals

    def previous(signum, frame):  # what was installed before: it must come back
        raise AssertionError("the previous handler ran while StopSignals was installed")

    old_int, old_term = signal.signal(signal.SIGINT, previous), signal.signal(signal.SIGTERM, previous)
    try:
        first: list[str] = []
        with StopSignals(on_first=first.append) as signals:
            assert signals.received is None and signals.exit_code == 1
            os.kill(os.getpid(), signal.SIGTERM)
            assert signals.received == "SIGTERM" and signals.exit_code == 143 and first == ["SIGTERM"]
            with pytest.raises(KeyboardInterrupt, match="SIGINT received twice: stopped at once, without a checkpoint"):
                os.kill(os.getpid(), signal.SIGINT)
            assert signals.received == "SIGTERM" and first == ["SIGTERM"], "the second signal is not a new first"
            # The second signal restored the previous handlers already.
            assert signal.getsignal(signal.SIGINT) is previous and signal.getsignal(signal.SIGTERM) is previous
        assert signal.getsignal(signal.SIGINT) is previous and signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def test_stop_signals_sigint_exits_130_and_restore_brings_back_the_handlers():
    from stabletrain.safety.interrupts import StopSignals

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signals = StopSignals().install()
    try:
        assert signal.getsignal(signal.SIGINT) == signals._handle and signal.getsignal(signal.SIGTERM) == signals._handle
        os.kill(os.getpid(), signal.SIGINT)
        assert (signals.received, signals.exit_code) == ("SIGINT", 130)
    finally:
        signals.restore()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    signals.restore()  # a second restore changes nothing
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_stop_signals_outside_the_main_thread_installs_nothing():
    import threading

    from stabletrain.safety.interrupts import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(StopSignals().install()))
    thread.start()
    thread.join()
    assert len(seen) == 1 and signal.getsignal(signal.SIGTERM) is before and seen[0]._previous == {}


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 1)])
def test_training_interrupted_carries_its_data_through_pickle(name, code, tmp_path):
    import pickle

    from stabletrain.safety.interrupts import TrainingInterrupted

    err = TrainingInterrupted("stopped", signal_name=name, step=7, checkpoint=tmp_path / "last.ckpt",
                              command="stabletrain train out=x resume_interrupted=true")
    back = pickle.loads(pickle.dumps(err))  # how DDP ranks and Fabric's launcher pass it on
    for e in (err, back):
        assert (str(e), e.signal_name, e.exit_code, e.step) == ("stopped", name, code, 7)
        assert e.checkpoint == tmp_path / "last.ckpt" and e.command == "stabletrain train out=x resume_interrupted=true"


_LAUNCHED = """
import os, sys, time
from stabletrain.safety.interrupts import wait_for_launcher
pid = os.fork()  # the child has its parent's command line: a process started by Fabric's launcher
if pid == 0:
    start = time.monotonic()
    wait_for_launcher(timeout=float(sys.argv[1]))
    print(f"waited {time.monotonic() - start:.2f}", flush=True)
    os._exit(0)
time.sleep(1.0)
os._exit(0)
"""


def test_wait_for_launcher_waits_for_a_parent_with_the_same_command_line_until_it_exits():
    done = subprocess.run([sys.executable, "-c", _LAUNCHED, "20"], env=cli_env(), capture_output=True, text=True,
                          timeout=120)
    waited = float(done.stdout.split()[-1])
    assert 0.8 <= waited < 15, done.stdout + done.stderr


def test_wait_for_launcher_gives_up_after_its_timeout_and_returns_at_once_under_another_parent():
    done = subprocess.run([sys.executable, "-c", _LAUNCHED, "0.3"], env=cli_env(), capture_output=True, text=True,
                          timeout=120)
    assert 0.25 <= float(done.stdout.split()[-1]) < 0.9, done.stdout + done.stderr
    code = ("import time; from stabletrain.safety.interrupts import wait_for_launcher; s = time.monotonic(); "
            "wait_for_launcher(timeout=20); print(f'waited {time.monotonic() - s:.2f}')")
    done = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert float(done.stdout.split()[-1]) < 1.0, done.stdout + done.stderr


def test_stop_signals_restores_the_default_where_the_previous_handler_was_not_set_from_python(monkeypatch):
    """``signal.signal`` returns None for a handler installed by C code: restore() sets SIG_DFL there."""
    from stabletrain.safety.interrupts import StopSignals

    real = signal.signal
    calls = []

    def from_c(sig, handler):
        calls.append((sig, handler))
        real(sig, handler)
        return None if len(calls) <= 2 else handler  # install: "no Python handler was there"

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(signal, "signal", from_c)
    signals = StopSignals().install()
    signals.restore()
    monkeypatch.undo()
    try:
        assert [h for _, h in calls[2:]] == [signal.SIG_DFL, signal.SIG_DFL]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_wait_for_launcher_in_process_waits_while_the_launcher_parent_lives(monkeypatch):
    """The same rule in-process: a parent whose command line is ours (here: this process itself) is
    the launcher; wait until the process is re-parented (the launcher exited) or the timeout."""
    from stabletrain.safety import interrupts

    me = os.getpid()
    seen = iter([me] * 4)
    monkeypatch.setattr(interrupts.os, "getppid", lambda: next(seen, 1))  # re-parented after 3 polls
    start = time.monotonic()
    interrupts.wait_for_launcher(timeout=30)
    assert 0.14 <= time.monotonic() - start < 10 and next(seen, None) is None

    monkeypatch.setattr(interrupts.os, "getppid", lambda: me)  # the launcher never exits
    start = time.monotonic()
    interrupts.wait_for_launcher(timeout=0.4)
    assert 0.4 <= time.monotonic() - start < 5

    monkeypatch.setattr(interrupts.os, "getppid", lambda: 1)  # another parent (init): no wait
    start = time.monotonic()
    interrupts.wait_for_launcher(timeout=30)
    assert time.monotonic() - start < 1


def test_wait_for_launcher_without_proc_returns_at_once(monkeypatch):
    from stabletrain.safety import interrupts

    class NoProc(type(Path())):
        def read_bytes(self):
            raise OSError("no /proc")

    monkeypatch.setattr(interrupts, "Path", NoProc)
    monkeypatch.setattr(interrupts.os, "getppid", lambda: os.getpid())
    start = time.monotonic()
    interrupts.wait_for_launcher(timeout=30)
    assert time.monotonic() - start < 1


def test_wait_for_launcher_polls_every_50_ms_for_at_most_60_s_by_default(monkeypatch):
    from stabletrain.safety import interrupts

    class Clock:  # a fake clock: one second passes per reading; sleeps are recorded, not slept
        now, sleeps = 0.0, []

        def monotonic(self):
            self.now += 1.0
            return self.now

        def sleep(self, seconds):
            self.sleeps.append(seconds)

    clock = Clock()
    monkeypatch.setattr(interrupts, "time", clock)
    monkeypatch.setattr(interrupts.os, "getppid", lambda: os.getpid())
    interrupts.wait_for_launcher()
    assert clock.sleeps == [0.05] * 59, "deadline 60 s after the first reading; readings 2..60"
