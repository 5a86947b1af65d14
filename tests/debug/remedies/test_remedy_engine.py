"""The verification loop with a stand-in runner (no training): the order, the budget in steps and seconds, the
baseline re-run only when the original rows do not cover the stretch, failures kept apart, the report written
(stabletrain.debug.remedies.engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stabletrain.debug.remedies import AS_RUN, FILE_JSON, Candidate, Plan, RunOutput, RunRequest, verify

EVAL = [60, 70, 80, 90, 99]


def loss(step: int) -> float:
    """The original run's loss: falling, with some noise."""
    return 5.0 - 0.02 * step + 0.03 * (step % 20 == 0)


BASE = sum(loss(s) for s in EVAL) / len(EVAL)


def candidate(name: str) -> Candidate:
    return Candidate(name, {f"model_args.{name}": 1.0}, "test")


def plan(tmp_path: Path, covered: bool = True, seconds_per_step: float = 0.5) -> Plan:
    run = tmp_path / "run"
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"step": s, "loss": loss(s), "gradient_norm": 1.0} for s in [*range(0, 100, 10), 99]]
    return Plan(run=run, settings={"steps": 100}, steps=100, log_every=10, start_step=0, start_checkpoint=None,
                start_why="test", since_step=None, since_why="", until_step=100, end_step=100, eval_steps=EVAL,
                rows=rows, baseline_covered=covered, seconds_per_step=seconds_per_step)


class FakeRunner:
    """Final loss ``offset`` above the original run per candidate name; 0.5 s per step; records the calls."""

    def __init__(self, offsets: dict[str, float], fail: str = ""):
        self.offsets, self.fail, self.calls = offsets, fail, []

    def __call__(self, request: RunRequest) -> RunOutput:
        self.calls.append(request)
        name = request.candidate.name
        if name == self.fail:
            raise RuntimeError("the runner broke")
        assert request.out.is_dir() and not any(request.out.iterdir())  # an empty scratch folder
        offset = self.offsets.get(name, 0.0)
        rows = [{"step": s, "loss": loss(s) + (offset if s >= 50 else 0.0), "gradient_norm": 1.0,
                 "signals/attn_logit_max": 10.0 + offset} for s in [*range(0, 100, 10), 99]]
        return RunOutput(rows=rows, seconds=0.5 * (request.end_step - 0), console=f"ran {name}")


def test_candidates_run_in_order_and_the_best_beating_the_baseline_is_picked(tmp_path):
    p = plan(tmp_path)
    runner = FakeRunner({"a": 0.2, "b": -0.5, "c": -0.8})
    lines: list[str] = []
    report = verify(p, [candidate("a"), candidate("b"), candidate("c")], runner, progress=lines.append,
                    command_for=lambda o: f"cmd {o.name}")
    assert [r.candidate.name for r in runner.calls] == ["a", "b", "c"]  # covered: no re-run of the run as it was
    assert report.baseline.source == "original rows" and report.baseline.steps_run == 0
    assert [o.name for o in report.ranked] == ["c", "b", "a"] and report.best.name == "c"
    assert report.next_action() == (f"Start again with c (verified: final loss {report.best.final_loss:.3g} vs "
                                    f"{report.baseline.final_loss:.3g} as run, steps 0-99 from step 0): cmd c")
    assert report.baseline.final_loss == pytest.approx(BASE) and report.best.final_loss == pytest.approx(BASE - 0.8)
    assert lines[1] == f"[1/3] a: 100 steps, final loss {BASE + 0.2:.3g}, does not beat as run (+0.2) (50 s)"
    assert lines[3] == f"[3/3] c: 100 steps, final loss {BASE - 0.8:.3g}, beats as run (-0.8) (50 s)"
    assert report.best.folder == p.run / "debug" / "remedies" / "c=1"  # the candidate's slug
    assert (report.best.folder / "console.txt").read_text() == "ran c"
    written = json.loads((p.run / "debug/remedies" / FILE_JSON).read_text())
    assert written["best"] == "c" and written["ranked"][0]["signals"] == {"signals/attn_logit_max": 9.2}
    assert written["ranked"][0]["command"] == "cmd c" and written["ranked"][2]["command"] == "cmd a"


def test_the_run_as_it_was_is_re_run_first_when_its_rows_do_not_cover_the_stretch(tmp_path):
    runner = FakeRunner({"a": -0.5})
    report = verify(plan(tmp_path, covered=False), [candidate("a")], runner, progress=None)
    assert [r.candidate for r in runner.calls] == [AS_RUN, candidate("a")]
    assert report.baseline.source == "re-run" and report.baseline.steps_run == 100
    assert report.steps == 200


