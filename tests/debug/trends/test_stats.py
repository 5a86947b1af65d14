"""The trend detector's robust statistics against float64 references computed here with numpy."""

from __future__ import annotations

import numpy as np
import pytest

from stabletrain.debug.trends.stats import LOG_FLOOR, log10_floored, median_mad_sigma, theil_sen_slope


@pytest.mark.parametrize("n", [1, 2, 7, 20])
def test_median_and_robust_sigma_match_a_float64_reference(n):
    xs = np.random.default_rng(n).lognormal(0.0, 2.0, n)
    med, sigma = median_mad_sigma(xs.tolist())
    assert med == pytest.approx(float(np.median(xs)), rel=1e-12)
    assert sigma == pytest.approx(1.4826 * float(np.median(np.abs(xs - np.median(xs)))), rel=1e-12, abs=1e-300)


def test_one_outlier_moves_neither_the_median_nor_the_sigma_much():
    base = [1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 0.98]
    med, sigma = median_mad_sigma(base)
    med_out, sigma_out = median_mad_sigma(base[:-1] + [1e9])
    assert abs(med_out - med) < 0.05 and sigma_out < 2 * sigma


def test_theil_sen_slope_is_the_median_pairwise_slope_and_ignores_an_outlier():
    ys = [3.0 - 0.5 * i for i in range(12)]
    assert theil_sen_slope(ys) == pytest.approx(-0.5, rel=1e-12)
    ys[4] = 1e6
    slopes = [(ys[j] - ys[i]) / (j - i) for i in range(12) for j in range(i + 1, 12)]
    assert theil_sen_slope(ys) == pytest.approx(float(np.median(slopes)), rel=1e-12)
    assert theil_sen_slope(ys) == pytest.approx(-0.5, rel=1e-12)
    assert theil_sen_slope([2.0]) == 0.0


def test_log10_has_a_floor_for_zero_and_negative_values():
    assert log10_floored(1e-3) == pytest.approx(-3.0)
    assert log10_floored(0.0) == LOG_FLOOR == log10_floored(-5.0)
    assert log10_floored(1e-20) == pytest.approx(-20.0)  # small positive values are not clipped
