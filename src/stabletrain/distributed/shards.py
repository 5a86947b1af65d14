"""Sharded state to files and back: each rank's shard, reassembled in one process.

:func:`local_shards` (no communication) gives this rank's slices of DTensor parameters as plain CPU
tensors and :func:`reassemble` puts them together in one process without ``torch.distributed``;
:func:`gather_full_state` (collective) gathers the full model and optimizer state on rank 0 and
:func:`load_full_state` loads such a state back into a sharded model. See docs/design/fsdp.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import torch
from torch import Tensor

from stabletrain.distributed.norms import dtensor_type
from stabletrain.errors import StabletrainError

if TYPE_CHECKING:
    from torch import nn

#: The ``format`` entry of a :func:`local_shards` dict; ``version`` is :data:`SHARDS_VERSION`.
SHARDS_FORMAT = "stabletrain.shards"
SHARDS_VERSION = 1


class ShardError(StabletrainError):
    """Shards cannot be described or put back together; the message says which tensor and rank."""


def local_shards(
    named_tensors: Iterable[tuple[str, Tensor]], rank: Optional[int] = None, world_size: Optional[int] = None
) -> dict[str, Any]:
    """This rank's part of each tensor, with its place in the full tensor; no communication.

    Args:
        named_tensors: ``model.named_parameters()``, ``named_buffers()`` or any (name, tensor)
            pairs. DTensors contribute their local shard; plain tensors (unsharded buffers, or a
            model that is not sharded at all) are stored whole and marked replicated.
        rank: This process's global rank; ``torch.distributed``'s when initialised, else 0.
        world_size: The number of processes; likewise.

    Returns:
        ``{"format", "version", "rank", "world_size", "tensors": {name: CPU tensor},
        "layout": {name: {"shape": full shape, "offset": start of the shard per dim,
        "sharded": bool}}}``: tensors, numbers, strings, lists and dicts only.

    Raises:
        ShardError: A placement other than ``Shard(d)`` and ``Replicate()`` (``Partial``, or the
            strided shards of FSDP combined with tensor parallelism), whose slices are not
            contiguous blocks.
    """
    rank, world_size = _rank_and_world(rank, world_size)
    dt = dtensor_type()
    tensors: dict[str, Tensor] = {}
    layout: dict[str, dict[str, Any]] = {}
    for name, tensor in named_tensors:
        t: Any = tensor.detach()
        if dt is not None and isinstance(t, dt):
            local = t.to_local()
            offset, shape = _shard_offset(name, t)
            if tuple(local.shape) != shape:
                raise ShardError(
                    f"{name}: the local shard has shape {tuple(local.shape)}, expected {shape} from the global shape "
                    f"{tuple(t.shape)} and placements {t.placements}; this sharding is not supported"
                )
            tensors[name] = local.to("cpu", copy=True)
            sharded = any(type(p).__name__ == "Shard" for p in t.placements)
            layout[name] = {"shape": list(t.shape), "offset": list(offset), "sharded": sharded}
        else:
            tensors[name] = t.to("cpu", copy=True)
            layout[name] = {"shape": list(t.shape), "offset": [0] * t.ndim, "sharded": False}
    return {
        "format": SHARDS_FORMAT,
        "version": SHARDS_VERSION,
        "rank": rank,
        "world_size": world_size,
        "tensors": tensors,
        "layout": layout,
    }


def _shard_offset(name: str, t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Start and shape of this rank's block of DTensor ``t``: each ``Shard(d)`` mesh dimension
    splits the current extent of tensor dim ``d`` as ``torch.chunk`` does (ceil-sized chunks,
    trailing ranks possibly empty), which is how DTensor and FSDP2 split."""
    start = [0] * t.ndim
    length = list(t.shape)
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:
        raise ShardError(f"{name}: this rank is not part of the DTensor's device mesh")
    for mesh_dim, placement in enumerate(t.placements):
        kind = type(placement).__name__
        if kind == "Replicate":
            continue
        if kind != "Shard":
            raise ShardError(
                f"{name}: placement {placement} on mesh dimension {mesh_dim} is not supported "
                "(only Shard(d) and Replicate(): FSDP and HSDP)"
            )
        d, n, c = placement.dim, t.device_mesh.size(mesh_dim), coordinate[mesh_dim]
        chunk = math.ceil(length[d] / n) if length[d] else 0
        begin = min(c * chunk, length[d])
        start[d] += begin
        length[d] = max(0, min(chunk, length[d] - begin))
    return tuple(start), tuple(length)


