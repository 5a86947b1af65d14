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

__all__ = ["tensor_stats", "Meter", "any_nonfinite", "unmasked_nonfinite", "to_host", "value_kind"]


def tensor_stats(t: Tensor, scratch: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """``(abs min, abs max)`` of ``t`` as device scalars, without a host synchronisation.

    A NaN anywhere makes both NaN and an inf of either sign makes the abs max inf, so the
    abs max alone decides finiteness.

    Args:
        t: A floating-point tensor with at least one element.
        scratch: CPU only: a dict in which to keep a buffer per dtype for ``|t|`` (it grows
            to the largest tensor measured); without it ``|t|`` is allocated afresh.
    """
    # On the CPU, |t| into a reused buffer then one aminmax was the fastest exact kernel measured
    # (vector_norm(t, +-inf) is not vectorised there, and a fresh |t| costs far more on a busy
    # machine). On a GPU vector_norm(t, +-inf) are fused passes that never materialise |t|, a
    # temporary as large as the activation (the logits, say).
    if t.device.type == "cpu":
        if scratch is None:
            return torch.aminmax(t.abs())
        n = t.numel()
        buf = scratch.get(t.dtype)
        if buf is None or buf.numel() < n:
            buf = scratch[t.dtype] = torch.empty(n, dtype=t.dtype)
        out = buf[:n].view(t.shape)
        torch.abs(t, out=out)
        return torch.aminmax(out)
    return torch.linalg.vector_norm(t, float("-inf")), torch.linalg.vector_norm(t, float("inf"))


class Meter:
    """:func:`tensor_stats` for the hooks: each (tensor, version) measured once per forward, each
    weight once per change, with a scratch buffer per thread."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple] = {}  # id(tensor) -> (weakref, version, stats) within a forward
        self._weights: dict[int, tuple] = {}  # id(weight) -> ((version, data_ptr, dtype, device), stats)
        self._local = threading.local()  # per-thread scratch buffers of tensor_stats

    def stats(self, t: Tensor) -> tuple[Tensor, Tensor]:
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = {}
        return tensor_stats(t, buffers)

    def measure(self, t: Tensor) -> tuple[Tensor, Tensor, Any]:
        """``(abs min, abs max, weak reference)`` of ``t`` (no reference to an inference tensor)."""
        # A tensor is often the output of one module and the input of the next, and of the
        # parents of both: measure each (tensor, version) once per forward.
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


def value_kind(amin: float, amax: float) -> Optional[str]:
    """``"nan"``, ``"inf"`` (of either sign), or None for a finite ``(abs min, abs max)``."""
    if amax != amax:
        return "nan"
    if amax == float("inf"):
        return "inf"
    return None
