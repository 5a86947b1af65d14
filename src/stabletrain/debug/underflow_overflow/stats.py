"""Statistics of a tensor on the device: abs min and max, and whether any of them is non-finite.

Nothing here synchronises with the host except :func:`to_host`, which reads many statistics in
one transfer per device. See ``docs/underflow_overflow.md`` (Cost).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = [
    "tensor_stats", "raw_stats", "nan_min", "check_abs_bits", "Meter", "any_nonfinite", "unmasked_nonfinite",
    "to_host", "value_kind",
]


#: The signed integer type of each float type's width: after ``abs`` (sign bit clear) the bit
#: patterns of non-negative floats order like the floats, NaN above +inf.
_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}
#: Per (device type, dtype): whether ``abs`` clears the sign bit of a NaN there (checked once).
_ABS_CLEARS_NAN_SIGN: dict[tuple[str, torch.dtype], bool] = {}


def check_abs_bits(device: torch.device | str) -> None:
    """Check, once per device type, that ``abs`` clears the sign bit of a NaN for each float type
    (IEEE's abs does; a host read per type). The monitor calls it when it is created, so that the
    check never falls in a training step."""
    kind = torch.device(device).type
    for dtype, ints in _INT_VIEW.items():
        if (kind, dtype) in _ABS_CLEARS_NAN_SIGN:
            continue
        try:
            # A NaN with its sign bit set, in a vectorised body and a scalar tail, each through abs.
            nan = torch.full((67,), float("nan"), dtype=dtype, device=device)
            signed = (nan.view(ints) | torch.iinfo(ints).min).view(dtype)
            ok = bool((torch.abs(signed).view(ints) >= 0).all())
        except RuntimeError:  # a type this device lacks
            ok = False
        _ABS_CLEARS_NAN_SIGN[(kind, dtype)] = ok


def _int_view(t: Tensor) -> Optional[torch.dtype]:
    """The integer type whose min/max of ``|t|``'s bits are ``|t|``'s abs min/max, or None where
    that does not hold (a dtype without one, or an ``abs`` that leaves a NaN's sign bit set)."""
    ints = _INT_VIEW.get(t.dtype)
    if ints is None:
        return None
    ok = _ABS_CLEARS_NAN_SIGN.get((t.device.type, t.dtype))
    if ok is None:
        check_abs_bits(t.device)
        ok = _ABS_CLEARS_NAN_SIGN[(t.device.type, t.dtype)]
    return ints if ok else None


def tensor_stats(t: Tensor, scratch: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """``(abs min, abs max)`` of ``t`` as device scalars, without a host synchronisation.

    A NaN anywhere makes both NaN and an inf of either sign makes the abs max inf, so the abs
    max alone decides finiteness.

    Args:
        t: A floating-point tensor with at least one element.
        scratch: CPU only: a dict in which to keep a buffer per dtype for ``|t|`` (it grows
            to the largest tensor measured); without it ``|t|`` is allocated afresh.
    """
    lo, hi = raw_stats(t.detach(), scratch)
    return torch.where(torch.isnan(hi), hi, lo), hi


def raw_stats(t: Tensor, scratch: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """:func:`tensor_stats` as the hooks take it, without the device op per tensor that makes the
    abs min NaN too: with a NaN in ``t`` the abs max is NaN but the abs min may be the smallest
    other magnitude. :func:`nan_min` applies "a NaN makes both NaN" on the host, when a report
    reads the values.

    ``t`` must be detached (no graph is recorded) and have at least one element.
    """
    # On the CPU: |t| into a reused buffer, then one min/max over its bits read as integers
    # (faster than over floats: no NaN handling; exact, since |t| has no sign bit). Fused passes
    # that never write |t| (vector_norm(t, +-inf)) are not vectorised there. On a GPU
    # vector_norm(t, +-inf) are fused passes that never materialise |t|, a temporary as large as
    # the activation (the logits, say). Measured: docs/benchmarks.md, "Kernel choice".
    if t.device.type == "cpu":
        n = t.numel()
        ints = _int_view(t)
        if scratch is not None and ints is not None and n > 2 * CHUNK and t.is_contiguous():
            return _chunked_stats(t.view(-1), ints, scratch)
        if scratch is None:
            out = torch.abs(t)
        else:
            buf = scratch.get(t.dtype)
            if buf is None or buf.numel() < n:
                buf = scratch[t.dtype] = torch.empty(n, dtype=t.dtype)
            out = buf[:n].view(t.shape)
            torch.abs(t, out=out)
        if ints is None:
            return torch.aminmax(out)
        lo, hi = torch.aminmax(out.view(ints))
        return lo.view(t.dtype), hi.view(t.dtype)
    return torch.linalg.vector_norm(t, float("-inf")), torch.linalg.vector_norm(t, float("inf"))


#: Elements of a large CPU tensor taken at a time: ``|t|`` of a chunk (1 MiB of float32) is read
#: back from the core's cache, not from memory (docs/benchmarks.md, "Kernel choice").
CHUNK = 1 << 18


def _chunked_stats(flat: Tensor, ints: torch.dtype, scratch: dict) -> tuple[Tensor, Tensor]:
    """:func:`raw_stats` of a large contiguous CPU tensor (viewed flat), chunk by chunk."""
    key = ("chunk", flat.dtype)
    buf = scratch.get(key)
    if buf is None:
        buf = scratch[key] = torch.empty(CHUNK, dtype=flat.dtype)
    n = flat.numel()
    parts = (n + CHUNK - 1) // CHUNK
    los = torch.empty(parts, dtype=ints)
    his = torch.empty(parts, dtype=ints)
    for i in range(parts):
        part = flat[i * CHUNK:(i + 1) * CHUNK]
        out = buf[:part.numel()]
        torch.abs(part, out=out)
        torch.aminmax(out.view(ints), out=(los[i], his[i]))
    return los.amin().view(flat.dtype), his.amax().view(flat.dtype)


class Meter:
    """:func:`tensor_stats` for the hooks: each (tensor, version) measured once per forward, each
    weight once per change, with a scratch buffer per thread."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple] = {}  # id(tensor) -> (weakref, version, stats) within a forward
        self._weights: dict[int, tuple] = {}  # id(weight) -> ((version, data_ptr, dtype, device), stats)
        self._local = threading.local()  # per-thread scratch buffers of tensor_stats

    def stats(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`tensor_stats` of ``t`` (detached here: the hooks run without ``no_grad``)."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = {}
        return raw_stats(t.detach(), buffers)

    def measure(self, t: Tensor) -> tuple[Tensor, Tensor, Any]:
        """``(abs min, abs max, weak reference)`` of ``t`` (no reference to an inference tensor)."""
        # A tensor is often the output of one module and the input of the next, and of the
        # parents of both: measure each (tensor, version) once per forward. In the backward pass
        # autograd hands the same gradient tensor to several hooks (both inputs of an add):
        # measured once too.
        if t.is_inference():
            return (*self.stats(t), None)
        key = id(t)
        version = t._version
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is t and hit[1] == version:
            return (*hit[2], hit[0])
        stats = self.stats(t)
        ref = weakref.ref(t)
        self._seen[key] = (ref, version, stats)
        return (*stats, ref)

    def weight(self, p: Tensor) -> tuple[Tensor, Tensor]:
        """``(abs min, abs max)`` of a weight."""
        # Weights change at the optimizer step only (which bumps their version): measure them
        # once per change, not once per call (gradient accumulation, shared modules).
        key = (p._version, p.data_ptr(), p.dtype, p.device)
        hit = self._weights.get(id(p))
        if hit is not None and hit[0] == key:
            return hit[1]
        stats = self.stats(p)
        self._weights[id(p)] = (key, stats)
        return stats

    def end_forward(self) -> None:
        """The outermost forward returned: the same tensor ids may be other tensors from now on."""
        self._seen.clear()

    def release(self) -> None:
        """Drop the tensors of the last forward and the scratch buffers."""
        self._seen.clear()
        self._local = threading.local()


def any_nonfinite(amaxes: list[Tensor]) -> Tensor:
    """A device bool scalar: True when any of these abs-max scalars is NaN or Inf."""
    if not amaxes:
        return torch.zeros((), dtype=torch.bool)
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in amaxes:
        by_device.setdefault(t.device, []).append(t)
    flags = [~torch.stack(ts).isfinite().all() for ts in by_device.values()]
    flag = flags[0]
    for other in flags[1:]:
        flag = flag | other.to(flag.device)
    return flag


def unmasked_nonfinite(t: Tensor) -> Tensor:
    """A device bool scalar: does ``t`` hold a NaN/Inf and is it not an additive mask (a tensor
    of only 0 and -inf)? No host synchronisation."""
    return ~torch.isfinite(t).all() & ~((t == 0) | torch.isneginf(t)).all()


def to_host(tensors: list[Tensor]) -> list[float]:
    """Values of many device scalars, one transfer per device."""
    out: list[float] = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        values = torch.stack([tensors[i].float() for i in idx]).tolist()
        for i, v in zip(idx, values, strict=True):
            out[i] = v
    return out


def nan_min(amin: float, amax: float) -> tuple[float, float]:
    """Host values of :func:`raw_stats`: a NaN anywhere makes the abs min NaN too."""
    return (amax, amax) if amax != amax else (amin, amax)


def value_kind(amin: float, amax: float) -> Optional[str]:
    """``"nan"``, ``"inf"`` (of either sign), or None for a finite ``(abs min, abs max)``."""
    if amax != amax:
        return "nan"
    if amax == float("inf"):
        return "inf"
    return None
