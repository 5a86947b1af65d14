"""An unstable episode of one signal, and how it is told: its description, its next actions (made concrete
with an :class:`AlertContext`), the printed alert and its ``metrics.jsonl`` row. See ``docs/trend_alerts.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from stabletrain.debug import advice
from stabletrain.utils.text import fmt_factor, fmt_number

KINDS = ("exploding", "vanishing", "spike", "plateau", "nonfinite")
SIGNALS = ("gradient_norm", "loss")


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
        settled: What already answered it, e.g. the resume that replaced its timeline: its next
            action says so instead of proposing the fixes again.
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
    settled: str = ""

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
            tail = f", {self.note}" if self.settled and self.note else ""
            return f"{s} is exploding ({what}): {v}, {fmt_factor(f)} its lowest recent level {r}{tail}"
        if self.kind == "vanishing":
            shrink = 1 / f if f > 0 else float("inf")
            return f"{s} is vanishing ({what}): {v}, {fmt_factor(shrink)} below its highest level {r}"
        if self.kind == "spike":
            tail = " (during warmup: tolerated)" if self.tolerated else ""
            if not math.isfinite(self.value):  # a recovery event: the spike is known, its value not logged
                return f"{s} spiked ({what})" + (f": {self.note}" if self.note else "")
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
    #: The optimizer (``model_args.optimizer`` or its class, ``torch.optim.AdamW``): the lr and
    #: clipping advice depend on it (see :func:`stabletrain.debug.advice.optimizer_family`).
    optimizer: Optional[str] = None
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
            optimizer=model_args.get("optimizer"),
        )


def next_actions(episode: Episode, context: Optional[AlertContext] = None) -> list[str]:
    """The spec's next actions for an episode, with values from ``context`` filled in
    (:mod:`stabletrain.debug.advice` proposes them)."""
    if episode.settled:
        return [f"already answered: {episode.settled}; the episodes after it say whether more is needed"]
    return _fixes(episode, context)


def _fixes(episode: Episode, context: Optional[AlertContext]) -> list[str]:
    c = context or AlertContext()
    lr = advice.positive(c.lr)
    now = f" (now {advice.setting_value(lr)})" if lr else ""
    precision = c.precision
    lower = advice.anchored_lower_lr(lr, c.history or (), episode.start_step, optimizer=c.optimizer) if lr else ""
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
