"""Global gradient norms of sharded (DTensor) gradients: local squares, one all-reduce.

Under FSDP2 per-shard norms (one ``_foreach_norm``) are squared, summed over the mesh in one
all-reduce and square-rooted, so the per-parameter and total norms are global and equal on every
rank, with nothing read back to the host. See docs/design/fsdp.md.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
from torch import Tensor

#: The process groups, in order, whose sum of squares a parameter's norm needs; () = none.
ReduceKey = tuple[Any, ...]


def dtensor_type() -> Any:
    """``DTensor`` if ``torch.distributed.tensor`` was imported, else None: nothing can be a
    DTensor before that module is loaded, and importing it costs time at every start."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(t: Any) -> bool:
    """Is ``t`` a DTensor (an FSDP2 parameter or gradient shard)?"""
    dt = dtensor_type()
    return dt is not None and isinstance(t, dt)


def local_tensor(t: Any) -> Tensor:
    """This rank's part of ``t``: a DTensor's local shard, any other tensor itself. For checks
    whose verdict is agreed over ranks afterwards (finite or not), where no sum is needed."""
    return t.to_local() if is_dtensor(t) else t


def local_grad(grad: Any) -> tuple[Tensor, ReduceKey]:
    """The part of ``grad`` held by this rank and the groups to sum its squared norm over.

    A plain tensor is its own local part and needs no reduction (DDP's gradients are already
    averaged on every rank). A DTensor's squared norm is summed over each mesh dimension that
    shards it (``Shard``); dimensions that replicate it (``Replicate``, the replica groups of
    HSDP) hold copies and are not summed.

    Raises:
        ValueError: A gradient is ``Partial`` (not yet reduced), which no FSDP gradient is after
            backward; its norm would be meaningless.
    """
    dt = dtensor_type()
    if dt is None or not isinstance(grad, dt):
        return grad, ()
    from torch.distributed.tensor import Replicate, Shard

    groups = []
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Shard):
            groups.append(grad.device_mesh.get_group(dim))
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"gradient norm: a DTensor gradient with placement {placement} on mesh dimension {dim} is not "
                "reduced yet; compute norms after backward has finished (FSDP reduce-scatters gradients then)."
            )
    return grad.to_local(), tuple(groups)


def sum_squares_over_mesh(squares: Tensor, keys: Sequence[ReduceKey]) -> Tensor:
    """Sum ``squares[i]`` (this rank's squared norm of parameter i) over the groups ``keys[i]``.

    One in-place all-reduce per distinct key (one for plain FSDP), on a copy of the selected
    entries when several keys are mixed. No host synchronisation.

    Returns:
        The global squared norms, same shape and device as ``squares``.
    """
    import torch.distributed as dist

    distinct: dict[ReduceKey, list[int]] = {}
    for i, key in enumerate(keys):
        if key:
            distinct.setdefault(key, []).append(i)
    if len(distinct) == 1 and len(next(iter(distinct.values()))) == len(keys):
        (key,) = distinct
        for group in key:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
        return squares
    out = squares.clone()
    for key, idx in distinct.items():
        index = torch.tensor(idx, device=squares.device)
        part = out.index_select(0, index)
        for group in key:
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
        out.index_copy_(0, index, part)
    return out
