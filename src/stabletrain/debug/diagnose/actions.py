"""Next actions: concrete steps with setting names and values, one function per cause (and, for a failure
of the arithmetic, per kind of op). See ``docs/diagnose.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from stabletrain.debug import advice
from stabletrain.debug.diagnose.classify import SOFTMAX_OPS, damaged_before, op_kind, precision_failure
from stabletrain.debug.diagnose.explain import (
    bad_input_text,
    culprit_samples,
    largest_text,
    other_rank_only,
    out_of_range_text,
)
from stabletrain.debug.diagnose.types import NOT_REPRODUCIBLE, PRECISION_INDUCED, Evidence
from stabletrain.debug.diagnose.weights import huge_from_start
from stabletrain.debug.nan_capture import REASON_NORM_OVERFLOW, REASON_SKIPPED
from stabletrain.debug.op_trace import OpFinding
from stabletrain.debug.replay import NaNCapture
from stabletrain.utils.text import fmt_list, fmt_number, shell_path

RESUME = "rerun your training command with resume_interrupted=true"


@dataclass(frozen=True)
class RunContext:
    """What the actions are written for: the capture, its run folder, and the run's settings with the
    learning-rate and clipping advice they give.

    Attributes:
        cap: The capture.
        out: The run folder (``out``), when the capture lies in one.
        settings: The run's settings ({} when the capture holds none).
        lr: A lower learning rate: "model_args.lr=0.001 or lower (was 0.01)".
        clip: Gradient clipping: "gradient_clip_val=1.0", or the run's value lowered.
        terms: The settings' names in the framework whose stabletrain integration took the capture
            (:data:`stabletrain.debug.advice.FRAMEWORK_TERMS`); None for ``stabletrain train`` and plain loops.
    """

    cap: NaNCapture
    out: Optional[Path]
    settings: dict[str, Any]
    lr: str
    clip: str
    terms: Optional[dict[str, str]] = None

    @classmethod
    def of(cls, cap: NaNCapture, out: Optional[Path], unstable_from: Optional[int] = None) -> RunContext:
        settings = cap.settings or {}
        meta = cap.ranks[0].model_meta or {}
        terms = advice.FRAMEWORK_TERMS.get(str(meta.get("framework"))) if not settings else None
        if terms is not None:
            # Lightning, the Hugging Face Trainer, Accelerate: their settings, not stabletrain train's.
            lr = advice.positive(meta.get("lr"))
            now = f", now {advice.setting_value(lr)}" if lr else ""
            return cls(cap, out, settings, f"a {advice.LR_DECREASE}x lower learning rate ({terms['lr']}{now})",
                       terms["clip_lower"] if meta.get("clipping") else terms["clip"], terms)
        clip = advice.clip(settings.get("gradient_clip_val") if settings else None, known=bool(settings))
        rows: list[dict[str, Any]] = []
        if out is not None and (out / "metrics.jsonl").is_file():
            from stabletrain.runfiles.history import read_run

            rows = read_run(out / "metrics.jsonl").rows
        return cls(cap, out, settings, lr_text(settings, rows, unstable_from), clip)

    @property
    def resume(self) -> str:
        """How to continue from the last checkpoint, in the run's own terms."""
        return self.terms["resume"] if self.terms else RESUME

    @property
    def image_task(self) -> bool:
        return self.settings.get("task") == "image_classification"


def next_actions(ev: Evidence, cap: NaNCapture, out: Optional[Path]) -> list[str]:
    """Concrete next steps for the cause ``ev`` shows, ending with the command that replays the step."""
    ctx = RunContext.of(cap, out, _instability_start(ev, cap.step))
    if ev.cause == NOT_REPRODUCIBLE:
        return not_reproducible(ev, ctx)
    if damaged_before(ev):
        actions = damaged_before_the_step(ev, ctx)
    elif ev.cause == PRECISION_INDUCED:
        actions = precision_induced(ev, ctx)
    else:
        actions = deterministic_numerical(ev, ctx)
    if ev.data.approximate:
        actions.append("Confirm the culprit samples in a full batch: BatchNorm makes their isolation approximate.")
    actions.append(f"Replay the step yourself: {replay_command(cap)}")
    return actions


