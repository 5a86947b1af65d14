"""Op-level tracing with provenance: where a harmful NaN or Inf is born, in forward or backward.

This is the offline, exact counterpart of the underflow/overflow monitor. A
``TorchDispatchMode`` sees every aten op of forward and backward; forward hooks on every
module give the module whose ``forward`` ran the op (so a functional op between two child
modules is blamed on the parent that ran it). For backward, each autograd node is tagged
(in its ``metadata``) with the module whose forward created it; during backward the node
being run is asked directly (``torch._C._current_autograd_node``), so a backward op is
named after the forward op and module it is the gradient of, and nodes created outside
every module's forward (the loss in ``training_step``, the loop's ``loss / accum``) are
reported as such instead of inheriting a neighbour's name. Every op's output is checked on
the host, so it is slow: use it on one captured step, not in training.

**Provenance, not op names.** Every op output that holds a NaN or an Inf gets an origin,
kept per tensor storage, for each kind of value (NaN, +Inf, -Inf):

* an op that makes the value where its inputs are finite is where it is *born* (log(0), an
  overflow, sqrt(-1), and also a deliberate ``masked_fill(-inf)`` or ``scalar_tensor(-inf)``);
* an op that makes a NaN from Inf values (``inf - inf``, a softmax over a row that is -inf
  everywhere) is where the NaN is born, *from* the Inf's origin;
* an op that passes values on (a view, a copy, an add, a matmul) keeps their origin; for
  elementwise ops this is decided per element;
* a NaN or Inf that no traced op made (in the data, a weight, a buffer registered in
  ``__init__``, a tensor made before tracing) is traced to that tensor, and to the first op
  that used it.

An op whose output is finite has neutralised the Infs it received (softmax, ``where``,
masking): nothing is kept and nothing is reported, however the Inf was built. What is
reported is a value that does harm, with its chain of origins: a non-finite loss (given to
:meth:`OpTracer.check_loss`; :func:`trace_first_nonfinite` does it) or a non-finite value in
the backward pass (a gradient). With no loss given, the first NaN born is reported.

Per sample: when a tensor's first dimension is the batch (or the batch times heads or tokens,
flattened batch-major), the rows that hold the bad values are reported (``rows``).

Example::

    finding, loss = trace_first_nonfinite(model, lambda: model.training_step(batch))
    if finding:
        print(finding.describe())   # e.g. NaN born in _softmax in attn ... from -Inf written by masked_fill ...
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

#: Owner of autograd nodes created outside every module's forward.
_OUTSIDE = ("", "")

#: Ops that return uninitialised memory, which may hold any bit pattern (NaN included) until
#: the next op writes it (dropout's mask is built in an ``empty_like``).
_UNINITIALISED_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted", "resize_"}

#: Ops that bring a constant written in the code (``torch.tensor(-inf)``) into the graph: the
#: constant's values are born there, not in a tensor "made outside the traced ops".
_CONSTANT_OPS = {"lift_fresh", "lift_fresh_copy"}

#: Elementwise copies that are not tagged pointwise: each output element comes from the same
#: input element (a float32 -> float16 cast that overflows is a birth, element by element).
_COPY_OPS = {"_to_copy", "copy_", "copy", "clone", "_copy_from", "_copy_from_and_resize"}

#: Kinds of non-finite values, tracked separately.
NAN, POSINF, NEGINF = "NaN", "+Inf", "-Inf"
_KINDS = (NAN, POSINF, NEGINF)

#: Where a value no traced op made comes from.
_INPUT_SOURCES = ("data", "weight", "buffer", "untracked")

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
# stabletrain's debugging tools (replay, diagnose) call the user's code; their frames are never the answer.
_DEBUG_DIR = os.path.dirname(_THIS_FILE) + os.sep
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(_THIS_FILE))) + os.sep  # .../src/ of stabletrain/


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
            lines.append(f"  input[{s.index}] {s.dtype}{s.shape}: abs min {s.abs_min:.4g}, abs max {s.abs_max:.4g}{flag}")
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


def _user_source(stack: list[traceback.FrameSummary]) -> Optional[str]:
    """The innermost frame outside torch and this module: the model code that called the op."""
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if path.startswith(_DEBUG_DIR) or path.startswith(_TORCH_DIR) or "/lightning_fabric/" in path:
            continue
        if frame.filename.startswith("<"):
            continue
        line = (frame.line or "").strip()
        return f"{_short_path(path)}:{frame.lineno}: {line}"
    return None


def _short_path(path: str) -> str:
    """``path`` relative to the working directory when below it (shorter in reports), a
    built-in model's file as ``stabletrain/...``, else absolute."""
    if path.startswith(_PACKAGE_PARENT):
        return path[len(_PACKAGE_PARENT):]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _anomaly_source(node: Any) -> Optional[str]:
    """The forward traceback anomaly mode stored on an autograd node, reduced to the user's line."""
    text = getattr(node, "metadata", {}).get("traceback_") if node is not None else None
    if not text:
        return None
    frames = []
    for entry in text if isinstance(text, list) else [text]:
        for line in str(entry).splitlines():
            line = line.strip()
            if line.startswith('File "'):
                try:
                    path, rest = line[6:].split('", line ', 1)
                    lineno = int(rest.split(",")[0])
                except ValueError:
                    continue
                frames.append(traceback.FrameSummary(path, lineno, "", lookup_line=True))
    return _user_source(frames)


