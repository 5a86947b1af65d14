"""Chaos (the slow layer): repeated random SIGKILLs of a run that checkpoints every step, a second
writer started against the live run, and ENOSPC at a random checkpoint write, each followed by a
resume. After each: every checkpoint loads, every metrics line parses (a torn line only where a
kill cut it, before the next resume), the final weights equal those of an uninterrupted run
bitwise (CPU), and the report reads the same steps and verdict as the uninterrupted run's."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import cli_env
from stabletrain.cli.main import main
from stabletrain.reporting import report
from stabletrain.runfiles.checkpoint import list_checkpoints, load_checkpoint, read_checkpoint_health
from stabletrain.runfiles.history import read_run

pytestmark = pytest.mark.slow

STEPS = 60
TINY = [
    "model_args.n_layers=1", "model_args.n_heads=2", "model_args.dim=32", "model_args.context_length=16",
    "model_args.dropout=0.0", "model_args.warmup_steps=2", "batch_size=8", "log_every_num_steps=1",
    "checkpoint_every_num_steps=1", "max_checkpoints_to_keep=3", "loggers.tensorboard.enabled=false",
]


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "stabletrain", "train", f"out={out}", f"steps={STEPS}", *TINY, *extra]


def _saved_step(out: Path) -> int:
    try:
        return read_checkpoint_health(out / "checkpoints" / "last.ckpt")[0]
    except Exception:
        return -1


def _check_intact(out: Path) -> None:
    """Every checkpoint file loads; every metrics line parses, but a line torn by a kill, which
    the next line (a resume) follows."""
    for path in (out / "checkpoints").glob("*.ckpt"):
        load_checkpoint(path)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    history = read_run(out / "metrics.jsonl")
    for number in history.skipped:
        assert number == len(lines) or json.loads(lines[number]).get("event") == "resume", lines[number - 1]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(out / "checkpoints" / "last.ckpt")["model"]


def _same_run(reference: Path, out: Path) -> None:
    ref, got = _weights(reference), _weights(out)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    ref_rows, rows = read_run(reference / "metrics.jsonl").rows, read_run(out / "metrics.jsonl").rows
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [(r["loss"], r["gradient_norm"]) for r in rows] == [(r["loss"], r["gradient_norm"]) for r in ref_rows]
    a, b = report(reference, quiet=True, plots=False), report(out, quiet=True, plots=False)
    assert a.verdict == b.verdict
    assert [c.step for c in list_checkpoints(out / "checkpoints")][-1] == STEPS


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("chaos") / "reference"
    done = subprocess.run(_command(out), env=cli_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_random_kills_then_two_writers_resume(tmp_path, reference):
    rng = random.Random(23)
    out = tmp_path / "run"
    kills = 0
    while kills < 6:
        start = _saved_step(out)
        resume = ("resume_interrupted=true",) if start >= 0 else ()
        proc = subprocess.Popen(_command(out, *resume), env=cli_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        target = start + rng.randint(1, 4)
        deadline = time.monotonic() + 300
        while _saved_step(out) < target and proc.poll() is None:
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.01)
        assert proc.poll() is None, proc.communicate()[1][-3000:]  # STEPS leaves room for every kill
        time.sleep(rng.uniform(0.0, 0.3))  # anywhere in a step: inside a write too
        proc.kill()
        proc.communicate()
        kills += 1
        _check_intact(out)
    assert _saved_step(out) < STEPS - 5
    # The same resume started twice at once (a requeued job and the old one): one trains to the
    # end, the other is refused naming it, before it changes anything.
    both = [subprocess.Popen(_command(out, "resume_interrupted=true"), env=cli_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p, *p.communicate(timeout=600)) for p in both]
    winners = [r for r in results if r[0].returncode == 0]
    losers = [r for r in results if r[0].returncode != 0]
    assert len(winners) == 1 and len(losers) == 1, [r[2][-2000:] for r in results]
    loser_err = losers[0][2]
    assert losers[0][0].returncode == 1 and "Traceback" not in loser_err
    assert f"is being written by pid {winners[0][0].pid} on host {socket.gethostname()}" in loser_err
    assert not list((out / "checkpoints").glob(".*.tmp"))
    _check_intact(out)
    _same_run(reference, out)


def test_enospc_at_random_checkpoint_writes_then_resume(tmp_path, monkeypatch, reference, capsys):
    from test_write_failures import FullDiskAt

    rng = random.Random(7)
    out = tmp_path / "full"
    argv = ["train", f"out={out}", f"steps={STEPS}", *TINY]
    failures = 0
    for _ in range(3):
        resume = ["resume_interrupted=true"] if (out / "checkpoints" / "last.ckpt").exists() else []
        with monkeypatch.context() as patch:
            FullDiskAt(patch, k=rng.randint(2, 8), after=rng.choice([0, 1000, 50_000]))
            code = main([*argv, *resume])
        err = capsys.readouterr().err
        assert code == 1 and "Traceback" not in err and "WriteFailedError: Could not write" in err
        assert "no space left on device (ENOSPC)" in err and "resume_interrupted=true" in err
        assert not list((out / "checkpoints").glob(".*.tmp"))
        _check_intact(out)
        failures += 1
    assert main([*argv, "resume_interrupted=true"]) == 0
    _same_run(reference, out)