def lr_text(settings: Optional[dict[str, Any]], rows: Sequence[dict[str, Any]] = (),
            unstable_from: Optional[int] = None) -> str:
    """The lr to try, as a setting: anchored to the highest lr that trained stably, or the
    default, else :data:`~stabletrain.debug.advice.LR_DECREASE` times lower than the run's
    (:func:`stabletrain.debug.advice.anchored_lr`), never a tenth of an absurd value."""
    model_args = (settings or {}).get("model_args")
    lr = advice.positive(model_args.get("lr")) if isinstance(model_args, dict) else None
    if lr is None:
        return f"a {advice.LR_DECREASE}x lower learning rate (model_args.lr)"
    value, why = advice.anchored_lr(lr, rows, unstable_from, optimizer=(settings or {})["model_args"].get("optimizer"))
    why = f"; {why}" if why else ""
    return f"model_args.lr={advice.setting_value(value)} or lower (was {advice.setting_value(lr)}{why})"


def _instability_start(ev: Evidence, step: int) -> int:
    """Where the instability began: at the newest healthy checkpoint when the weights were
    already damaged, else the captured step."""
    w = ev.weights
    ck = next((c for c in w.checkpoints if c["path"] == w.healthy_checkpoint), None) if w.healthy_checkpoint else None
    return min(step, int(ck["step"])) if ck is not None else step


def replay_command(cap: NaNCapture) -> str:
    """The command the capture's error message showed (it names your model), else a plain one."""
    stored = cap.ranks[0].raw.get("replay_command")
    if isinstance(stored, str) and stored.startswith("stabletrain replay ") and (
            len(cap.ranks) == 1 or cap.world_size > 1):
        return stored
    return f"stabletrain replay {shell_path(cap.path)}"


# -------------------------------------------------------------------------- not reproducible


def not_reproducible(ev: Evidence, ctx: RunContext) -> list[str]:
    """Rerun and watch: the step does not fail again from what it started with."""
    cap = ctx.cap
    if other_rank_only(ev, cap):
        return [f"Diagnose all ranks together: stabletrain diagnose {shell_path(cap.ranks[0].path.parent.parent)}"]
    last = ""
    if ctx.out and not ctx.terms:
        last = f" ({ctx.out / 'checkpoints' / 'last.ckpt'} holds no NaN: nancapture stopped before the optimizer step)"
    localise = ctx.terms["debug"] if ctx.terms else "debug_args.underflow_overflow.enabled=true"
    return [
        (f"Rerun from the last checkpoint: {ctx.resume}{last}. A sporadic failure usually does not recur at the "
         "same step."),
        f"If it fails again at another step, localise it while it happens: {localise} "
        "shows the first module that goes non-finite.",
        "On a GPU: make kernels deterministic (torch.use_deterministic_algorithms(True)) and check the hardware "
        "(nvidia-smi -q for ECC errors, temperatures); replay the capture on the original machine "
        f"({replay_command(cap)} --device cuda).",
    ]


# ------------------------------------------------------------- damaged before the step began


def damaged_before_the_step(ev: Evidence, ctx: RunContext) -> list[str]:
    """Weights huge or non-finite, or a buffer the failing op read non-finite: earlier steps did the damage."""
    w = ev.weights
    start = huge_from_start(ctx.cap, w, ev.history) if w.status == "huge" else ""
    if start:
        # Not divergence: no resume or lower lr changes weights that were huge from the start.
        top = w.largest[0]
        return [f"Fix the initialisation or the weights loaded: {top.name} holds |w| up to {fmt_number(top.abs_max)} "
                f"when step {ev.step} begins, and {start}. Resuming from a checkpoint of this run or lowering the "
                "learning rate cannot change that."]
    buffers_only = not w.nonfinite and w.status != "huge"
    # The optimizer does not write buffers: the learning rate is not implicated.
    lr = "the same settings" if buffers_only else ctx.lr
    actions = [_resume_before_the_damage(ev, ctx, "weights and buffers" if buffers_only else "weights", lr)]
    optimizer = (ctx.settings.get("model_args") or {}).get("optimizer")
    if ev.precision == "16-true" and w.nonfinite and optimizer in (None, "adamw"):
        # Not the learning rate: in float16, Adam divides by sqrt(v) + eps with both rounded to 0.
        actions.append(
            f"With precision=16-true the optimizer runs in float16 too: "
            f"{'AdamW' if optimizer else 'an Adam-type optimizer'}'s second moment (the squared gradient) underflows "
            "to 0 for small gradients and its eps=1e-8 is 0 in float16, so the update divides by 0 and writes Inf "
            "into the weights. Train with precision=16-mixed or precision=bf16-mixed (float32 master weights and "
            "optimizer state) or precision=32-true."
        )
    if (w.nonfinite or w.status == "huge") and (advice.clipping_helps(optimizer) or optimizer is None):
        actions.append(f"Keep single steps from blowing the weights up: {ctx.clip}.")
    elif w.nonfinite or w.status == "huge":
        actions.append(f"Clipping gradients would not keep single steps small: {advice.update_size(optimizer)}.")
    else:
        # Buffers are not trained by the optimizer: clipping gradients does not protect them.
        actions.append(
            f"Find what put NaN/Inf into {fmt_list(w.nonfinite_buffers, 3)}: the forward pass updates them from the "
            f"data (running statistics), so a batch with huge or non-finite values before step {ctx.cap.step} can "
            "corrupt them without a non-finite loss; guard the update (skip non-finite batch statistics) or check "
            "that data."
        )
    return actions


