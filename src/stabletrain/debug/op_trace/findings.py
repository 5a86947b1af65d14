"""What the op tracer reports: :class:`OpFinding` (where a harmful NaN or Inf was born, and its chain of
origins) and :class:`TensorStat` (the statistics of one tensor). See ``docs/diagnose.md``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

#: Kinds of non-finite values, tracked separately.
NAN, POSINF, NEGINF = "NaN", "+Inf", "-Inf"
KINDS = (NAN, POSINF, NEGINF)

#: Where a value no traced op made comes from.
INPUT_SOURCES = ("data", "weight", "buffer", "untracked")


@dataclass
class TensorStat:
    """Abs min/max of one tensor argument of an op (computed in float64 on finite entries)."""

    index: int
    dtype: str
    shape: list[int]
    abs_min: float
    abs_max: float
    nan: int
    posinf: int
    neginf: int

    @property
    def nonfinite(self) -> bool:
        return bool(self.nan or self.posinf or self.neginf)


@dataclass
class OpFinding:
    """Where a harmful NaN or Inf was born (or, for one no traced op made, first used).

    Attributes:
        op: The aten op, e.g. ``aten.log.default``.
        phase: "forward" or "backward".
        module: Module path in the user's names ("" is the root module); for a backward op,
            the module whose forward created the node being differentiated.
        module_type: Class name of that module.
        outside_forward: True when the op (or, in backward, the node it differentiates) ran
            outside every module's ``forward``: in ``training_step``, a step function or the
            training loop; ``module`` is then "" (the root).
        dtype: dtype of the bad output.
        output: Statistics of the bad output.
        inputs: Statistics of each tensor input, in argument order.
        inputs_nonfinite: True when the op only passed on a NaN/Inf it did not make: one that no
            traced op made (``source`` says where it was: the data, a weight, a buffer).
        source: ``file:line: code`` of the model source that called the op (forward), or that
            created the differentiated node (backward), where it could be found.
        forward_op: For backward ops, the autograd node, e.g. ``SqrtBackward0``.
        op_index: Number of aten ops that ran before it in the traced call.
        kind: The value this finding is about: "NaN", "+Inf" or "-Inf".
        origin: How it came about: "op" (the op made it from finite inputs), "inf" (a NaN the
            op made from Inf values: see ``cause``), or, when ``inputs_nonfinite``, where the
            value already was: "data", "weight", "buffer", "untracked" (a tensor made before
            or outside the traced ops).
        input_name: For "data", "weight", "buffer": which tensor (``batch['x']``, ``fc.weight``).
        cause: For origin "inf": the finding of the Inf the NaN was made from.
        written: The op wrote an infinite constant it was given (``masked_fill(-inf)``,
            ``full(-inf)``, ``scalar_tensor(-inf)``).
        deliberate: The Inf is there on purpose, as in an attention mask: written from an
            infinite constant, or held in a tensor no traced op made (the data, a buffer) whose
            values are only 0 and -inf (an additive mask). A NaN made from a deliberate Inf is
            reported where it is made; from any other Inf (an overflow, log(0)), at that Inf.
        rows: Rows of the batch (the traced samples) whose values are bad here, when the
            tensor has a batch dimension.
        reached: Where it did harm: "loss" or "gradient" (None when reported without either).
    """

    op: str
    phase: str
    module: str
    module_type: str
    dtype: str
    output: TensorStat
    inputs: list[TensorStat] = field(default_factory=list)
    inputs_nonfinite: bool = False
    source: Optional[str] = None
    forward_op: Optional[str] = None
    op_index: int = 0
    outside_forward: bool = False
    kind: str = ""
    origin: str = "op"
    input_name: Optional[str] = None
    cause: Optional["OpFinding"] = None
    written: bool = False
    deliberate: bool = False
    rows: Optional[list[int]] = None
    reached: Optional[str] = None

    @property
    def op_name(self) -> str:
        """The op without namespace and overload, e.g. ``log``."""
        parts = self.op.split(".")
        return parts[1] if len(parts) >= 2 else self.op

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["op_name"] = self.op_name
        data["chain"] = self.chain()
        return data

    @property
    def where(self) -> str:
        """``module (Type)``, or where the op ran when outside every module's forward."""
        if self.outside_forward:
            return f"{self.module_type} outside forward"
        return f"{self.module or '<root>'} ({self.module_type})"

    def chain(self, rows: bool = True) -> str:
        """Where the value came from, in words, e.g. ``NaN born in _softmax in attn (Attention),
        forward, from -Inf written by masked_fill in attn (Attention), forward, on rows [5]``."""
        what = self.kind or "/".join(_kinds_of_stat(self.output))
        if self.inputs_nonfinite:
            held = {"data": f"the data ({self.input_name})", "weight": f"the weight {self.input_name}",
                    "buffer": f"the buffer {self.input_name}",
                    }.get(self.origin, "a tensor that no traced op made (made before tracing, or a constant)")
            text = f"{what} already in {held}, first used by {self.op_name} in {self.where}, {self.phase}"
        else:
            verb = "written by" if self.written else "born in"
            text = f"{what} {verb} {self.op_name} in {self.where}, {self.phase}"
            if self.cause is not None:
                text += f", from {self.cause.chain(rows=False)}"
        if rows and self.rows:
            text += f", on row{'s' if len(self.rows) > 1 else ''} {_rows_text(self.rows)}"
        return text

    def describe(self) -> str:
        kinds = _kinds_of_stat(self.output)
        head = f"{self.op} in {self.where}, {self.phase}, {self.dtype}: output has {'/'.join(kinds)}"
        if self.forward_op:
            head += f"; gradient of {self.forward_op}"
        lines = [head]
        for s in self.inputs:
            flag = " NON-FINITE" if s.nonfinite else ""
            lines.append(
                f"  input[{s.index}] {s.dtype}{s.shape}: abs min {s.abs_min:.4g}, abs max {s.abs_max:.4g}{flag}"
            )
        if self.source:
            lines.append(f"  source: {self.source}")
        lines.append(f"  origin: {self.chain()}" + (f"; it reached the {self.reached}" if self.reached else ""))
        return "\n".join(lines)


def _kinds_of_stat(s: TensorStat) -> list[str]:
    return [k for k, n in ((NAN, s.nan), (POSINF, s.posinf), (NEGINF, s.neginf)) if n]


def _rows_text(rows: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, rows[:limit]))
    return f"[{shown}{', ...' if len(rows) > limit else ''}]"


def tensor_stat(t: torch.Tensor, index: int = 0) -> TensorStat:
    x = t.detach()
    if x.is_complex():
        x = x.abs()
    x = x.to(torch.float64)
    nan = int(torch.isnan(x).sum())
    posinf = int(torch.isposinf(x).sum())
    neginf = int(torch.isneginf(x).sum())
    finite = x[torch.isfinite(x)].abs()
    lo = float(finite.min()) if finite.numel() else math.nan
    hi = float(finite.max()) if finite.numel() else math.nan
    return TensorStat(index, str(t.dtype).replace("torch.", ""), list(t.shape), lo, hi, nan, posinf, neginf)


def pick_origin(candidates: list["OpFinding"]) -> "OpFinding":
    """Of several origins an output could be traced to, the one to name: an Inf made by
    arithmetic before one written on purpose (a mask), before one no traced op made."""
    return min(candidates, key=lambda f: (f.written, f.inputs_nonfinite))


def replace_index(stat: TensorStat, index: int) -> TensorStat:
    stat.index = index
    return stat
