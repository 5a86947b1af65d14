"""``stabletrain diagnose ... --verify`` and ``stabletrain report ... --verify`` in-process: the first next action
printed is the verified remedy with its numbers and a command that works; the suggestions that were not verified
say so. And a run of your own model and dataset, which settings.json cannot rebuild."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import mechanism_runs as runs
import pytest
import torch

import stabletrain
from conftest import LinearData, Regression
from stabletrain.cli.main import main
from stabletrain.cli.remedies import split_next
from stabletrain.debug.remedies import FILE_JSON, SCRATCH, RemedyError
from stabletrain.reporting.remedies import verify_remedies
from stabletrain.runfiles.history import read_run


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def boom(tmp_path_factory: pytest.TempPathFactory) -> runs.Rows:
    """The README tour on the tiny model: SGD at lr 1 with nancapture, checkpoints every 2 steps (its
    runaway updates begin at step 4: the checkpoint of step 4 is the newest healthy one)."""
    return runs.run_sgd_blowup(tmp_path_factory.mktemp("boom"), checkpoint_every_num_steps=2,
                               max_checkpoints_to_keep=100, debug_args={"nancapture": {"enabled": True}})


def numbered(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^\d+\. ", line)]


def test_diagnose_a_capture_with_verify_puts_the_verified_lr_first_and_its_command_works(boom, capsys):
    capture = boom.out / "debug" / "nan_capture" / "rank0"
    assert (capture / "nan_capture.pt").is_file()
    with one_thread():
        assert main(["diagnose", str(capture), "--verify", "--budget-steps", "200"]) == 0
    out = capsys.readouterr().out
    actions = numbered(out)
    assert actions[0].startswith("1. Resume with model_args.lr=0.1 (verified: final loss ")
    assert "where the run as it was went non-finite at step" in actions[0]
    assert all(a.split(". ", 1)[1].startswith(("Not verified: ", "Tried: ", "Replay the step yourself")) for a in actions[1:])
    assert any(a.split(". ", 1)[1].startswith("Not verified: ") for a in actions[1:])
    assert "| rank | candidate | from step | result | vs as run | steps | seconds |" in out
    assert out.index("## Next actions") < out.index("# Verified remedies")

    # The files say what was printed: diagnosis.md with the merged actions, remedies.json with the ranking.
    assert numbered((capture / "diagnosis.md").read_text()) == actions
    assert json.loads((capture / "diagnosis.json").read_text())["next_actions"][0] == actions[0][3:]
    remedies = json.loads((boom.out / SCRATCH / FILE_JSON).read_text())
    assert remedies["best"] == "model_args.lr=0.1" and remedies["steps"] <= 200
    assert remedies["plan"]["start_checkpoint"] in actions[0]
    # diagnose again, without --verify, while the run is as it was verified: the same next actions.
    with one_thread():
        again = stabletrain.diagnose(capture)
    assert again.next_actions == [a.split(". ", 1)[1] for a in actions]
    assert numbered((capture / "diagnosis.md").read_text()) == actions

    # The command printed continues the run from the healthy checkpoint at lr 0.1, and trains to the end.
    command = actions[0].split("): ", 1)[1]
    argv = shlex.split(command)
    assert argv[:2] == ["stabletrain", "train"] and "model_args.lr=0.1" in argv
    with one_thread():
        assert main(argv[1:]) == 0
    history = read_run(boom.out / "metrics.jsonl")
    last = history.rows[-1]
    assert last["step"] == 99 and last["loss"] < 4 and last["lr"] < 0.1
    assert history.resumes[-1] == remedies["plan"]["start_step"]


def test_diagnose_a_run_without_capture_with_verify_prints_and_writes_only_the_merged_actions(tmp_path, capsys):
    """A run that never went non-finite (attention-logit growth): diagnose --verify printed its own next
    actions ("not verified on this run: --verify tries it") above the verified ones, and left diagnosis.md
    and .json saying so after they were tried. Now one list, the same in what is printed and in the files."""
    rows = runs.run_attention_growth(tmp_path, steps=60, checkpoint_every_num_steps=10)
    assert rows.error is None and any(e["event"] == "mechanism" for e in rows.events)
    with one_thread():
        assert main(["diagnose", str(rows.out), "--verify", "--budget-steps", "100"]) == 0
    out = capsys.readouterr().out
    actions = numbered(out)
    assert actions[0].startswith(("1. Resume with ", "1. Start again with ", "1. No verified remedy")), actions
    assert all(a.split(". ", 1)[1].startswith(("Not verified: ", "Tried: ")) for a in actions[1:]), actions
    assert len(actions) >= 2 and "--verify tries it" not in out
    assert out.count("## Next actions") == 1 and out.index("## Next actions") < out.index("# Verified remedies")
    folder = rows.out / "debug"
    assert numbered((folder / "diagnosis.md").read_text()) == actions
    merged = [a.split(". ", 1)[1] for a in actions]
    assert json.loads((folder / "diagnosis.json").read_text())["next_actions"] == merged

    # Later messages about the run quote that verification while metrics.jsonl is unchanged: diagnose without
    # --verify gives the same actions, the report (terminal and summary.md) the verified one first and its own
    # suggestions marked as tried, none saying "--verify tries it".
    assert stabletrain.diagnose(rows.out).next_actions == merged
    r = stabletrain.report(rows.out, quiet=True, plots=False)
    _, reported = split_next(r.text)
    assert reported[0] == merged[0] and reported[1].startswith("Tried: attention-logit growth: ")
    assert "(measured here: " in reported[1] and "--verify tries it" not in r.text
    assert f"verified remedies: {folder / 'remedies' / 'remedies.md'}" in r.text
    summary = (rows.out / "report" / "summary.md").read_text()
    assert "## Remedies verified" in summary and merged[0] in summary and "--verify tries it" not in summary
    # A run that went on since (one more row) is not the run verified: the suggestions are unverified again.
    with open(rows.out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 60, "loss": 3.0}) + "\n")
    r = stabletrain.report(rows.out, quiet=True, plots=False)
    assert "not verified on this run: --verify tries it" in r.text and "verified remedies:" not in r.text
    assert "--verify tries it" in stabletrain.diagnose(rows.out).next_actions[0]


def test_report_with_verify_prints_the_verified_remedy_as_the_first_next_action(tmp_path, capsys):
    rows = runs.run_adam_eps(tmp_path, checkpoint_every_num_steps=20, steps=40)
    with one_thread():  # lr x0.3, lr x0.1, warmup, then eps: the 4th of the candidates (no mechanism named)
        assert main(["report", str(rows.out), "--verify", "--budget-steps", "160", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"stabletrain report: {rows.out}")
    assert "\nnext:" not in out  # the report's own next actions moved below the verified one
    actions = numbered(out)
    assert actions[0].startswith(("1. Resume with model_args.eps=1e-08 (verified: ",
                                  "1. Start again with model_args.eps=1e-08 (verified: "))
    assert all(a.split(". ", 1)[1].startswith(("Not verified: ", "Tried: ")) for a in actions[1:])
    assert "Not tried (budget): " in out and (rows.out / "report" / "summary.md").is_file()
    # summary.md, written again after the verification, quotes it as printed.
    summary = (rows.out / "report" / "summary.md").read_text()
    assert "## Remedies verified" in summary and actions[0].split(". ", 1)[1] in summary


def test_verify_options_need_verify_and_a_positive_budget(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path), "--budget-steps", "10"])
    assert exit_.value.code == 2 and "--budget-steps only with --verify" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["diagnose", str(tmp_path), "--verify", "--budget-seconds", "0"])
    assert "--budget-seconds: a number of seconds > 0, got 0" in capsys.readouterr().err


def test_diagnose_verify_of_a_folder_that_is_no_run_says_so(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path), "--verify"]) == 1
    assert "no NaN capture in" in capsys.readouterr().err


# ------------------------------------------------------------------------ your own model and data


def own_run(out: Path, **settings: Any) -> Path:
    """SGD at lr 1 on :class:`Regression`: the weights blow up within a few steps."""
    with contextlib.redirect_stdout(None), one_thread():
        with pytest.raises(stabletrain.NonFiniteStepError):
            stabletrain.train(out=out, model=Regression(), data=LinearData(64), batch_size=8, steps=40,
                              log_every_num_steps=1, checkpoint_every_num_steps=2, max_checkpoints_to_keep=100,
                              model_args={"optimizer": "sgd", "lr": 1.0, "warmup_steps": 0},
                              loggers={"tensorboard": {"enabled": False}}, **settings)
    return out


def test_a_run_of_your_own_model_needs_it_and_then_is_verified(tmp_path):
    run = own_run(tmp_path / "own")
    settings = json.loads((run / "settings.json").read_text())
    assert settings["model"].startswith("<") and settings["data"].startswith("<")
    with pytest.raises(RemedyError) as err:
        verify_remedies(run, progress=None)
    text = str(err.value)
    assert "its own model (<conftest.Regression>): pass model=" in text and "--model file.py:Class" in text
    assert "its own dataset (<conftest.LinearData>): pass data=" in text

    given = Regression()
    weights = {k: v.clone() for k, v in given.state_dict().items()}
    with one_thread():
        report = verify_remedies(run, model=given, data=LinearData(64), progress=None)
    assert all(torch.equal(v, given.state_dict()[k]) for k, v in weights.items())  # copied, not trained
    lrs = {o.candidate.overrides.get("model_args.lr"): o for o in report.ranked}
    assert {0.3, 0.1} <= set(lrs) and 0.001 not in lrs
    assert report.best is not None and report.best.status == "finite" and report.best.trains
    # No command line can express your objects: the command is the Python call with the change.
    command = report.commands[report.best.name]
    assert command.startswith("stabletrain.train(out=") and "... your other settings ..." in command
    (name, value), = report.best.candidate.overrides.items()
    assert command.endswith(f"with {name}={value!r}")


@pytest.mark.slow
def test_ctrl_c_during_verify_stops_it_exits_130_and_leaves_the_run_untouched(tmp_path):
    """A real SIGINT to `stabletrain diagnose RUN --verify` while a re-run trains: the verification stops
    (it used to go on with the next candidate), says so, keeps what finished, exit 130."""
    import hashlib
    import signal
    import subprocess
    import sys
    import time

    from conftest import cli_env

    rows = runs.run_attention_growth(tmp_path, steps=100, checkpoint_every_num_steps=10)
    own = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in rows.out.rglob("*") if p.is_file()}
    proc = subprocess.Popen([sys.executable, "-m", "stabletrain", "diagnose", str(rows.out), "--verify"],
                            env={**cli_env(), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    scratch = rows.out / SCRATCH
    deadline = time.monotonic() + 120
    while not any(scratch.glob("*/metrics.jsonl")) and time.monotonic() < deadline:  # a re-run is training
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "SIGINT during the re-run of " in out and "the verification stops here" in out, out
    finished = [line for line in out.split("SIGINT during")[0].splitlines()
                if re.match(r"\[\d+/\d+\] ", line) and "] as run:" not in line]
    assert (scratch / FILE_JSON).is_file() == bool(finished)  # what finished is kept, nothing else written
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in own}
    assert after == own  # the run's own files, byte for byte