def _resume_before_the_damage(ev: Evidence, ctx: RunContext, state: str, lr: str) -> str:
    """Where to start again from: the newest healthy checkpoint, or from scratch."""
    w = ev.weights
    if w.healthy_checkpoint:
        ck = next(c for c in w.checkpoints if c["path"] == w.healthy_checkpoint)
        path = Path(w.healthy_checkpoint)
        where = (RESUME if path.name == "last.ckpt" else
                 f"rerun your training command with resume_from={shell_path(path)}")
        why = f": {ck['why']}" if ck.get("why") else ""
        return (f"Resume from before the damage: the newest checkpoint with healthy {state} is step {ck['step']} "
                f"(|w| up to {fmt_number(ck['abs_max'])}{why}); {where} and {lr}.")
    if w.checkpoints:
        newest = w.checkpoints[-1]
        why = newest.get("why") or f"|w| up to {fmt_number(newest['abs_max'])}, huge from {fmt_number(w.threshold)}"
        return (f"No checkpoint of this run has healthy {state} (the newest, step {newest['step']}: {why}): "
                f"start again with overwrite=true and {lr}.")
    if ctx.out is not None and ctx.out.is_dir() and not ctx.terms:
        return (f"No checkpoint of this run was found under {ctx.out / 'checkpoints'} (written before step "
                f"{ctx.cap.step}): start again with overwrite=true and {lr}.")
    # A framework's checkpoints are its own (not searched): the user knows where they are.
    return f"Resume from a checkpoint written before the {state} went bad ({ctx.resume}) with {lr}."


# ------------------------------------------------------------------------- precision-induced


def precision_induced(ev: Evidence, ctx: RunContext) -> list[str]:
    """A wider precision, or the value kept in range (or computed stably) where it goes wrong."""
    f = ev.finding
    failure = precision_failure(f) if f is not None and not f.inputs_nonfinite else None
    if ev.origin == "precision_conversion":
        actions = _convert_the_batch_safely(ev, ctx)
    else:
        actions = [_wider_precision(ev, f, failure)]
        if f is not None and f.source and f.phase == "forward":
            actions.append(_keep_the_precision(ev, f.source, failure))
    if ev.reason == REASON_SKIPPED:
        actions += _allow_more_skipped_steps(ctx)
    return actions


def _convert_the_batch_safely(ev: Evidence, ctx: RunContext) -> list[str]:
    """16-true / bf16-true converted finite inputs beyond the type's range into Inf."""
    dtype = advice.dtype_name(ev.precision)
    largest = torch.finfo(torch.float16 if dtype == "float16" else torch.bfloat16).max
    return [
        f"Train with precision=bf16-mixed or precision=32-true, which keep the batch in float32: {ev.precision} "
        f"converts every input to {dtype}, whose largest value is {largest:.6g}.",
        f"Or keep {ev.precision} and scale the inputs into {dtype}'s range: {out_of_range_text(ev)}"
        + (" (transform_args.normalize)." if ctx.image_task else " (normalise them in the data pipeline)."),
    ]


