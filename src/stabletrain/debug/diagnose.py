"""diagnose: from a NaN capture to a verdict — which op, which module, which sample, and why.

:func:`diagnose` (also ``cap.diagnose()`` and ``stabletrain diagnose PATH``) takes a capture
written by nancapture and answers, offline:

1. **Why** (first, because it decides what else is worth doing): the step is replayed in
   the captured precision twice, then in float32 (unless that is the captured one) and in
   float64 (likewise). The class is decided by the captured precision and float32 alone:
   a failure that does not come back in both replays in the captured precision is **not
   reproducible** (nondeterminism, an external cause, a hardware fault); one that comes
   back in a reduced captured precision (16-mixed, bf16-mixed, 16-true, bf16-true) but
   not in float32 is **precision-induced**; one that comes back in float32 too (or was
   captured in 32-true or 64-true) is **deterministic numerical**. The float64 replay
   does not change the class; it is evidence reported with it: a deterministic numerical
   failure that float64 keeps finite is an overflow that a wider type only postpones.
2. **Which data**: the microbatches and then the samples within the culprit microbatch
   that are enough to trigger the failure, found by replaying subsets (delta debugging:
   halves first, then smaller pieces). A failure visible in the loss is checked with
   forward passes only; a failure only in the gradients with forward and backward. The
   complement is checked too, to tell a bad sample from a model that fails on any data.
3. **Where exactly**: the culprit subset alone is replayed under op-level tracing
   (:class:`~stabletrain.debug.op_trace.OpTracer`), which follows where every NaN/Inf comes
   from and reports where the first harmful one (at the loss or in a gradient) was born:
   op, module path, phase, dtype, abs min/max of its inputs, the source line, for backward
   ops the forward op and module they differentiate, and for a NaN made from a masking
   -Inf the op that wrote the -Inf. An Inf that something neutralises (a masked softmax)
   is never reported.
4. **Before or during the step**: were the weights already huge or non-finite when the
   step began (then earlier steps did the damage, and the checkpoints are searched for
   the last healthy one) or healthy (the step itself failed)?
5. **Report**: a short account with concrete next actions (``model_args.lr``,
   ``precision``, ``gradient_clip_val``, ``transform_args``), written next to the capture
   as ``diagnosis.md`` and ``diagnosis.json``.

On the command line: ``stabletrain diagnose PATH`` (:mod:`stabletrain.cli.diagnose`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from stabletrain.debug import advice
from stabletrain.debug.nan_capture import (
    REASON_NORM_OVERFLOW,
    REASON_OTHER_RANK,
    REASON_SKIPPED,
    NaNCaptureError,
    default_step_fn,
)
from stabletrain.debug.op_trace import OpFinding, OpTracer, is_additive_mask
from stabletrain.debug.replay import (
    ForwardBackwardResult,
    MicrobatchKey,
    NaNCapture,
    forward_backward,
    load_nan_capture,
    normalize_precision,
)
from stabletrain.utils.io import atomic_write_text
from stabletrain.utils.text import fmt_list, fmt_number, json_float, shell_path
from stabletrain.utils.tree import bitwise_equal, json_ready, named_tensors

__all__ = [
    "diagnose",
    "Diagnosis",
    "ReplayOutcome",
    "DataReport",
    "WeightsReport",
    "ParamStat",
    "PRECISION_INDUCED",
    "DETERMINISTIC_NUMERICAL",
    "NOT_REPRODUCIBLE",
    "HUGE_WEIGHT",
]

#: Cause classes.
PRECISION_INDUCED = "precision_induced"
DETERMINISTIC_NUMERICAL = "deterministic_numerical"
NOT_REPRODUCIBLE = "not_reproducible"
_CAUSE_TITLES = {
    PRECISION_INDUCED: "precision-induced",
    DETERMINISTIC_NUMERICAL: "deterministic numerical",
    NOT_REPRODUCIBLE: "not reproducible",
}

#: A weight whose magnitude reaches this is "huge": trained networks keep weights near 1
#: (normalisation gains, embeddings, projections are O(0.01-1)); 1e3 is far outside that
#: and well inside every float range, so it flags divergence before it becomes an overflow.
HUGE_WEIGHT = 1e3

_FILE_MD = "diagnosis.md"
_FILE_JSON = "diagnosis.json"


# --------------------------------------------------------------------------------------
# Result types
# --------------------------------------------------------------------------------------


@dataclass
class ReplayOutcome:
    """One full replay of the captured step.

    Attributes:
        label: What it tested ("captured precision", "captured precision, again", "float32", "float64").
        precision: The precision it ran in.
        reproduced: A loss or a gradient was non-finite.
        losses: Each microbatch's loss.
        nan_param_names: Parameters with a non-finite gradient.
        gradient_norm: L2 norm of all gradients.
        seconds: How long it took.
    """

    label: str
    precision: str
    reproduced: bool
    losses: list[float]
    nan_param_names: list[str]
    gradient_norm: float
    seconds: float
    _loss_tensors: list[Tensor] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "precision": self.precision,
            "reproduced": self.reproduced,
            "losses": [json_float(x) for x in self.losses],
            "nan_param_names": self.nan_param_names,
            "gradient_norm": json_float(self.gradient_norm),
            "seconds": round(self.seconds, 3),
        }


@dataclass
class ParamStat:
    """Magnitude of one parameter's values at the start of the step."""

    name: str
    shape: list[int]
    abs_max: float
    rms: float
    nonfinite: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": self.shape, "abs_max": json_float(self.abs_max), "rms": json_float(self.rms),
                "nonfinite": self.nonfinite}


@dataclass
class WeightsReport:
    """Were the weights (and buffers) healthy when the step began?

    Attributes:
        status: "healthy", "huge" (some weight reaches ``threshold``) or "nonfinite"
            (some parameter, or some buffer such as running statistics, holds NaN/Inf).
        threshold: The magnitude counted as huge.
        largest: The parameters with the largest magnitudes, largest first.
        nonfinite: Parameters holding NaN or Inf.
        nonfinite_buffers: Buffers (e.g. BatchNorm statistics) holding NaN or Inf.
        checkpoints: For unhealthy weights: each checkpoint of the run with its step and
            largest weight magnitude (``{"path", "step", "abs_max", "healthy"}``).
        healthy_checkpoint: The newest checkpoint whose weights are finite and below the
            threshold and whose buffers are finite.
    """

    status: str
    threshold: float
    largest: list[ParamStat]
    nonfinite: list[ParamStat]
    nonfinite_buffers: list[str]
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    healthy_checkpoint: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "threshold": self.threshold,
            "largest": [p.to_dict() for p in self.largest],
            "nonfinite": [p.to_dict() for p in self.nonfinite],
            "nonfinite_buffers": self.nonfinite_buffers,
            "checkpoints": [{**c, "abs_max": json_float(c["abs_max"])} for c in self.checkpoints],
            "healthy_checkpoint": self.healthy_checkpoint,
        }


@dataclass
class DataReport:
    """Which data is enough to trigger the failure.

    Attributes:
        status: "isolated" (these samples trigger it and the rest of their microbatch does
            not), "not_data_specific" (other, disjoint samples fail too: the model fails on
            any data), "combination" (no microbatch fails alone, only some together),
            "not_searched" (the failure is not reproducible).
        note: One sentence saying what was found.
        check: "forward" (the loss is non-finite: forward passes suffice) or "forward+backward".
        failing_microbatches: Microbatches that fail on their own, as (rank, micro_step).
        microbatches: The culprit microbatch(es) the samples belong to.
        row_sets: Disjoint sets of rows (positions in the culprit microbatch) that each
            trigger the failure; usually one set of one sample. Empty unless "isolated":
            when any data fails there is no culprit to name.
        index_sets: The same as dataset indices, when the capture holds them.
        examples: For "not_data_specific": sets of rows that fail on their own, found while
            searching (the first is the one traced); they are examples, not culprits.
        example_indices: The same as dataset indices, when the capture holds them.
        microbatch_size: Samples in the culprit microbatch.
        approximate: True when batch-dependent layers make the isolation of single samples approximate.
        caveats: Why the isolation may be approximate.
        nonfinite_inputs: Non-finite values already in the data: ``{"rank", "micro_step",
            "row", "index", "field", "count"}`` per sample and tensor.
        out_of_range_inputs: For a capture in 16-true or bf16-true (which convert the
            batch to float16 or bfloat16): finite values in the data that this conversion
            turns into Inf, with the same keys plus ``abs_max`` (the sample's largest).
        replays: Subset replays done.
    """

    status: str
    note: str = ""
    check: str = "forward"
    failing_microbatches: list[MicrobatchKey] = field(default_factory=list)
    microbatches: list[MicrobatchKey] = field(default_factory=list)
    row_sets: list[list[int]] = field(default_factory=list)
    index_sets: Optional[list[list[int]]] = None
    examples: list[list[int]] = field(default_factory=list)
    example_indices: Optional[list[list[int]]] = None
    microbatch_size: int = 0
    approximate: bool = False
    caveats: list[str] = field(default_factory=list)
    nonfinite_inputs: list[dict[str, Any]] = field(default_factory=list)
    out_of_range_inputs: list[dict[str, Any]] = field(default_factory=list)
    replays: int = 0

    @property
    def rows(self) -> list[int]:
        """The first culprit set's rows."""
        return self.row_sets[0] if self.row_sets else []

    @property
    def dataset_indices(self) -> Optional[list[int]]:
        """The first culprit set's dataset indices, when known."""
        return self.index_sets[0] if self.index_sets else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "note": self.note,
            "check": self.check,
            "failing_microbatches": [_key_dict(k) for k in self.failing_microbatches],
            "microbatches": [_key_dict(k) for k in self.microbatches],
            "rows": self.rows,
            "dataset_indices": self.dataset_indices,
            "row_sets": self.row_sets,
            "index_sets": self.index_sets,
            "examples": self.examples,
            "example_indices": self.example_indices,
            "microbatch_size": self.microbatch_size,
            "approximate": self.approximate,
            "caveats": self.caveats,
            "nonfinite_inputs": self.nonfinite_inputs,
            "out_of_range_inputs": json_ready(self.out_of_range_inputs),
            "replays": self.replays,
        }


