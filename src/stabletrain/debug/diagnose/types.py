"""The facts a diagnosis is drawn from: the replays, the culprit data, the weights, and the cause classes.

:class:`Evidence` gathers them; :class:`~stabletrain.debug.diagnose.result.Diagnosis` adds the prose.
See ``docs/diagnose.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from stabletrain.debug.diagnose.damage import Damage
from stabletrain.debug.op_trace import OpFinding
from stabletrain.debug.replay import MicrobatchKey
from stabletrain.utils.text import json_float
from stabletrain.utils.tree import json_ready

#: Cause classes.
PRECISION_INDUCED = "precision_induced"
DETERMINISTIC_NUMERICAL = "deterministic_numerical"
NOT_REPRODUCIBLE = "not_reproducible"
CAUSE_TITLES = {
    PRECISION_INDUCED: "precision-induced",
    DETERMINISTIC_NUMERICAL: "deterministic numerical",
    NOT_REPRODUCIBLE: "not reproducible",
}

#: A weight whose magnitude reaches this is "huge": trained networks keep weights near 1
#: (normalisation gains, embeddings, projections are O(0.01-1)); 1e3 is far outside that
#: and well inside every float range, so it flags divergence before it becomes an overflow.
HUGE_WEIGHT = 1e3

#: Samples to replay: ``{microbatch: [row, ...]}``, as ``forward_backward(rows=...)`` takes them.
RowSelection = Mapping[Union[int, MicrobatchKey], Sequence[int]]


def key_dict(key: MicrobatchKey) -> dict[str, int]:
    """A (rank, micro_step) key as JSON."""
    return {"rank": key[0], "micro_step": key[1]}


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
        return {"name": self.name, "shape": self.shape, "abs_max": json_float(self.abs_max),
                "rms": json_float(self.rms), "nonfinite": self.nonfinite}


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
        damage: For non-finite weights: which earlier event made them so, from the run's
            ``metrics.jsonl`` (:mod:`~stabletrain.debug.diagnose.damage`), when it shows one.
    """

    status: str
    threshold: float
    largest: list[ParamStat]
    nonfinite: list[ParamStat]
    nonfinite_buffers: list[str]
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    healthy_checkpoint: Optional[str] = None
    damage: Optional[Damage] = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "threshold": self.threshold,
            "largest": [p.to_dict() for p in self.largest],
            "nonfinite": [p.to_dict() for p in self.nonfinite],
            "nonfinite_buffers": self.nonfinite_buffers,
            "checkpoints": [{**c, "abs_max": json_float(c["abs_max"])} for c in self.checkpoints],
            "healthy_checkpoint": self.healthy_checkpoint,
            "damage": None if self.damage is None else self.damage.to_dict(),
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
            "failing_microbatches": [key_dict(k) for k in self.failing_microbatches],
            "microbatches": [key_dict(k) for k in self.microbatches],
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
class Evidence:
    """What :func:`~stabletrain.debug.diagnose.diagnose` measured, before any of it is put into words.

    Attributes:
        path: The capture diagnosed.
        step, ranks, world_size, precision, loss_scale, reason, model_class: From the capture.
        device: Where the replays ran.
        cause: :data:`NOT_REPRODUCIBLE` when either replay in the captured precision is
            finite; else :data:`PRECISION_INDUCED` when the captured precision is reduced
            (16-mixed, bf16-mixed, 16-true, bf16-true) and the float32 replay is finite;
            else :data:`DETERMINISTIC_NUMERICAL` (float32 fails too, or the run was in
            32-true or 64-true). The float64 replay does not decide the class.
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
        history: The run's last logged metrics rows (step, loss, gradient_norm), when found.
        timings: Seconds per phase.
        mechanisms: The mechanisms the run's logged signals named before the captured step
            (:mod:`stabletrain.debug.mechanisms.rules`): why the values got there.
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
    deterministic: Optional[bool]
    matches_capture: Optional[bool]
    replays: list[ReplayOutcome]
    reproduces_in: dict[str, bool]
    finding: Optional[OpFinding]
    traced_on: Optional[dict[str, Any]]
    origin: Optional[str]
    data: DataReport
    weights: WeightsReport
    history: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    mechanisms: list[Any] = field(default_factory=list)

    @property
    def cause_title(self) -> str:
        return CAUSE_TITLES[self.cause]
