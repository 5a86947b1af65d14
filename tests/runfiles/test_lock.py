"""The run lock: a second writer is refused naming the holder; a lock left by a killed process is
taken over with a line saying so; readers need no lock."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_env, tiny_lm
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.runfiles.checkpoint import read_checkpoint_health
from stabletrain.runfiles.lock import LOCK_NAME, STALE_AFTER_S, RunLock, RunLockedError, read_holder
from stabletrain.training.loop import train

HOLD_AND_DIE = """
import os, signal, sys
from stabletrain.runfiles.checkpoint import read_checkpoint_health
from stabletrain.runfiles.lock import RunLock
RunLock(sys.argv[1]).acquire()
print(os.getpid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_second_writer_refused_with_holder(tmp_path):
    first = RunLock(tmp_path / "run").acquire()
    record = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(RunLockedError) as err:
        RunLock(tmp_path / "run").acquire()
    assert err.value.pid == os.getpid() and err.value.host == socket.gethostname()
    assert err.value.started == record["started"]
    text = str(err.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in text
    assert f"kill {os.getpid()} on {socket.gethostname()}" in text and "another out folder" in text
    first.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    again = RunLock(tmp_path / "run").acquire()  # released: free again, nothing to take over
    assert again.took_over is None
    again.release()
    again.release()  # idempotent


def test_lock_of_killed_process_taken_over(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, str(out)], env=cli_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL
    dead_pid = int(done.stdout.split()[0])
    assert read_holder(out / LOCK_NAME).pid == dead_pid  # the file stayed behind
    lock = RunLock(out).acquire()
    assert lock.took_over is not None
    assert f"left by pid {dead_pid} on host {socket.gethostname()}" in lock.took_over
    assert "no longer running" in lock.took_over
    assert read_holder(out / LOCK_NAME).pid == os.getpid()
    lock.release()


def test_lock_from_other_host_respected_until_stale(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    record = {"pid": 4242, "host": "node-elsewhere", "started": "2026-12-04T10:00:00+00:00", "heartbeat": time.time()}
    (out / LOCK_NAME).write_text(json.dumps(record))
    with pytest.raises(RunLockedError, match="pid 4242 on host node-elsewhere.*heartbeat was 0 s ago"):
        RunLock(out).acquire()
    record["heartbeat"] = time.time() - STALE_AFTER_S - 5
    (out / LOCK_NAME).write_text(json.dumps(record))
    lock = RunLock(out).acquire()
    assert "node-elsewhere" in lock.took_over and "heartbeat is over 600 s old" in lock.took_over
    lock.release()


def test_train_refused_while_locked_and_fresh_run_ignores_lock_file(tmp_path):
    out = tmp_path / "run"
    holder = RunLock(out).acquire()  # a live writer (this process)
    with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
        train(out=out, **tiny_lm(steps=2))
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written by the refused run
    holder.release()
    train(out=out, **tiny_lm(steps=2))  # the lock file of a finished run does not make the folder "not empty"
    assert not (out / LOCK_NAME).exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")[0]] == [0, 1]


TINY_CLI = [
    "model_args.n_layers=1", "model_args.n_heads=2", "model_args.dim=32", "model_args.context_length=16",
    "batch_size=8", "log_every_num_steps=1", "checkpoint_every_num_steps=5", "loggers.tensorboard.enabled=false",
]


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return read_metrics(path)[0] if path.exists() else []


@pytest.mark.slow
def test_two_writers_real_processes(tmp_path):
    """Start the same resume twice: the second is refused naming the first's pid and host; after
    the first is SIGKILLed the next start takes over its lock and continues the run."""
    out = tmp_path / "run"
    first_run = subprocess.run([sys.executable, "-m", "stabletrain", "train", f"out={out}", "steps=10", *TINY_CLI],
                               env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert first_run.returncode == 0, first_run.stderr[-2000:]
    resume = [sys.executable, "-m", "stabletrain", "train", f"out={out}", "steps=100000", "resume_interrupted=true",
              *TINY_CLI]
    first = subprocess.Popen(resume, env=cli_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 240
        while len(_rows(out)) < 14:
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = subprocess.run(resume, env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert second.returncode == 1
        assert "Traceback" not in second.stderr
        assert f"RunLockedError: {out} is being written by pid {first.pid} on host {socket.gethostname()}" \
            in second.stderr
        assert first.poll() is None  # the first run was not disturbed
    finally:
        first.kill()
        first.communicate()
    rows_before = _rows(out)
    saved_step = read_checkpoint_health(out / "checkpoints" / "last.ckpt")[0]
    third = subprocess.run([*resume[:5], f"steps={saved_step + 3}", *resume[6:]], env=cli_env(), cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"Took over the run lock {out / LOCK_NAME} left by pid {first.pid}" in third.stdout
    assert not (out / LOCK_NAME).exists()
    rows, events = read_metrics(out / "metrics.jsonl")
    assert len(rows) > len(rows_before)
    assert [e["step"] for e in events if e["event"] == "resume"][-1] == saved_step
    assert rows[-1]["step"] == saved_step + 2
