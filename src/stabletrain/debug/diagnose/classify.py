"""The cause class from full replays (precision-induced, deterministic numerical, not reproducible), and the
finer classes the prose and the advice build on: was the damage done before the step, what kind of op failed,
and how a reduced precision broke it. See ``docs/diagnose.md``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch

from stabletrain.debug import advice
from stabletrain.debug.diagnose.types import (
    DETERMINISTIC_NUMERICAL,
    NOT_REPRODUCIBLE,
    PRECISION_INDUCED,
    Evidence,
    ReplayOutcome,
)
from stabletrain.debug.op_trace import OpFinding
from stabletrain.debug.replay import ForwardBackwardResult, NaNCapture, forward_backward
from stabletrain.utils.tree import bitwise_equal

#: Ops that normalise over a row: a row that is -inf everywhere makes them NaN.
SOFTMAX_OPS = {"_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax", "logsumexp"}


@dataclass
class FullReplay:
    """One replay of the whole step: its summary for the report, and what it computed."""

    outcome: ReplayOutcome
    result: ForwardBackwardResult


@dataclass
class Classification:
    """The full replays and the cause class they give.

    Attributes:
        cause: One of the cause classes of :mod:`~stabletrain.debug.diagnose.types`.
        replays: Captured precision twice, then float32 and float64 (each unless it is the captured one).
        reproduces_in: Precision -> whether the failure came back in it (in both replays for the captured one).
        deterministic: Whether the two replays in the captured precision agree bitwise (None when not reproducible).
        matches_capture: Whether the first replay's losses are bitwise the captured ones (None: none captured).
        first: What the first replay computed: the subset search starts from its losses.
    """

    cause: str
    replays: list[ReplayOutcome]
    reproduces_in: dict[str, bool]
    deterministic: Optional[bool]
    matches_capture: Optional[bool]
    first: ForwardBackwardResult

    @property
    def reproducible(self) -> bool:
        return self.cause != NOT_REPRODUCIBLE


def classify(cap: NaNCapture, precision: str, device: torch.device) -> Classification:
    """Replay the step in ``precision`` twice, then in float32 and float64, and classify the failure."""
    first = full_replay(cap, "captured precision", precision, device)
    again = full_replay(cap, "captured precision, again", precision, device)
    replays = [first.outcome, again.outcome]
    if precision != "32-true":
        replays.append(full_replay(cap, "float32", "32-true", device).outcome)
    if precision != "64-true":
        replays.append(full_replay(cap, "float64", "64-true", device).outcome)
    reproduces_in = reproduces_by_precision(replays)
    reproducible = first.outcome.reproduced and again.outcome.reproduced
    return Classification(
        cause=cause_class(precision, reproducible, reproduces_in.get("32-true", False)),
        replays=replays,
        reproduces_in=reproduces_in,
        deterministic=same_outcome(first, again) if reproducible else None,
        matches_capture=matches_capture(cap, first.result),
        first=first.result,
    )


def full_replay(cap: NaNCapture, label: str, precision: str, device: torch.device) -> FullReplay:
    start = time.perf_counter()
    res = forward_backward(cap, precision=precision, device=device)
    outcome = ReplayOutcome(
        label=label,
        precision=res.precision,
        reproduced=res.reproduces(cap.reason),
        losses=res.loss_values,
        nan_param_names=res.nonfinite_param_names,
        gradient_norm=res.gradient_norm,
        seconds=time.perf_counter() - start,
    )
    return FullReplay(outcome, res)


def reproduces_by_precision(replays: list[ReplayOutcome]) -> dict[str, bool]:
    """Precision -> whether every replay in it failed."""
    reproduces_in: dict[str, bool] = {}
    for r in replays:
        reproduces_in[r.precision] = reproduces_in.get(r.precision, True) and r.reproduced
    return reproduces_in


def cause_class(precision: str, reproducible: bool, fp32_fails: bool) -> str:
    """The cause class: decided by the captured precision and float32 alone."""
    if not reproducible:
        return NOT_REPRODUCIBLE
    if precision in advice.REDUCED_PRECISIONS and not fp32_fails:
        return PRECISION_INDUCED
    return DETERMINISTIC_NUMERICAL


def same_outcome(a: FullReplay, b: FullReplay) -> bool:
    """Bitwise the same losses and the same non-finite gradients."""
    la, lb = a.result.losses, b.result.losses
    if len(la) != len(lb) or not all(bitwise_equal(x, y) for x, y in zip(la, lb, strict=True)):
        return False
    if a.outcome.nan_param_names != b.outcome.nan_param_names:
        return False
    ga, gb = a.outcome.gradient_norm, b.outcome.gradient_norm
    return (math.isnan(ga) and math.isnan(gb)) or ga == gb


def matches_capture(cap: NaNCapture, result: ForwardBackwardResult) -> Optional[bool]:
    """Whether the replayed losses are bitwise those training logged; None when the capture holds none."""
    captured = [loss for r in cap.ranks for loss in r.losses]
    if not captured or len(captured) != len(result.losses):
        return None
    return all(bitwise_equal(a, b) for a, b in zip(result.losses, captured, strict=True))


def damaged_before(ev: Evidence) -> bool:
    """Whether the model state at the start of the step explains the failure: huge or
    non-finite weights, or non-finite buffers that the failing op read (a NaN in a buffer
    the forward pass does not use, such as BatchNorm's running statistics in training
    mode, does not make this step fail)."""
    w = ev.weights
    if w.status == "huge" or w.nonfinite:
        return True
    return bool(w.nonfinite_buffers) and (ev.origin == "buffers" or ev.finding is None)


_LOG_OPS = ("log", "log2", "log10", "log1p", "xlogy", "_log_softmax", "log_softmax")
_DIV_OPS = ("div", "div_", "reciprocal", "true_divide", "remainder", "fmod")


def op_kind(f: OpFinding) -> str:
    """What went wrong at the op: "propagated" (a non-finite input passed on), "nan_from_inf" (a NaN
    made from a deliberate Inf, a mask), "sqrt_grad", "log", "div", "sqrt", "overflow" or "other"."""
    if f.inputs_nonfinite:
        return "propagated"
    if f.origin == "inf":
        return "nan_from_inf"  # a NaN made from a deliberate Inf (a mask): see f.cause
    if f.phase == "backward" and f.forward_op and f.forward_op.startswith(("Sqrt", "Rsqrt", "Pow")):
        return "sqrt_grad"
    if f.op_name in _LOG_OPS:
        return "log"
    if f.op_name in _DIV_OPS:
        return "div"
    if f.op_name in ("sqrt", "rsqrt") and f.output.nan:
        return "sqrt"
    if f.output.posinf or f.output.neginf:
        return "overflow"
    return "other"


def precision_failure(f: OpFinding) -> str:
    """How a reduced precision broke an op with finite inputs: "overflow" (a value beyond
    the dtype's range) or "rounding" (a value rounded to 0, or to the wrong side of 0, that
    the op cannot take: log, division, square root, or its gradient)."""
    kind = op_kind(f)
    if kind in ("log", "sqrt", "sqrt_grad") or f.op_name == "rsqrt":  # rsqrt is infinite only at 0
        return "rounding"
    if kind == "div":
        # x / 0 is rounding; a finite nonzero divisor that gives Inf is an overflow.
        divisors = f.inputs[1:] if len(f.inputs) > 1 else f.inputs  # reciprocal has one input
        divisor_zero = any(s.abs_min == 0 for s in divisors)
        return "rounding" if divisor_zero or not (f.output.posinf or f.output.neginf) else "overflow"
    if kind == "overflow":
        return "overflow"
    return "rounding"  # NaN from finite inputs
