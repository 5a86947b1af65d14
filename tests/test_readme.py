"""The README's two commands stay true, and the README stays a front page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env
from stabletrain.loggers.jsonl import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "the README starts with a bash block"
    return [line.split("#")[0].strip() for line in block.group(1).strip().splitlines()]


def test_readme_starts_with_install_and_run_then_install_and_test():
    run, test = _readme_commands()
    assert run == 'pip install -e ".[all]" && stabletrain train out=out/demo'
    assert test == 'pip install -e ".[dev]" && python -m pytest -q'
    ci = (ROOT / ".ci" / "run").read_text()
    install, command = test.split(" && ")
    assert install in ci and command in ci, ".ci/run runs the README's test command"


@pytest.mark.slow
def test_main_command_trains_the_default_task(tmp_path):
    """The README's first command end to end (about 3 minutes on 2 cores; not asserted here,
    timings belong in benchmarks; the README's claim is held against its own output below)."""
    command = _readme_commands()[0].split(" && ")[1].split()  # stabletrain train out=out/demo
    exe = Path(sys.executable).with_name("stabletrain")
    argv = [str(exe), *command[1:]] if exe.exists() else [sys.executable, "-m", "stabletrain", *command[1:]]
    result = subprocess.run(argv, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    rows, events = read_metrics(tmp_path / "out" / "demo" / "metrics.jsonl")
    assert rows[-1]["step"] == 499
    assert rows[-1]["loss"] < 1.5 < 5.0 < rows[0]["loss"], "the default model learns the generated text"
    assert "Done: 500 steps" in result.stdout
    assert [e for e in events if e["event"] == "trend_alert"] == [], "a stable run raises no trend alert"
    assert "WARNING" not in result.stdout
    assert (tmp_path / "out" / "demo" / "checkpoints" / "last.ckpt").exists()


def test_the_readme_time_claims_match_the_outputs_it_shows():
    """"about N min" (or "about N s") beside a command is within a factor 1.5 of the "Done: ... in
    H:MM:SS" that the README shows for that command (its output in the tour)."""
    text = (ROOT / "README.md").read_text()
    claims = re.findall(r"^(?:.*&& )?(stabletrain train [^#\n]*?)\s+#.*?about (\d+) (min|s)\b", text, re.M)
    assert claims, "the README states how long its first command takes"
    for command, amount, unit in claims:
        minutes = int(amount) / (60 if unit == "s" else 1)
        shown = re.search(re.escape("$ " + command.strip()) + r"\n(?:.*\n)*?Done: .*? in (\d+):(\d\d):(\d\d)", text)
        assert shown, f"the README shows no output of {command!r}"
        h, m, s = (int(x) for x in shown.groups())
        took = h * 60 + m + s / 60
        assert minutes / 1.5 <= took <= minutes * 1.5, (command, amount, unit, took)


def test_readme_is_a_front_page():
    """The manual lives in docs/; the README stays a front page (the tour, the features, links)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move the detail to a page in docs/"
    assert "## A tour: train, blow up, replay, diagnose, resume" in lines