def test_budget_steps_and_seconds_leave_candidates_out_and_say_why(tmp_path):
    runner = FakeRunner({})
    report = verify(plan(tmp_path), [candidate(n) for n in "abc"], runner, budget_steps=250, progress=None)
    assert [o.name for o in report.ranked] == ["a", "b"] and report.steps == 200
    assert [(c.name, why) for c, why in report.not_tried] == [("c", "needs 100 steps, 50 of budget_steps=250 left")]

    lines: list[str] = []
    report = verify(plan(tmp_path / "s"), [candidate(n) for n in "abc"], FakeRunner({}), budget_seconds=120,
                    progress=lines.append)
    assert [o.name for o in report.ranked] == ["a", "b"]  # 50 s each at the measured 0.5 s/step; 20 s left
    (c, why), = report.not_tried
    assert why == "needs about 50 s (100 steps at 0.5 s/step), 20 s of budget_seconds=120 left"
    assert lines[3] == f"[3/3] c: not tried ({why})"
    assert "Not tried (budget): c (" in report.to_markdown()


def test_the_first_estimate_is_the_runs_own_step_time(tmp_path):
    runner = FakeRunner({})
    report = verify(plan(tmp_path, seconds_per_step=2.0), [candidate("a")], runner, budget_seconds=100,
                    progress=None)
    assert not runner.calls and report.not_tried[0][1].startswith("needs about 200 s (100 steps at 2 s/step)")
    assert str(report) == "No verified remedy: no candidate was tried (the budget left none)."


def test_a_runner_failure_is_that_candidates_error_and_the_others_still_run(tmp_path):
    report = verify(plan(tmp_path), [candidate("a"), candidate("b")], FakeRunner({"b": -1.0}, fail="a"),
                    progress=None)
    by_name = {o.name: o for o in report.ranked}
    assert by_name["a"].status == "error" and by_name["a"].error == "RuntimeError: the runner broke"
    assert report.best.name == "b" and [o.name for o in report.ranked] == ["b", "a"]


def test_names_are_distinct_and_not_the_baseline(tmp_path):
    with pytest.raises(ValueError, match="'a' is given twice"):
        verify(plan(tmp_path), [candidate("a"), candidate("a")], FakeRunner({}), progress=None)
    with pytest.raises(ValueError, match="'as run'"):
        verify(plan(tmp_path), [Candidate("as run", {"x": 1}, "")], FakeRunner({}), progress=None)


def lr(value: float) -> Candidate:
    return Candidate(f"model_args.lr={value:g}", {"model_args.lr": value}, "test")


def test_when_the_lowest_lr_tried_trains_best_the_next_one_down_is_tried_until_one_is_worse(tmp_path):
    # The run's lr is 1: candidates x0.3 and x0.1. Lower trains better down to 0.03, then worse at 0.009.
    runner = FakeRunner({"model_args.lr=0.3": -0.2, "model_args.lr=0.1": -0.4, "model_args.lr=0.03": -0.6,
                         "model_args.lr=0.009": -0.5})
    lines: list[str] = []
    report = verify(plan(tmp_path), [lr(0.3), lr(0.1)], runner, progress=lines.append)
    assert [r.candidate.name for r in runner.calls] == ["model_args.lr=0.3", "model_args.lr=0.1",
                                                        "model_args.lr=0.03", "model_args.lr=0.009"]
    assert report.best.name == "model_args.lr=0.03"
    added = next(o for o in report.ranked if o.name == "model_args.lr=0.03").candidate
    assert added.overrides == {"model_args.lr": 0.03} and "the next one down" in added.why
    assert lines[3] == ("Added model_args.lr=0.03: the lowest lr tried (0.1) trained best of the lrs: the next one "
                        "down (x0.3) may train better still")
    assert lines[4].startswith("[3/3] model_args.lr=0.03: 100 steps") and lines[6].startswith("[4/4] model_args.lr=0.009")


def test_no_lower_lr_when_a_higher_one_trains_best_and_at_most_two_below_the_candidates(tmp_path):
    runner = FakeRunner({"model_args.lr=0.3": -0.5, "model_args.lr=0.1": -0.4})
    verify(plan(tmp_path), [lr(0.3), lr(0.1)], runner, progress=None)
    assert len(runner.calls) == 2  # the best is bracketed
    steady = FakeRunner({f"model_args.lr={v:g}": -v0 for v, v0 in ((0.3, 0.1), (0.1, 0.2), (0.03, 0.3),
                                                                   (0.009, 0.4), (0.0027, 0.5))})
    report = verify(plan(tmp_path / "b"), [lr(0.3), lr(0.1)], steady, progress=None)
    assert [r.candidate.name for r in steady.calls][2:] == ["model_args.lr=0.03", "model_args.lr=0.009"]
    assert report.best.name == "model_args.lr=0.009"  # 0.0027 would be the third below the candidates: not tried