@dataclass
class Diagnosis:
    """What :func:`diagnose` found. ``str(diagnosis)`` is the human-readable account.

    Attributes:
        path: The capture diagnosed.
        step, ranks, world_size, precision, loss_scale, reason, model_class: From the capture.
        device: Where the replays ran.
        cause: :data:`NOT_REPRODUCIBLE` when either replay in the captured precision is
            finite; else :data:`PRECISION_INDUCED` when the captured precision is reduced
            (16-mixed, bf16-mixed, 16-true, bf16-true) and the float32 replay is finite;
            else :data:`DETERMINISTIC_NUMERICAL` (float32 fails too, or the run was in
            32-true or 64-true). The float64 replay does not decide the class.
        cause_explanation: The same in plain language, with the evidence (including
            whether float64 keeps the step finite).
        deterministic: Whether the two replays in the captured precision agreed bitwise.
        matches_capture: Whether the first replay's losses equal the captured ones bitwise
            (None when the capture holds no losses).
        replays: The full replays: captured precision twice, then float32 and float64
            (each unless it is the captured precision).
        reproduces_in: Precision -> whether the failure came back in it (for the captured
            precision: in both replays).
        finding: Where the first harmful non-finite value was born (see :mod:`~stabletrain.debug.op_trace`;
            None when not reproducible or not found).
        traced_on: The subset that was traced: ``{"microbatches", "rows", "dataset_indices"}``.
        origin: Where a non-finite *input* of the first op came from ("data", "weights",
            "buffers", "precision_conversion"), when the op only passed one on.
        data: :class:`DataReport`.
        weights: :class:`WeightsReport`.
        summary: What happened, in one or two sentences.
        probable_cause: The most likely cause, in plain language.
        next_actions: Concrete next steps with setting names and values.
        history: The run's last logged metrics rows (step, loss, gradient_norm), when found.
        timings: Seconds per phase.
        files: The diagnosis.md and diagnosis.json written.
    """

    path: str
    step: int
    ranks: list[int]
    world_size: int
    precision: str
    loss_scale: Optional[float]
    reason: str
    model_class: str
    device: str
    cause: str
    cause_explanation: str
    deterministic: Optional[bool]
    matches_capture: Optional[bool]
    replays: list[ReplayOutcome]
    reproduces_in: dict[str, bool]
    finding: Optional[OpFinding]
    traced_on: Optional[dict[str, Any]]
    origin: Optional[str]
    data: DataReport
    weights: WeightsReport
    summary: str
    probable_cause: str
    next_actions: list[str]
    history: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    @property
    def cause_title(self) -> str:
        return _CAUSE_TITLES[self.cause]

    @property
    def verdict(self) -> str:
        """One line: the cause class and the probable cause."""
        return f"{self.cause_title}: {self.probable_cause}"

    def to_dict(self) -> dict[str, Any]:
        """The same fields as the report, JSON-ready (non-finite numbers as "nan", "inf", "-inf")."""
        finding = None
        if self.finding is not None:
            finding = json_ready(self.finding.to_dict())
            finding["where"] = self.finding.where
        return {
            "path": self.path,
            "step": self.step,
            "ranks": self.ranks,
            "world_size": self.world_size,
            "precision": self.precision,
            "loss_scale": self.loss_scale,
            "reason": self.reason,
            "model_class": self.model_class,
            "device": self.device,
            "verdict": self.verdict,
            "summary": self.summary,
            "cause": self.cause,
            "cause_title": self.cause_title,
            "cause_explanation": self.cause_explanation,
            "probable_cause": self.probable_cause,
            "deterministic": self.deterministic,
            "matches_capture": self.matches_capture,
            "reproduces_in": self.reproduces_in,
            "replays": [r.to_dict() for r in self.replays],
            "where": finding,
            "traced_on": None if self.traced_on is None else {
                **self.traced_on, "microbatches": [_key_dict(k) for k in self.traced_on["microbatches"]]},
            "origin": self.origin,
            "data": self.data.to_dict(),
            "weights": self.weights.to_dict(),
            "next_actions": self.next_actions,
            "history": json_ready(self.history),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "files": self.files,
        }

    def __str__(self) -> str:
        return self.to_markdown()

    def to_markdown(self) -> str:
        """The human-readable account (Markdown), as written to ``diagnosis.md``."""
        return _render(self)


# --------------------------------------------------------------------------------------
# The diagnosis
# --------------------------------------------------------------------------------------


def diagnose(
    capture: Union[str, Path, NaNCapture],
    *,
    model: Optional[nn.Module] = None,
    step_fn: Optional[Callable[[nn.Module, Any], Tensor]] = None,
    device: Optional[Union[str, torch.device]] = None,
    write: bool = True,
    huge_weight: float = HUGE_WEIGHT,
    max_subset_replays: int = 64,
) -> Diagnosis:
    """Diagnose a NaN capture offline: which op, which module, which sample, and why.

    Args:
        capture: A loaded :class:`~stabletrain.debug.replay.NaNCapture`, or a path that
            :func:`~stabletrain.load_nan_capture` accepts (rank folder, ``nan_capture.pt``,
            folder of all ranks, run folder).
        model: Your own model, for a capture of one (as for ``load_nan_capture``).
        step_fn: ``step_fn(model, batch) -> loss``, if the model has no ``training_step``.
        device: Where to replay; default: the captured device type when available, else CPU.
        write: Write ``diagnosis.md`` and ``diagnosis.json`` next to the capture.
        huge_weight: The weight magnitude counted as huge (see :data:`HUGE_WEIGHT`).
        max_subset_replays: Upper bound on subset replays while searching for the culprit data.

    Returns:
        A :class:`Diagnosis`; ``print(d)`` shows the account, ``d.to_dict()`` the same for machines.

    Raises:
        NaNCaptureError: The capture cannot be read or its model cannot be rebuilt.

    Example::

        d = stabletrain.diagnose("out/boom/debug/nan_capture/rank0")
        print(d)                                  # also in out/boom/debug/nan_capture/rank0/diagnosis.md
        print(d.cause, d.finding.op, d.finding.module, d.data.dataset_indices)
    """
    timings: dict[str, float] = {}
    clock = _PhaseTimer(timings)
    with clock("load"):
        if isinstance(capture, NaNCapture):
            cap = capture
            if model is not None:
                cap.model = model
            if step_fn is not None:
                cap.step_fn = step_fn
        else:
            cap = load_nan_capture(capture, model=model, step_fn=step_fn)
        replay_model = cap.get_model()
        precision = normalize_precision(cap.precision)
        dev = torch.device(device) if device is not None else cap.default_device()

    with clock("weights"):
        weights = _weights_report(cap, huge_weight)
        bad_inputs = _nonfinite_inputs(cap)
        out_of_range = _out_of_range_inputs(cap, precision)

    with clock("replays"):
        first = _full_replay(cap, "captured precision", precision, dev)
        again = _full_replay(cap, "captured precision, again", precision, dev)
        replays = [first.outcome, again.outcome]
        if precision != "32-true":
            replays.append(_full_replay(cap, "float32", "32-true", dev).outcome)
        if precision != "64-true":
            replays.append(_full_replay(cap, "float64", "64-true", dev).outcome)
    reproduces_in: dict[str, bool] = {}
    for r in replays:
        reproduces_in[r.precision] = reproduces_in.get(r.precision, True) and r.reproduced
    deterministic = _same_outcome(first, again)
    captured_losses = [loss for r in cap.ranks for loss in r.losses]
    matches_capture = None
    if captured_losses and len(captured_losses) == len(first.result.losses):
        matches_capture = all(bitwise_equal(a, b) for a, b in zip(first.result.losses, captured_losses))
    reproducible = first.outcome.reproduced and again.outcome.reproduced
    fp32_fails = reproduces_in.get("32-true", False)
    if not reproducible:
        cause = NOT_REPRODUCIBLE
    elif precision in advice.REDUCED_PRECISIONS and not fp32_fails:
        cause = PRECISION_INDUCED
    else:
        cause = DETERMINISTIC_NUMERICAL

    finding: Optional[OpFinding] = None
    traced_on: Optional[dict[str, Any]] = None
    if reproducible:
        with clock("bisect"):
            data = _isolate(cap, first.result, precision, dev, max_subset_replays)
        data.nonfinite_inputs = bad_inputs
        data.out_of_range_inputs = out_of_range
        data.caveats = _isolation_caveats(replay_model, data) if data.status == "isolated" else data.caveats
        data.approximate = any("batch-dependent" in c for c in data.caveats)
        with clock("trace"):
            keys = data.microbatches
            sample_rows = data.rows or (data.examples[0] if data.examples else [])
            rows = {keys[0]: sample_rows} if sample_rows and len(keys) == 1 else None
            finding = _trace(cap, replay_model, keys, rows, precision, dev)
            index_sets = data.index_sets if data.row_sets else data.example_indices
            traced_on = {
                "microbatches": keys,
                "rows": sample_rows if rows else None,
                "dataset_indices": index_sets[0] if rows and index_sets else None,
            }
    else:
        data = DataReport(status="not_searched", nonfinite_inputs=bad_inputs, out_of_range_inputs=out_of_range,
                          note="not searched: a failure that does not come back cannot be narrowed down by replaying subsets")

    with clock("checkpoints"):
        out = _run_folder(cap)
        if weights.status != "healthy" and out is not None:
            _scan_checkpoints(out / "checkpoints", weights, set(cap.ranks[0].params), set(cap.ranks[0].buffers))
        history = _history(out) if out is not None else []

    origin = _origin(finding, data, weights, precision, traced_on)
    diag = Diagnosis(
        path=str(cap.path),
        step=cap.step,
        ranks=[r.rank for r in cap.ranks],
        world_size=cap.world_size,
        precision=precision,
        loss_scale=cap.loss_scale,
        # Of several ranks, the one that failed says why; the others stopped with it (other_rank).
        reason=next((r.reason for r in cap.ranks if r.reason != REASON_OTHER_RANK), cap.ranks[0].reason),
        model_class=cap.ranks[0].model_class,
        device=str(dev),
        cause=cause,
        cause_explanation="",
        deterministic=deterministic if reproducible else None,
        matches_capture=matches_capture,
        replays=replays,
        reproduces_in=reproduces_in,
        finding=finding,
        traced_on=traced_on,
        origin=origin,
        data=data,
        weights=weights,
        summary="",
        probable_cause="",
        next_actions=[],
        history=history,
        timings=timings,
    )
    diag.cause_explanation = _explain_cause(diag, cap)
    diag.summary = _summary(diag, cap)
    diag.probable_cause = _probable_cause(diag, cap)
    diag.next_actions = _next_actions(diag, cap, out)
    if write:
        folder = _output_folder(cap)
        md, js = folder / _FILE_MD, folder / _FILE_JSON
        diag.files = [str(md), str(js)]
        atomic_write_text(diag.to_markdown() + "\n", md)
        atomic_write_text(json.dumps(diag.to_dict(), indent=2) + "\n", js)
    return diag


