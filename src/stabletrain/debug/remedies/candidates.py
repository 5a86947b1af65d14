"""The candidate remedies: settings (and model options) to try from a checkpoint, picked from the run's
own settings and the mechanisms named (see docs/remedies.md).

:func:`candidates_for` gives them in the order they are tried: first those that answer the named
mechanisms, then the others that apply to the run. Every value is derived from the run's own
settings (its lr times 0.3 and 0.1, its warmup lengthened, ...), never from another optimizer's
default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from stabletrain.config import ModelArgs
from stabletrain.debug import advice
from stabletrain.debug.mechanisms.rules import MECHANISMS as RULE_MECHANISMS

__all__ = [
    "MECHANISMS",
    "MECHANISM_NAMES",
    "Candidate",
    "candidates_for",
    "candidate_notes",
    "AS_RUN",
]

#: The mechanism ids a caller may name (the rules that name them: :data:`stabletrain.debug.mechanisms.rules.MECHANISMS`,
#: with their names), plus bad data and a non-finite step, which the guard and diagnose name.
MECHANISM_NAMES: dict[str, str] = {
    **{key: info.name for key, info in RULE_MECHANISMS.items()},
    "bad_data": "bad data",
    "nonfinite": "a non-finite step",
}
MECHANISMS = tuple(MECHANISM_NAMES)

#: Per mechanism, the candidates that answer it, most relevant first (keys of :func:`_all_candidates`).
RELEVANT: dict[str, tuple[str, ...]] = {
    "attention_logit_growth": ("qk_norm", "lr_0.3", "lr_0.1", "warmup"),
    "output_logit_divergence": ("z_loss", "weight_decay", "lr_0.3"),
    "adam_eps": ("eps",),
    "stale_second_moment": ("beta2", "lr_0.3"),
    "runaway_updates": ("lr_0.3", "lr_0.1", "warmup", "clip"),
    "fp16_range": ("precision",),
    "bad_data": (),
    "nonfinite": ("lr_0.3", "lr_0.1", "clip", "warmup", "precision"),
}
#: The order of the candidates no named mechanism asks for. ``weight_decay`` is tried only for
#: output-logit divergence (it changes what the run optimises, not only how stably).
GENERIC = ("lr_0.3", "lr_0.1", "warmup", "clip", "eps", "beta2", "precision", "qk_norm", "z_loss")

#: The z-loss coefficient PaLM used.
Z_LOSS = 1e-4
#: AdamW weight decay proposed against output-logit divergence when the run has less.
WEIGHT_DECAY = 0.1
#: The eps proposed at most (the default): lower by 100x when the run's is already that small.
EPS = 1e-8
#: beta2 proposed at most.
BETA2 = 0.95


@dataclass(frozen=True)
class Candidate:
    """One remedy to try: the run's own settings with ``overrides``.

    Attributes:
        name: How it is written: the settings as ``key=value`` (``model_args.lr=0.03``).
        overrides: Dotted setting -> value (``{"model_args.lr": 0.03}``).
        why: Why it is a candidate, in one sentence.
        from_start: The change cannot be made on resume (it adds weights): tried from step 0, with the
            run's seed and data order, through the same steps.
        resume_before: Tried from the checkpoint only when the checkpoint holds fewer steps than this
            (a longer warmup changes nothing from a checkpoint past its end); from step 0 otherwise.
        mechanisms: The named mechanisms it answers.
    """

    name: str
    overrides: dict[str, Any]
    why: str
    from_start: bool = False
    resume_before: Optional[int] = None
    mechanisms: tuple[str, ...] = field(default=())

    @property
    def slug(self) -> str:
        """A folder name: ``lr=0.03``, ``qk_norm=true``, ``as_run``."""
        if not self.overrides:
            return re.sub(r"[^A-Za-z0-9._=-]+", "_", self.name).strip("_") or "candidate"
        parts = [f"{k.rsplit('.', 1)[-1]}={_word(v)}" for k, v in self.overrides.items()]
        return re.sub(r"[^A-Za-z0-9._=-]+", "_", "_".join(parts)).strip("_")

    def starts_at(self, checkpoint_step: int) -> int:
        """The step this candidate starts from when the verification starts at ``checkpoint_step``."""
        if self.from_start or (self.resume_before is not None and checkpoint_step >= self.resume_before):
            return 0
        return checkpoint_step

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "overrides": dict(self.overrides), "why": self.why,
                "from_start": self.from_start, "resume_before": self.resume_before,
                "mechanisms": list(self.mechanisms)}


#: The unchanged settings: the baseline every candidate is compared with.
AS_RUN = Candidate("as run", {}, "the run's own settings, unchanged: the baseline")


def _word(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return advice.setting_value(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_word(v) for v in value) + "]"
    return str(value)


def name_of(overrides: Mapping[str, Any]) -> str:
    """``model_args.lr=0.03 gradient_clip_val=1``: the overrides as settings."""
    return " ".join(f"{k}={_word(v)}" for k, v in overrides.items())


def _model_args(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``model_args`` of ``settings`` over ModelArgs' defaults (a partial dict or settings.json)."""
    given = settings.get("model_args") if isinstance(settings.get("model_args"), Mapping) else {}
    return {**ModelArgs().model_dump(mode="json"), **dict(given or {})}


