"""Decisions every rank takes together: this process's rank, and reductions over all ranks.

A debugging tool that stops training because of something only its rank saw must not simply
raise: the other ranks would wait forever in the next collective. Each rank contributes a
number at a point every rank reaches, and all of them act on the same reduced value.

Every function works in three settings: inside the trainer (pass its Lightning ``fabric``),
in a plain ``torch.distributed`` program (initialised process group, no fabric), and in a
single process (no communication at all).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["rank_and_world_size", "max_over_ranks", "any_rank", "ranks_with", "leading_message", "gather_names"]


def _process_group() -> Optional[Any]:
    """``torch.distributed`` when a process group is initialised, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_world_size(fabric: Any = None) -> tuple[int, int]:
    """``(rank, world size)``: the fabric's, else the initialised process group's, else ``(0, 1)``."""
    if fabric is not None:
        return int(fabric.global_rank), int(fabric.world_size)
    dist = _process_group()
    if dist is None:
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _all_reduce(t: Tensor, op: str, fabric: Any) -> Tensor:
    """All-reduce a float32 tensor over the ranks (``op``: "max" or "sum"); a new tensor."""
    if fabric is not None:
        # A copy: the all-reduce works in place and must not change the caller's tensor.
        return fabric.all_reduce(t.to(fabric.device).clone(), reduce_op=op)
    dist = _process_group()
    assert dist is not None
    t = t.clone().reshape(-1)  # at least one dimension, as every backend accepts
    if dist.get_backend() == "nccl" and t.device.type != "cuda":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t


def max_over_ranks(value: float | Tensor, fabric: Any = None) -> float:
    """The largest ``value`` (a number or a scalar tensor) over all ranks, on every rank: one
    host read, and one all-reduce when there are several ranks.

    Every rank must call it at the same point.

    Example::

        worst = max_over_ranks(monitor.nonfinite_code())   # 0.0 on every rank when all is well
    """
    _, world_size = rank_and_world_size(fabric)
    if world_size == 1:
        return float(value)
    device = value.device if isinstance(value, Tensor) else torch.device("cpu")
    t = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(())
    return float(_all_reduce(t, "max", fabric))


def any_rank(flag: bool | Tensor, fabric: Any = None) -> bool:
    """True on every rank when ``flag`` is true on any rank (see :func:`max_over_ranks`)."""
    return bool(max_over_ranks(flag, fabric))


def ranks_with(flag: bool | Tensor, fabric: Any = None) -> list[int]:
    """The ranks where ``flag`` is true, on every rank (one all-reduce when there are several).

    Every rank must call it at the same point.
    """
    rank, world_size = rank_and_world_size(fabric)
    if world_size == 1:
        return [rank] if bool(flag) else []
    device = flag.device if isinstance(flag, Tensor) else torch.device("cpu")
    votes = torch.zeros(world_size, dtype=torch.float32, device=device)
    votes[rank] = torch.as_tensor(flag, dtype=torch.float32, device=device)
    return [r for r, v in enumerate(_all_reduce(votes, "sum", fabric).tolist()) if v > 0]


def leading_message(level: int, message: str, fabric: Any = None) -> tuple[str, int]:
    """``(message, rank)`` of the rank with the highest ``level`` (the lowest such rank), on every
    rank: one all-reduce and one broadcast when there are several ranks.

    For a failure every rank reports at once: each rank gives how directly it saw the cause
    (e.g. 2: its own loss is non-finite, 1: it found a non-finite value itself, 0: it stopped
    with the others) and its message; every rank then reports the leading rank's message, so
    that the ranks never print different causes for the same step. Every rank must call it at
    the same point.
    """
    rank, world_size = rank_and_world_size(fabric)
    if world_size == 1:
        return message, rank
    # One max: the level first, then the lowest rank among those with it.
    code = max_over_ranks(float(level * world_size + (world_size - 1 - rank)), fabric)
    leader = world_size - 1 - int(code) % world_size
    import torch.distributed as dist

    box = [message if rank == leader else None]
    dist.broadcast_object_list(box, src=leader)
    return str(box[0]), leader


def gather_names(names: list[str]) -> list[str]:
    """Every rank's ``names`` joined, on every rank: rank 0's first, then those only later ranks
    found, in order, each once (``all_gather_object``; one process: ``names`` itself).

    Every rank must call it at the same point (a failure path: it costs a host round trip).
    """
    dist = _process_group()
    if dist is None or dist.get_world_size() == 1:
        return list(names)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(names))
    return list(dict.fromkeys(n for part in gathered for n in part))
