"""The rules that name a silent instability from the logged ``signals/...``: attention-logit growth, output-logit
divergence, the Adam epsilon regime, runaway updates, the stale second moment and the float16 range.

:class:`MechanismDetector` streams the logged rows of a run (host floats: the trainer's one read per logged
step) and returns the mechanisms it names at each step; :func:`detect_mechanisms` runs it over a finished
run's rows. Each rule reads only what a row holds, so the live alert, ``stabletrain report`` and
``stabletrain diagnose`` name the same mechanism at the same step from the same ``metrics.jsonl``.
:data:`MECHANISMS` holds each mechanism's name, rule, published fix and reference (docs/mechanisms.md's
table is checked against it). The thresholds are ``debug_args.mechanisms`` settings.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Mapping, Optional, Sequence

from stabletrain.config import MechanismArgs
from stabletrain.debug.mechanisms import keys
from stabletrain.utils.text import fmt_number


@dataclass(frozen=True)
class MechanismInfo:
    """What is known of a mechanism: its name, the rule that names it, the published fixes and where they come
    from."""

    id: str
    name: str
    rule: str
    fix: str
    reference: str


MECHANISMS: dict[str, MechanismInfo] = {m.id: m for m in (
    MechanismInfo(
        "attention_logit_growth", "attention-logit growth",
        "a module's `signals/attn_logit_max` >= `attn_logit_limit` (50) while its `signals/attn_entropy` <= "
        "`attn_entropy_floor` (0.1 nats), at `persist` (2) logged points in a row",
        "qk-layernorm (`model_args.qk_norm=true`), or a lower lr",
        "Dehghani et al. 2023 (ViT-22B); Wortsman et al. 2023",
    ),
    MechanismInfo(
        "output_logit_divergence", "output-logit divergence",
        "`signals/output_logit_mean` (the logits' common level, which the softmax ignores) at least "
        "`logit_mean_limit` (20) from 0 and from its first logged value, at `persist` logged points in a row",
        "z-loss (`model_args.z_loss=1e-4`), or weight decay",
        "Chowdhery et al. 2022 (PaLM's z-loss); Wortsman et al. 2023",
    ),
    MechanismInfo(
        "adam_eps", "the Adam epsilon regime",
        "`signals/adam_eps_fraction` >= `eps_fraction` (0.5) and every group's update RMS "
        "(`update_rms` x `weight_rms`) <= `eps_update_ratio` (0.1) x the lr, at one logged point (a count over "
        "every second moment is not noise)",
        "a lower eps (`model_args.eps`)",
        "Wortsman et al. 2023",
    ),
    MechanismInfo(
        "stale_second_moment", "a stale second moment",
        "Adam family: `signals/update_rms_max` >= `stale_update_jump` (10) x its median over the last `window` (10) "
        "logged points, with the loss above twice their median, after a stretch without a mechanism",
        "a lower beta2 (`model_args.betas`), or a lower lr",
        "Molybog et al. 2023",
    ),
    MechanismInfo(
        "runaway_updates", "runaway updates",
        "a group's `signals/update_rms` >= `runaway_update` (0.3) per step with its `signals/weight_rms` >= "
        "`runaway_growth` (2) x its first logged value and the loss >= (1 + `runaway_loss_rise` (0.2)) x its lowest, "
        "at `persist` logged points in a row",
        "a lower lr; a longer warmup; gradient clipping (not for Adam: its update is about lr whatever the "
        "gradient)",
        "Rybakov et al. 2024; Wortsman et al. 2023",
    ),
    MechanismInfo(
        "fp16_range", "the float16 range",
        "precision 16-mixed or 16-true, and `signals/attn_logit_max` or `signals/output_logit_absmax` above "
        "1/4 of float16's largest value (65504), or the loss scale at or below 1, at `persist` logged points",
        "bf16 (`precision=bf16-mixed`) or float32 for the module",
        "Micikevicius et al. 2018 (mixed precision training)",
    ),
)}

#: The mechanisms' names, in the order of :data:`MECHANISMS` (the report's statuses).
NAMES = tuple(m.name for m in MECHANISMS.values())

#: float16's largest finite value.
FP16_MAX = 65504.0


@dataclass
class Mechanism:
    """A mechanism named in a run.

    Attributes:
        id: The key of :data:`MECHANISMS` (``attention_logit_growth``, ...).
        where: The attention module(s) or parameter group(s) it was found in ("" for the whole model).
        start_step: When the mechanism began: the first of the logged points in a row at which its rule held
            (for attention-logit growth, from where the logit rose past a fifth of the limit). A checkpoint
            written after it is not healthy.
        detected_step: The logged step at which the rule held (the live alert's step).
        evidence: The numbers, as one sentence.
        values: The same numbers for machines (``metrics.jsonl``'s ``mechanism`` row).
        end_step: The last logged step the rule held before it stopped holding; None while it still does.
        follows: The id of a mechanism already named and still open when this one was: this one is most likely
            its consequence (runaway updates grow every logit), not a second cause.
        settled: What already answered it (a resume that replaced its timeline); "" when nothing did.
        episode: 1 the first time its rule named it, 2 when the rule named it again after it closed, and so on
            (a mechanism that comes and goes is warned about in full once, then in one line).
    """

    id: str
    where: str
    start_step: int
    detected_step: int
    evidence: str
    values: dict[str, float] = field(default_factory=dict)
    end_step: Optional[int] = None
    follows: str = ""
    settled: str = ""
    episode: int = 1
    #: The later episodes of the same mechanism in the same place (:func:`merge_episodes`), told in one clause.
    repeats: list["Mechanism"] = field(default_factory=list, compare=False, repr=False)

    @property
    def info(self) -> MechanismInfo:
        return MECHANISMS[self.id]

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def open(self) -> bool:
        return self.end_step is None

    def steps_text(self) -> str:
        found = f"found at step {self.detected_step}"
        text = f"from step {self.start_step}, {found}" + ("" if self.open else f", until step {self.end_step}")
        if self.repeats:
            last = self.repeats[-1]
            times = "once" if len(self.repeats) == 1 else f"{len(self.repeats)} times"
            text += (f"; named again {times}, from step {self.repeats[0].start_step}"
                     + (" and still open" if last.open else f" until step {last.end_step}"))
        return text

    def describe(self) -> str:
        """One line: which mechanism, where, from when, the numbers."""
        where = f" in {self.where}" if self.where else ""
        after = f"; it follows {MECHANISMS[self.follows].name}, most likely as its consequence" if self.follows else ""
        settled = f"; {self.settled}" if self.settled else ""
        return f"{self.name}{where} ({self.steps_text()}{after}{settled}): {self.evidence}"

    def end_event(self, step: int) -> dict[str, Any]:
        """The ``{"event": "mechanism_end", ...}`` row: the rule stopped holding (logged at ``step``)."""
        return {"event": "mechanism_end", "step": step, "id": self.id, "name": self.name, "where": self.where,
                "start_step": self.start_step, "end_step": self.end_step,
                "message": f"{self.name} no longer holds (it held from step {self.start_step} to {self.end_step})"}

    def to_event(self) -> dict[str, Any]:
        """The ``{"event": "mechanism", ...}`` row of ``metrics.jsonl``."""
        return {
            "event": "mechanism", "step": self.detected_step, "id": self.id, "name": self.name, "where": self.where,
            "start_step": self.start_step, "detected_step": self.detected_step, "end_step": self.end_step,
            "evidence": self.evidence, "values": self.values, "fix": self.info.fix,
            "reference": self.info.reference, "follows": self.follows, "message": self.describe(),
            "episode": self.episode,
        }

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> Optional["Mechanism"]:
        """The mechanism a ``mechanism`` row records (None for another row or an unknown id)."""
        if event.get("event") != "mechanism" or event.get("id") not in MECHANISMS:
            return None
        try:
            return cls(str(event["id"]), str(event.get("where") or ""), int(event["start_step"]),
                       int(event.get("detected_step", event["step"])), str(event.get("evidence") or ""),
                       dict(event.get("values") or {}),
                       None if event.get("end_step") is None else int(event["end_step"]),
                       str(event.get("follows") or ""), episode=int(event.get("episode") or 1))
        except (KeyError, TypeError, ValueError):
            return None


def _num(row: Mapping[str, Any], key: str) -> Optional[float]:
    v = row.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _f(x: float) -> str:
    return fmt_number(x)


def _with(base: str, row: Mapping[str, Any]) -> dict[str, float]:
    """``{name: value}`` of the keys ``base/<name>`` a row holds (finite values)."""
    prefix = base + "/"
    return {k[len(prefix):]: float(v) for k, v in row.items()
            if k.startswith(prefix) and isinstance(v, (int, float)) and math.isfinite(v)}


class _Rule:
    """One mechanism's rule: ``hold(step, row)`` says whether it holds at a logged row (and where, with what
    numbers); the detector counts the streak and opens and closes the :class:`Mechanism`."""

    id = ""
    #: One logged point is enough: the evidence cannot come from one noisy value (the eps regime is a count over
    #: every second moment; a stale-moment spike is a single step by nature).
    single = False

    def __init__(self, args: MechanismArgs, context: "RuleContext"):
        self.args = args
        self.context = context
        self.streak = 0
        self.streak_start: Optional[int] = None
        self.misses = 0
        self.last_held = -1
        self.current: Optional[Mechanism] = None

    def hold(self, step: int, row: Mapping[str, Any]) -> Optional[tuple[str, str, dict[str, float]]]:
        """``(where, evidence, values)`` when the rule holds at this row, else None."""
        raise NotImplementedError

    def began(self, step: int) -> int:
        """The first step of the stretch the mechanism covers, when it is named at ``step``."""
        return self.streak_start if self.streak_start is not None else step

    def observe(self, step: int, row: Mapping[str, Any]) -> None:
        """Follow what the rule needs between rows (first values, lowest loss, ...), after :meth:`hold`."""


@dataclass
class RuleContext:
    """What the rows do not hold: the run's settings that the evidence quotes and the fixes start from (every
    field optional; a plain loop may give none)."""

    precision: Optional[str] = None
    optimizer: Optional[str] = None
    eps: Optional[float] = None
    betas: Optional[Sequence[float]] = None
    lr: Optional[float] = None
    task: Optional[str] = None
    weight_decay: Optional[float] = None
    warmup_steps: Optional[int] = None
    gradient_clip_val: Optional[float] = None
    qk_norm: Optional[bool] = None
    z_loss: Optional[float] = None

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "RuleContext":
        """From a run's resolved settings (``settings.json``, or ``TrainSettings.to_json_dict()``)."""
        m = settings.get("model_args") or {}
        return cls(precision=settings.get("precision"), optimizer=m.get("optimizer"), eps=m.get("eps"),
                   betas=m.get("betas"), lr=m.get("lr"), task=settings.get("task"),
                   weight_decay=m.get("weight_decay"), warmup_steps=m.get("warmup_steps"),
                   gradient_clip_val=settings.get("gradient_clip_val"), qk_norm=m.get("qk_norm"),
                   z_loss=m.get("z_loss"))

    @property
    def builtin_lm(self) -> bool:
        """The built-in language model, which has ``model_args.qk_norm`` and ``model_args.z_loss``."""
        return self.task == "language_model"

    @property
    def adam(self) -> bool:
        return self.optimizer is None or "adam" in str(self.optimizer).lower()


