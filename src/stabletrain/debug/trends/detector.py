"""The trend detector: exploding, vanishing, spike, plateau and non-finite episodes.

:class:`TrendDetector` streams logged values (:meth:`~TrendDetector.update` returns the episodes
alerted at that step, :meth:`~TrendDetector.finish` closes them) and :func:`detect_trends` runs it
over a finished series. Thresholds are the ``trend_alerts`` settings. See docs/trend_alerts.md.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import Mapping, Optional, Sequence

from stabletrain.config import TrendAlertArgs
from stabletrain.debug.trends.episode import SIGNALS, Episode
from stabletrain.debug.trends.signals import LogSignal, Plateau

#: Loss at or below start / CONVERGED_LOSS_RATIO: small gradients are convergence, not vanishing.
CONVERGED_LOSS_RATIO = 10.0


class TrendDetector:
    """Streams logged values and opens an :class:`Episode` per instability.

    Args:
        settings: Thresholds (``trend_alerts`` settings); defaults when None.
        warmup_steps: Spikes before this step are tolerated (recorded, not alerted).

    ``update`` returns the episodes that just opened and should be alerted; ``episodes``
    keeps every episode, including tolerated and closed ones.

    Example::

        detector = TrendDetector(warmup_steps=50)
        for step, (loss, gn) in enumerate(zip(losses, grad_norms)):
            for episode in detector.update(step, {"loss": loss, "gradient_norm": gn}):
                print(episode.message())
    """

    def __init__(self, settings: Optional[TrendAlertArgs] = None, warmup_steps: int = 0):
        self.settings = settings or TrendAlertArgs()
        self.warmup_steps = warmup_steps
        a = self.settings
        self.signals = {
            "gradient_norm": LogSignal(
                "gradient_norm", a, a.spike_factor, a.explode_factor, a.vanish_factor, warmup_steps
            ),
            "loss": LogSignal("loss", a, a.loss_spike_factor, a.loss_explode_factor, None, warmup_steps),
        }
        self.plateau = Plateau(a, warmup_steps)
        self.episodes: list[Episode] = []
        self.last_step: Optional[int] = None
        self._nonfinite: dict[str, Optional[Episode]] = {s: None for s in SIGNALS}
        self._nonfinite_run: dict[str, int] = {s: 0 for s in SIGNALS}
        self._nonfinite_start: dict[str, int] = {}
        self._loss_positive = True
        self._loss_first: list[float] = []
        self._loss_recent: deque[float] = deque(maxlen=self.settings.persist)
        self._skipped = 0.0  # the guard's count of steps the fp16 GradScaler skipped, at the last row
        #: Logged steps whose non-finite gradient norm was the fp16 GradScaler's own skip (its scaled
        #: gradients overflowed; it skips the step and lowers its scale): expected, not an episode.
        self.scaler_skips: list[int] = []

    def update(self, step: int, metrics: Mapping[str, float]) -> list[Episode]:
        """Feed one logged step (``loss`` and/or ``gradient_norm`` keys); return new alerts.

        A ``loss_scale`` key (fp16 loss scaling) makes single non-finite gradient norms
        expected: the scaler skips those steps. With a ``skipped_steps`` key too (the guard's
        count of the steps the scaler skipped), a non-finite gradient norm with a finite loss at
        a row where that count grew is the scaler's skip, however many come in a row (its scale
        backs off from too high a start, one halving per skip; the guard stops a run whose skips
        never end), while the scale is at least 1: recorded in :attr:`scaler_skips`, not an
        episode.
        """
        self.last_step = step
        opened: list[Episode] = []
        fp16_skips = "loss_scale" in metrics
        scaler_skip = False
        skipped = metrics.get("skipped_steps")
        if fp16_skips and skipped is not None and math.isfinite(float(skipped)):
            # Below a scale of 1 the scaler is no longer backing off from too high a start: the
            # gradients overflow float16 unscaled, and its skips are the fault's.
            scaler_skip = float(skipped) > self._skipped and float(metrics["loss_scale"]) >= 1.0
            self._skipped = float(skipped)
        loss = metrics.get("loss")
        if loss is not None:
            loss = float(loss)
            if self._finite("loss", step, loss, 1, opened):
                self._loss_recent.append(loss)
                if len(self._loss_first) < self.settings.persist:
                    self._loss_first.append(loss)
                self._loss_positive = self._loss_positive and loss > 0
        gn = metrics.get("gradient_norm")
        if gn is not None and scaler_skip and not math.isfinite(float(gn)) and loss is not None and math.isfinite(loss):
            self.scaler_skips.append(step)
        elif gn is not None:
            gn = float(gn)
            if self._finite("gradient_norm", step, gn, self.settings.persist if fp16_skips else 1, opened):
                opened += self.signals["gradient_norm"].update(step, gn, allow_vanishing=not self._converged())
        if loss is not None and math.isfinite(loss):
            if self._loss_positive:
                opened += self.signals["loss"].update(step, loss)
            exploding = any(s.explode is not None for s in self.signals.values())
            plateau = self.plateau.update(step, loss, allow=not exploding)
            if plateau is not None:
                opened.append(plateau)
        self._link_nonfinite(opened)
        self.episodes.extend(opened)
        return [e for e in opened if e.alerted]

    def _link_nonfinite(self, opened: list[Episode]) -> None:
        """One alert where one is enough; each signal keeps its own episode and range."""
        nonfinite = {e.signal: e for e in opened if e.kind == "nonfinite"}
        if len(nonfinite) == 2:  # a NaN loss gives NaN gradients: the loss's alert says both
            nonfinite["loss"].note = "and so is gradient_norm"
            nonfinite["gradient_norm"].merged = True
            return
        if not nonfinite:
            return
        (signal, episode), = nonfinite.items()
        other_signal = "loss" if signal == "gradient_norm" else "gradient_norm"
        other = self._nonfinite[other_signal]
        if other is None:
            return
        episode.note = f"after {other_signal}, not finite since step {other.start_step}"
        if signal == "gradient_norm":
            # The loss went first (e.g. under fp16, where gradient_norm needs P points in a
            # row): NaN gradients are what a NaN loss makes, nothing new to alert.
            episode.merged = True
        else:
            # Non-finite gradients reached the weights, or the loss overflowed: the user must
            # learn that the loss is gone too, and from when, without the actions again.
            episode.follows = other_signal

    def _finite(self, signal: str, step: int, value: float, persist: int, opened: list[Episode]) -> bool:
        current = self._nonfinite[signal]
        if math.isfinite(value):
            self._nonfinite_run[signal] = 0
            if current is not None:
                current.open = False
                self._nonfinite[signal] = None
            return True
        self._nonfinite_run[signal] += 1
        if self._nonfinite_run[signal] == 1:
            self._nonfinite_start[signal] = step
        if current is not None:
            current.end_step = step
        elif self._nonfinite_run[signal] >= persist:
            episode = Episode("nonfinite", signal, self._nonfinite_start[signal], step, step, value)
            self._nonfinite[signal] = episode
            opened.append(episode)
        return False

    def _converged(self) -> bool:
        """The loss fell CONVERGED_LOSS_RATIO-fold or more from its start: small gradients are expected."""
        if not self._loss_first or not self._loss_recent or not self._loss_positive:
            return False
        first = median(self._loss_first)
        return median(self._loss_recent) <= first / CONVERGED_LOSS_RATIO

    def open_episodes(self) -> list[Episode]:
        return [e for e in self.episodes if e.open]

    def finish(self) -> list[Episode]:
        """Close every open episode at the last step seen; return all episodes."""
        for episode in self.episodes:
            episode.open = False
        return self.episodes


def detect_trends(
    gradient_norm: Optional[Sequence[float]] = None,
    loss: Optional[Sequence[float]] = None,
    steps: Optional[Sequence[int]] = None,
    *,
    warmup_steps: int = 0,
    settings: Optional[TrendAlertArgs] = None,
    extra: Optional[Sequence[Mapping[str, float]]] = None,
) -> list[Episode]:
    """Every episode in a finished series (the offline form of :class:`TrendDetector`).

    Args:
        gradient_norm: Logged gradient norms, one per logged step.
        loss: Logged losses, aligned with ``gradient_norm`` (either may be omitted).
        steps: The steps they were logged at; default 0, 1, 2, ...
        warmup_steps: Spikes before this step are tolerated.
        settings: Thresholds; defaults when None.
        extra: Optional per-point metrics merged in (e.g. ``loss_scale`` under fp16).

    Returns:
        All episodes, closed, in the order they were recognised (tolerated ones included).

    Example::

        for e in detect_trends(gradient_norm=[1.0] * 30 + [10.0 * 2**i for i in range(10)]):
            print(e.kind, e.start_step, e.end_step)    # spike 30 31, then exploding 30 39
    """
    n = max(len(gradient_norm) if gradient_norm is not None else 0, len(loss) if loss is not None else 0)
    steps = list(range(n)) if steps is None else list(steps)
    detector = TrendDetector(settings, warmup_steps=warmup_steps)
    for i in range(n):
        point: dict[str, float] = dict(extra[i]) if extra is not None else {}
        if gradient_norm is not None and i < len(gradient_norm):
            point["gradient_norm"] = float(gradient_norm[i])
        if loss is not None and i < len(loss):
            point["loss"] = float(loss[i])
        detector.update(steps[i], point)
    return detector.finish()