def test_a_signal_during_a_re_run_stops_the_verification_and_keeps_what_finished(tmp_path):
    from stabletrain.safety.interrupts import TrainingInterrupted

    class Interrupted(FakeRunner):
        def __call__(self, request: RunRequest) -> RunOutput:
            if request.candidate.name == "b":
                self.calls.append(request)
                raise TrainingInterrupted("SIGINT: stopped", signal_name="SIGINT", step=3, checkpoint=None,
                                          command="")
            return super().__call__(request)

    p = plan(tmp_path)
    runner = Interrupted({"a": -0.5})
    lines: list[str] = []
    with pytest.raises(TrainingInterrupted):
        verify(p, [candidate("a"), candidate("b"), candidate("c")], runner, progress=lines.append)
    assert [r.candidate.name for r in runner.calls] == ["a", "b"]  # c is never started
    assert lines[-1] == (f"SIGINT during the re-run of b: the verification stops here. The run's own files are "
                         f"untouched; the 1 candidate(s) finished so far are in {p.scratch}")
    written = json.loads((p.run / "debug/remedies" / FILE_JSON).read_text())
    assert written["best"] == "a" and [o["candidate"]["name"] for o in written["ranked"]] == ["a"]
    assert any("Stopped by SIGINT during the re-run of b" in n for n in written["notes"])


def test_after_the_verification_a_suggestion_it_tried_says_so_with_its_numbers(tmp_path):
    runner = FakeRunner({"model_args.lr=0.3": -0.5, "model_args.lr=0.1": -0.2})
    report = verify(plan(tmp_path), [lr(0.3), lr(0.1)], runner, progress=None)
    assert report.best.name == "model_args.lr=0.3"
    actions = report.next_actions([
        "lower the learning rate: model_args.lr=0.1 (now 1; not verified on this run: --verify tries it)",
        "clip gradients: gradient_clip_val=1.0",
        "a lower lr: model_args.lr=0.3 or model_args.lr=0.03",
        "Replay the step yourself: stabletrain replay out/x",
        "a longer warmup: model_args.warmup_steps=100 (not verified on this run: --verify tries it)",
    ])
    assert actions[1] == ("Tried: lower the learning rate: model_args.lr=0.1 (now 1; tried by --verify) "
                          f"(measured here: model_args.lr=0.1: final loss {BASE - 0.2:.3g})")
    assert actions[2] == "Not verified: clip gradients: gradient_clip_val=1.0"
    # model_args.lr=0.3 is the verified remedy; model_args.lr=0.03 was not tried (0.3 is not a prefix match).
    assert actions[3] == ("Tried: a lower lr: model_args.lr=0.3 or model_args.lr=0.03 (measured here: "
                          f"model_args.lr=0.3: final loss {BASE - 0.5:.3g} (the verified remedy above))")
    assert actions[4] == "Replay the step yourself: stabletrain replay out/x"
    # Not tried (not a candidate here, or the budget left it out): it does not claim --verify tried it.
    assert actions[5] == "Not verified: a longer warmup: model_args.warmup_steps=100 (not tried by --verify)"


def test_a_suggestion_names_a_tried_candidate_by_its_number_and_loses_its_own_not_verified():
    """Diagnose suggests gradient_clip_val=1.0; the candidate tried is gradient_clip_val=1: the same setting
    (it was "Not verified" beside the table that showed it tried). And a suggestion whose own words said "not
    verified: <why this lr>" no longer says so once that lr was measured."""
    from stabletrain.debug.remedies.record import label_suggestion

    measured = [("gradient_clip_val=1", "final loss 14.3", False), ("model_args.lr=0.1", "final loss 3.14", True)]
    assert label_suggestion("Keep single steps from blowing the weights up: gradient_clip_val=1.0 (clipping is off).",
                            measured) == ("Tried: Keep single steps from blowing the weights up: gradient_clip_val=1.0 "
                                          "(clipping is off). (measured here: gradient_clip_val=1: final loss 14.3)")
    assert label_suggestion("resume_from=x.ckpt and model_args.lr=0.1 (was 1; the run's lr x0.1, not verified: no "
                            "logged stretch trained stably at a lower lr)", measured) == (
        "Tried: resume_from=x.ckpt and model_args.lr=0.1 (was 1; the run's lr x0.1: no logged stretch trained stably "
        "at a lower lr) (measured here: model_args.lr=0.1: final loss 3.14 (the verified remedy above))")
    # Another value of the same setting, or another setting ending in the same name, is not the one tried.
    assert label_suggestion("gradient_clip_val=0.5", measured) == "Not verified: gradient_clip_val=0.5"
    assert label_suggestion("model_args.lr=0.01", measured) == "Not verified: model_args.lr=0.01"
    assert label_suggestion("other.gradient_clip_val=1", measured) == "Not verified: other.gradient_clip_val=1"
    # A finding, not a setting to try, keeps its words.
    finding = "precision is already 32-true: reduced precision is not the cause"
    assert label_suggestion(finding, measured) == finding
