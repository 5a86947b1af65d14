"""Read gradient_norm and loss as trends, and warn once per unstable episode.

The detector works on values that are already logged (host floats, one point every
``log_every_num_steps`` steps), so it adds no host-device synchronisation. It keeps a few
dozen numbers per signal and compares each new point with robust statistics of the points
before it: medians and MADs of log10 values, so that one outlier moves nothing and a
factor of 10 is the same distance at any scale.

========================  ====================================================================
Episode kind              When (defaults of ``trend_alerts``; W = ``window``, P = ``persist``)
========================  ====================================================================
``exploding``             The last P points are all >= ``spike_factor`` x and their median
                          >= ``explode_factor`` x (10x) the lowest band level of the recent
                          past (band level: median of W points; recent past: 10 W points);
                          or, faster, two rising points, the last ``explode_factor`` squared
                          (100x) above it. The loss uses ``loss_explode_factor`` (4x).
                          Before P points exist (no band yet): from the second logged point
                          on, one point two orders of magnitude (100x) above the lowest
                          point before it.
``vanishing``             The last P points are all <= the highest band level / ``vanish_factor``
                          (100x), gradient_norm only. Not raised when the loss fell 10x or more
                          from its start (a model that fits its data has small gradients).
``spike``                 One point >= ``spike_factor`` x (5x; loss: ``loss_spike_factor``, 2x)
                          the median of the W points before it, and beyond ``z`` robust standard
                          deviations. Tolerated (recorded, not alerted) during lr warmup.
``plateau``               The loss over the last W points is flat and has improved by less
                          than ``plateau_min_improvement`` (5%) since the start.
``nonfinite``             The loss is NaN/Inf; or gradient_norm is, for P points in a row under
                          fp16 loss scaling (where single skipped steps are expected), else at once.
                          Each signal has its own episode and step range. Both at the same step:
                          one alert says both. gradient_norm first, the loss later: a follow-up
                          alert (one line) says when the loss went. The loss first: the NaN
                          gradients that follow are recorded, not alerted (a NaN loss makes them).
========================  ====================================================================

Every jump must also exceed ``z`` robust standard deviations (1.4826 x MAD) of its reference
band, so a noisy signal needs a larger jump. An episode is alerted when it opens, and stays
open (no new alert) until the signal comes back, halfway in log terms. The alert (and its
``metrics.jsonl`` row) gives the step range as of detection; the episode's final range is in
:attr:`TrendDetector.episodes` after :meth:`TrendDetector.finish`, and in ``stabletrain report``.

In any loop, on plain numbers::

    detector = TrendDetector(warmup_steps=100)
    for step in range(steps):
        ...
        if step % 10 == 0:
            for episode in detector.update(step, {"loss": loss.item(), "gradient_norm": gn}):
                print(episode.message())

    episodes = detect_trends(gradient_norm=[...], loss=[...], steps=[...])   # offline

In the trainer, :class:`TrendAlerts` does this on ``on_log``: it prints each alert with
concrete next actions and records it in ``metrics.jsonl`` as an ``{"event": "trend_alert"}``
row. It is on by default (``trend_alerts.enabled``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from stabletrain.config import TrendAlertArgs
from stabletrain.debug import advice
from stabletrain.events import TrainerLike
from stabletrain.utils.text import fmt_factor, fmt_number

KINDS = ("exploding", "vanishing", "spike", "plateau", "nonfinite")
SIGNALS = ("gradient_norm", "loss")

#: The lowest/highest band level is looked for over this many windows back.
HORIZON_WINDOWS = 10
#: Vanishing needs bands of at least this share of a window (an early transient is not a level).
VANISH_MIN_BAND_SHARE = 0.5
#: Loss at or below start / CONVERGED_LOSS_RATIO: small gradients are convergence, not vanishing.
CONVERGED_LOSS_RATIO = 10.0
#: Floor for log10 of non-positive values (a gradient norm of exactly 0).
_LOG_FLOOR = -30.0
#: Before a band exists: a point this many orders of magnitude above the lowest one before it
#: is exploding.
EARLY_ORDERS = 2.0


@dataclass
class Episode:
    """One unstable stretch of one signal.

    Attributes:
        kind: exploding, vanishing, spike, plateau or nonfinite.
        signal: gradient_norm or loss.
        start_step: First step of the episode.
        end_step: Last step seen in it so far (final once ``open`` is False).
        detected_step: Step at which it was recognised (and alerted).
        value: The signal's value when recognised (for spikes: the highest value).
        reference: The level it is compared with (NaN where there is none).
        tolerated: A spike during warmup: recorded, not alerted.
        open: Whether the episode is still going on.
        note: Extra words for the description.
        merged: Recorded, not alerted: another signal's alert already says it (gradient_norm
            going non-finite with, or after, the loss).
        follows: For a non-finite episode alerted as a follow-up: the signal that was already
            non-finite (its alert gave the next actions, so the follow-up repeats none).
    """

    kind: str
    signal: str
    start_step: int
    end_step: int
    detected_step: int
    value: float
    reference: float = float("nan")
    tolerated: bool = False
    open: bool = True
    note: str = ""
    merged: bool = False
    follows: str = ""

    @property
    def factor(self) -> float:
        """value / reference (NaN when either is missing or the reference is not positive)."""
        if not (math.isfinite(self.value) and math.isfinite(self.reference)) or self.reference <= 0:
            return float("nan")
        return self.value / self.reference

    @property
    def alerted(self) -> bool:
        """Whether the live alerts print it (tolerated and merged episodes are only recorded)."""
        return not (self.tolerated or self.merged)

    def steps_text(self) -> str:
        if self.start_step == self.end_step:
            return f"step {self.start_step}"
        return f"steps {self.start_step}-{self.end_step}"

    def describe(self) -> str:
        """One line: what happened, where, by how much."""
        s, what = self.signal, self.steps_text()
        v, r, f = fmt_number(self.value), fmt_number(self.reference), self.factor
        if self.kind == "exploding":
            return f"{s} is exploding ({what}): {v}, {fmt_factor(f)} its lowest recent level {r}"
        if self.kind == "vanishing":
            shrink = 1 / f if f > 0 else float("inf")
            return f"{s} is vanishing ({what}): {v}, {fmt_factor(shrink)} below its highest level {r}"
        if self.kind == "spike":
            tail = " (during warmup: tolerated)" if self.tolerated else ""
            return f"{s} spiked ({what}): {v}, {fmt_factor(f)} its recent median {r}{tail}"
        if self.kind == "plateau":
            return f"{s} is on a plateau ({what}): {v}, barely below its start {r}"
        return f"{s} is not finite ({what}): {v}" + (f", {self.note}" if self.note else "")

    def message(self, context: Optional["AlertContext"] = None) -> str:
        """The alert as printed: description, then one ``next:`` line per action."""
        return format_alerts([self], context)

    def to_event(self, context: Optional["AlertContext"] = None) -> dict[str, Any]:
        """The ``metrics.jsonl`` row recording this episode (its range as of detection)."""
        event = {
            "event": "trend_alert",
            "step": self.detected_step,
            "kind": self.kind,
            "signal": self.signal,
            "start_step": self.start_step,
            "end_step": self.end_step,
            "value": self.value,
            "reference": self.reference,
            "factor": self.factor,
            "tolerated": self.tolerated,
            "message": self.describe(),
            "actions": next_actions(self, context),
        }
        if self.follows:
            event["follows"] = self.follows
        return event


@dataclass
class AlertContext:
    """What makes the next actions concrete; every field is optional."""

    lr: Optional[float] = None
    precision: Optional[str] = None
    gradient_clip_val: Optional[float] = None
    warmup_steps: Optional[int] = None
    n_params: Optional[int] = None
    task: Optional[str] = None
    #: Logged rows (step, lr, loss, gradient_norm) before the alert: anchor the lr advice.
    history: Optional[list[dict[str, Any]]] = None
    #: The newest healthy checkpoint as the setting that resumes from it (``resume_from=...`` or
    #: ``resume_interrupted=true``) and why it is healthy; ``checkpoint_known`` with no setting:
    #: the run has none.
    resume_setting: Optional[str] = None
    checkpoint_why: str = ""
    checkpoint_known: bool = False

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], n_params: Optional[int] = None) -> "AlertContext":
        """From resolved settings (settings.json, or ``TrainSettings.to_json_dict()``)."""
        model_args = settings.get("model_args") or {}
        if n_params is None:
            n_params = (settings.get("model_meta") or {}).get("n_params")
        return cls(
            lr=model_args.get("lr"),
            precision=settings.get("precision"),
            gradient_clip_val=settings.get("gradient_clip_val"),
            warmup_steps=model_args.get("warmup_steps"),
            n_params=n_params,
            task=settings.get("task"),
        )


def next_actions(episode: Episode, context: Optional[AlertContext] = None) -> list[str]:
    """The spec's next actions for an episode, with values from ``context`` filled in
    (:mod:`stabletrain.debug.advice` proposes them)."""
    c = context or AlertContext()
    lr = advice.positive(c.lr)
    now = f" (now {advice.setting_value(lr)})" if lr else ""
    precision = c.precision
    lower = advice.anchored_lower_lr(lr, c.history or (), episode.start_step) if lr else ""
    if episode.kind == "exploding":
        actions = [
            f"lower the learning rate: {lower}"
            if lr
            else f"lower the learning rate (model_args.lr), e.g. by {advice.LR_DECREASE}x"
        ]
        switch = advice.switch_precision(precision)
        current = f" (now {precision})" if precision else ""
        if precision in ("16-mixed", "16-true") or precision is None:
            actions.append(f"switch to a more stable precision: {switch}{current}")
        elif switch:
            actions.append(f"rule out reduced precision: {switch} (now {precision})")
        if not advice.positive(c.gradient_clip_val):
            actions.append(f"clip gradients: gradient_clip_val={advice.CLIP_VALUE}")
        if c.resume_setting:
            actions.append(f"go back to the newest healthy checkpoint ({c.checkpoint_why}): {c.resume_setting}")
        return actions
    if episode.kind == "vanishing":
        small = c.n_params is not None and c.n_params <= 10_000_000
        size = f" (this model has {c.n_params:,} parameters; small models often need more)" if small else ""
        actions = [
            f"raise the learning rate: {advice.raise_lr(lr)}{now}{size}"
            if lr
            else "raise the learning rate (model_args.lr), especially for small models (~10M parameters or fewer)"
        ]
        if c.task in (None, "image_classification", "custom"):
            actions.append(
                "check that the input normalization matches your data: transform_args.normalize.mean/std"
            )
        if precision in ("16-mixed", "16-true"):
            actions.append(f"tiny fp16 gradients underflow to zero: precision=bf16-mixed (now {precision})")
        return actions
    if episode.kind == "spike":
        if episode.tolerated:
            return ["none: short spikes during learning-rate warmup are usually normal"]
        warm = c.warmup_steps
        return [
            "a single spike is usually harmless; if spikes recur or grow, "
            + (
                "" if advice.positive(c.gradient_clip_val)
                else f"clip gradients: gradient_clip_val={advice.CLIP_VALUE}, "
            )
            + (f"lower model_args.lr{now}, " if lr else "lower model_args.lr, ")
            + (f"or warm up longer: model_args.warmup_steps={max(2 * warm, 100)}" if warm is not None
               else "or warm up longer (model_args.warmup_steps)")
        ]
    if episode.kind == "plateau":
        actions = [
            f"if gradient_norm is small too, raise the learning rate: {advice.raise_lr(lr)}{now}"
            if lr
            else "if gradient_norm is small too, raise the learning rate (model_args.lr)",
            "check that inputs and labels match (a shuffled or constant label gives a flat loss)",
        ]
        if c.task in (None, "image_classification", "custom"):
            actions.append("check the input normalization: transform_args.normalize.mean/std")
        return actions
    if c.resume_setting:
        rerun = f"re-run from the newest healthy checkpoint ({c.checkpoint_why}): {c.resume_setting}"
    elif c.checkpoint_known:
        rerun = "no healthy checkpoint yet: start again with overwrite=true"
    else:
        rerun = "re-run from the newest healthy checkpoint (resume_from=<its path>)"
    return [
        rerun + (f" with a lower {lower}" if lr else ""),
        "if it reproduces, isolate reduced precision: precision=32-true" + (f" (now {precision})" if precision else "")
        if precision not in ("32-true", "64-true")
        else f"precision is already {precision}: reduced precision is not the cause",
        "localise it: debug_args.underflow_overflow.enabled=true, then debug_args.nancapture.enabled=true",
    ]


# ------------------------------------------------------------------------------- statistics


def _median_mad_sigma(xs: Sequence[float]) -> tuple[float, float]:
    """Median and robust standard deviation (1.4826 x median absolute deviation)."""
    # statistics.median: these lists are a few dozen numbers, where numpy's call overhead dominates.
    med = median(xs)
    return med, 1.4826 * median([abs(x - med) for x in xs])


def theil_sen_slope(ys: Sequence[float]) -> float:
    """Median of the pairwise slopes of equally spaced points (robust to outliers)."""
    y = np.asarray(ys, dtype=np.float64)
    n = len(y)
    if n < 2:
        return 0.0
    i, j = np.triu_indices(n, k=1)
    return float(np.median((y[j] - y[i]) / (j - i)))


def _log(v: float) -> float:
    return math.log10(v) if v > 0 else _LOG_FLOOR


# --------------------------------------------------------------------------------- signals


class _LogSignal:
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
        x = _log(value)
        before = [p[1] for p in self.points][-self.W :]
        self.points.append((step, x, value))
        n_points = len(self.points)
        if n_points > self.P:
            older = [p[1] for p in self.points][: -self.P][-self.W :]
            med, sigma = _median_mad_sigma(older)
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
        med, sigma = _median_mad_sigma(before)
        threshold = max(self.spike_log, self.z * sigma)
        if x - med < threshold:
            return
        tolerated = step < self.warmup_steps
        self.spike = Episode("spike", self.signal, step, step, step, value, 10**med, tolerated=tolerated)
        self.spike_ref, self.spike_threshold = med, threshold
        opened.append(self.spike)

class _Plateau:
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
        sigma = _median_mad_sigma(residuals.tolist())[1] / scale
        improved_noise = 3 * 1.25 * sigma * math.sqrt(1 / len(values) + 1 / len(self.first))
        change_noise = 3 * sigma * math.sqrt(12 / len(values))
        tolerance = self.min_improvement * slack
        if improved >= max(tolerance, improved_noise):
            return False
        # One-sided: a rising loss is not improving either (and a steep rise is "exploding").
        return not trend or change >= -max(tolerance, change_noise)


# -------------------------------------------------------------------------------- detector


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
            "gradient_norm": _LogSignal(
                "gradient_norm", a, a.spike_factor, a.explode_factor, a.vanish_factor, warmup_steps
            ),
            "loss": _LogSignal("loss", a, a.loss_spike_factor, a.loss_explode_factor, None, warmup_steps),
        }
        self.plateau = _Plateau(a, warmup_steps)
        self.episodes: list[Episode] = []
        self.last_step: Optional[int] = None
        self._nonfinite: dict[str, Optional[Episode]] = {s: None for s in SIGNALS}
        self._nonfinite_run: dict[str, int] = {s: 0 for s in SIGNALS}
        self._nonfinite_start: dict[str, int] = {}
        self._loss_positive = True
        self._loss_first: list[float] = []
        self._loss_recent: deque[float] = deque(maxlen=self.settings.persist)

    def update(self, step: int, metrics: Mapping[str, float]) -> list[Episode]:
        """Feed one logged step (``loss`` and/or ``gradient_norm`` keys); return new alerts.

        A ``loss_scale`` key (fp16 loss scaling) makes single non-finite gradient norms
        expected: the scaler skips those steps.
        """
        self.last_step = step
        opened: list[Episode] = []
        fp16_skips = "loss_scale" in metrics
        loss = metrics.get("loss")
        if loss is not None:
            loss = float(loss)
            if self._finite("loss", step, loss, 1, opened):
                self._loss_recent.append(loss)
                if len(self._loss_first) < self.settings.persist:
                    self._loss_first.append(loss)
                self._loss_positive = self._loss_positive and loss > 0
        gn = metrics.get("gradient_norm")
        if gn is not None:
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


def format_alerts(episodes: Sequence[Episode], context: Optional[AlertContext] = None) -> str:
    """Episodes recognised at the same step as one warning: each description, then the
    next actions of all of them without repeats. A follow-up (``Episode.follows``) adds its
    line only: the alert it follows gave the same actions."""
    lines = [f"WARNING {e.describe()}." for e in episodes]
    seen: set[str] = set()
    for e in episodes:
        if e.follows:
            continue
        for action in next_actions(e, context):
            if action not in seen:
                seen.add(action)
                lines.append(f"  next: {action}")
    return "\n".join(lines)


# -------------------------------------------------------------------------------- callback


class TrendAlerts:
    """Trainer callback: runs a :class:`TrendDetector` on every logged step (``on_log``).

    Each new episode is printed once with concrete next actions (``trainer.console``) and
    recorded in ``metrics.jsonl`` as ``{"event": "trend_alert", "kind": ..., "signal": ...,
    "start_step": ..., "end_step": ..., "actions": [...]}``. The metrics it reads are host
    floats the trainer already read back, so it adds no host synchronisation.

    Args:
        settings: Thresholds; default: the trainer's ``trend_alerts`` settings.

    Example::

        stabletrain.train(out="out/x", trend_alerts={"explode_factor": 5})   # on by default
    """

    def __init__(self, settings: Optional[TrendAlertArgs] = None):
        self._settings = settings
        self.detector: Optional[TrendDetector] = None
        self.context: Optional[AlertContext] = None
        self.alerts: list[dict[str, Any]] = []
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_ROWS)

    def on_train_start(self, trainer: TrainerLike) -> None:
        s = trainer.settings
        self.detector = TrendDetector(self._settings or s.trend_alerts, warmup_steps=s.model_args.warmup_steps)
        self.context = AlertContext(
            lr=s.model_args.lr,
            precision=getattr(trainer, "precision", None),
            gradient_clip_val=s.gradient_clip_val,
            warmup_steps=s.model_args.warmup_steps,
            n_params=sum(p.numel() for p in trainer.model.parameters()),
            task=(trainer.task.name if getattr(trainer, "task", None) is not None else None),
        )
        if s.resume_interrupted or getattr(s, "resume_from", None) is not None:
            self._replay_history(Path(trainer.out) / "metrics.jsonl", before_step=trainer.step)

    def _replay_history(self, path: Path, before_step: int) -> None:
        """After a resume, continue the trend of the steps already logged (alerts already given)."""
        from stabletrain.run_history import read_run

        if self.detector is None or not path.exists():
            return
        for row in read_run(path).rows:
            step = row.get("step")
            if isinstance(step, int) and step < before_step:
                self.detector.update(step, row)
                self.history.append(_history_row(step, row))

    def on_log(self, trainer: TrainerLike, *, step: int, metrics: dict[str, float]) -> None:
        if self.detector is None:
            self.on_train_start(trainer)
        assert self.detector is not None
        self.history.append(_history_row(step, metrics))
        opened = self.detector.update(step, metrics)
        if not opened:
            return
        assert self.context is not None
        self.context.history = list(self.history)
        if any(e.kind in ("nonfinite", "exploding") for e in opened) and hasattr(trainer, "healthy_checkpoint"):
            checkpoint_context(self.context, trainer)
        for episode in opened:
            event = episode.to_event(self.context)
            self.alerts.append(event)
            trainer.log_event(event)
        trainer.console.info(format_alerts(opened, self.context))

    def on_train_end(self, trainer: TrainerLike) -> None:
        if self.detector is not None:
            self.detector.finish()


#: Logged rows a live TrendAlerts keeps for the lr advice.
HISTORY_ROWS = 500


def _history_row(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {"step": step, **{k: metrics.get(k) for k in ("lr", "loss", "gradient_norm")}}


def checkpoint_context(context: AlertContext, trainer: Any) -> None:
    """The newest healthy checkpoint, as the setting that resumes from it."""
    best = trainer.healthy_checkpoint()
    context.checkpoint_known = True
    if best is None:
        context.resume_setting = None
        return
    last = best.path.parent / "last.ckpt"
    same = best.path == last or _step_of(last) == best.step
    context.resume_setting = "resume_interrupted=true" if same else f"resume_from={best.path}"
    context.checkpoint_why = f"step {best.step}: {best.why}"


def _step_of(path: Path) -> Optional[int]:
    from stabletrain.checkpoint import read_checkpoint_health

    try:
        return read_checkpoint_health(path)[0] if path.is_file() else None
    except Exception:
        return None


__all__ = [
    "Episode",
    "AlertContext",
    "TrendDetector",
    "TrendAlerts",
    "detect_trends",
    "next_actions",
    "checkpoint_context",
    "theil_sen_slope",
    "KINDS",
]
