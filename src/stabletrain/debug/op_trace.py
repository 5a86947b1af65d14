"""Op-level tracing: the first aten op whose output is non-finite, in forward or backward.

This is the offline, exact counterpart of the underflow/overflow monitor. A
``TorchDispatchMode`` sees every aten op of forward and backward; forward hooks on every
module give the module whose ``forward`` ran the op (so a functional op between two child
modules is blamed on the parent that ran it). For backward, each autograd node is tagged
(in its ``metadata``) with the module whose forward created it; during backward the node
being run is asked directly (``torch._C._current_autograd_node``), so a backward op is
named after the forward op and module it is the gradient of, and nodes created outside
every module's forward (the loss in ``training_step``, the loop's ``loss / accum``) are
reported as such instead of inheriting a neighbour's name. Every op's output is checked on
the host, so it is slow — use it on one captured step, not in training.

Deliberate infinities are not failures: a fill op (``masked_fill``, ``full``, ``where``, ...)
whose infinite values come from an infinite scalar argument is skipped, because attention
masks are built that way.

Example::

    finding = trace_first_nonfinite(model, lambda: model.training_step(batch).backward())
    if finding:
        print(finding.describe())
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: Ops that write a given value; an infinite value they write on purpose is not a fault.
_FILL_OPS = {
    "masked_fill", "masked_fill_", "fill", "fill_", "full", "full_like", "new_full", "where",
    "scalar_tensor", "index_fill", "index_fill_", "masked_scatter", "lift_fresh", "lift_fresh_copy",
}

#: Owner of autograd nodes created outside every module's forward.
_OUTSIDE = ("", "")

#: Ops that return uninitialised memory, which may hold any bit pattern (NaN included) until
#: the next op writes it (dropout's mask is built in an ``empty_like``).
_UNINITIALISED_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted", "resize_"}

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
    """The first op whose output held a NaN or Inf.

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
        inputs_nonfinite: True when an input was already non-finite (the op only passed it on:
            then the tensor came from outside the traced ops, e.g. a poisoned input).
        source: ``file:line: code`` of the model source that called the op (forward), or that
            created the differentiated node (backward), where it could be found.
        forward_op: For backward ops, the autograd node, e.g. ``SqrtBackward0``.
        op_index: Number of aten ops that ran before it in the traced call.
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

    @property
    def op_name(self) -> str:
        """The op without namespace and overload, e.g. ``log``."""
        parts = self.op.split(".")
        return parts[1] if len(parts) >= 2 else self.op

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["op_name"] = self.op_name
        return data

    @property
    def where(self) -> str:
        """``module (Type)``, or where the op ran when outside every module's forward."""
        if self.outside_forward:
            return f"{self.module_type} outside forward"
        return f"{self.module or '<root>'} ({self.module_type})"

    def describe(self) -> str:
        kinds = [k for k, n in (("NaN", self.output.nan), ("+Inf", self.output.posinf), ("-Inf", self.output.neginf)) if n]
        head = f"{self.op} in {self.where}, {self.phase}, {self.dtype}: output has {'/'.join(kinds)}"
        if self.forward_op:
            head += f"; gradient of {self.forward_op}"
        lines = [head]
        for s in self.inputs:
            flag = " NON-FINITE" if s.nonfinite else ""
            lines.append(f"  input[{s.index}] {s.dtype}{s.shape}: abs min {s.abs_min:.4g}, abs max {s.abs_max:.4g}{flag}")
        if self.source:
            lines.append(f"  source: {self.source}")
        return "\n".join(lines)


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
        before = _copy_written(func, args, kwargs) if watching and func._schema.is_mutable else None
        out = func(*args, **kwargs)
        owner.op_count += 1
        if watching:
            b_args, b_kwargs = before if before is not None else (args, kwargs)
            owner.inspect(func, b_args, b_kwargs, out)
        return out


