"""What an aten op does to its tensors: which ops write in place (and copies of what they overwrite), which are
elementwise, which return uninitialised memory; the kinds of non-finite values a tensor holds, and whether it
is an additive mask. See ``docs/diagnose.md``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from stabletrain.debug.op_trace.findings import KINDS, NAN, POSINF

#: Ops that return uninitialised memory, which may hold any bit pattern (NaN included) until
#: the next op writes it (dropout's mask is built in an ``empty_like``).
UNINITIALISED_OPS = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted", "resize_"
}

#: Ops that bring a constant written in the code (``torch.tensor(-inf)``) into the graph: the
#: constant's values are born there, not in a tensor "made outside the traced ops".
CONSTANT_OPS = {"lift_fresh", "lift_fresh_copy"}

#: Elementwise copies that are not tagged pointwise: each output element comes from the same
#: input element (a float32 -> float16 cast that overflows is a birth, element by element).
_COPY_OPS = {"_to_copy", "copy_", "copy", "clone", "_copy_from", "_copy_from_and_resize"}

#: Ops that update arguments in place without saying so in their schema: the running
#: statistics of batch norm (positions of the arguments written).
_UNDECLARED_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4), "miopen_batch_norm": (3, 4)}

def writes_in_place(func: Any) -> bool:
    return func._schema.is_mutable or func.__name__.split(".")[0] in _UNDECLARED_WRITES


def copy_written(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
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
            written.add(storage_ptr(value))
    written.discard(None)
    if not written:
        return tuple(args), kwargs

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and storage_ptr(value) in written:
            return value.detach().clone()
        return value

    return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}


def storage_ptr(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None


def is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel() > 0


def magnitude(t: torch.Tensor) -> torch.Tensor:
    return t.abs() if t.is_complex() else t


def nonfinite_kinds(t: torch.Tensor) -> list[str]:
    """The kinds of non-finite values ``t`` holds (one host read)."""
    x = magnitude(t.detach())
    flags = torch.stack([torch.isnan(x).any(), torch.isposinf(x).any(), torch.isneginf(x).any()]).tolist()
    return [k for k, f in zip(KINDS, flags) if f]


def kind_mask(t: torch.Tensor, kind: str) -> torch.Tensor:
    x = magnitude(t.detach())
    return torch.isnan(x) if kind == NAN else torch.isposinf(x) if kind == POSINF else torch.isneginf(x)


_POINTWISE: dict[Any, bool] = {}


def is_elementwise(func: Any) -> bool:
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


def infinite_constant(flat_args: list[Any]) -> bool:
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