#: Settings a fix can only take in a new run (``FROZEN_ON_RESUME`` in stabletrain.runfiles.checkpoint).
NEW_RUN_SETTINGS = ("model_args.qk_norm",)


def starts_over(fix: str) -> bool:
    """Whether a fix of :func:`published_fixes` needs a new run (it cannot resume from a checkpoint)."""
    return any(name in fix for name in NEW_RUN_SETTINGS)


def published_fixes(mechanism_id: str, context: Optional[RuleContext] = None) -> list[str]:
    """The published fixes of a mechanism as settings of this run where it has them (not verified on the run:
    the caller says so)."""
    c = context or RuleContext()
    from stabletrain.debug.advice import setting_value

    lr = c.lr if isinstance(c.lr, (int, float)) and c.lr > 0 else None
    ours = c.task is not None  # stabletrain's trainer: its settings; another loop: the words
    if lr and ours:
        lower = f"a lower lr: model_args.lr={setting_value(lr * 0.3)} (x0.3)"
    elif lr:
        lower = f"a lower learning rate: {setting_value(lr * 0.3)} (x0.3 of {setting_value(lr)})"
    else:
        lower = "a lower learning rate"
    if mechanism_id == "attention_logit_growth":
        if c.builtin_lm and not c.qk_norm:
            first = ("qk-layernorm: model_args.qk_norm=true (LayerNorm of each head's queries and keys; a new run: it "
                     "adds weights, which a checkpoint does not hold)")
        elif c.builtin_lm:
            first = "qk-layernorm is already on (model_args.qk_norm=true): its gains grew; a lower lr"
        else:
            first = "qk-layernorm: a LayerNorm of each head's queries and keys before their product"
        return [first, lower]
    if mechanism_id == "output_logit_divergence":
        z = ("z-loss: model_args.z_loss=1e-4" if c.builtin_lm and not c.z_loss
             else "z-loss: add 1e-4 * logsumexp(logits)**2 to the loss")
        wd = (f"weight decay: model_args.weight_decay=0.1 (now {setting_value(c.weight_decay)})"
              if c.weight_decay is not None and c.weight_decay < 0.1 else "weight decay")
        return [z, wd]
    if mechanism_id == "adam_eps":
        eps = c.eps if isinstance(c.eps, (int, float)) and c.eps > 0 else None
        if eps is None:
            return ["a lower Adam eps"]
        return [f"a lower eps: model_args.eps={setting_value(min(eps / 100, 1e-8))} (now {setting_value(eps)})"]
    if mechanism_id == "stale_second_moment":
        b = list(c.betas) if c.betas and len(c.betas) == 2 else None
        beta2 = (f"a lower beta2: model_args.betas=[{setting_value(b[0])}, 0.95] (now {setting_value(b[1])})"
                 if b and b[1] > 0.95 else "a lower beta2")
        return [beta2, lower]
    if mechanism_id == "runaway_updates":
        fixes = [lower.replace("x0.3", "x0.3; x0.1 if it still runs away")]
        warm = c.warmup_steps
        fixes.append(f"a longer warmup: model_args.warmup_steps={max(2 * warm, 100)} (now {warm})"
                     if isinstance(warm, int) else "a longer warmup")
        if not c.adam and not c.gradient_clip_val:
            clip = "gradient_clip_val=1.0" if ours else "at a total norm of 1.0"
            fixes.append(f"gradient clipping: {clip} (it bounds this optimizer's update, which is lr x the gradient)")
        return fixes
    if mechanism_id == "fp16_range":
        return [f"bf16: {'precision=bf16-mixed' if ours else 'bfloat16 instead of float16'} (float16's range ends "
                "at 65504; bfloat16's at 3.4e38)",
                "or float32 for the module that overflows"]
    return []