def _copy_written(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``args`` and ``kwargs`` with the tensors ``func`` writes to, and every argument sharing
    their memory (``h.add_(h)``), replaced by copies."""
    args, kwargs = list(args), dict(kwargs)
    written = set()
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
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


class OpTracer:
    """Context manager finding the first non-finite op while active.

    Args:
        model: The module whose submodule names are reported.
        check_backward: Also trace the backward pass (needs anomaly mode for source lines).
        armed: Inspect ops from the start; with False, ops are only counted until
            :meth:`arm` is called (e.g. a replay arms it once the captured state is loaded,
            so that restoring non-finite weights is not reported as the failing op).

    Example::

        with OpTracer(model) as tracer:
            model.training_step(batch).backward()
        print(tracer.finding.describe() if tracer.finding else "all finite")
    """

    def __init__(self, model: nn.Module, check_backward: bool = True, armed: bool = True):
        self.model = model
        self.check_backward = check_backward
        self.armed = armed
        self.finding: Optional[OpFinding] = None
        self.op_count = 0
        self._stack: list[tuple[str, str]] = []
        # Autograd nodes are tagged in their own metadata (not by id(): ids of freed nodes are reused).
        self._key = f"stabletrain.op_trace.owner.{id(self)}"
        self._handles: list[Any] = []
        self._anomaly: Any = None
        self._mode: Optional[_Tracer] = None

    # -- module tracking -----------------------------------------------------------
    def _pre(self, name: str, type_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            # What fed this module was computed by whoever runs now: the parent's forward, or
            # nobody's when it is called from training_step or the loop. Claim it so before this
            # module's post-hook can take it.
            if self.check_backward:
                self._claim_nodes(args, self._stack[-1] if self._stack else _OUTSIDE)
            self._stack.append((name, type_name))

        return hook

    def _post(self, name: str, type_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._stack and self._stack[-1][0] == name:
                self._stack.pop()
            if self.check_backward:
                self._claim_nodes(output, (name, type_name))

        return hook

    def arm(self) -> None:
        """Start inspecting ops (see ``armed``)."""
        self.armed = True

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

    # -- op inspection ---------------------------------------------------------------
    def inspect(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if func.__name__.split(".")[0] in _UNINITIALISED_OPS:
            return
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        bad = None
        for t in outs:
            if (t.is_floating_point() or t.is_complex()) and t.numel() and not bool(torch.isfinite(t).all()):
                bad = t
                break
        if bad is None:
            return
        op = str(func)  # aten.log.default
        short = op.split(".")[1] if "." in op else op
        flat_args = tree_flatten((args, kwargs))[0]
        if short in _FILL_OPS and bool(torch.isnan(bad).sum() == 0):
            scalars = [a for a in flat_args if isinstance(a, (int, float)) and not isinstance(a, bool)]
            scalars += [float(a) for a in flat_args if isinstance(a, torch.Tensor) and a.numel() == 1 and a.is_floating_point()]
            if any(math.isinf(s) for s in scalars):
                return  # a deliberate -inf/+inf fill, e.g. an attention mask
        inputs = [tensor_stat(a, i) for i, a in enumerate(a for a in flat_args if isinstance(a, torch.Tensor))
                  if a.is_floating_point() or a.is_complex()]
        in_backward = torch._C._current_graph_task_id() != -1
        root_type = type(self.model).__name__
        if in_backward:
            node = torch._C._current_autograd_node()
            owner = node.metadata.get(self._key) if node is not None else None
            outside = owner is None or owner == _OUTSIDE
            module, type_name = ("", root_type) if outside else owner
            source = _anomaly_source(node)
            forward_op = node.name() if node is not None else None
        else:
            outside = not self._stack
            module, type_name = self._stack[-1] if self._stack else ("", root_type)
            source = _user_source(traceback.extract_stack())
            forward_op = None
        self.finding = OpFinding(
            op=op,
            phase="backward" if in_backward else "forward",
            module=module,
            module_type=type_name,
            dtype=str(bad.dtype).replace("torch.", ""),
            output=tensor_stat(bad),
            inputs=[replace_index(s, i) for i, s in enumerate(inputs)],
            inputs_nonfinite=any(s.nonfinite for s in inputs),
            source=source,
            forward_op=forward_op,
            op_index=self.op_count - 1,
            outside_forward=outside,
        )

    # -- context manager -------------------------------------------------------------
    def __enter__(self) -> "OpTracer":
        for name, module in self.model.named_modules():
            type_name = type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._pre(name, type_name)))
            self._handles.append(module.register_forward_hook(self._post(name, type_name)))
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
) -> tuple[Optional[OpFinding], Optional[torch.Tensor]]:
    """Run ``forward()`` (which returns a scalar loss), then its backward, under op tracing.

    Args:
        model: The model whose module names are reported.
        forward: Runs the forward pass and returns the loss.
        backward: Also run and trace ``loss.backward()``.

    Returns:
        ``(finding or None, loss)``.
    """
    with OpTracer(model, check_backward=backward) as tracer:
        loss = forward()
        if backward and isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    return tracer.finding, loss


__all__ = ["OpFinding", "OpTracer", "TensorStat", "tensor_stat", "trace_first_nonfinite"]


if __name__ == "__main__":  # pragma: no cover - a manual smoke check
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    f, _ = trace_first_nonfinite(m, lambda: torch.log(m(torch.zeros(2, 3)) * 0).sum())
    print(f.describe() if f else "no finding", file=sys.stderr)
