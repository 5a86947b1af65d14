"""The episodes of one signal: spikes, exploding and vanishing in log10 space (:class:`LogSignal`), and the
loss's plateau (:class:`Plateau`). :class:`~stabletrain.debug.trends.detector.TrendDetector` runs them; the
rules are in its module docstring and in ``docs/trend_alerts.md``.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import Optional

import numpy as np

from stabletrain.config import TrendAlertArgs
from stabletrain.debug.trends.episode import Episode
from stabletrain.debug.trends.stats import log10_floored, median_mad_sigma, theil_sen_slope

#: The lowest/highest band level is looked for over this many windows back.
HORIZON_WINDOWS = 10
#: Vanishing needs bands of at least this share of a window (an early transient is not a level).
VANISH_MIN_BAND_SHARE = 0.5
#: Before a band exists: a point this many orders of magnitude above the lowest one before it
#: is exploding.
EARLY_ORDERS = 2.0


class LogSignal:
    """One positive signal in log10 space: spikes, exploding and (optionally) vanishing."""

    def __init__(
        self,
        signal: str,
        args: TrendAlertArgs,
        spike_factor: float,
        explode_factor: float,
        vanish_factor: Optional[float],
        warmup_steps: int,
    ):
        self.signal = signal
        self.W, self.P, self.z = args.window, args.persist, args.z
        self.spike_log = math.log10(spike_factor)
        self.explode_log = math.log10(explode_factor)
        self.vanish_log = math.log10(vanish_factor) if vanish_factor else None
        self.warmup_steps = warmup_steps
        self.points: deque[tuple[int, float, float]] = deque(maxlen=self.W + self.P)  # (step, log, value)
        # Band level (median, sigma, points) of every point that has left the last P.
        self.bands: deque[tuple[float, float, int]] = deque(maxlen=HORIZON_WINDOWS * self.W)
        self.spike: Optional[Episode] = None
        self.spike_threshold = 0.0
        self.spike_ref = 0.0
        self.explode: Optional[Episode] = None
        self.explode_ref = 0.0
        self.vanish: Optional[Episode] = None
        self.vanish_ref = 0.0

    def update(self, step: int, value: float, allow_vanishing: bool = True) -> list[Episode]:
        opened: list[Episode] = []
        x = log10_floored(value)
        before = [p[1] for p in self.points][-self.W :]
        self.points.append((step, x, value))
        n_points = len(self.points)
        if n_points > self.P:
            older = [p[1] for p in self.points][: -self.P][-self.W :]
            med, sigma = median_mad_sigma(older)
            self.bands.append((med, sigma, len(older)))
        recent = [p[1] for p in self.points][-self.P :]

        self._update_exploding(step, value, recent, opened)
        self._update_vanishing(step, value, recent, allow_vanishing, opened)
        self._update_spike(step, x, value, before, opened)
        return opened

    def _update_exploding(self, step: int, value: float, recent: list[float], opened: list[Episode]) -> None:
        level = median(recent)
        if self.explode is not None:
            if level - self.explode_ref >= self.explode_log / 2:
                self.explode.end_step = step
                return
            self.explode.open = False
            self.explode = None
        if not self.bands:
            self._update_early(step, value, opened)
            return
        if len(recent) < self.P:
            return
        ref, sigma, _ = min(self.bands, key=lambda b: b[0])
        persistent = min(recent) - ref >= self.spike_log and level - ref >= max(self.explode_log, self.z * sigma)
        # Faster growth needs less persistence: two rising points, the last 2 orders of
        # magnitude above the reference, are an explosion too (often the last before NaN).
        fast = (
            recent[-2] - ref >= self.spike_log
            and recent[-1] > recent[-2]
            and recent[-1] - ref >= max(2 * self.explode_log, self.z * sigma)
        )
        if not (persistent or fast):
            return
        threshold = ref + self.spike_log
        start = step
        for s, lx, _ in reversed(self.points):
            if lx < threshold:
                break
            start = s
        self.explode = Episode("exploding", self.signal, start, step, step, value, 10**ref)
        self.explode_ref = ref
        if self.spike is not None:  # the spike was the start of this
            self.spike.open = False
            self.spike = None
        opened.append(self.explode)

    def _update_early(self, step: int, value: float, opened: list[Episode]) -> None:
        """Too few points for a band: a jump of two orders of magnitude over the lowest point
        before it is an explosion already (a run can go from 5 to 1e9 in its first logged steps)."""
        xs = [p[1] for p in self.points]
        if len(xs) < 2:
            return
        ref = min(xs[:-1])
        if xs[-1] - ref < EARLY_ORDERS:
            return
        start = step
        for s, lx, _ in reversed(self.points):
            if lx < ref + self.spike_log:
                break
            start = s
        self.explode = Episode("exploding", self.signal, start, step, step, value, 10**ref)
        self.explode_ref = ref
        opened.append(self.explode)

    def _update_vanishing(
        self, step: int, value: float, recent: list[float], allow: bool, opened: list[Episode]
    ) -> None:
        if self.vanish_log is None:
            return
        level = median(recent)
        if self.vanish is not None:
            if self.vanish_ref - level >= self.vanish_log / 2:
                self.vanish.end_step = step
                return
            self.vanish.open = False
            self.vanish = None
        min_points = max(self.P, int(self.W * VANISH_MIN_BAND_SHARE))
        full = [b for b in self.bands if b[2] >= min_points]
        if not allow or len(recent) < self.P or not full:
            return
        ref, sigma, _ = max(full, key=lambda b: b[0])
        if ref - max(recent) < max(self.vanish_log, self.z * sigma):
            return
        threshold = ref - self.vanish_log
        start = step
        for s, lx, _ in reversed(self.points):
            if lx > threshold:
                break
            start = s
        self.vanish = Episode("vanishing", self.signal, start, step, step, value, 10**ref)
        self.vanish_ref = ref
        opened.append(self.vanish)

    def _update_spike(self, step: int, x: float, value: float, before: list[float], opened: list[Episode]) -> None:
        if self.spike is not None:
            if x - self.spike_ref >= self.spike_threshold:
                self.spike.end_step = step
                self.spike.value = max(self.spike.value, value)
                return
            self.spike.open = False
            self.spike = None
        if self.explode is not None or len(before) < self.P:
            return
        med, sigma = median_mad_sigma(before)
        threshold = max(self.spike_log, self.z * sigma)
        if x - med < threshold:
            return
        tolerated = step < self.warmup_steps
        self.spike = Episode("spike", self.signal, step, step, step, value, 10**med, tolerated=tolerated)
        self.spike_ref, self.spike_threshold = med, threshold
        opened.append(self.spike)


class Plateau:
    """A loss that is not going down and has barely improved since the start.

    The start level is the median of the first W/2 points; "not going down" means the
    Theil-Sen trend over the last W points predicts less than the threshold of improvement
    across them. Both thresholds grow with the loss's own scatter. Once open, the episode
    ends only when the loss has improved twice the threshold since the start (hysteresis:
    noise around the threshold gives one episode, not many).
    """

    def __init__(self, args: TrendAlertArgs, warmup_steps: int):
        self.W = args.window
        self.n_first = max(args.persist, args.window // 2)
        self.min_improvement = args.plateau_min_improvement
        self.warmup_steps = warmup_steps
        self.points: deque[tuple[int, float]] = deque(maxlen=self.W)
        self.first: list[float] = []
        self.episode: Optional[Episode] = None

    def update(self, step: int, value: float, allow: bool) -> Optional[Episode]:
        if len(self.first) < self.n_first:
            self.first.append(value)
        self.points.append((step, value))
        if self.episode is not None:
            if allow and self._stuck(slack=2.0, trend=False):
                self.episode.end_step = step
                return None
            self.episode.open = False
            self.episode = None
        if not (allow and self._stuck(slack=1.0)):
            return None
        start = self.points[0][0]
        self.episode = Episode("plateau", "loss", start, step, step, value, median(self.first))
        return self.episode

    def _stuck(self, slack: float, trend: bool = True) -> bool:
        if len(self.points) < self.W or self.points[0][0] < self.warmup_steps:
            return False
        first = median(self.first)
        values = np.asarray([v for _, v in self.points], dtype=np.float64)
        current = float(median(values.tolist()))
        scale = max(abs(first), abs(current), 1e-12)
        slope = theil_sen_slope(values)
        change = slope * (len(values) - 1) / scale
        improved = (first - current) / scale
        # Noise-aware: a noisy loss must move more than its own scatter to count as moving.
        residuals = values - slope * np.arange(len(values))
        sigma = median_mad_sigma(residuals.tolist())[1] / scale
        improved_noise = 3 * 1.25 * sigma * math.sqrt(1 / len(values) + 1 / len(self.first))
        change_noise = 3 * sigma * math.sqrt(12 / len(values))
        tolerance = self.min_improvement * slack
        if improved >= max(tolerance, improved_noise):
            return False
        # One-sided: a rising loss is not improving either (and a steep rise is "exploding").
        return not trend or change >= -max(tolerance, change_noise)
