"""Reading a step's values with as few host syncs as possible, and reducing them over ranks.

Used by :class:`~stabletrain.integrations.common.StepTools`; see its module for the reads per step.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Optional

import torch
from torch import Tensor

from stabletrain.utils.amp import already_unscaled, live_scale

#: Status codes (see :func:`encode_status`); a gradient norm is never negative. GUARD_FAILED:
#: the guard's check after an earlier optimizer step failed (below FAILED: the earlier cause wins
#: the minimum over ranks).
GUARD_FAILED, FAILED, NAN, INF = -4.0, -3.0, -2.0, -1.0



def encode_status(failed: Tensor, total: Tensor) -> Tensor:
    """One float32 device scalar that carries a step's failure flag and its gradient norm.

    ``>= 0``: the norm; ``-1``: the norm is +inf; ``-2``: it is NaN; ``-3``: the step failed
    (``-4``, :data:`GUARD_FAILED`, is set by the caller over it).
    NaN never enters a collective (a min over NaN depends on the order of the ranks), and
    the minimum over ranks is ``-3`` when any rank failed, else the norm, which is the same
    on every rank once DDP has averaged the gradients.
    """
    total = total.reshape(()).float()
    code = torch.where(torch.isnan(total), NAN, torch.where(torch.isinf(total), INF, total))
    return torch.where(failed.reshape(()).to(code.device), torch.full_like(code, FAILED), code)


def decode_status(value: float) -> tuple[bool, float]:
    """(failed, gradient norm) from :func:`encode_status`'s value."""
    if value == FAILED:
        return True, math.nan
    if value == NAN:
        return False, math.nan
    if value == INF:
        return False, math.inf
    return False, value


def read_pair(a: Tensor, b: Tensor) -> tuple[float, float]:
    """Two device scalars as float32 host values with one read.

    The two float32 values share one int64 word, and ``.item()`` of it is a single
    ``aten._local_scalar_dense``: one synchronisation on a GPU, and what
    ``stabletrain.utils.sync.CountSyncs`` counts (``tolist()`` of a CPU tensor dispatches
    nothing, so it would hide the read from the count).
    """
    pair = torch.stack([a.reshape(()).float(), b.reshape(()).float().to(a.device)])
    word = int(pair.view(torch.int64).item())
    first, second = struct.unpack("=2f", struct.pack("=q", word))
    return first, second


def all_reduce(t: Tensor, op: str) -> Tensor:
    """``t`` reduced over ranks (``"min"``, ``"max"`` or ``"sum"``) when ``torch.distributed``
    runs several processes; else ``t``. A copy: the caller's tensor is left alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return t
    out = t.detach().float().clone()
    if dist.get_backend() == "nccl" and out.device.type != "cuda":
        out = out.cuda()
    ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
    dist.all_reduce(out, op=ops[op])
    return out


#: ``Tensor.numpy`` as torch defines it: a view of host memory, neither a copy nor a wait on a device
#: (taken at import: ``stabletrain.utils.sync.CountSyncs`` counts ``.numpy()`` calls as host copies).
_HOST_VIEW = torch.Tensor.numpy


class LaggedAgreement:
    """A device flag agreed over ranks (any rank true) without a host sync in the step that sets it:
    :meth:`start` launches an asynchronous all-reduce, :meth:`result` (a step later, at the same
    point on every rank) reads it. On a GPU the result lands in pinned host memory by an
    asynchronous copy; reading it waits only for that copy, a step back, not for the step running
    now. With one process the flag is read as it is."""

    def __init__(self) -> None:
        self._pending: Optional[tuple[Any, Tensor, Any]] = None

    @property
    def pending(self) -> bool:
        """Whether a flag was started and not read yet."""
        return self._pending is not None

    def start(self, flag: Tensor) -> None:
        """Launch the agreement on ``flag`` (a device bool scalar); the previous one must have been read."""
        import torch.distributed as dist

        if self._pending is not None:
            raise RuntimeError("LaggedAgreement.start: the previous flag was not read")
        out = flag.detach().reshape(1).to(torch.float32, copy=True)  # the collective writes into it
        work = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl" and out.device.type != "cuda":
                out = out.cuda()
            work = dist.all_reduce(out, op=dist.ReduceOp.MAX, async_op=True)
        event = None
        if out.device.type == "cuda":
            if work is not None:
                work.wait()  # NCCL: the current stream waits for the collective; the host does not
                work = None
            host = torch.empty(1, dtype=torch.float32, pin_memory=True)
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            out = host
        self._pending = (work, out, event)

    def result(self) -> bool:
        """Whether the flag last started was true on any rank (False when none was started). Every
        rank must call it at the same point; it waits for the collective (and, on a GPU, the copy)."""
        if self._pending is None:
            return False
        work, out, event = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if event is not None:
            event.synchronize()
        return bool(_HOST_VIEW(out)[0] > 0)  # host memory by now: no device to wait for


def dist_rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size of ``torch.distributed`` ((0, 1) when not running)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's and Accelerate's wrappers."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def pending_scale(scaler: Any, optimizer: Any) -> Optional[Tensor]:
    """The fp16 loss scale still in the gradients, as a device tensor; None when they are
    unscaled (no scaler, or ``scaler.unscale_(optimizer)`` already ran this step).

    Reading it here instead of calling ``unscale_`` leaves the framework's own un-scaling
    (Accelerate's ``clip_grad_norm_``, Lightning's AMP plugin) to run as usual: a second
    ``unscale_`` of the same step is an error in ``torch.amp.GradScaler``.
    """
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    if optimizer is not None and already_unscaled(scaler, inner_optimizer(optimizer)):
        return None
    return live_scale(scaler)