def reassemble(shards: Sequence[dict[str, Any]], replicated_from: int = 0) -> dict[str, Tensor]:
    """The full tensors from the :func:`local_shards` of every rank, in one process.

    Args:
        shards: One :func:`local_shards` dict per rank, in any order.
        replicated_from: The rank whose copy of an unsharded tensor is used. Under FSDP buffers
            are not sharded and not synchronised either: BatchNorm running statistics, for one,
            differ between ranks. :func:`replicated_mismatches` names those.

    Returns:
        ``{name: full CPU tensor}`` in the order of the first shard.

    Raises:
        ShardError: A rank is missing or twice, the shards disagree (names, shapes, dtypes,
            world size), or some element of a tensor is in no shard.
    """
    by_rank = _check_ranks(shards)
    first = by_rank[0]
    if replicated_from not in by_rank:
        raise ShardError(f"replicated_from={replicated_from} is not a rank of these shards (0..{len(by_rank) - 1})")
    names = list(first["layout"])
    for r, s in by_rank.items():
        if list(s["layout"]) != names:
            missing = sorted(set(names) - set(s["layout"]))
            extra = sorted(set(s["layout"]) - set(names))
            raise ShardError(f"rank {r}'s shard holds other tensors than rank 0's: missing {missing}, extra {extra}")
    out: dict[str, Tensor] = {}
    for name in names:
        lay = first["layout"][name]
        shape, dtype = tuple(lay["shape"]), first["tensors"][name].dtype
        for r, s in by_rank.items():
            other = s["layout"][name]
            if tuple(other["shape"]) != shape or s["tensors"][name].dtype != dtype:
                raise ShardError(
                    f"{name}: rank {r} has shape {tuple(other['shape'])} {s['tensors'][name].dtype}, "
                    f"rank 0 {shape} {dtype}; the shards come from different models"
                )
        if not lay["sharded"]:
            out[name] = by_rank[replicated_from]["tensors"][name].clone()
            continue
        full = torch.empty(shape, dtype=dtype)
        covered = torch.zeros(shape, dtype=torch.bool)
        for r, s in by_rank.items():
            local, offset = s["tensors"][name], s["layout"][name]["offset"]
            outside = any(o < 0 or o + n > size for o, n, size in zip(offset, local.shape, shape))
            if len(offset) != len(shape) or outside:
                raise ShardError(
                    f"{name}: rank {r}'s shard {tuple(local.shape)} at offset {list(offset)} lies outside the full "
                    f"shape {shape}; the shard file is damaged or not from local_shards"
                )
            block = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            full[block] = local
            covered[block] = True
        if not bool(covered.all()):
            raise ShardError(
                f"{name}: {int((~covered).sum())} of {covered.numel()} elements are in no rank's shard; "
                "the shards do not tile the tensor"
            )
        out[name] = full
    return out


def replicated_mismatches(shards: Sequence[dict[str, Any]]) -> list[str]:
    """Names of unsharded tensors whose copies differ between ranks (bitwise; NaN equals NaN)."""
    by_rank = _check_ranks(shards)
    first = by_rank[0]
    bad = []
    for name, lay in first["layout"].items():
        if lay["sharded"]:
            continue
        ref = first["tensors"][name]
        others = [s["tensors"][name] for s in by_rank.values()]
        if any(not torch.equal(ref, t) and not _same_with_nan(ref, t) for t in others):
            bad.append(name)
    return bad


def _same_with_nan(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _check_ranks(shards: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    if not shards:
        raise ShardError("no shards given")
    for s in shards:
        if s.get("format") != SHARDS_FORMAT:
            raise ShardError(f"not a {SHARDS_FORMAT} dict (format {s.get('format')!r})")
        if s.get("version", 0) > SHARDS_VERSION:
            raise ShardError(
                f"shard format version {s['version']} is newer than this stabletrain reads ({SHARDS_VERSION})"
            )
    worlds = sorted({int(s["world_size"]) for s in shards})
    if len(worlds) != 1:
        raise ShardError(f"the shards come from runs of different world sizes: {worlds}")
    world = worlds[0]
    ranks = sorted(int(s["rank"]) for s in shards)
    missing = sorted(set(range(world)) - set(ranks))
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if missing or twice:
        raise ShardError(
            f"shards of a {world}-process run: missing ranks {missing}, ranks given twice {twice}; "
            "every rank writes its own shard (under rank{r}/): give one per rank"
        )
    return {int(s["rank"]): s for s in shards}


def _rank_and_world(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    return rank, world_size


def gather_full_state(
    model: "nn.Module", optimizer: Optional[torch.optim.Optimizer] = None
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The full model and optimizer state on rank 0's CPU; empty dicts on the other ranks.

    Collective: every rank must call it. The model state has the keys of the unsharded model's
    ``state_dict()``; the optimizer state is keyed by parameter name (``{"state": {name: ...},
    "param_groups": [{"params": [names], ...}]}``) rather than by position. Both load with
    ``torch.load(weights_only=True)``.

    Args:
        model: The sharded model (after ``fully_shard``).
        optimizer: Its optimizer, built after sharding; None for the model only.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state: dict[str, Any] = get_model_state_dict(model, options=options)
    optim_state: dict[str, Any] = {}
    if optimizer is not None:
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)  # type: ignore[assignment]
    return model_state, optim_state


def load_full_state(
    model: "nn.Module",
    optimizer: Optional[torch.optim.Optimizer] = None,
    model_state: Optional[dict[str, Tensor]] = None,
    optim_state: Optional[dict[str, Any]] = None,
) -> None:
    """Put full states (as :func:`gather_full_state` returns them) into a sharded model and
    optimizer; each rank keeps its shard. Collective: every rank must call it.

    Only rank 0's ``model_state`` and ``optim_state`` are read; they are broadcast from it, so
    the other ranks may pass empty dicts (no shared file system needed, one copy in host memory).
    Either may be None to leave that part alone (a model loaded with ``load_state_dict`` before
    ``fully_shard`` needs only the optimizer state here, after sharding).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    if model_state is not None:
        set_model_state_dict(model, dict(model_state), options=options)  # type: ignore[arg-type]
    if optimizer is not None and optim_state is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)