class _PhaseTimer:
    """``with timer("phase"):`` adds the seconds spent inside to ``timings["phase"]``."""

    def __init__(self, timings: dict[str, float]):
        self.timings = timings

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - start


# --------------------------------------------------------------------------------------
# Replays and classification
# --------------------------------------------------------------------------------------


@dataclass
class _FullReplay:
    """One replay of the whole step: its summary for the report, and what it computed."""

    outcome: ReplayOutcome
    result: ForwardBackwardResult


def _full_replay(cap: NaNCapture, label: str, precision: str, device: torch.device) -> _FullReplay:
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
        _loss_tensors=list(res.losses),
    )
    return _FullReplay(outcome, res)


def _same_outcome(a: _FullReplay, b: _FullReplay) -> bool:
    """Bitwise the same losses and the same non-finite gradients."""
    la, lb = a.outcome._loss_tensors, b.outcome._loss_tensors
    if len(la) != len(lb) or not all(bitwise_equal(x, y) for x, y in zip(la, lb)):
        return False
    if a.outcome.nan_param_names != b.outcome.nan_param_names:
        return False
    ga, gb = a.outcome.gradient_norm, b.outcome.gradient_norm
    return (math.isnan(ga) and math.isnan(gb)) or ga == gb


# --------------------------------------------------------------------------------------
# Which data: delta debugging over microbatches and samples
# --------------------------------------------------------------------------------------


