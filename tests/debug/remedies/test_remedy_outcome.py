"""One re-run measured from its rows, the noise of a final loss, the comparison with the baseline and the
ranking (stabletrain.debug.remedies.outcome)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stabletrain.debug.remedies import AS_RUN, Candidate, beats, noise_of_mean, rank
from stabletrain.debug.remedies.outcome import MIN_GAIN, outcome_from_rows

LR = Candidate("model_args.lr=0.03", {"model_args.lr": 0.03}, "test")


def rows(losses: dict[int, float], **extra) -> list[dict]:
    return [{"step": s, "loss": v, "gradient_norm": 1.0, **extra} for s, v in losses.items()]


@pytest.mark.parametrize("values", [[3.0, 2.9, 2.95, 2.7, 2.8], [1.0, 1.2, 0.9, 1.1], [2.0, 2.5, 2.2]])
def test_noise_is_the_standard_error_around_the_linear_trend(values):
    n = len(values)
    x = np.arange(n, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    if n >= 4:
        resid = y - np.polyval(np.polyfit(x, y, 1), x)
        expected = math.sqrt((resid ** 2).sum() / (n - 2) / n)
    else:
        expected = math.sqrt(y.var(ddof=1) / n)
    assert noise_of_mean(values) == pytest.approx(expected, rel=1e-12)


def test_a_loss_falling_in_a_straight_line_has_no_noise():
    assert noise_of_mean([3.0, 2.8, 2.6, 2.4, 2.2]) == pytest.approx(0.0, abs=1e-12)
    assert noise_of_mean([2.0]) is None


def test_outcome_is_the_mean_of_the_compared_steps():
    o = outcome_from_rows(LR, rows({10: 5.0, 20: 4.0, 30: 3.0, 40: 2.5, 49: 2.4}), [30, 40, 49], from_step=10,
                          end_step=50)
    assert o.status == "finite" and o.final_loss == pytest.approx((3.0 + 2.5 + 2.4) / 3)
    assert o.final_losses == [(30, 3.0), (40, 2.5), (49, 2.4)] and o.start_loss == 5.0 and o.trains


def test_a_non_finite_row_or_guard_event_makes_it_non_finite_at_its_step():
    o = outcome_from_rows(LR, rows({10: 5.0, 20: math.nan}), [20], from_step=10, end_step=50)
    assert (o.status, o.nonfinite_step) == ("non-finite", 20) and o.final_loss is None and not o.trains
    event = [{"event": "nonfinite_step", "step": 27}]
    o = outcome_from_rows(LR, rows({10: 5.0, 20: 4.0}), [20, 30], from_step=10, end_step=50, events=event)
    assert (o.status, o.nonfinite_step) == ("non-finite", 27)
    before = outcome_from_rows(LR, rows({10: 5.0, 20: 4.0}), [20], from_step=10, end_step=50,
                               events=[{"event": "nonfinite_step", "step": 3}])
    assert before.status == "finite"  # before the stretch: not this outcome's


def test_missing_steps_or_a_failed_start_are_errors_that_say_why():
    o = outcome_from_rows(LR, rows({10: 5.0}), [40, 49], from_step=10, end_step=50)
    assert o.status == "error" and "no logged loss at the steps compared (40, 49)" in o.error
    o = outcome_from_rows(LR, [], [40], from_step=10, end_step=50, error="ConfigError: precision: ...")
    assert o.status == "error" and o.error.startswith("ConfigError")


def test_beats_needs_more_than_twice_the_standard_error_and_one_percent():
    base = outcome_from_rows(AS_RUN, rows({0: 5.0, 10: 3.0, 20: 3.1, 30: 2.9, 40: 3.0, 49: 3.05}), [10, 20, 30, 40, 49],
                             from_step=0, end_step=50)
    close = outcome_from_rows(LR, rows({0: 5.0, 10: 2.99, 20: 3.08, 30: 2.88, 40: 2.99, 49: 3.04}),
                              [10, 20, 30, 40, 49], from_step=0, end_step=50)
    ok, gain, threshold = beats(close, base)
    se = math.sqrt(base.noise ** 2 + close.noise ** 2)
    assert not ok and gain == pytest.approx(0.014) and threshold == pytest.approx(max(2 * se, MIN_GAIN * 3.01))
    far = outcome_from_rows(LR, rows({0: 5.0, 10: 2.5, 20: 2.4, 30: 2.45, 40: 2.3, 49: 2.35}), [10, 20, 30, 40, 49],
                            from_step=0, end_step=50)
    assert beats(far, base)[0]


def test_any_candidate_that_trains_beats_a_non_finite_baseline_and_none_that_does_not():
    base = outcome_from_rows(AS_RUN, rows({10: 5.0, 20: math.inf}), [40], from_step=10, end_step=50)
    trains = outcome_from_rows(LR, rows({10: 5.0, 40: 4.0}), [40], from_step=10, end_step=50)
    rises = outcome_from_rows(LR, rows({10: 5.0, 40: 8.0}), [40], from_step=10, end_step=50)
    assert beats(trains, base)[0] and math.isinf(beats(trains, base)[1])
    assert not rises.trains and not beats(rises, base)[0]
    assert "did not train: it started at 5" in rises.result_text()


def test_rank_puts_finite_first_then_by_loss_non_finite_by_how_long_it_lasted():
    def make(name, losses, events=()):
        return outcome_from_rows(Candidate(name, {"x": name}, ""), rows(losses), [40], from_step=10, end_step=50,
                                 events=list(events))

    outs = [
        make("nan_early", {10: 5.0, 15: math.nan}),
        make("rises", {10: 5.0, 40: 6.0}),
        make("good", {10: 5.0, 40: 2.0}),
        make("better", {10: 5.0, 40: 1.5}),
        make("nan_late", {10: 5.0, 35: math.nan}),
        outcome_from_rows(Candidate("broken", {"y": 1}, ""), [], [40], from_step=10, end_step=50, error="E"),
    ]
    assert [o.name for o in rank(outs)] == ["better", "good", "rises", "nan_late", "nan_early", "broken"]
