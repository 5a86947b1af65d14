"""Every reader survives a torn last line of metrics.jsonl, written on purpose: it says what it
skipped and loses nothing else; a resume appends its rows on lines of their own."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import tiny_lm
from stabletrain.cli.main import main
from stabletrain.debug.diagnose.damage import earlier_damage
from stabletrain.debug.diagnose.weights import history
from stabletrain.loggers.jsonl import JsonlLogger, read_metrics
from stabletrain.runfiles.history import read_run
from stabletrain.training.loop import train

TORN = '{"step": 5, "loss": 2.3, "gradi'


def _torn_metrics(path: Path, steps: int = 5) -> None:
    lines = [json.dumps({"step": s, "loss": 3.0 - 0.1 * s, "gradient_norm": 1.0, "lr": 1e-3}) for s in range(steps)]
    path.write_text("\n".join(lines) + "\n" + TORN)


def test_history_readers_skip_torn_last_line_and_say_so(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _torn_metrics(path)
    run = read_run(path)
    assert [r["step"] for r in run.rows] == [0, 1, 2, 3, 4]
    assert run.skipped == [6]
    assert run.skipped_note(path) == (
        f"{path}: skipped 1 line that does not parse (line 6: cut short by a crash or a full disk); "
        "every other line was read (5 logged steps, 0 events).")
    assert [r["step"] for r in read_metrics(path)[0]] == [0, 1, 2, 3, 4]
    # diagnose's history of the run reads the same rows
    assert [r["step"] for r in history(tmp_path, last=3)] == [2, 3, 4]
    assert earlier_damage(tmp_path, step=5).last_finite == 4  # the last whole row
    # a clean file has nothing to say
    path.write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    assert read_run(path).skipped == [] and read_run(path).skipped_note(path) is None


def test_logger_ends_a_torn_line_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _torn_metrics(path)
    logger = JsonlLogger(path)
    logger.log_metrics({"loss": 2.5}, step=5)
    logger.close()
    assert path.read_text().splitlines()[-2:] == [TORN, '{"step": 5, "loss": 2.5}']
    run = read_run(path)
    assert [r["step"] for r in run.rows] == [0, 1, 2, 3, 4, 5] and run.skipped == [6]


def test_resume_and_report_after_torn_line(tmp_path, capsys):
    out = tmp_path / "run"
    train(out=out, **tiny_lm(steps=4, checkpoint_every_num_steps=2))
    metrics = out / "metrics.jsonl"
    rows_before = read_run(metrics).rows
    with open(metrics, "a") as f:
        f.write('{"step": 4, "loss": 5.4')  # a kill in the middle of the next row
    n_lines = len(metrics.read_text().splitlines())
    leftover = out / "checkpoints" / ".last.ckpt.k1ll3d.tmp"  # a kill during a checkpoint write
    leftover.write_bytes(b"PK\x03\x04 partial")
    capsys.readouterr()
    train(out=out, resume_interrupted=True, **tiny_lm(steps=6, checkpoint_every_num_steps=2))
    printed = capsys.readouterr().out
    assert f"{metrics}: skipped 1 line that does not parse (line {n_lines}: cut short" in printed
    run = read_run(metrics)
    assert run.skipped == [n_lines]
    assert [r["step"] for r in run.rows] == [0, 1, 2, 3, 4, 5]
    assert run.rows[:4] == rows_before  # nothing before the torn line lost
    assert not leftover.exists()
    assert main(["report", str(out), "--no-plots"]) == 0
    assert f"{metrics}: skipped 1 line that does not parse (line {n_lines}:" in capsys.readouterr().out