class _Tracer(TorchDispatchMode):
    def __init__(self, owner: "OpTracer"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        owner = self.owner
        watching = owner.finding is None and owner.armed
        # An in-place op overwrites its input: keep a copy, so the report shows the input as
        # it was (finite) rather than the op's own non-finite result.
        before = _copy_written(func, args, kwargs) if watching and _writes(func) else None
        out = func(*args, **kwargs)
        owner.op_count += 1
        if watching:
            owner.inspect(func, args, kwargs, out, before=before)
        return out


#: Ops that update arguments in place without saying so in their schema: the running
#: statistics of batch norm (positions of the arguments written).
_UNDECLARED_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4), "miopen_batch_norm": (3, 4)}


def _writes(func: Any) -> bool:
    return func._schema.is_mutable or func.__name__.split(".")[0] in _UNDECLARED_WRITES


def _copy_written(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``args`` and ``kwargs`` with the tensors ``func`` writes to, and every argument sharing
    their memory (``h.add_(h)``), replaced by copies."""
    args, kwargs = list(args), dict(kwargs)
    written = set()
    undeclared = _UNDECLARED_WRITES.get(func.__name__.split(".")[0], ())
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if (info is None or not info.is_write) and i not in undeclared:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            written.add(_storage_ptr(value))
    written.discard(None)
    if not written:
        return tuple(args), kwargs

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and _storage_ptr(value) in written:
            return value.detach().clone()
        return value

    return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}


def _storage_ptr(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel() > 0


def _magnitude(t: torch.Tensor) -> torch.Tensor:
    return t.abs() if t.is_complex() else t


def _kinds(t: torch.Tensor) -> list[str]:
    """The kinds of non-finite values ``t`` holds (one host read)."""
    x = _magnitude(t.detach())
    flags = torch.stack([torch.isnan(x).any(), torch.isposinf(x).any(), torch.isneginf(x).any()]).tolist()
    return [k for k, f in zip(_KINDS, flags) if f]


def _kind_mask(t: torch.Tensor, kind: str) -> torch.Tensor:
    x = _magnitude(t.detach())
    return torch.isnan(x) if kind == NAN else torch.isposinf(x) if kind == POSINF else torch.isneginf(x)


_POINTWISE: dict[Any, bool] = {}


def _elementwise(func: Any) -> bool:
    """Whether each output element of ``func`` comes from the input elements at the same
    (broadcast) position: ops tagged pointwise, their in-place forms, and plain copies."""
    hit = _POINTWISE.get(func)
    if hit is None:
        name = func.__name__.split(".")[0]
        hit = torch.Tag.pointwise in func.tags or name in _COPY_OPS
        if not hit and name.endswith("_"):  # in-place forms are not always tagged
            packet = getattr(torch.ops.aten, name[:-1], None)
            overload = getattr(packet, func._overloadname, None) if packet is not None else None
            hit = overload is not None and torch.Tag.pointwise in overload.tags
        _POINTWISE[func] = hit
    return hit


def _infinite_constant(flat_args: list[Any]) -> bool:
    """Whether the op was given an infinite number to write (a Python scalar or a one-element tensor)."""
    for a in flat_args:
        if isinstance(a, float) and math.isinf(a):
            return True
        if isinstance(a, torch.Tensor) and a.numel() == 1 and a.is_floating_point() and bool(torch.isinf(a).all()):
            return True
    return False


def is_additive_mask(t: torch.Tensor) -> bool:
    """Whether ``t`` holds only 0 and -inf: an additive attention mask, judged by its values
    (a NaN or an Inf in such a tensor is there on purpose)."""
    x = t.detach()
    if x.is_complex() or x.dtype == torch.bool:
        return False
    return bool(((x == 0) | torch.isneginf(x)).all())


def _pick(candidates: list["OpFinding"]) -> "OpFinding":
    """Of several origins an output could be traced to, the one to name: an Inf made by
    arithmetic before one written on purpose (a mask), before one no traced op made."""
    return min(candidates, key=lambda f: (f.written, f.inputs_nonfinite))


class _Input:
    """A non-finite tensor argument of the op being inspected."""

    __slots__ = ("now", "was", "kinds", "broadcast")

    def __init__(self, now: torch.Tensor, was: torch.Tensor):
        self.now = now  # the argument itself (its storage holds the origins)
        self.was = was  # its values before the op ran (differs for in-place ops)
        self.kinds = _kinds(was)
        self.broadcast: Optional[torch.Tensor] = None


class _Op:
    """What one op with a non-finite output is: shared by the findings made for it."""

    def __init__(self, tracer: "OpTracer", func: Any, args: Any, kwargs: Any, before: Any):
        self.tracer = tracer
        self.func = func
        self.op = str(func)
        b_args, b_kwargs = before if before is not None else (args, kwargs)
        self.flat_now = tree_flatten((args, kwargs))[0]
        self.flat_was = tree_flatten((b_args, b_kwargs))[0]
        self.in_backward = torch._C._current_graph_task_id() != -1
        self.op_index = tracer.op_count - 1
        self._common: Optional[dict[str, Any]] = None

    def common(self) -> dict[str, Any]:
        """Fields every finding of this op shares (computed once, only when one is made)."""
        if self._common is None:
            t = self.tracer
            root_type = type(t.model).__name__
            if self.in_backward:
                node = torch._C._current_autograd_node()
                owner = node.metadata.get(t._key) if node is not None else None
                outside = owner is None or owner == _OUTSIDE
                module, type_name = ("", root_type) if outside else owner
                source = _anomaly_source(node)
                forward_op = node.name() if node is not None else None
            else:
                outside = not t._stack
                module, type_name = t._stack[-1] if t._stack else ("", root_type)
                source = _user_source(traceback.extract_stack())
                forward_op = None
            floats = [a for a in self.flat_was
                      if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())]
            self._common = dict(
                op=self.op, phase="backward" if self.in_backward else "forward", module=module, module_type=type_name,
                inputs=[tensor_stat(a, i) for i, a in enumerate(floats)], source=source, forward_op=forward_op,
                op_index=self.op_index, outside_forward=outside,
            )
        return self._common

    def finding(self, bad: torch.Tensor, kind: str, origin: str, cause: Optional[OpFinding] = None,
                input_name: Optional[str] = None, rows_of: Optional[torch.Tensor] = None) -> OpFinding:
        passed_on = origin in _INPUT_SOURCES
        written = origin == "op" and kind != NAN and _infinite_constant(self.flat_was)
        if origin in ("data", "buffer", "untracked"):
            # A tensor of only 0 and -inf is an additive mask; other Infs in it are damage.
            deliberate = rows_of is not None and kind == NEGINF and is_additive_mask(rows_of)
        else:
            deliberate = written
        return OpFinding(
            **self.common(), dtype=str(bad.dtype).replace("torch.", ""), output=tensor_stat(bad),
            inputs_nonfinite=passed_on, kind=kind, origin=origin, input_name=input_name, cause=cause,
            written=written, deliberate=deliberate and kind != NAN,
            # Where the op made them: all its non-finite rows, or the positions given.
            rows=self.tracer._rows(rows_of, kind) if rows_of is not None else self.tracer._rows(bad),
        )


class OpTracer:
    """Context manager that traces where NaN/Inf values are born and reports the first one
    that does harm (see the module docstring).

    Args:
        model: The module whose submodule names are reported.
        check_backward: Also trace the backward pass (needs anomaly mode for source lines).
        armed: Inspect ops from the start; with False, ops are only counted until
            :meth:`arm` is called (e.g. a replay arms it once the captured state is loaded,
            so that restoring non-finite weights is not reported as the failing op).

    Example::

        with OpTracer(model) as tracer:
            tracer.watch_batch(batch)             # optional: name the data and its rows
            loss = model.training_step(batch)
            tracer.check_loss(loss)               # a non-finite loss is reported with its origin
            loss.backward()                       # ... else the first non-finite gradient
        print(tracer.finding.describe() if tracer.finding else "all finite")
    """

    def __init__(self, model: nn.Module, check_backward: bool = True, armed: bool = True):
        self.model = model
        self.check_backward = check_backward
        self.armed = armed
        self.finding: Optional[OpFinding] = None
        self.op_count = 0
        #: Samples in the traced batch (from :meth:`watch_batch` or the model's first input).
        self.batch_size: Optional[int] = None
        self._stack: list[tuple[str, str]] = []
        # Autograd nodes are tagged in their own metadata (not by id(): ids of freed nodes are reused).
        self._key = f"stabletrain.op_trace.owner.{id(self)}"
        self._handles: list[Any] = []
        self._anomaly: Any = None
        self._mode: Optional[_Tracer] = None
        # Origins per storage, for each kind of value; a weak reference tells a storage that
        # was freed (and whose memory may hold a new tensor) from a live one.
        self._records: dict[int, tuple[Any, dict[str, OpFinding]]] = {}
        # Tensors no traced op makes: weights, buffers and the data, by storage.
        self._known: dict[int, tuple[Any, str, str]] = {}
        self._first_nan: Optional[OpFinding] = None
        self._loss_checked = False

    # -- what the tensors are ----------------------------------------------------------
    def arm(self) -> None:
        """Start inspecting ops (see ``armed``)."""
        self.armed = True
        self._register_model()

    def _register_model(self) -> None:
        # Registered when armed: a replay replaces the parameters' storages before that.
        for name, p in self.model.named_parameters():
            self._know(p, "weight", name)
        for name, b in self.model.named_buffers():
            self._know(b, "buffer", name)

    def _know(self, t: torch.Tensor, source: str, name: str) -> None:
        ptr = _storage_ptr(t)
        if ptr is not None and ptr not in self._known:
            self._known[ptr] = (StorageWeakRef(t.untyped_storage()), source, name)

    def watch_batch(self, batch: Any, prefix: str = "batch") -> None:
        """Name the tensors of ``batch`` (as ``batch['x']``) for NaN/Inf found in them, and
        take its first dimension as the batch for per-sample rows."""
        leaves, _ = tree_flatten_with_path(batch)
        for path, t in leaves:
            if isinstance(t, torch.Tensor):
                if self.batch_size is None and t.ndim:
                    self.batch_size = int(t.shape[0])
                self._know(t, "data", prefix + keystr(path))

    def _rows(self, t: torch.Tensor, kind: Optional[str] = None) -> Optional[list[int]]:
        """Rows of the batch where ``t`` holds non-finite values (of ``kind``), when ``t`` has a
        batch dimension first (or the batch flattened with heads or tokens, batch-major)."""
        n = self.batch_size
        if not n or t.ndim == 0 or t.shape[0] % n:
            return None
        if t.dtype == torch.bool:  # already the mask of bad elements
            bad = t
        else:
            bad = _kind_mask(t, kind) if kind else ~torch.isfinite(_magnitude(t.detach()))
        per_row = bad.reshape(t.shape[0], -1).any(1).nonzero().flatten()
        return sorted(set((per_row // (t.shape[0] // n)).tolist()))

    # -- module tracking -----------------------------------------------------------
    def _pre(self, name: str, type_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not self._stack and self.batch_size is None:
                leaves = tree_flatten((args, kwargs))[0]
                first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.ndim), None)
                if first is not None:
                    self.batch_size = int(first.shape[0])
            if not self._stack and self.armed:
                # What the outermost module is given and no traced op made is its input data.
                for i, a in enumerate(args):
                    for t in tree_flatten(a)[0]:
                        if isinstance(t, torch.Tensor):
                            self._know(t, "data", f"input[{i}]")
                for k, v in kwargs.items():
                    for t in tree_flatten(v)[0]:
                        if isinstance(t, torch.Tensor):
                            self._know(t, "data", f"input[{k!r}]")
            # What fed this module was computed by whoever runs now: the parent's forward, or
            # nobody's when it is called from training_step or the loop. Claim it so before this
            # module's post-hook can take it.
            if self.check_backward:
                self._claim_nodes((args, kwargs), self._stack[-1] if self._stack else _OUTSIDE)
            self._stack.append((name, type_name))

        return hook

    def _post(self, name: str, type_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self._stack and self._stack[-1][0] == name:
                self._stack.pop()
            if self.check_backward:
                self._claim_nodes(output, (name, type_name))

        return hook

    def _claim_nodes(self, output: Any, owner: tuple[str, str]) -> None:
        """Give the not-yet-owned autograd nodes behind ``output`` to ``owner`` (innermost first)."""
        leaves, _ = tree_flatten(output)
        todo = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        key = self._key
        while todo:
            node = todo.pop()
            if node is None:
                continue
            meta = node.metadata
            if key in meta:
                continue
            meta[key] = owner
            todo.extend(n for n, _ in node.next_functions if n is not None)

    # -- provenance ------------------------------------------------------------------
    def _origins(self, t: torch.Tensor) -> dict[str, OpFinding]:
        ptr = _storage_ptr(t)
        entry = self._records.get(ptr) if ptr is not None else None
        if entry is None or entry[0].expired():
            return {}
        return entry[1]

    def _record(self, t: torch.Tensor, origins: dict[str, OpFinding]) -> None:
        ptr = _storage_ptr(t)
        if ptr is None or not origins:
            return
        entry = self._records.get(ptr)
        if entry is None or entry[0].expired():
            if len(self._records) > 4096:  # forget freed storages now and then
                self._records = {k: v for k, v in self._records.items() if not v[0].expired()}
            entry = self._records[ptr] = (StorageWeakRef(t.untyped_storage()), {})
        entry[1].update(origins)

    def _input_origin(self, op: _Op, inp: _Input, kind: str, bad: torch.Tensor) -> OpFinding:
        """The origin of the ``kind`` values of input ``inp``; for a tensor that no traced op
        made, a finding at this op (the first to use it), kept for later uses too."""
        found = self._origins(inp.now).get(kind)
        if found is not None:
            return found
        ptr = _storage_ptr(inp.now)
        known = self._known.get(ptr) if ptr is not None else None
        if known is not None and known[0].expired():
            known = None
        source, name = (known[1], known[2]) if known is not None else ("untracked", None)
        found = op.finding(bad, kind, source, input_name=name, rows_of=inp.was)
        self._record(inp.now, {kind: found})
        return found

    def _output_origins(self, op: _Op, out: torch.Tensor, inputs: list[_Input]) -> dict[str, OpFinding]:
        kinds = _kinds(out)
        if not inputs:
            return {k: op.finding(out, k, "op") for k in kinds}
        if _elementwise(op.func) and self._broadcast(inputs, out):
            return self._elementwise_origins(op, out, kinds, inputs)
        found: dict[str, OpFinding] = {}
        for k in kinds:
            if k == NAN:
                nan_in = [i for i in inputs if NAN in i.kinds]
                inf_in = [i for i in inputs if POSINF in i.kinds or NEGINF in i.kinds]
                if nan_in:
                    found[k] = self._input_origin(op, nan_in[0], NAN, out)
                elif inf_in:
                    causes = [self._input_origin(op, i, s, out)
                              for i in inf_in for s in (POSINF, NEGINF) if s in i.kinds]
                    found[k] = op.finding(out, NAN, "inf", cause=_pick(causes))
                else:
                    found[k] = op.finding(out, NAN, "op")
            else:
                # Same sign first; the other sign passed through a negation; else born here.
                other = NEGINF if k == POSINF else POSINF
                src = next((i for i in inputs if k in i.kinds), None)
                src = src or next((i for i in inputs if other in i.kinds), None)
                if src is not None:
                    found[k] = self._input_origin(op, src, k if k in src.kinds else other, out)
                else:
                    found[k] = op.finding(out, k, "op")
        return found

    @staticmethod
    def _broadcast(inputs: list[_Input], out: torch.Tensor) -> bool:
        for inp in inputs:
            try:
                inp.broadcast = torch.broadcast_to(inp.was, out.shape)
            except RuntimeError:
                return False
        return True

    def _elementwise_origins(
        self, op: _Op, out: torch.Tensor, kinds: list[str], inputs: list[_Input]
    ) -> dict[str, OpFinding]:
        """Origins decided element by element: a bad output element comes from a bad input
        element at the same position, or is born here."""
        masks = [{k: _kind_mask(i.broadcast, k) for k in i.kinds} for i in inputs]  # type: ignore[arg-type]
        any_bad = torch.zeros(out.shape, dtype=torch.bool, device=out.device)
        for m in masks:
            for v in m.values():
                any_bad |= v
        found: dict[str, OpFinding] = {}
        for k in kinds:
            at = _kind_mask(out, k)
            born = at & ~any_bad
            if k == NAN:
                src = next((i for i, m in zip(inputs, masks) if NAN in m and bool((at & m[NAN]).any())), None)
                if src is not None:  # an older NaN passed on
                    found[k] = self._input_origin(op, src, NAN, out)
                    continue
                causes = [self._input_origin(op, i, s, out) for i, m in zip(inputs, masks)
                          for s in (POSINF, NEGINF) if s in m and bool((at & m[s]).any())]
                if causes and not bool(born.any()):
                    found[k] = op.finding(out, NAN, "inf", cause=_pick(causes), rows_of=at & ~born)
                else:
                    found[k] = op.finding(out, NAN, "op", rows_of=born)
                continue
            if bool(born.any()):  # a new Inf (an overflow) is named before Infs passed on with it
                found[k] = op.finding(out, k, "op", rows_of=born)
                continue
            other = NEGINF if k == POSINF else POSINF
            src, sign = None, k
            for s in (k, other):
                src = next((i for i, m in zip(inputs, masks) if s in m and bool((at & m[s]).any())), None)
                if src is not None:
                    sign = s
                    break
            found[k] = self._input_origin(op, src, sign, out) if src is not None else op.finding(out, k, "op")
        return found

    # -- op inspection ---------------------------------------------------------------
    def inspect(self, func: Any, args: Any, kwargs: Any, out: Any, before: Any = None) -> None:
        """Trace the origins of ``func``'s non-finite outputs; report the first harmful one.

        Args:
            func, args, kwargs, out: The op, its arguments and what it returned.
            before: For an in-place op, ``(args, kwargs)`` with the written tensors as they were.
        """
        name = func.__name__.split(".")[0]
        if name in _UNINITIALISED_OPS:
            return
        outs = [t for t in tree_flatten(out)[0] if _is_float(t)]
        bad = [t for t in outs if not bool(torch.isfinite(t).all())]
        if not bad:
            return  # finite: whatever Inf came in was neutralised here
        op = _Op(self, func, args, kwargs, before)
        inputs = []
        if name not in _CONSTANT_OPS:
            for now, was in zip(op.flat_now, op.flat_was):
                if _is_float(was) and not bool(torch.isfinite(was).all()):
                    inputs.append(_Input(now, was))
        first: Optional[dict[str, OpFinding]] = None
        for t in bad:
            origins = self._output_origins(op, t, inputs)
            self._record(t, origins)
            first = first or origins
            if self._first_nan is None and NAN in origins:
                self._first_nan = origins[NAN]
        if op.in_backward and first:
            # A non-finite value in the backward pass is a non-finite gradient.
            self._report(first, "gradient")

    def _report(self, origins: dict[str, OpFinding], reached: str) -> None:
        f = origins.get(NAN) or origins.get(POSINF) or origins.get(NEGINF)
        if f is None or self.finding is not None:
            return
        if f.cause is not None and not f.cause.deliberate:
            f = f.cause  # the Inf (an overflow, log(0), a bad input) did the harm, the NaN followed
        self.finding = dataclasses.replace(f, reached=reached)

    def check_loss(self, loss: Any) -> None:
        """Report the origin of a non-finite ``loss`` (the harm done in the forward pass)."""
        self._loss_checked = True
        if self.finding is not None or not self.armed or not _is_float(loss):
            return
        if bool(torch.isfinite(loss).all()):
            return
        origins = self._origins(loss)
        if origins:
            self._report({k: origins[k] for k in _kinds(loss) if k in origins} or origins, "loss")

    # -- context manager -------------------------------------------------------------
    def __enter__(self) -> "OpTracer":
        for name, module in self.model.named_modules():
            type_name = type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._pre(name, type_name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name, type_name), with_kwargs=True))
        if self.armed:
            self._register_model()
        if self.check_backward:
            self._anomaly = torch.autograd.set_detect_anomaly(True, check_nan=False)
            self._anomaly.__enter__()
        self._mode = _Tracer(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        if self._anomaly is not None:
            self._anomaly.__exit__(*exc)
            self._anomaly = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.finding is None and not self._loss_checked and self._first_nan is not None:
            self.finding = self._first_nan  # no loss to judge harm by: a NaN born is one
        self._records.clear()

    def claim_remaining(self, output: Any, name: str = "", type_name: str = "") -> None:
        """Give nodes created outside every module (e.g. a loss in training_step) an explicit
        owner; nodes left unclaimed are reported with ``outside_forward=True``."""
        if self.check_backward:
            self._claim_nodes(output, (name, type_name or type(self.model).__name__))


def replace_index(stat: TensorStat, index: int) -> TensorStat:
    stat.index = index
    return stat


def trace_first_nonfinite(
    model: nn.Module,
    forward: Callable[[], torch.Tensor],
    backward: bool = True,
    batch: Any = None,
) -> tuple[Optional[OpFinding], Optional[torch.Tensor]]:
    """Run ``forward()`` (which returns a scalar loss), then its backward, under op tracing.

    Args:
        model: The model whose module names are reported.
        forward: Runs the forward pass and returns the loss.
        backward: Also run and trace ``loss.backward()``.
        batch: The batch ``forward`` uses, if any: NaN/Inf in it are named as the data, and its
            first dimension gives the rows (samples) of findings (see :meth:`OpTracer.watch_batch`).

    Returns:
        ``(finding or None, loss)``: the origin of a non-finite loss, else of the first
        non-finite value in the backward pass.
    """
    with OpTracer(model, check_backward=backward) as tracer:
        if batch is not None:
            tracer.watch_batch(batch)
        loss = forward()
        tracer.check_loss(loss)
        if backward and isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    return tracer.finding, loss


__all__ = ["OpFinding", "OpTracer", "TensorStat", "is_additive_mask", "tensor_stat", "trace_first_nonfinite"]


if __name__ == "__main__":  # pragma: no cover - a manual smoke check
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    f, _ = trace_first_nonfinite(m, lambda: torch.log(m(torch.zeros(2, 3)) * 0).sum())
    print(f.describe() if f else "no finding", file=sys.stderr)