def _wider_precision(ev: Evidence, f: Optional[OpFinding], failure: Optional[str]) -> str:
    """The precision to train in instead, for the way the captured one failed."""
    dtype = advice.dtype_name(ev.precision)
    backward = f is not None and f.phase == "backward"
    if failure == "rounding" and f is not None:
        tiny = (" (if it is a tiny value that underflows rather than a lost digit: float16 flushes values below "
                "6e-08 to 0, and precision=bf16-mixed, with float32's range, works too).")
        return (f"Train with precision=32-true: {dtype} keeps only about 3 significant digits, and {f.op_name} gets a "
                f"value that float32 keeps but {dtype} rounds away" + (tiny if dtype == "float16" else "."))
    if ev.precision == "16-mixed" and backward:
        return ("Train with precision=bf16-mixed (float32's range, no loss scaling needed) or precision=32-true: "
                f"the float16 gradients overflow even at loss scale {fmt_number(ev.loss_scale or math.nan)}.")
    if ev.precision == "16-mixed":
        return ("Train with precision=bf16-mixed (same exponent range as float32; GPUs with bfloat16 support) or "
                "precision=32-true: a float16 activation exceeds 65504, which loss scaling cannot help.")
    if ev.precision == "16-true" and backward:
        return ("Train with precision=16-mixed (float32 master weights, and dynamic loss scaling that keeps float16 "
                "gradients in range), precision=bf16-mixed (float32's range, no loss scaling needed) or "
                "precision=32-true: float16 gradients leave float16's range (now 16-true).")
    if ev.precision == "16-true":
        return ("Train with precision=bf16-mixed (float32's range) or precision=32-true: a float16 value exceeds 65504 "
                "in the forward pass. precision=16-mixed (float32 master weights, dynamic loss scaling) helps only if "
                "autocast runs this op in float32; its loss scaling acts on gradients, not on activations (now "
                "16-true).")
    # bfloat16 has float32's range: an overflow in it alone is at float32's edge too.
    return f"Train with precision=32-true: the values reach the edge of {dtype}'s range."


def _keep_the_precision(ev: Evidence, source: str, failure: Optional[str]) -> str:
    """Fix the line instead: compute the value stably, or keep it in range."""
    if failure == "rounding":
        return (f"Or keep {ev.precision} and compute the value that loses its precision in float32 (x.float()) or in "
                "a stable form (F.logsigmoid(-z) for log(1 - sigmoid(z)), torch.log1p(x) for log(1 + x), "
                f"x.clamp_min(eps) before log, division or sqrt) at {source}.")
    return f"Or keep {ev.precision} and keep the value in range where it grows: {source}."


def _allow_more_skipped_steps(ctx: RunContext) -> list[str]:
    """fp16 loss scaling skipped steps in a row: the scaler may only have been finding its scale."""
    skipped = ctx.cap.ranks[0].raw.get("consecutive_skipped_steps")
    limit = (ctx.settings.get("debug_args") or {}).get("nancapture", {}).get("max_skipped_steps")
    if not (isinstance(skipped, int) and skipped):
        return []
    return [
        f"If training had only just started, the GradScaler may still have been lowering its initial scale "
        f"(it skips a step each time it halves it): allow more skipped steps in a row with "
        f"debug_args.nancapture.max_skipped_steps={2 * skipped}"
        + (f" (was {limit})." if limit else f" (now {skipped}).")
    ]


# ------------------------------------------------------------------- deterministic numerical


@dataclass(frozen=True)
class Culprit:
    """Where the fix goes and what it is for: the op's source line and the isolated samples.

    Attributes:
        samples: The isolated culprit samples ("the sample at dataset index 7"), "" when none is isolated.
        one: Exactly one culprit sample (the verbs agree with it).
        src: " at file.py:12 (the line)" when the op's source line is known, else "".
    """

    samples: str
    one: bool
    src: str

    @classmethod
    def of(cls, ev: Evidence) -> Culprit:
        samples = culprit_samples(ev) if ev.data.status == "isolated" else ""
        one = bool(samples) and sum(len(r) for r in ev.data.row_sets) == 1
        f = ev.finding
        return cls(samples, one, f" at {f.source}" if f is not None and f.source else "")

    def verb(self, plural: str) -> str:
        """``plural`` agreeing with the samples: "drive" or "drives"."""
        return plural + "s" if self.one else plural

    def of_data(self, default: str = "the data") -> str:
        return self.samples or default


def deterministic_numerical(ev: Evidence, ctx: RunContext) -> list[str]:
    """The same arithmetic fails on the same data whatever the precision: guard the op, fix the data."""
    f = ev.finding
    kind = op_kind(f) if f is not None else "other"
    at = Culprit.of(ev)
    if f is None:
        actions = [_keep_gradients_in_range(ctx, at) if ev.reason == REASON_NORM_OVERFLOW else _inspect(None, ctx, at)]
    elif kind == "propagated" and ev.origin == "data":
        actions = _fix_the_data(ev, ctx, at)
    else:
        actions = [OP_FIXES.get(kind, _inspect)(f, ctx, at)]
    if at.samples and kind != "propagated" and ev.data.status == "isolated":
        actions.append(f"Look at {at.samples}: what sets {'it' if at.one else 'them'} apart (an outlier, an "
                       "empty or constant input) is what the guard must handle.")
    if ctx.settings.get("precision") not in (None, "32-true") and ev.precision in advice.REDUCED_PRECISIONS:
        actions.append(f"The failure is independent of precision; keep precision={ev.precision}.")
    return actions