def _settings_dict(settings: Any) -> Mapping[str, Any]:
    if isinstance(settings, Mapping):
        return settings
    to_json = getattr(settings, "to_json_dict", None)
    if callable(to_json):
        return to_json()
    raise TypeError(f"settings: a dict (settings.json) or TrainSettings, got {type(settings).__name__}")


def _task(settings: Mapping[str, Any]) -> str:
    task = settings.get("task")
    if task:
        return str(task)
    model = settings.get("model")
    if model is None or model == "transformer":
        return "language_model"
    if isinstance(model, str) and (model == "cnn" or model.startswith("torchvision/")):
        return "image_classification"
    return "custom"


def _all_candidates(settings: Mapping[str, Any]) -> tuple[dict[str, Candidate], list[str]]:
    """Every candidate that applies to the run, by key, and why the others do not."""
    args = _model_args(settings)
    optimizer = str(args.get("optimizer") or "adamw")
    label = advice.optimizer_label(optimizer)
    adam = advice.optimizer_family(optimizer) == "adam"
    found: dict[str, Candidate] = {}
    notes: list[str] = []
    lr = advice.positive(args.get("lr"))
    if lr is not None:
        for factor in (0.3, 0.1):
            value = float(advice.setting_value(lr * factor))
            found[f"lr_{factor:g}"] = Candidate(
                f"model_args.lr={advice.setting_value(value)}", {"model_args.lr": value},
                f"the run's lr x{factor:g} ({label}, lr {advice.setting_value(lr)}): smaller steps")
    steps = int(settings.get("steps") or 0)
    warmup = int(args.get("warmup_steps") or 0)
    longer = min(steps // 2, max(4 * warmup, steps // 10))
    if longer > warmup:
        found["warmup"] = Candidate(
            f"model_args.warmup_steps={longer}", {"model_args.warmup_steps": longer},
            f"a longer warmup ({warmup} -> {longer} of {steps} steps): a lower lr while the weights and the "
            f"optimizer's statistics settle; from step 0 when the checkpoint is past step {longer}",
            resume_before=longer)
    clip = advice.positive(settings.get("gradient_clip_val"))
    if advice.clipping_helps(optimizer):
        value = CLIP_DEFAULT if clip is None else float(advice.setting_value(clip / 2))
        was = "clipping is off" if clip is None else f"was {advice.setting_value(clip)}"
        found["clip"] = Candidate(f"gradient_clip_val={advice.setting_value(value)}", {"gradient_clip_val": value},
                                  f"clip the gradient norm ({was}): {advice.update_size(optimizer)}")
    else:
        notes.append(f"gradient clipping is not a candidate: {advice.update_size(optimizer)}")
    if adam:
        eps = advice.positive(args.get("eps"))
        if eps is not None:
            value = min(EPS, float(advice.setting_value(eps * 0.01)))
            found["eps"] = Candidate(
                f"model_args.eps={advice.setting_value(value)}", {"model_args.eps": value},
                f"a lower AdamW eps ({advice.setting_value(eps)} -> {advice.setting_value(value)}): entries whose "
                "sqrt(v) is below eps get updates damped by eps instead of normalised")
        betas = args.get("betas")
        if isinstance(betas, (list, tuple)) and len(betas) == 2:
            beta1, beta2 = float(betas[0]), float(betas[1])
            lower = BETA2 if beta2 > BETA2 else float(advice.setting_value(1 - 2 * (1 - beta2)))
            if 0 < lower < beta2:
                found["beta2"] = Candidate(
                    f"model_args.betas=[{advice.setting_value(beta1)}, {advice.setting_value(lower)}]",
                    {"model_args.betas": [beta1, lower]},
                    f"a lower beta2 ({advice.setting_value(beta2)} -> {advice.setting_value(lower)}): the second "
                    "moments follow the gradients faster, so a stale small v cannot make a large update")
        wd = float(args.get("weight_decay") or 0.0)
        if wd < WEIGHT_DECAY:
            found["weight_decay"] = Candidate(
                f"model_args.weight_decay={advice.setting_value(WEIGHT_DECAY)}",
                {"model_args.weight_decay": WEIGHT_DECAY},
                f"weight decay {advice.setting_value(wd)} -> {advice.setting_value(WEIGHT_DECAY)}: keeps the output "
                "weights, and so the logits, from drifting")
    precision = settings.get("precision")
    if precision in advice.REDUCED_PRECISIONS:
        wider = advice.stabler_precisions(str(precision))[0]
        found["precision"] = Candidate(
            f"precision={wider}", {"precision": wider},
            f"{wider} instead of {precision}: {advice.dtype_name(wider)}'s range or digits where "
            f"{advice.dtype_name(str(precision))} runs out")
    if _task(settings) == "language_model":
        if not args.get("qk_norm"):
            found["qk_norm"] = Candidate(
                "model_args.qk_norm=true", {"model_args.qk_norm": True},
                "LayerNorm of queries and keys bounds q.k/sqrt(d) (Dehghani et al. 2023; Wortsman et al. 2023); it "
                "adds weights, so it is tried from step 0 (a new run with the run's seed and data order)",
                from_start=True)
        if not float(args.get("z_loss") or 0.0):
            found["z_loss"] = Candidate(
                f"model_args.z_loss={advice.setting_value(Z_LOSS)}", {"model_args.z_loss": Z_LOSS},
                f"z-loss {advice.setting_value(Z_LOSS)} x logsumexp(logits)^2 pulls the output log-partition "
                "toward 0 (PaLM)")
    return found, notes


#: The clipping threshold proposed when the run does not clip.
CLIP_DEFAULT = advice.CLIP_VALUE


def _check(mechanisms: Sequence[str]) -> tuple[str, ...]:
    if isinstance(mechanisms, str):
        mechanisms = (mechanisms,)
    unknown = [m for m in mechanisms if m not in MECHANISM_NAMES]
    if unknown:
        raise ValueError(f"mechanisms: unknown {', '.join(map(repr, unknown))}; available names are: "
                         f"{', '.join(MECHANISMS)}")
    return tuple(dict.fromkeys(mechanisms))


def candidates_for(settings: Any, mechanisms: Sequence[str] = ()) -> list[Candidate]:
    """The candidate remedies for a run, in the order they are tried.

    The candidates that answer the named ``mechanisms`` come first (in the order of the
    mechanisms, then of :data:`RELEVANT`), with the mechanism in ``why``; then every other
    candidate that applies to the run (:data:`GENERIC`). What applies: the run's lr x0.3 and x0.1;
    a longer warmup; gradient clipping (SGD only: an Adam-type update is about lr whatever the
    gradient); for AdamW a lower eps and a lower beta2; a wider precision when the run computes in
    float16 or bfloat16; for the built-in language model ``model_args.qk_norm=true`` (from step 0)
    and ``model_args.z_loss=1e-4``. Weight decay only for ``output_logit_divergence``.

    Args:
        settings: The run's settings: settings.json as a dict, or a ``TrainSettings``.
        mechanisms: Mechanism ids (:data:`MECHANISMS`), e.g. ``("attention_logit_growth",)``.

    Raises:
        ValueError: An unknown mechanism id.

    Example::

        candidates_for({"model_args": {"optimizer": "sgd", "lr": 1.0}, "steps": 100}, ["nonfinite"])[0].name
        # 'model_args.lr=0.3'
    """
    named = _check(mechanisms)
    found, _ = _all_candidates(_settings_dict(settings))
    order: dict[str, list[str]] = {}
    for mechanism in named:
        for key in RELEVANT[mechanism]:
            if key in found:
                order.setdefault(key, []).append(mechanism)
    for key in GENERIC:
        if key in found:
            order.setdefault(key, [])
    result = []
    for key, answers in order.items():
        c = found[key]
        if answers:
            against = " and ".join(MECHANISM_NAMES[m] for m in answers)
            c = Candidate(c.name, c.overrides, f"against {against}: {c.why}", c.from_start, c.resume_before,
                          tuple(answers))
        result.append(c)
    return result


def candidate_notes(settings: Any, mechanisms: Sequence[str] = ()) -> list[str]:
    """Sentences on what is not a candidate for this run and why (clipping under AdamW; bad data)."""
    named = _check(mechanisms)
    _, notes = _all_candidates(_settings_dict(settings))
    if "bad_data" in named:
        notes.append("bad data: no setting fixes it; find the samples (stabletrain diagnose of a capture names them) "
                     "and leave them out of the data (on_instability.policy=skip_step quarantines samples that make a "
                     "step non-finite)")
    return notes