class _AttentionGrowth(_Rule):
    id = "attention_logit_growth"

    def __init__(self, args: MechanismArgs, context: RuleContext):
        super().__init__(args, context)
        self.first: dict[str, tuple[int, float]] = {}
        self.high_since: dict[str, int] = {}

    def _modules(self, row: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
        logits, entropy = _with(keys.ATTN_LOGIT_MAX, row), _with(keys.ATTN_ENTROPY, row)
        found = {m: (logits[m], entropy[m]) for m in logits if m in entropy}
        if not found:  # a logger that kept only the aggregates
            lmax, hmin = _num(row, keys.ATTN_LOGIT_MAX), _num(row, keys.ATTN_ENTROPY_MIN)
            if lmax is not None and hmin is not None:
                found = {"": (lmax, hmin)}
        return found

    def hold(self, step: int, row: Mapping[str, Any]) -> Optional[tuple[str, str, dict[str, float]]]:
        a = self.args
        modules = self._modules(row)
        for m, (logit, _) in modules.items():  # where the logit began its climb: a fifth of the limit
            if logit >= a.attn_logit_limit / 5:
                self.high_since.setdefault(m, step)
            else:
                self.high_since.pop(m, None)
        hit = {m: v for m, v in modules.items() if v[0] >= a.attn_logit_limit and v[1] <= a.attn_entropy_floor}
        if not hit:
            return None
        names = sorted(hit, key=lambda m: -hit[m][0])
        top = names[0]
        logit, entropy = hit[top]
        first_step, first = self.first.get(top, (step, logit))
        where = ", ".join(n for n in names if n) if any(names) else ""
        others = f" ({len(names)} modules)" if len(names) > 1 else ""
        key = keys.module_key(keys.ATTN_LOGIT_MAX, top) if top else keys.ATTN_LOGIT_MAX
        evidence = (f"{key} {_f(logit)} ({_f(first)} at step {first_step}) with a mean attention entropy of "
                    f"{_f(entropy)} nats{others}: the softmax is one-hot, its logits so far apart that it passes "
                    f"no gradient to the other keys")
        return where, evidence, {"attn_logit_max": logit, "attn_entropy": entropy, "first_attn_logit_max": first,
                                 "modules": float(len(names))}

    def began(self, step: int) -> int:
        """Where the logits began their climb (a fifth of the limit), when that was before the rule held."""
        starts = list(self.high_since.values())
        return min([*starts, super().began(step)])

    def observe(self, step: int, row: Mapping[str, Any]) -> None:
        for m, (logit, _) in self._modules(row).items():
            self.first.setdefault(m, (step, logit))


class _OutputLogitDivergence(_Rule):
    id = "output_logit_divergence"

    def __init__(self, args: MechanismArgs, context: RuleContext):
        super().__init__(args, context)
        self.first: Optional[tuple[int, float]] = None

    def hold(self, step: int, row: Mapping[str, Any]) -> Optional[tuple[str, str, dict[str, float]]]:
        mean = _num(row, keys.OUTPUT_LOGIT_MEAN)
        if mean is None or self.first is None:
            return None
        limit = self.args.logit_mean_limit
        first_step, first = self.first
        if abs(mean) < limit or abs(mean - first) < limit:
            return None
        lse = _num(row, keys.OUTPUT_LOGSUMEXP)
        loss = _num(row, "loss")
        at_lse = f", log Z {_f(lse)}" if lse is not None else ""
        at_loss = f", at a loss of {_f(loss)}" if loss is not None else ""
        evidence = (f"{keys.OUTPUT_LOGIT_MEAN} {_f(mean)} ({_f(first)} at step {first_step}){at_lse}{at_loss}: the "
                    f"output logits drifted together, a level the softmax and the loss do not see")
        values = {"output_logit_mean": mean, "first_output_logit_mean": first}
        if lse is not None:
            values["output_logsumexp"] = lse
        return "", evidence, values

    def observe(self, step: int, row: Mapping[str, Any]) -> None:
        mean = _num(row, keys.OUTPUT_LOGIT_MEAN)
        if self.first is None and mean is not None:
            self.first = (step, mean)


def _update_ratios(row: Mapping[str, Any]) -> dict[str, float]:
    """Per group, the update's RMS over the lr: ``update_rms * weight_rms / lr`` (Adam's normalised update is
    about 1 of it)."""
    lr = _num(row, "lr")
    if lr is None or lr <= 0:
        return {}
    updates, weights = _with(keys.UPDATE_RMS, row), _with(keys.WEIGHT_RMS, row)
    return {g: updates[g] * weights[g] / lr for g in updates if g in weights}


class _AdamEps(_Rule):
    id = "adam_eps"
    single = True

    def hold(self, step: int, row: Mapping[str, Any]) -> Optional[tuple[str, str, dict[str, float]]]:
        fraction = _num(row, keys.ADAM_EPS_FRACTION)
        if fraction is None or fraction < self.args.eps_fraction:
            return None
        ratios = _update_ratios(row)
        if ratios and max(ratios.values()) > self.args.eps_update_ratio:
            return None
        eps = f" (eps={_f(self.context.eps)})" if self.context.eps is not None else ""
        evidence = (f"{keys.ADAM_EPS_FRACTION} {_f(fraction)}: {fraction:.0%} of the second-moment entries are below "
                    f"eps{eps}")
        values = {"adam_eps_fraction": fraction}
        if ratios:
            g = max(ratios, key=lambda k: ratios[k])
            evidence += (f", and the updates are damped: the largest group update RMS ({g}) is {_f(ratios[g])} x the "
                         f"lr, where Adam's normalised update is about 1 x")
            values["update_over_lr"] = ratios[g]
        else:
            evidence += " (no lr or update logged to tell how much the updates are damped)"
        return "", evidence, values


class _RunawayUpdates(_Rule):
    id = "runaway_updates"

    def __init__(self, args: MechanismArgs, context: RuleContext):
        super().__init__(args, context)
        self.first: dict[str, tuple[int, float]] = {}
        self.lowest_loss: Optional[float] = None
        self.large_since: dict[str, int] = {}

    def hold(self, step: int, row: Mapping[str, Any]) -> Optional[tuple[str, str, dict[str, float]]]:
        a = self.args
        updates, weights = _with(keys.UPDATE_RMS, row), _with(keys.WEIGHT_RMS, row)
        for g, u in updates.items():
            if u >= a.runaway_update:
                self.large_since.setdefault(g, step)
            else:
                self.large_since.pop(g, None)
        loss = _num(row, "loss")
        low = self.lowest_loss
        if loss is None or low is None or low <= 0 or loss < (1 + a.runaway_loss_rise) * low:
            return None
        hit = {}
        for g, u in updates.items():
            start = self.first.get(g)
            w = weights.get(g)
            if u >= a.runaway_update and start is not None and w is not None and start[1] > 0 \
                    and w >= a.runaway_growth * start[1]:
                hit[g] = (u, w, start)
        if not hit:
            return None
        g = max(hit, key=lambda k: hit[k][0])
        u, w, (first_step, w0) = hit[g]
        since = self.large_since.get(g, step)
        evidence = (f"{keys.UPDATE_RMS}/{g} {_f(u)}: each step changes the weights by {u:.0%} of their size (at or "
                    f"above {_f(a.runaway_update)} since step {since}), {keys.WEIGHT_RMS}/{g} {_f(w)} ({_f(w / w0)}x "
                    f"its {_f(w0)} at step {first_step}), and the loss rises: {_f(loss)}, {_f(loss / low)}x its "
                    f"lowest {_f(low)}")
        return ", ".join(sorted(hit)), evidence, {"update_rms": u, "weight_rms": w, "first_weight_rms": w0,
                                                  "loss": loss, "lowest_loss": low}

    def observe(self, step: int, row: Mapping[str, Any]) -> None:
        for g, w in _with(keys.WEIGHT_RMS, row).items():
            if w > 0:
                self.first.setdefault(g, (step, w))
        loss = _num(row, "loss")
        if loss is not None and (self.lowest_loss is None or loss < self.lowest_loss):
            self.lowest_loss = loss


class _StaleSecondMoment(_Rule):
    id = "stale_second_moment"
    single = True

    def __init__(self, args: MechanismArgs, context: RuleContext):
        super().__init__(args, context)
        self.updates: deque[float] = deque(maxlen=args.window)
        self.losses: deque[float] = deque(maxlen=args.window)
        self.adam = False

    def hold(self, step: int, row: Mapping[str, Any]) -> Optional[tuple[str, str, dict[str, float]]]:
        self.adam = self.adam or keys.ADAM_EPS_FRACTION in row
        u, loss = _num(row, keys.UPDATE_RMS_MAX), _num(row, "loss")
        if not self.adam or u is None or loss is None or len(self.updates) < self.updates.maxlen:  # type: ignore
            return None
        ref_u, ref_loss = median(self.updates), median(self.losses)
        if ref_u <= 0 or ref_loss <= 0 or u < self.args.stale_update_jump * ref_u or loss < 2 * ref_loss:
            return None
        beta2 = f" (beta2={_f(self.context.betas[1])})" if self.context.betas and len(self.context.betas) > 1 else ""
        evidence = (f"{keys.UPDATE_RMS_MAX} {_f(u)}, {_f(u / ref_u)}x its median {_f(ref_u)} over the last "
                    f"{len(self.updates)} logged points, with the loss at {_f(loss)} ({_f(loss / ref_loss)}x its "
                    "median): "
                    f"after a calm stretch the second moments{beta2} lag the gradients that grew, and Adam's update "
                    f"m / sqrt(v) is no longer about lr")
        return "", evidence, {"update_rms_max": u, "median_update_rms_max": ref_u, "loss": loss,
                              "median_loss": ref_loss}

    def observe(self, step: int, row: Mapping[str, Any]) -> None:
        u, loss = _num(row, keys.UPDATE_RMS_MAX), _num(row, "loss")
        if u is not None and loss is not None and self.current is None:
            self.updates.append(u)
            self.losses.append(loss)


class _Fp16Range(_Rule):
    id = "fp16_range"

    def hold(self, step: int, row: Mapping[str, Any]) -> Optional[tuple[str, str, dict[str, float]]]:
        if self.context.precision not in ("16-mixed", "16-true"):
            return None
        limit = FP16_MAX / 4
        for key in (keys.ATTN_LOGIT_MAX, keys.OUTPUT_LOGIT_ABSMAX):
            v = _num(row, key)
            if v is not None and abs(v) >= limit:
                return "", (f"{key} {_f(v)} under precision {self.context.precision}: {_f(abs(v) / FP16_MAX)} of "
                            f"float16's largest value {_f(FP16_MAX)}"), {key[len(keys.PREFIX):]: v}
        scale = _num(row, "loss_scale")
        if scale is not None and scale <= 1:
            return "", (f"the loss scale fell to {_f(scale)}: even unscaled, the gradients overflow float16"), \
                {"loss_scale": scale}
        return None


_RULES: tuple[type[_Rule], ...] = (_AttentionGrowth, _OutputLogitDivergence, _AdamEps, _RunawayUpdates,
                                   _StaleSecondMoment, _Fp16Range)


class MechanismDetector:
    """Streams logged rows and names the mechanisms their signals show.

    Args:
        settings: The thresholds (``debug_args.mechanisms``); defaults when None.
        context: The run's precision, optimizer, eps and betas (what a row does not hold).

    ``update(step, row)`` returns the mechanisms named at that step (each once: a mechanism stays open while its
    rule holds, and is closed after ``persist`` logged points without it); ``found`` keeps all of them.

    Example::

        detector = MechanismDetector()
        for row in rows:                          # metrics.jsonl rows with signals/... keys
            for m in detector.update(row["step"], row):
                print(m.describe())
    """

    def __init__(self, settings: Optional[MechanismArgs] = None, context: Optional[RuleContext] = None):
        self.args = settings or MechanismArgs()
        self.context = context or RuleContext()
        self.rules = [rule(self.args, self.context) for rule in _RULES]
        self.found: list[Mechanism] = []
        #: The mechanisms the last :meth:`update` closed (their rule failed ``persist`` logged points in a row).
        self.closed_now: list[Mechanism] = []
        self.last_step: Optional[int] = None

    def update(self, step: int, row: Mapping[str, Any]) -> list[Mechanism]:
        """Feed one logged row; return the mechanisms named at this step."""
        self.last_step = step
        named: list[Mechanism] = []
        self.closed_now = []
        for rule in self.rules:
            held = rule.hold(step, row)
            rule.observe(step, row)
            if held is None:
                rule.streak, rule.streak_start = 0, None
                if rule.current is not None:
                    rule.misses += 1
                    if rule.misses >= self.args.persist:  # closed: it held last at last_held
                        rule.current.end_step = rule.last_held
                        self.closed_now.append(rule.current)
                        rule.current = None
                continue
            rule.misses = 0
            if rule.streak == 0:
                rule.streak_start = step
            rule.streak += 1
            rule.last_held = step
            where, evidence, values = held
            if rule.current is not None:  # still the same mechanism: its latest numbers
                firsts = {k: v for k, v in rule.current.values.items() if k.startswith("first")}
                rule.current.values = {**values, **firsts}
            elif rule.streak >= (1 if rule.single else self.args.persist):
                m = Mechanism(rule.id, where, min(rule.began(step), rule.streak_start or step), step, evidence, values)
                earlier = [r.current for r in self.rules if r.current is not None]
                if earlier:
                    m.follows = min(earlier, key=lambda e: e.detected_step).id
                m.episode = 1 + sum(f.id == rule.id for f in self.found)
                rule.current = m
                self.found.append(m)
                named.append(m)
        return named

    def open(self) -> list[Mechanism]:
        """The mechanisms not closed yet (their rule held at one of the last ``persist`` logged points)."""
        return [r.current for r in self.rules if r.current is not None]

    def pending_since(self) -> Optional[int]:
        """The step a mechanism would begin at if a rule that held at the last logged point, but not yet
        ``persist`` times, holds again; None when no rule is pending. A checkpoint written meanwhile is healthy
        for now, but rotation keeps one from before that step (:mod:`stabletrain.runfiles.checkpoint`)."""
        pending = [r.began(self.last_step) for r in self.rules
                   if r.current is None and r.streak > 0 and self.last_step is not None]
        return min(pending) if pending else None


def detect_mechanisms(
    rows: Sequence[Mapping[str, Any]], settings: Optional[MechanismArgs] = None,
    context: Optional[RuleContext] = None,
) -> list[Mechanism]:
    """Every mechanism named over a finished run's logged rows (in step order)."""
    detector = MechanismDetector(settings, context)
    for row in rows:
        step = row.get("step")
        if isinstance(step, int):
            detector.update(step, row)
    return detector.found


def mechanisms_of_run(rows: Sequence[Mapping[str, Any]], settings: Mapping[str, Any],
                      replaced: Sequence[Mapping[str, Any]] = (), resumes: Sequence[int] = ()) -> list[Mechanism]:
    """The mechanisms of a run's logged rows, judged with the run's own thresholds and settings
    (its ``settings.json``), a mechanism that came and went told once (:func:`merge_episodes`); and,
    from ``replaced`` (the events of timelines that the ``resumes`` replaced), those named there, each
    ``settled`` (it says so; a fix is not advised for it)."""
    found = detect_mechanisms(rows, mechanism_settings(settings), RuleContext.from_settings(settings))
    if resumes:
        for ev in replaced:
            m = Mechanism.from_event(ev)
            if m is not None:
                m.settled = f"before the resume from step {min(resumes)}, whose timeline replaced it"
                found.append(m)
    return merge_episodes(found)


def merge_episodes(mechanisms: Sequence[Mechanism]) -> list[Mechanism]:
    """The first episode of each mechanism and place, in order, with the later ones in its ``repeats``
    (its sentence says how often and until when; the first one's numbers stand for them)."""
    first: dict[tuple[str, str, str], Mechanism] = {}
    merged: list[Mechanism] = []
    for m in mechanisms:
        key = (m.id, m.where, m.settled)
        if key in first:
            first[key].repeats.append(m)
            continue
        m.repeats = []
        first[key] = m
        merged.append(m)
    return merged


def causes(mechanisms: Sequence[Mechanism]) -> list[Mechanism]:
    """The mechanisms that are not the consequence of an earlier one, nor settled by a resume."""
    return [m for m in mechanisms if not m.follows and not m.settled]


def mechanism_settings(settings: Mapping[str, Any]) -> Optional[MechanismArgs]:
    """The run's own thresholds from its settings.json (None: the defaults, also for a settings.json of
    another version)."""
    raw = ((settings.get("debug_args") or {}).get("mechanisms")) if isinstance(settings, Mapping) else None
    if not isinstance(raw, dict):
        return None
    try:
        return MechanismArgs(**raw)
    except ValueError:
        return None