def _keep_gradients_in_range(ctx: RunContext, at: Culprit) -> str:
    """No op made a non-finite value: finite gradients too large for a float32 norm."""
    return (f"Keep the gradients in range ({largest_text(ctx.cap)}): lower the learning rate ({ctx.lr}) and "
            f"clip ({ctx.clip}) if they grew over steps; if {at.of_data()} is an outlier (an input "
            "far out of scale), fix or normalise it.")


def _fix_the_data(ev: Evidence, ctx: RunContext, at: Culprit) -> list[str]:
    """NaN/Inf already in the data."""
    actions = [
        f"Fix or drop {at.of_data('the bad samples')}: {bad_input_text(ev)}, and NaN/Inf in the data reaches "
        "the loss whatever the precision or learning rate. Check the data pipeline that produced it."
    ]
    if ctx.image_task:
        actions.append("Check transform_args (transform_args.normalize.std must be well above 0 for every channel).")
    return actions


def _guard_log(f: OpFinding, ctx: RunContext, at: Culprit) -> str:
    return (f"Guard the logarithm{at.src}: torch.log(x.clamp_min(1e-12)) (or log1p / log_softmax) — "
            f"{at.of_data()} {at.verb('drive')} its argument to 0 or below.")


def _guard_division(f: OpFinding, ctx: RunContext, at: Culprit) -> str:
    return (f"Guard the division{at.src}: divide by x.clamp_min(1e-12) or x + 1e-12 (keeping the sign) — "
            f"{at.of_data()} {at.verb('make')} the denominator 0.")


def _guard_sqrt(f: OpFinding, ctx: RunContext, at: Culprit) -> str:
    return (f"Guard the square root{at.src}: torch.sqrt(x.clamp_min(0)) — {at.of_data()} {at.verb('make')} its "
            "argument negative.")


def _finite_sqrt_gradient(f: OpFinding, ctx: RunContext, at: Culprit) -> str:
    return (f"Make the derivative finite{at.src}: torch.sqrt(x + 1e-12) instead of torch.sqrt(x) — its gradient "
            f"1/(2 sqrt(x)) is infinite at x = 0, where {at.of_data()} {at.verb('put')} it.")


def _bound_activations(f: OpFinding, ctx: RunContext, at: Culprit) -> str:
    return f"Activations overflow{at.src}: lower the learning rate ({ctx.lr}) and bound updates ({ctx.clip})."


def _keep_masks_out_of_arithmetic(f: OpFinding, ctx: RunContext, at: Culprit) -> str:
    """A NaN made from a deliberate -Inf: a row masked everywhere, or the mask in arithmetic."""
    if f.op_name in SOFTMAX_OPS:
        return (
            f"Keep at least one unmasked position in every row{at.src}: {at.of_data('some samples')} "
            f"{at.verb('leave')} a row masked everywhere (an all-padding sequence, a key_padding_mask row that is all "
            "True). Drop such samples, or make fully masked rows finite before the softmax (mask with "
            "torch.finfo(dtype).min instead of -inf, or scores.masked_fill(mask.all(-1, keepdim=True), 0))."
        )
    return (f"Keep the masking -Inf out of arithmetic{at.src}: {f.chain(rows=False)}. Mask with "
            "torch.finfo(dtype).min instead of -inf, or apply the mask after this op.")


def _inspect(f: Optional[OpFinding], ctx: RunContext, at: Culprit) -> str:
    return (f"Inspect {f.op_name if f else 'the failing op'}{at.src}; lower the learning rate ({ctx.lr}) if values "
            "grow over steps.")


#: The fix for each kind of op (:func:`~stabletrain.debug.diagnose.classify.op_kind`) that made the value;
#: any other kind is inspected.
OP_FIXES: dict[str, Callable[[OpFinding, RunContext, Culprit], str]] = {
    "log": _guard_log,
    "div": _guard_division,
    "sqrt": _guard_sqrt,
    "sqrt_grad": _finite_sqrt_gradient,
    "overflow": _bound_activations,
    "nan_from_inf": _keep_masks_out_of_arithmetic,
}
