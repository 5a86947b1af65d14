"""Robust statistics of short series: median and MAD, the Theil-Sen slope, log10 with a floor.
See ``docs/trend_alerts.md``.
"""

from __future__ import annotations

import math
from statistics import median
from typing import Sequence

import numpy as np

#: Floor for log10 of non-positive values (a gradient norm of exactly 0).
LOG_FLOOR = -30.0


def median_mad_sigma(xs: Sequence[float]) -> tuple[float, float]:
    """Median and robust standard deviation (1.4826 x median absolute deviation)."""
    # statistics.median: these lists are a few dozen numbers, where numpy's call overhead dominates.
    med = median(xs)
    return med, 1.4826 * median([abs(x - med) for x in xs])


def theil_sen_slope(ys: Sequence[float] | np.ndarray) -> float:
    """Median of the pairwise slopes of equally spaced points (robust to outliers)."""
    y = np.asarray(ys, dtype=np.float64)
    n = len(y)
    if n < 2:
        return 0.0
    i, j = np.triu_indices(n, k=1)
    return float(np.median((y[j] - y[i]) / (j - i)))


def log10_floored(v: float) -> float:
    """log10 of ``v``; :data:`LOG_FLOOR` for zero and negative values."""
    return math.log10(v) if v > 0 else LOG_FLOOR