class _ReplayBudget:
    """The subset replays the search may run. A replay asked for past the limit is not run:
    it counts as not failing and marks the budget ``refused``, so that the search can discard
    what it decided without replays."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.refused = False

    def take(self) -> bool:
        """Use one replay; False (and ``refused``) when none is left."""
        if self.used >= self.limit:
            self.refused = True
            return False
        self.used += 1
        return True


def _isolate(cap: NaNCapture, full: ForwardBackwardResult, precision: str, device: torch.device,
             max_replays: int) -> DataReport:
    keys = list(full.microbatches)
    loss_bad = [k for k, v in zip(keys, full.loss_values) if not math.isfinite(v)]
    report = DataReport(status="isolated", check="forward" if loss_bad else "forward+backward")
    errors: list[str] = []
    budget = _ReplayBudget(max_replays)

    def fails(mbs: Sequence[MicrobatchKey], rows: Optional[dict[MicrobatchKey, list[int]]] = None,
              forward_only: bool = False) -> bool:
        if not budget.take():
            return False
        report.replays = budget.used
        try:
            res = forward_backward(cap, microbatches=list(mbs), rows=rows, precision=precision, device=device,
                                   backward=not forward_only)
        except NaNCaptureError:
            raise
        except Exception as exc:  # e.g. BatchNorm refusing a batch of one sample
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return False
        return res.reproduces(cap.reason)

    # Microbatches: a loss is computed per microbatch, so the full replay already says which
    # ones produce a non-finite loss. Gradient-only failures need a replay per microbatch.
    if loss_bad:
        failing = loss_bad
    elif len(keys) == 1:
        failing = keys
    else:
        failing = [k for k in keys if fails([k])]
        if budget.refused:
            failing = []
    report.failing_microbatches = failing
    if not failing:
        combo = _ddmin(keys, lambda s: fails(s))
        if budget.refused:
            combo = keys
        report.status = "combination"
        report.microbatches = combo
        report.note = (
            f"no microbatch fails on its own; together, microbatches {_keys_text(combo)} do: their accumulated "
            "gradient goes out of range, not any one sample's"
        )
        return report

    culprit = failing[0]
    rank, micro = culprit
    part = cap.rank_capture(rank)
    n = part.microbatch_size(micro)
    report.microbatches = [culprit]
    report.microbatch_size = n
    forward_only = culprit in loss_bad
    check = lambda rows: fails([culprit], {culprit: list(rows)}, forward_only)  # noqa: E731
    sets: list[list[int]] = []
    remaining = list(range(n))
    rest_fails = False
    probes: list[int] = []
    if n == 1:
        sets = [[0]]
        remaining = []
    else:
        # Up to 3 disjoint culprit sets: a second bad sample is found, and a model that
        # fails on any data shows itself by its complement still failing after three.
        # Whatever was decided after the budget ran out is discarded.
        for round_ in range(3):
            found = _ddmin(remaining, check)
            if budget.refused:
                break
            sets.append(found)
            remaining = [r for r in remaining if r not in found]
            if not remaining:
                break
            rest = check(remaining)
            if budget.refused:
                break
            rest_fails = rest
            if not rest_fails:
                break
            if round_ == 0 and len(found) == 1 and len(remaining) >= 3:
                # The rest fails too. Before searching it, probe three single samples spread
                # over it: when they all fail alone, any sample does (cheaper than two searches).
                picks = [remaining[0], remaining[len(remaining) // 2], remaining[-1]]
                alone = all(check([r]) for r in picks)
                if budget.refused:
                    break
                if alone:
                    probes = picks
                    break
    if budget.refused:
        report.caveats.append(f"stopped after {max_replays} subset replays (max_subset_replays)")
    if not sets:
        sets = [list(range(n))]
    ix = part.indices[micro]
    index_sets = [[int(ix[r]) for r in s] for s in sets] if isinstance(ix, Tensor) else None
    where = f"microbatch {micro}" + (f" of rank {rank}" if len(cap.ranks) > 1 else "")
    every = not remaining and n > 1 and all(len(s) == 1 for s in sets) and len(sets) == n
    if rest_fails or every:
        # No culprit: what failed on its own are examples (one is traced), not samples to blame.
        report.status = "not_data_specific"
        report.examples = sets + [[r] for r in probes]
        if isinstance(ix, Tensor):
            report.example_indices = [[int(ix[r]) for r in s] for s in report.examples]
        if every:
            report.note = f"every sample of {where} fails on its own: the failure does not depend on particular data"
        elif probes:
            report.note = (
                f"row {sets[0][0]} of {where} fails on its own, and so do rows {', '.join(map(str, probes))} picked from "
                f"the other {len(remaining)} samples: the failure does not depend on particular data"
            )
        else:
            report.note = (
                f"{len(sets)} disjoint sets of samples of {where} each fail on their own and the remaining "
                f"{len(remaining)} samples fail too: the failure does not depend on particular data"
            )
        if len(failing) > 1:
            report.note += f" ({len(failing)} of {len(keys)} microbatches fail alone)"
    else:
        report.row_sets, report.index_sets = sets, index_sets
        names = _samples_text(sets, report.index_sets)
        together = any(len(s) > 1 for s in sets)
        if len(sets) == 1:
            verb = "trigger the failure together (not one alone)" if together else "triggers the failure"
        else:
            verb = "each trigger the failure on their own" if not together else "trigger the failure (in groups)"
        report.note = f"{names} of {where} ({n} samples) {verb}; the other samples of the microbatch do not"
        others = [k for k in failing if k != culprit]
        if others:
            report.note += f"; microbatches {_keys_text(others)} also fail alone (not searched further)"
    if errors:
        report.caveats.append(
            f"{len(errors)} subset(s) could not be run and counted as not failing ({errors[0]}); "
            "layers that need several samples (BatchNorm) refuse very small subsets"
        )
    return report


def _ddmin(items: list[Any], fails: Callable[[list[Any]], bool]) -> list[Any]:
    """A 1-minimal subset of ``items`` (which fails) that still fails (Zeller's delta debugging).

    With one culprit this is a bisection: about 2 log2(len(items)) checks.
    """
    items = list(items)
    n = 2
    while len(items) >= 2:
        chunks = _split(items, n)
        reduced = False
        for chunk in chunks:
            if fails(chunk):
                items, n, reduced = chunk, 2, True
                break
        if not reduced and n > 2:  # with 2 chunks each complement is the other chunk, already tried
            for chunk in chunks:
                rest = [x for x in items if x not in chunk]
                if fails(rest):
                    items, n, reduced = rest, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items


def _split(items: list[Any], n: int) -> list[list[Any]]:
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        if end > start:
            out.append(items[start:end])
        start = end
    return out


def _isolation_caveats(model: nn.Module, data: DataReport) -> list[str]:
    caveats = list(data.caveats)
    norms = [name or "<root>" for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms and data.microbatch_size > 1:
        caveats.insert(0,
            f"the model has batch-dependent layers (BatchNorm in training mode: {fmt_list(norms, 3)}): a subset of samples is "
            "normalised with its own batch statistics, so samples replayed on their own do not see exactly what they saw "
            "in the full microbatch; the isolation of single samples is approximate"
        )
    drops = [name for name, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    if drops and data.microbatch_size > 1:
        caveats.append(
            "dropout masks are drawn for the subset's shape from the captured random state, so they differ from the "
            "full microbatch's"
        )
    return caveats


def _nonfinite_inputs(cap: NaNCapture) -> list[dict[str, Any]]:
    """Non-finite values already in the captured batches, per sample and tensor; a sample's
    additive mask (only 0 and -inf) holds them on purpose and is left out."""

    def bad(t: Tensor) -> Tensor:
        flags = ~torch.isfinite(t)
        if t.is_complex() or not bool(flags.any()):
            return flags
        masks = (t == 0) | torch.isneginf(t)
        if t.ndim:
            masks = masks.reshape(len(t), -1).all(1).reshape([len(t)] + [1] * (t.ndim - 1))
        else:
            masks = masks.all()
        return flags & ~masks

    return _flag_inputs(cap, bad)


def _out_of_range_inputs(cap: NaNCapture, precision: str) -> list[dict[str, Any]]:
    """Finite values of the captured batches that 16-true or bf16-true, which convert the
    batch to their dtype, turn into Inf; per sample and tensor, with the sample's abs max."""
    dtype = {"16-true": torch.float16, "bf16-true": torch.bfloat16}.get(precision)
    if dtype is None:
        return []
    limit = torch.finfo(dtype).max

    def beyond(t: Tensor) -> Tensor:
        if t.is_complex() or torch.finfo(t.dtype).max <= limit:
            return torch.zeros_like(t, dtype=torch.bool)
        return torch.isfinite(t) & ~torch.isfinite(t.to(dtype))

    return _flag_inputs(cap, beyond, with_abs_max=True)


def _flag_inputs(cap: NaNCapture, test: Callable[[Tensor], Tensor], with_abs_max: bool = False) -> list[dict[str, Any]]:
    """Where ``test(tensor) -> bool mask`` holds in the captured batches, per sample and tensor."""
    found = []
    for part in cap.ranks:
        for micro, batch in enumerate(part.microbatches):
            if batch is None:
                continue
            n = part.microbatch_size(micro)
            ix = part.indices[micro]
            for name, t in named_tensors(batch):
                if not (t.is_floating_point() or t.is_complex()) or not t.numel():
                    continue
                bad = test(t)
                if not bool(bad.any()):
                    continue
                if t.ndim and t.shape[0] == n:
                    counts = bad.reshape(n, -1).sum(1)
                    for row in torch.nonzero(counts).flatten().tolist():
                        found.append({
                            "rank": part.rank, "micro_step": micro, "row": row,
                            "index": int(ix[row]) if isinstance(ix, Tensor) else None,
                            "field": name, "count": int(counts[row]),
                        })
                        if with_abs_max:
                            found[-1]["abs_max"] = float(t[row].abs().max())
                else:
                    found.append({"rank": part.rank, "micro_step": micro, "row": None, "index": None,
                                  "field": name, "count": int(bad.sum())})
                    if with_abs_max:
                        found[-1]["abs_max"] = float(t[bad].abs().max())
    return found


# --------------------------------------------------------------------------------------
# Where: op tracing of the culprit subset
# --------------------------------------------------------------------------------------


def _trace(
    cap: NaNCapture,
    model: nn.Module,
    keys: list[MicrobatchKey],
    rows: Optional[dict[MicrobatchKey, list[int]]],
    precision: str,
    device: torch.device,
) -> Optional[OpFinding]:
    base = cap.step_fn or default_step_fn
    # The forward pass alone first: most failures start there, and it costs neither the
    # backward pass nor anomaly mode (which records a traceback per autograd node).
    for backward in (False, True):
        tracer = OpTracer(model, check_backward=backward, armed=False)

        def traced_step(m: nn.Module, batch: Any, *step_args: Any, tracer: OpTracer = tracer) -> Tensor:
            # Armed once the captured state is loaded and the batch is on the device: restoring
            # non-finite weights is not the failing op; what the model does with them is.
            tracer.arm()
            tracer.watch_batch(batch)
            loss = base(m, batch, *step_args)
            tracer.check_loss(loss)  # a non-finite loss is the harm: its origin is the finding
            return loss

        forward_backward(cap, microbatches=keys, rows=rows, precision=precision, device=device, context=tracer,
                         step_fn=traced_step, backward=backward)
        if tracer.finding is not None:
            # Rows of the traced subset -> rows of the microbatch (unknown over several microbatches).
            subset = rows[keys[0]] if rows and len(keys) == 1 else None
            return _microbatch_rows(tracer.finding, subset, len(keys) == 1)
    return None


def _microbatch_rows(f: OpFinding, subset: Optional[list[int]], one_microbatch: bool) -> OpFinding:
    def convert(r: Optional[list[int]]) -> Optional[list[int]]:
        if r is None or not one_microbatch:
            return None
        return r if subset is None else [subset[i] for i in r if i < len(subset)]

    cause = dataclasses.replace(f.cause, rows=convert(f.cause.rows)) if f.cause is not None else None
    return dataclasses.replace(f, rows=convert(f.rows), cause=cause)


def _origin(finding: Optional[OpFinding], data: DataReport, weights: WeightsReport, precision: str,
            traced_on: Optional[dict[str, Any]] = None) -> Optional[str]:
    if finding is None or not finding.inputs_nonfinite:
        return None
    # The tracer knows which tensor held it; the data scan tells bad data from a conversion.
    if finding.origin == "weight" and weights.nonfinite:
        return "weights"
    if finding.origin == "buffer" and weights.nonfinite_buffers:
        return "buffers"
    rows = set(data.rows or ((traced_on or {}).get("rows") or []))
    keys = set(data.microbatches)
    for bad in data.nonfinite_inputs:
        if (bad["rank"], bad["micro_step"]) in keys and (bad["row"] is None or bad["row"] in rows):
            return "data"
    if weights.nonfinite:
        return "weights"
    if weights.nonfinite_buffers:
        return "buffers"
    if precision in ("16-true", "bf16-true"):
        return "precision_conversion"
    return None


# --------------------------------------------------------------------------------------
# Before or during the step: the weights
# --------------------------------------------------------------------------------------


def _weights_report(cap: NaNCapture, threshold: float) -> WeightsReport:
    stats = []
    for name, p in cap.ranks[0].params.items():  # DDP keeps the parameters equal on every rank
        if p.is_floating_point() and p.numel():
            stats.append(_param_stat(name, p))
    nonfinite = [s for s in stats if s.nonfinite]
    largest = sorted(stats, key=lambda s: -s.abs_max if math.isfinite(s.abs_max) else 0.0)[:5]
    buffers = sorted({
        name for part in cap.ranks for name, b in part.buffers.items() if _bad_buffer(b)
    })
    top = max((s.abs_max for s in stats if math.isfinite(s.abs_max)), default=0.0)
    # A NaN in a buffer (running statistics) at the start of the step is damage from earlier
    # steps just as much as a NaN in a weight: the forward pass that updated it did it.
    status = "nonfinite" if (nonfinite or buffers) else ("huge" if top >= threshold else "healthy")
    return WeightsReport(status, float(threshold), largest, nonfinite, buffers)


def _bad_buffer(b: Tensor) -> bool:
    """A buffer holding NaN/Inf that is not there on purpose (an additive mask of 0 and -inf is)."""
    return b.is_floating_point() and b.numel() > 0 and not bool(torch.isfinite(b).all()) and not is_additive_mask(b)


def _param_stat(name: str, p: Tensor) -> ParamStat:
    x = p.detach()
    finite = torch.isfinite(x)
    n_bad = int(finite.numel() - finite.sum())
    vals = x[finite] if n_bad else x
    if not vals.numel():
        return ParamStat(name, list(p.shape), math.nan, math.nan, n_bad)
    abs_max = float(vals.abs().max())
    rms = float(torch.linalg.vector_norm(vals, dtype=torch.float64)) / math.sqrt(vals.numel())
    return ParamStat(name, list(p.shape), abs_max, rms, n_bad)


def _run_folder(cap: NaNCapture) -> Optional[Path]:
    """``out`` for a capture at ``out/debug/nan_capture/rank{N}/nan_capture.pt``."""
    f = cap.ranks[0].path.resolve()
    if len(f.parents) > 3 and f.parents[1].name == "nan_capture" and f.parents[2].name == "debug":
        return f.parents[3]
    return None


def _scan_checkpoints(folder: Path, weights: WeightsReport, names: set[str], buffer_names: set[str]) -> None:
    if not folder.is_dir():
        return
    from stabletrain.checkpoint import CheckpointError, load_checkpoint

    seen: dict[int, dict[str, Any]] = {}
    files = sorted(folder.glob("step_*.ckpt")) + [folder / "last.ckpt"]
    for path in files:
        if not path.is_file():
            continue
        try:
            state = load_checkpoint(path)
        except CheckpointError:
            continue
        step = int(state.get("step", -1))
        if step in seen:
            continue
        model = state.get("model", {})
        values = [t for n, t in model.items() if n in names and isinstance(t, Tensor) and t.is_floating_point()]
        # Buffers count for health only when finite or not: running statistics may be large legitimately.
        buffers = [t for n, t in model.items() if n in buffer_names and isinstance(t, Tensor) and t.is_floating_point()]
        finite = all(bool(torch.isfinite(t).all()) for t in values)
        top = max((float(t.detach().abs().max()) for t in values if t.numel()), default=0.0) if finite else math.inf
        buffers_finite = not any(_bad_buffer(t) for t in buffers)
        seen[step] = {"path": str(path), "step": step, "abs_max": top,
                      "healthy": finite and buffers_finite and top < weights.threshold}
    weights.checkpoints = [seen[s] for s in sorted(seen)]
    healthy = [c for c in weights.checkpoints if c["healthy"]]
    if healthy:
        best = healthy[-1]
        # Prefer the periodic file: last.ckpt is overwritten by the next run.
        same = [c for c in weights.checkpoints if c["step"] == best["step"]]
        weights.healthy_checkpoint = same[0]["path"]


def _history(out: Path, last: int = 5) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    from stabletrain.loggers.jsonl import read_metrics

    try:
        rows, _ = read_metrics(path)
    except OSError:
        return []
    keep = ("step", "loss", "gradient_norm", "lr")
    return [{k: r[k] for k in keep if k in r} for r in rows[-last:]]


# --------------------------------------------------------------------------------------
# Words: explanation, probable cause, next actions
# --------------------------------------------------------------------------------------


def _explain_cause(d: Diagnosis, cap: NaNCapture) -> str:
    first, again = d.replays[0], d.replays[1]
    dtype = advice.dtype_name(d.precision)
    if d.cause == NOT_REPRODUCIBLE:
        if d.reason == REASON_OTHER_RANK and len(cap.ranks) == 1:
            return (
                f"This rank's own step was healthy: another rank's data failed and this rank stopped with it. "
                f"Diagnose the folder of all ranks ({cap.ranks[0].path.parent.parent}) instead."
            )
        n = sum(r.reproduced for r in (first, again))
        if n == 1:
            which = "first" if first.reproduced else "second"
            head = (
                f"Replayed twice from exactly the captured weights, data and random state in {d.precision}, the step "
                f"failed only the {which} time: the same computation gives different results from run to run."
            )
        else:
            head = (
                f"Replayed twice from exactly the captured weights, data and random state in {d.precision}, the step "
                "was finite both times: what training computed cannot be computed again from what it started with."
            )
        return head + (
            " So the failure is not caused by the weights, the data or the arithmetic of this step. Likely causes: "
            "nondeterminism (nondeterministic GPU kernels, a race, random numbers drawn from a source the capture does "
            "not hold), something outside the model's forward and backward (a callback or hook that changed values, "
            "memory corruption), or a hardware fault (a flipped bit, an overheating GPU)."
        )
    finite_in = [p for p, ok in d.reproduces_in.items() if not ok]
    failing_in = [p for p, ok in d.reproduces_in.items() if ok]
    det = "" if d.deterministic else (
        " The two replays in the captured precision disagree bitwise, though both fail: some kernels are nondeterministic."
    )
    if d.cause == PRECISION_INDUCED:
        return (
            f"It comes back every time in {d.precision} ({dtype}) and is finite in {', '.join(finite_in)}: the values "
            f"leave the range or precision of {dtype}, while the arithmetic is sound in wider types." + det
        )
    text = f"It comes back every time in {', '.join(failing_in)}"
    if "32-true" in failing_in:
        dtype = "float32"  # the widest type that fails is the one whose range the values exceed
    if finite_in:
        big = next((r for r in d.replays if r.precision in finite_in), None)
        mag = ""
        if big is not None and big.losses:
            mag = f" (loss {fmt_number(max(abs(x) for x in big.losses))}, gradient_norm {fmt_number(big.gradient_norm)})"
        text += (
            f", and only {', '.join(finite_in)} keeps it finite{mag}: the values exceed what {dtype} can hold. "
            "A wider type postpones the overflow; it does not fix the values"
        )
    else:
        text += ": the same arithmetic on the same data fails whatever the precision"
    return text + "." + det


def _op_kind(f: OpFinding) -> str:
    name = f.op_name
    if f.inputs_nonfinite:
        return "propagated"
    if f.origin == "inf":
        return "nan_from_inf"  # a NaN made from a deliberate Inf (a mask): see f.cause
    if f.phase == "backward" and f.forward_op and f.forward_op.startswith(("Sqrt", "Rsqrt", "Pow")):
        return "sqrt_grad"
    if name in ("log", "log2", "log10", "log1p", "xlogy", "_log_softmax", "log_softmax"):
        return "log"
    if name in ("div", "div_", "reciprocal", "true_divide", "remainder", "fmod"):
        return "div"
    if name in ("sqrt", "rsqrt") and f.output.nan:
        return "sqrt"
    if f.output.posinf or f.output.neginf:
        return "overflow"
    return "other"


#: Ops that normalise over a row: a row that is -inf everywhere makes them NaN.
_SOFTMAX_OPS = {"_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax", "logsumexp"}


def _chain_text(d: Diagnosis, f: OpFinding) -> str:
    """Where the value was born and what it came from, with the samples it was born on."""
    text = f.chain(rows=False)
    if f.rows:
        ix = d.traced_on.get("dataset_indices") if d.traced_on else None
        rows = (d.traced_on or {}).get("rows") or []
        indices = [ix[rows.index(r)] for r in f.rows if r in rows] if ix and rows else None
        text += ", on " + _samples_text([f.rows], [indices] if indices and len(indices) == len(f.rows) else None)
    return text


def _finding_text(f: OpFinding) -> str:
    kinds = [k for k, n in (("NaN", f.output.nan), ("+Inf", f.output.posinf), ("-Inf", f.output.neginf)) if n]
    grad = f" (the gradient of {f.forward_op})" if f.forward_op else ""
    return f"`{f.op}`{grad} in {f.where}, {f.phase} pass, {f.dtype}, gives {'/'.join(kinds)}"


def _damaged_before(d: Diagnosis) -> bool:
    """Whether the model state at the start of the step explains the failure: huge or
    non-finite weights, or non-finite buffers that the failing op read (a NaN in a buffer
    the forward pass does not use, such as BatchNorm's running statistics in training
    mode, does not make this step fail)."""
    w = d.weights
    if w.status == "huge" or w.nonfinite:
        return True
    return bool(w.nonfinite_buffers) and (d.origin == "buffers" or d.finding is None)


def _probable_cause(d: Diagnosis, cap: NaNCapture) -> str:
    w = d.weights
    if d.cause == NOT_REPRODUCIBLE:
        if d.reason == REASON_OTHER_RANK and len(cap.ranks) == 1:
            return "another rank's data failed; this rank only stopped with it"
        return "nondeterminism, an external cause or a hardware fault: the captured step does not fail again when replayed"
    if w.status == "nonfinite" and _damaged_before(d):
        if w.nonfinite:
            top = w.nonfinite[0]
            text = (f"the weights were already non-finite when the step began ({top.nonfinite} value(s) of {top.name}"
                    f"{'' if len(w.nonfinite) == 1 else f' and {len(w.nonfinite) - 1} other parameter(s)'}): "
                    "an earlier step did the damage")
        else:
            where = f" and {d.finding.op_name} in {d.finding.where} is the first op to read them" if d.finding else ""
            noun = "buffer" if len(w.nonfinite_buffers) == 1 else "buffers"
            text = (f"the {noun} {fmt_list(w.nonfinite_buffers, 3)} already held NaN/Inf when the step began{where}: "
                    "an earlier step's forward pass, which updates them, did the damage")
        if d.data.status == "isolated":
            text += f"; only the data that reaches them fails ({_samples_text(d.data.row_sets, d.data.index_sets)})"
        return text
    if w.status == "huge":
        top = w.largest[0]
        return (f"the weights were already huge when the step began (|w| up to {fmt_number(top.abs_max)} in {top.name}): "
                "training was diverging in earlier steps, most likely from a learning rate too high")
    f = d.finding
    data_text = ""
    if d.data.status == "isolated":
        data_text = f" for {_samples_text(d.data.row_sets, d.data.index_sets)}"
    if f is None and d.reason == REASON_NORM_OVERFLOW:
        return (f"finite gradients too large for a float32 norm ({_largest_text(cap)}){data_text}: no op produced "
                "a non-finite value, but the update would be huge")
    if f is None:
        return "the failure could not be traced to an op" + data_text
    kind = _op_kind(f)
    if kind == "propagated":
        if d.origin == "data":
            bad = _bad_input_text(d)
            return f"bad data: {bad}; {f.op_name} in {f.where} is only the first op to use it"
        if d.origin == "precision_conversion":
            dtype = advice.dtype_name(d.precision)
            return (f"the batch holds values beyond {dtype}'s range ({_out_of_range_text(d)}): {d.precision} converts "
                    f"the batch to {dtype}, which turns them into Inf before {f.op_name} in {f.where}")
        return f"a non-finite value reached {f.op_name} in {f.where} from outside the traced ops ({d.origin or 'unknown origin'})"
    if kind == "nan_from_inf":
        what = ("a softmax over a row that is masked everywhere has nothing left to normalise (an all-padding "
                "sample, a query with no allowed key)" if f.op_name in _SOFTMAX_OPS else
                "arithmetic turns a deliberate Inf into NaN (inf - inf, 0 * inf)")
        return f"NaN from a masking -Inf: {_chain_text(d, f)}: {what}" + ("" if f.rows else data_text)
    if d.cause == PRECISION_INDUCED:
        dtype = advice.dtype_name(d.precision)
        big = max((s.abs_max for s in f.inputs if math.isfinite(s.abs_max)), default=math.nan)
        if _precision_failure(f) == "rounding":
            zero = any(s.abs_min == 0 for s in f.inputs)
            kinds = "/".join(k for k, n in (("NaN", f.output.nan), ("+Inf", f.output.posinf), ("-Inf", f.output.neginf)) if n)
            lost = ("an input that is exactly 0 in " + dtype if zero else f"inputs that {dtype} has rounded")
            return (f"{dtype} rounding: {f.op_name} in {f.where} ({f.phase}) gives {kinds} from {lost}{data_text}; "
                    "the same step is finite in float32, which keeps that value")
        if f.phase == "backward" and d.precision == "16-mixed":
            return (f"{dtype} overflow in the backward pass ({f.op_name} in {f.where}) at loss scale "
                    f"{fmt_number(d.loss_scale or math.nan)}{data_text}: the gradients do not fit in {dtype}")
        return (f"{dtype} overflow: {f.op_name} in {f.where} ({f.phase}) turns inputs up to |{fmt_number(big)}| into "
                f"{'Inf' if f.output.posinf or f.output.neginf else 'NaN'}{data_text}; the same step is finite in float32")
    where = f" at {f.source}" if f.source else ""
    if kind == "log":
        return f"log of zero or of a negative number: {f.op_name} in {f.where}{where}{data_text}"
    if kind == "div":
        return f"division by zero: {f.op_name} in {f.where}{where}{data_text}"
    if kind == "sqrt":
        return f"square root of a negative number: {f.op_name} in {f.where}{where}{data_text}"
    if kind == "sqrt_grad":
        return (f"a finite forward pass with an infinite gradient: the derivative of {f.forward_op.replace('Backward0', '').lower()} "
                f"at 0 in {f.where}{where}{data_text}")
    if kind == "overflow":
        big = max((s.abs_max for s in f.inputs if math.isfinite(s.abs_max)), default=math.nan)
        return f"overflow: {f.op_name} in {f.where} ({f.phase}) turns inputs up to |{fmt_number(big)}| into Inf{data_text}"
    return f"{f.op_name} in {f.where} ({f.phase}) produced a non-finite value{data_text}"


def _precision_failure(f: OpFinding) -> str:
    """How a reduced precision broke an op with finite inputs: "overflow" (a value beyond
    the dtype's range) or "rounding" (a value rounded to 0, or to the wrong side of 0, that
    the op cannot take: log, division, square root, or its gradient)."""
    kind = _op_kind(f)
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


def _culprit_inputs(d: Diagnosis, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries of a data scan that belong to the culprit samples."""
    rows = set(d.data.rows or ((d.traced_on or {}).get("rows") or []))
    keys = set(d.data.microbatches)
    return [e for e in entries if (e["rank"], e["micro_step"]) in keys and (e["row"] is None or e["row"] in rows)]


def _sample_label(entry: dict[str, Any]) -> str:
    if entry["index"] is not None:
        return f"sample {entry['index']}"
    return f"row {entry['row']}" if entry["row"] is not None else f"microbatch {entry['micro_step']}"


def _bad_input_text(d: Diagnosis) -> str:
    parts = [f"{bad['field']} of {_sample_label(bad)} holds {bad['count']} non-finite value{'s' if bad['count'] > 1 else ''}"
             for bad in _culprit_inputs(d, d.data.nonfinite_inputs)]
    return ", ".join(parts[:3]) or "the input"


def _out_of_range_text(d: Diagnosis) -> str:
    parts = [f"{e['field']} of {_sample_label(e)} reaches {fmt_number(e['abs_max'])} in magnitude"
             for e in _culprit_inputs(d, d.data.out_of_range_inputs)]
    return ", ".join(parts[:3]) or "the data"


def _summary(d: Diagnosis, cap: NaNCapture) -> str:
    first = d.replays[0]
    n_mb = len(first.losses)
    ranks = f"rank {d.ranks[0]} of {d.world_size}" if len(d.ranks) == 1 else f"ranks {', '.join(map(str, d.ranks))} of {d.world_size}"
    n_params = len(cap.ranks[0].params)
    what = {
        "nonfinite_loss": "a non-finite loss",
        "nonfinite_gradients": "non-finite gradients",
        REASON_SKIPPED: f"fp16 loss scaling skipped steps in a row (loss scale {fmt_number(d.loss_scale or math.nan)})",
        REASON_OTHER_RANK: "a failure on another rank",
        REASON_NORM_OVERFLOW: "a gradient norm overflow",
    }.get(d.reason, d.reason)
    if d.reason == REASON_NORM_OVERFLOW:
        text = (f"Training stopped at step {d.step} ({ranks}, {d.precision}, {n_mb} microbatch(es)) on {what}: every "
                f"gradient element was finite, but {_largest_text(cap)}, and the float32 gradient norm was inf.")
    else:
        text = (f"Training stopped at step {d.step} ({ranks}, {d.precision}, {n_mb} microbatch(es)) on {what}; "
                f"{len(cap.nan_param_names)} of {n_params} parameters had NaN/Inf gradients.")
    if d.cause != NOT_REPRODUCIBLE:
        bad = [i for i, x in enumerate(first.losses) if not math.isfinite(x)]
        if not bad and not first.nan_param_names and not math.isfinite(first.gradient_norm):
            text += " The replay gives the same: finite losses and gradient elements, gradient norm inf."
            return text + (" Its losses are bitwise those of training." if d.matches_capture else "")
        if bad:
            text += f" The replay gives the same: losses {', '.join(fmt_number(first.losses[i]) for i in bad)} in microbatch(es) {', '.join(map(str, bad))}"
        else:
            text += " The replay gives the same: every loss is finite, but the backward pass is not"
        text += f", NaN/Inf gradients in {len(first.nan_param_names)} parameter(s)."
        if d.matches_capture:
            text += " Its losses are bitwise those of training."
    return text


def _largest_text(cap: NaNCapture) -> str:
    """'|gradient| reached 2.5e+19 in fc.weight', from a gradient_norm_overflow capture."""
    largest = next((r.largest_gradients for r in cap.ranks if r.largest_gradients), [])
    if not largest:
        return "the gradients were too large"
    name, value = largest[0]
    return f"|gradient| reached {fmt_number(value)} in {name}"


def _lr_text(settings: Optional[dict[str, Any]]) -> str:
    model_args = (settings or {}).get("model_args")
    lr = advice.positive(model_args.get("lr")) if isinstance(model_args, dict) else None
    if lr is None:
        return f"a {advice.LR_DECREASE}x lower learning rate (model_args.lr)"
    return f"{advice.lower_lr(lr)} or lower (was {advice.setting_value(lr)})"


def _next_actions(d: Diagnosis, cap: NaNCapture, out: Optional[Path]) -> list[str]:
    settings = cap.settings
    lr = _lr_text(settings)
    clip = advice.clip(settings.get("gradient_clip_val") if settings else None, known=bool(settings))
    resume = "rerun your training command with resume_interrupted=true"
    actions: list[str] = []
    w = d.weights
    if d.cause == NOT_REPRODUCIBLE:
        if d.reason == REASON_OTHER_RANK and len(cap.ranks) == 1:
            return [f"Diagnose all ranks together: stabletrain diagnose {cap.ranks[0].path.parent.parent}"]
        last = f" ({out / 'checkpoints' / 'last.ckpt'} holds no NaN: nancapture stopped before the optimizer step)" if out else ""
        return [
            f"Rerun from the last checkpoint: {resume}{last}. A sporadic failure usually does not recur at the same step.",
            "If it fails again at another step, localise it while it happens: debug_args.underflow_overflow.enabled=true "
            "shows the first module that goes non-finite.",
            "On a GPU: make kernels deterministic (torch.use_deterministic_algorithms(True)) and check the hardware "
            "(nvidia-smi -q for ECC errors, temperatures); replay the capture on the original machine "
            f"({_replay_command(cap)} --device cuda).",
        ]
    if _damaged_before(d):
        buffers_only = not w.nonfinite and w.status != "huge"
        state = "weights and buffers" if buffers_only else "weights"
        if buffers_only:
            lr = "the same settings"  # the optimizer does not write buffers: the learning rate is not implicated
        if w.healthy_checkpoint:
            ck = next(c for c in w.checkpoints if c["path"] == w.healthy_checkpoint)
            last = Path(w.healthy_checkpoint).parent / "last.ckpt"
            where = ("" if Path(w.healthy_checkpoint).name == "last.ckpt" else
                     f"copy {w.healthy_checkpoint} over {last}, then ")
            actions.append(
                f"Resume from before the damage: the newest checkpoint with healthy {state} is step {ck['step']} "
                f"(|w| up to {fmt_number(ck['abs_max'])}); {where}{resume} and {lr}."
            )
        elif w.checkpoints:
            actions.append(
                f"No checkpoint of this run has healthy {state} (all reach |w| >= {fmt_number(w.threshold)} or hold NaN): "
                f"start again with overwrite=true and {lr}."
            )
        elif out is not None and out.is_dir():
            actions.append(
                f"No checkpoint of this run was found under {out / 'checkpoints'} (written before step {cap.step}): "
                f"start again with overwrite=true and {lr}."
            )
        else:
            actions.append(f"Resume from a checkpoint written before the {state} went bad ({resume}) with {lr}.")
        optimizer = ((settings or {}).get("model_args") or {}).get("optimizer")
        if d.precision == "16-true" and w.nonfinite and optimizer in (None, "adamw"):
            # Not the learning rate: in float16, Adam divides by sqrt(v) + eps with both rounded to 0.
            actions.append(
                f"With precision=16-true the optimizer runs in float16 too: {'AdamW' if optimizer else 'an Adam-type optimizer'}'s "
                "second moment (the squared gradient) underflows to 0 for small gradients and its eps=1e-8 is 0 in "
                "float16, so the update divides by 0 and writes Inf into the weights. Train with precision=16-mixed or "
                "precision=bf16-mixed (float32 master weights and optimizer state) or precision=32-true."
            )
        if w.nonfinite or w.status == "huge":
            actions.append(f"Keep single steps from blowing the weights up: {clip}.")
        else:
            # Buffers are not trained by the optimizer: clipping gradients does not protect them.
            actions.append(
                f"Find what put NaN/Inf into {fmt_list(w.nonfinite_buffers, 3)}: the forward pass updates them from the data "
                f"(running statistics), so a batch with huge or non-finite values before step {cap.step} can corrupt them "
                "without a non-finite loss; guard the update (skip non-finite batch statistics) or check that data."
            )
    elif d.cause == PRECISION_INDUCED:
        f = d.finding
        dtype = advice.dtype_name(d.precision)
        failure = _precision_failure(f) if f is not None and not f.inputs_nonfinite else None
        if d.origin == "precision_conversion":
            largest = torch.finfo(torch.float16 if dtype == "float16" else torch.bfloat16).max
            actions.append(
                f"Train with precision=bf16-mixed or precision=32-true, which keep the batch in float32: {d.precision} "
                f"converts every input to {dtype}, whose largest value is {largest:.6g}."
            )
            image = (settings or {}).get("task") == "image_classification"
            actions.append(
                f"Or keep {d.precision} and scale the inputs into {dtype}'s range: {_out_of_range_text(d)}"
                + (" (transform_args.normalize)." if image else " (normalise them in the data pipeline).")
            )
        elif failure == "rounding":
            actions.append(
                f"Train with precision=32-true: {dtype} keeps only about 3 significant digits, and {f.op_name} gets a "
                f"value that float32 keeps but {dtype} rounds away"
                + (" (if it is a tiny value that underflows rather than a lost digit: float16 flushes values below "
                   "6e-08 to 0, and precision=bf16-mixed, with float32's range, works too)." if dtype == "float16" else ".")
            )
        elif d.precision == "16-mixed" and f is not None and f.phase == "backward":
            actions.append(
                f"Train with precision=bf16-mixed (float32's range, no loss scaling needed) or precision=32-true: "
                f"the float16 gradients overflow even at loss scale {fmt_number(d.loss_scale or math.nan)}."
            )
        elif d.precision == "16-mixed":
            actions.append(
                "Train with precision=bf16-mixed (same exponent range as float32; GPUs with bfloat16 support) or "
                "precision=32-true: a float16 activation exceeds 65504, which loss scaling cannot help."
            )
        elif d.precision == "16-true" and f is not None and f.phase == "backward":
            actions.append(
                "Train with precision=16-mixed (float32 master weights, and dynamic loss scaling that keeps float16 "
                "gradients in range), precision=bf16-mixed (float32's range, no loss scaling needed) or precision=32-true: "
                "float16 gradients leave float16's range (now 16-true)."
            )
        elif d.precision == "16-true":
            actions.append(
                "Train with precision=bf16-mixed (float32's range) or precision=32-true: a float16 value exceeds 65504 in "
                "the forward pass. precision=16-mixed (float32 master weights, dynamic loss scaling) helps only if autocast "
                "runs this op in float32; its loss scaling acts on gradients, not on activations (now 16-true)."
            )
        else:  # bfloat16 has float32's range: an overflow in it alone is at float32's edge too
            actions.append(f"Train with precision=32-true: the values reach the edge of {dtype}'s range.")
        if f is not None and f.source and f.phase == "forward" and d.origin != "precision_conversion":
            if failure == "rounding":
                actions.append(
                    f"Or keep {d.precision} and compute the value that loses its precision in float32 (x.float()) or in "
                    "a stable form (F.logsigmoid(-z) for log(1 - sigmoid(z)), torch.log1p(x) for log(1 + x), "
                    f"x.clamp_min(eps) before log, division or sqrt) at {f.source}."
                )
            else:
                actions.append(f"Or keep {d.precision} and keep the value in range where it grows: {f.source}.")
        if d.reason == REASON_SKIPPED:
            skipped = cap.ranks[0].raw.get("consecutive_skipped_steps")
            limit = ((settings or {}).get("debug_args") or {}).get("nancapture", {}).get("max_skipped_steps")
            if isinstance(skipped, int) and skipped:
                actions.append(
                    f"If training had only just started, the GradScaler may still have been lowering its initial scale "
                    f"(it skips a step each time it halves it): allow more skipped steps in a row with "
                    f"debug_args.nancapture.max_skipped_steps={2 * skipped}"
                    + (f" (was {limit})." if limit else f" (now {skipped}).")
                )
    else:
        f = d.finding
        kind = _op_kind(f) if f is not None else "other"
        samples = _samples_text(d.data.row_sets, d.data.index_sets) if d.data.status == "isolated" else ""
        one = bool(samples) and sum(len(r) for r in d.data.row_sets) == 1
        verb = (lambda plural: plural + "s") if one else (lambda plural: plural)  # noqa: E731
        src = f" at {f.source}" if f is not None and f.source else ""
        if f is None and d.reason == REASON_NORM_OVERFLOW:
            actions.append(f"Keep the gradients in range ({_largest_text(cap)}): lower the learning rate ({lr}) and "
                           f"clip ({clip}) if they grew over steps; if {samples or 'the data'} is an outlier (an input "
                           "far out of scale), fix or normalise it.")
        elif kind == "propagated" and d.origin == "data":
            actions.append(
                f"Fix or drop {samples or 'the bad samples'}: {_bad_input_text(d)}, and NaN/Inf in the data reaches "
                "the loss whatever the precision or learning rate. Check the data pipeline that produced it."
            )
            if (settings or {}).get("task") == "image_classification":
                actions.append("Check transform_args (transform_args.normalize.std must be well above 0 for every channel).")
        elif kind == "log":
            actions.append(f"Guard the logarithm{src}: torch.log(x.clamp_min(1e-12)) (or log1p / log_softmax) — "
                           f"{samples or 'the data'} {verb('drive')} its argument to 0 or below.")
        elif kind == "div":
            actions.append(f"Guard the division{src}: divide by x.clamp_min(1e-12) or x + 1e-12 (keeping the sign) — "
                           f"{samples or 'the data'} {verb('make')} the denominator 0.")
        elif kind == "sqrt":
            actions.append(f"Guard the square root{src}: torch.sqrt(x.clamp_min(0)) — {samples or 'the data'} {verb('make')} its argument negative.")
        elif kind == "sqrt_grad":
            actions.append(f"Make the derivative finite{src}: torch.sqrt(x + 1e-12) instead of torch.sqrt(x) — its gradient "
                           f"1/(2 sqrt(x)) is infinite at x = 0, where {samples or 'the data'} {verb('put')} it.")
        elif kind == "overflow":
            actions.append(f"Activations overflow{src}: lower the learning rate ({lr}) and bound updates ({clip}).")
        elif kind == "nan_from_inf" and f is not None and f.op_name in _SOFTMAX_OPS:
            actions.append(
                f"Keep at least one unmasked position in every row{src}: {samples or 'some samples'} "
                f"{verb('leave')} a row masked everywhere (an all-padding sequence, a key_padding_mask row that is all "
                "True). Drop such samples, or make fully masked rows finite before the softmax (mask with "
                "torch.finfo(dtype).min instead of -inf, or scores.masked_fill(mask.all(-1, keepdim=True), 0))."
            )
        elif kind == "nan_from_inf" and f is not None:
            actions.append(f"Keep the masking -Inf out of arithmetic{src}: {f.chain(rows=False)}. Mask with "
                           "torch.finfo(dtype).min instead of -inf, or apply the mask after this op.")
        else:
            actions.append(f"Inspect {f.op_name if f else 'the failing op'}{src}; lower the learning rate ({lr}) if values grow over steps.")
        if samples and kind not in ("propagated",) and d.data.status == "isolated":
            actions.append(f"Look at {samples}: what sets {'it' if one else 'them'} apart (an outlier, an "
                           "empty or constant input) is what the guard must handle.")
        if (settings or {}).get("precision") not in (None, "32-true") and d.precision in advice.REDUCED_PRECISIONS:
            actions.append(f"The failure is independent of precision; keep precision={d.precision}.")
    if d.data.approximate:
        actions.append("Confirm the culprit samples in a full batch: BatchNorm makes their isolation approximate.")
    actions.append(f"Replay the step yourself: {_replay_command(cap)}")
    return actions


def _replay_command(cap: NaNCapture) -> str:
    """The command the capture's error message showed (it names your model), else a plain one."""
    stored = cap.ranks[0].raw.get("replay_command")
    if isinstance(stored, str) and stored.startswith("stabletrain replay ") and (len(cap.ranks) == 1 or cap.world_size > 1):
        return stored
    return f"stabletrain replay {shell_path(cap.path)}"


def _samples_text(sets: list[list[int]], index_sets: Optional[list[list[int]]]) -> str:
    if index_sets:
        flat = [i for s in index_sets for i in s]
        if len(flat) == 1:
            return f"the sample at dataset index {flat[0]}"
        return f"the samples at dataset indices {fmt_list(flat, 8)}"
    flat = [r for s in sets for r in s]
    return f"row {flat[0]}" if len(flat) == 1 else f"rows {fmt_list(flat, 8)}"


def _keys_text(keys: Sequence[MicrobatchKey]) -> str:
    ranks = {r for r, _ in keys}
    if len(ranks) <= 1:
        return ", ".join(str(m) for _, m in keys)
    return ", ".join(f"{m} (rank {r})" for r, m in keys)


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------


def _render(d: Diagnosis) -> str:
    ranks = f"rank {d.ranks[0]}" if len(d.ranks) == 1 else f"ranks {', '.join(map(str, d.ranks))}"
    lines = [
        f"# Diagnosis of step {d.step} ({ranks}): {d.path}",
        "",
        f"**Verdict: {d.cause_title}** — {d.probable_cause}.",
        "",
        "## What happened",
        "",
        d.summary,
        "",
        "## Where",
        "",
    ]
    f = d.finding
    if f is not None:
        lines.append(f"First harmful non-finite op: {_finding_text(f)}.")
        lines.append("")
        for s in f.inputs:
            counts = ", ".join(f"{n} {k}" for k, n in (("NaN", s.nan), ("+Inf", s.posinf), ("-Inf", s.neginf)) if n)
            flag = f" — already non-finite: {counts}" if s.nonfinite else ""
            mag = (f"abs min {fmt_number(s.abs_min)}, abs max {fmt_number(s.abs_max)}" if math.isfinite(s.abs_max)
                   else "no finite value")
            lines.append(f"- input {s.index}: {s.dtype} {list(s.shape)}, {mag}{flag}")
        if f.source:
            lines.append(f"- source: `{f.source}`")
        if f.outside_forward:
            lines.append("- ran outside every module's forward: in training_step, the step function or the training loop")
        if f.phase == "backward" and f.forward_op:
            lines.append(f"- differentiates `{f.forward_op}`, created in the forward pass"
                         + ("" if f.outside_forward else f" of {f.where}"))
        if f.origin == "inf" or (f.reached == "gradient" and f.phase == "forward"):
            reached = f"; it reached the {f.reached}" + (" in the backward pass" if f.reached == "gradient" else "")
            lines.append(f"- origin: {_chain_text(d, f)}{reached if f.reached else ''}")
        if d.origin:
            origin = {
                "data": f"the data ({_bad_input_text(d)})",
                "weights": "the weights, non-finite at the start of the step",
                "buffers": f"buffers ({', '.join(d.weights.nonfinite_buffers[:3])})",
                "precision_conversion": f"the conversion of the batch to {advice.dtype_name(d.precision)} "
                                        f"({_out_of_range_text(d)})",
            }.get(d.origin, d.origin)
            lines.append(f"- its input was already non-finite: it came from {origin}")
        if d.traced_on:
            t = d.traced_on
            what = f"microbatch(es) {_keys_text(t['microbatches'])}"
            if t.get("rows"):
                what += f", rows {t['rows']}" + (f" (dataset indices {t['dataset_indices']})" if t.get("dataset_indices") else "")
            lines.append(f"- traced on {what}, in {d.precision}")
    elif d.cause == NOT_REPRODUCIBLE:
        lines.append("Not traced: the failure does not come back when the step is replayed.")
    else:
        lines.append("No non-finite value reached the loss or a gradient when the culprit subset was traced.")
    lines += ["", "## Why", ""]
    lines.append("| replay | precision | result | losses | gradient_norm |")
    lines.append("|---|---|---|---|---|")
    for r in d.replays:
        res = "fails" if r.reproduced else "finite"
        lines.append(f"| {r.label} | {r.precision} | {res} | {fmt_list(r.losses, 4, fmt_number)} | {fmt_number(r.gradient_norm)} |")
    lines += ["", f"**{d.cause_title}**: {d.cause_explanation}"]
    if d.matches_capture is False and d.cause != NOT_REPRODUCIBLE:
        lines.append("")
        lines.append("Note: the replayed losses differ in their last bits from those training logged "
                     "(another device, library version, or nondeterministic kernels).")
    lines += ["", "## Which data", ""]
    data = d.data
    lines.append(data.note[:1].upper() + data.note[1:] + "." if data.note else "-")
    if data.status in ("isolated", "not_data_specific") and data.microbatches:
        extra = f" ({data.replays} subset replay(s), {data.check} checks)"
        lines[-1] += extra
    bad_in = [b for b in data.nonfinite_inputs]
    if bad_in:
        shown = ", ".join(
            (f"sample {b['index']}" if b["index"] is not None else f"microbatch {b['micro_step']} row {b['row']}")
            + f" {b['field']} ({b['count']})" for b in bad_in[:5])
        lines.append(f"- non-finite values already in the captured data: {shown}{' ...' if len(bad_in) > 5 else ''}")
    for c in data.caveats:
        lines.append(f"- caveat: {c}")
    lines += ["", "## Before or during the step", ""]
    w = d.weights
    if w.status == "healthy":
        lines.append(f"The weights were healthy when the step began (all finite, |w| below {fmt_number(w.threshold)}): the step itself failed.")
    elif w.status == "huge":
        lines.append(f"The weights were already huge when the step began (|w| >= {fmt_number(w.threshold)}): the damage happened in earlier steps.")
    elif w.nonfinite:
        names = ", ".join(f"{p.name} ({p.nonfinite})" for p in w.nonfinite[:4])
        lines.append(f"The weights already held NaN/Inf when the step began: {names}. The damage happened in earlier steps.")
    else:
        lines.append(f"The weights were finite, but buffers already held NaN/Inf when the step began: "
                     f"{fmt_list(w.nonfinite_buffers, 4)}. The damage happened in earlier steps"
                     + ("." if _damaged_before(d) else ", though the failure traces back to something else (see Where)."))
    lines.append("")
    lines.append("Largest weights: " + ", ".join(
        f"{p.name} {fmt_number(p.abs_max)}" + (f" (and {p.nonfinite} NaN/Inf)" if p.nonfinite else "") for p in w.largest) + ".")
    if w.nonfinite_buffers and w.nonfinite:
        lines.append(f"Non-finite buffers: {', '.join(w.nonfinite_buffers[:5])}.")
    if w.checkpoints:
        lines.append("Checkpoints: " + ", ".join(
            f"step {c['step']} |w| {fmt_number(c['abs_max'])}" + (
                "" if c["healthy"] else " (bad)" if not c["abs_max"] < w.threshold else " (non-finite buffers)")
            for c in w.checkpoints) + ".")
    if d.history:
        lines.append("Last logged steps: " + ", ".join(
            f"{h.get('step')}: loss {fmt_number(h.get('loss'))} grad_norm {fmt_number(h.get('gradient_norm'))}" for h in d.history) + ".")
    lines += ["", "## Next actions", ""]
    lines += [f"{i}. {a}" for i, a in enumerate(d.next_actions, 1)]
    lines += ["", "Diagnosed in " + ", ".join(f"{k} {v:.2f}s" for k, v in d.timings.items())
              + f" = {sum(d.timings.values()):.1f}s on {d.device}."]
    return "\n".join(lines)


def _key_dict(key: MicrobatchKey) -> dict[str, int]:
    return {"rank": key[0], "micro_step": key[1]}


def _output_folder(cap: NaNCapture) -> Path:
    """Next to the capture: the rank folder, or for several ranks the folder holding them."""
    first = cap.ranks[0].path.parent
    return first if len(cap.ranks) == 1 else first.parent
