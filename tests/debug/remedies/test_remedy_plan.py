"""Where a verification starts and ends, read from a run's files written here by hand: the trouble and its
kind, the stretch, the steps compared, whether the original rows cover it (stabletrain.debug.remedies.plan)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from stabletrain.debug.remedies import RemedyError, find_trouble, make_plan
from stabletrain.runfiles.history import read_run


def write_run(folder: Path, lines: list[dict], steps: int = 100, log_every: int = 10, **settings) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "settings.json").write_text(json.dumps({"steps": steps, "log_every_num_steps": log_every,
                                                      "world_size": 1, **settings}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def rows(steps, loss=lambda s: 5.0 - 0.01 * s) -> list[dict]:
    return [{"step": s, "loss": loss(s), "gradient_norm": 1.0, "steps_per_s": 20.0} for s in steps]


def test_the_earliest_trouble_wins_and_mechanism_rows_name_their_ids(tmp_path):
    lines = [
        *rows(range(0, 60, 10)),
        {"event": "trend_alert", "step": 40, "kind": "spike", "signal": "loss", "start_step": 5, "tolerated": True},
        {"event": "trend_alert", "step": 50, "kind": "exploding", "signal": "loss", "start_step": 40,
         "message": "loss is exploding"},
        {"event": "mechanism", "step": 30, "id": "runaway_updates", "start_step": 20, "detected_step": 30,
         "message": "runaway updates from step 20"},
        {"event": "mechanism", "step": 20, "id": "attention_logit_growth", "start_step": 10, "detected_step": 20},
        {"event": "nonfinite_step", "step": 57},
    ]
    trouble = find_trouble(read_run(write_run(tmp_path, lines) / "metrics.jsonl"))
    assert trouble.since == 10 and trouble.failed == 57  # a tolerated warmup spike does not count
    assert trouble.mechanisms == ["attention_logit_growth", "runaway_updates"]  # by their start
    assert find_trouble(read_run(write_run(tmp_path / "h", rows(range(0, 100, 10))) / "metrics.jsonl")).since is None


def test_a_nan_loss_row_is_trouble_an_inf_gradient_norm_alone_is_not(tmp_path):
    fp16 = [*rows(range(0, 30, 10)), {"step": 30, "loss": 4.0, "gradient_norm": math.inf}]  # a skipped fp16 step
    assert find_trouble(read_run(write_run(tmp_path / "a", fp16) / "metrics.jsonl")).since is None
    nan = [*rows(range(0, 30, 10)), {"step": 30, "loss": math.nan, "gradient_norm": 1.0}]
    trouble = find_trouble(read_run(write_run(tmp_path / "b", nan) / "metrics.jsonl"))
    assert (trouble.since, trouble.failed) == (30, 30)


def test_a_failed_run_is_verified_past_its_failure_to_the_next_logged_step(tmp_path):
    run = write_run(tmp_path, [*rows(range(0, 50, 10)), {"event": "nan_detected", "step": 47}])
    plan = make_plan(run, start=0)
    assert (plan.start_step, plan.until_step, plan.failed_step) == (0, 47, 47)
    assert plan.end_step == 71  # 47 + max(10, 47 // 2) = 70, a logged step: stop after it
    assert plan.eval_steps == [40, 50, 60, 70]  # the logged steps of the stretch's second half
    assert not plan.baseline_covered and plan.original_steps() == 48  # steps 0-47
    assert plan.seconds_per_step == pytest.approx(1 / 20)


def test_a_finished_run_covers_its_stretch_and_is_compared_at_its_last_logged_steps(tmp_path):
    run = write_run(tmp_path, rows([*range(0, 100, 10), 99]))
    plan = make_plan(run, margin=20)
    assert plan.since_step is None and plan.start_checkpoint is None and "no trouble" in plan.start_why
    assert (plan.until_step, plan.end_step) == (100, 100)  # never past the run's steps
    assert plan.eval_steps == [60, 70, 80, 90, 99] and plan.baseline_covered
    resumed = write_run(tmp_path / "r", [*rows([*range(0, 100, 10), 99]), {"event": "resume", "step": 50},
                                          *rows([*range(50, 100, 10), 99])])
    plan = make_plan(resumed)
    assert not plan.baseline_covered and "resumed at step 50" in plan.notes[0]


def test_a_fresh_start_says_whether_any_checkpoint_was_written_before_the_trouble(tmp_path):
    import torch

    from stabletrain.runfiles.checkpoint import save_checkpoint

    run = write_run(tmp_path, [*rows(range(0, 50, 10)), {"event": "nan_detected", "step": 47}])
    plan = make_plan(run)
    assert plan.start_checkpoint is None and plan.start_why.startswith("no checkpoint was written before step 47")
    # One written before it, not healthy: the other sentence.
    state = {"step": 30, "model": {"w": torch.zeros(2)}, "health": {"healthy": False, "why": "exploding"}}
    save_checkpoint(state, run, periodic=True, keep=5)
    plan = make_plan(run)
    assert plan.start_checkpoint is None
    assert plan.start_why.startswith("no checkpoint recorded healthy holds fewer steps than 47")


def test_what_cannot_be_verified_says_what_to_pass(tmp_path):
    with pytest.raises(RemedyError, match="no settings.json in"):
        make_plan(tmp_path)
    run = write_run(tmp_path / "ddp", rows(range(0, 30, 10)))
    (run / "settings.json").write_text(json.dumps({"steps": 30, "world_size": 2}))
    with pytest.raises(RemedyError, match="trained by 2 processes"):
        make_plan(run)
    with pytest.raises(RemedyError, match=r"start: no checkpoint of step 20 in .*checkpoints at steps: none"):
        make_plan(write_run(tmp_path / "one", rows(range(0, 30, 10))), start=20)
