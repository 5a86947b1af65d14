"""Which earlier event made the weights non-finite, read from hand-written metrics.jsonl files."""

from __future__ import annotations

import json

from stabletrain.debug.diagnose.damage import earlier_damage


def _run(tmp_path, lines):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return tmp_path


def test_no_record_no_claim(tmp_path):
    assert earlier_damage(None, 5) is None
    assert earlier_damage(tmp_path, 5) is None, "no metrics.jsonl: nothing to say, not a guess"
    assert earlier_damage(_run(tmp_path, [{"step": 7, "loss": 1.0, "gradient_norm": 1.0}]), 5) is None, \
        "rows only after the captured step show nothing about before it"


def test_the_guards_record_of_an_optimizer_step_names_it(tmp_path):
    out = _run(tmp_path, [
        {"step": 0, "loss": 2.0, "gradient_norm": 1.0},
        {"event": "nonfinite_step", "step": 3, "origin": "optimizer", "nonfinite": ["parameters"],
         "param_names": ["fc1.weight", "fc1.bias"]},
        {"event": "nonfinite_step", "step": 9, "origin": "gradients", "nonfinite": ["gradient norm"]},
    ])
    d = earlier_damage(out, 6)
    assert d.step == 3 and d.first_nonfinite == 3
    assert d.text.startswith("the optimizer step of step 3 wrote NaN/Inf into fc1.weight, fc1.bias from finite")
    assert earlier_damage(out, 3) is None or earlier_damage(out, 3).step != 3, "an event at the step itself is not earlier"


def test_nonfinite_gradients_with_a_finite_loss_name_that_steps_update(tmp_path):
    out = _run(tmp_path, [
        {"step": 0, "loss": 2.0, "gradient_norm": 1.0},
        {"step": 1, "loss": 1.9, "gradient_norm": 1.5},
        {"step": 2, "loss": 1.8, "gradient_norm": "nan"},
        {"step": 3, "loss": "nan", "gradient_norm": "nan"},
    ])
    d = earlier_damage(out, 4)
    assert (d.step, d.last_finite, d.first_nonfinite) == (2, 1, 2)
    assert "the gradient norm non-finite at step 2: the update of step 2 applied non-finite gradients" in d.text


def test_a_nonfinite_loss_bounds_the_step_without_naming_one(tmp_path):
    out = _run(tmp_path, [
        {"step": 0, "loss": 2.0, "gradient_norm": 1.0},
        {"step": 10, "loss": 1.5, "gradient_norm": 2.0},
        {"step": 20, "loss": "inf", "gradient_norm": "nan"},
    ])
    d = earlier_damage(out, 25)
    assert (d.step, d.last_finite, d.first_nonfinite) == (None, 10, 20)
    assert "were finite at step 10, the loss and gradient norm non-finite at step 20" in d.text


def test_sparse_logging_gives_a_range(tmp_path):
    out = _run(tmp_path, [{"step": 0, "loss": 2.0, "gradient_norm": 1.0},
                          {"step": 10, "loss": 1.5, "gradient_norm": 2.0}])
    d = earlier_damage(out, 17)
    assert (d.step, d.last_finite, d.first_nonfinite) == (None, 10, None)
    assert "the damage happened in steps 10 to 16 (log_every_num_steps=1 narrows it to one step)" in d.text
    d = earlier_damage(out, 11)
    assert d.step == 10 and "step 10's optimizer step, or code run after it, made them non-finite" in d.text


def test_a_resumed_timeline_reads_the_rows_that_won(tmp_path):
    # The first attempt went non-finite at step 4; the run resumed at 3 and logged finite rows instead.
    out = _run(tmp_path, [
        {"step": 3, "loss": 2.0, "gradient_norm": 1.0},
        {"step": 4, "loss": "nan", "gradient_norm": "nan"},
        {"event": "resume", "step": 3},
        {"step": 3, "loss": 2.0, "gradient_norm": 1.0},
        {"step": 4, "loss": 1.9, "gradient_norm": 1.1},
    ])
    d = earlier_damage(out, 8)
    assert (d.step, d.last_finite, d.first_nonfinite) == (None, 4, None)
