"""Sharded checkpoints through torch.distributed.checkpoint (DCP): no rank gathers the model.

:func:`sharded_state` is the model and optimizer state as each rank holds it (DTensor shards,
keyed by parameter name), :func:`write_shards` writes every rank's part into one folder, at once
or in a background thread (``dcp.async_save``), :func:`load_shards` loads a folder into a sharded
model and optimizer on any number of processes (DCP reshards), and :func:`load_full` reads a
folder in one process without a process group, as the full state a ``last.ckpt`` file holds.

DCP's own readers unpickle its index (``.metadata``) and its non-tensor items with
``weights_only=False``; here the index is read by an unpickler that accepts only DCP's
metadata classes, and the non-tensor items with ``torch.load(weights_only=True)``: reading a
checkpoint runs no code, as for a full file. See docs/distributed.md ("Sharded checkpoints").
"""

from __future__ import annotations

import io
import pickle
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch import nn

__all__ = ["sharded_state", "write_shards", "load_shards", "load_full", "positional_optimizer_state"]


def sharded_state(model: "nn.Module", optimizer: torch.optim.Optimizer, init: bool = False) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` as this rank holds them: DTensor shards (no copy, no
    collective), the optimizer state keyed by parameter name (``get_optimizer_state_dict``).

    An optimizer that has not stepped yet has no state, and ``get_optimizer_state_dict`` would
    create it by running a step with zero gradients and lr 0: AdamW's step count would then start
    at 1, and the first real update would differ from an unsharded run's. Without ``init`` such an
    optimizer gives ``{"state": {}, "param_groups": [...]}`` instead; ``init=True`` (a template
    to load a checkpoint into, whose values replace it) lets it create the state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if not optimizer.state and not init:
        names = {id(p): n for n, p in model.named_parameters()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        return {"model": get_model_state_dict(model), "optimizer": {"state": {}, "param_groups": groups}}
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def write_shards(state: dict[str, Any], folder: Path, *, asynchronous: bool = False,
                 process_group: Any = None) -> Optional[Future]:
    """Every rank writes its shards of ``state`` into ``folder`` (collective); rank 0 writes DCP's
    index last. Tensors replicated on every rank (plain tensors, e.g. AdamW's ``step``) are
    written once.

    Args:
        state: :func:`sharded_state`'s dict.
        folder: An existing folder every rank sees.
        asynchronous: ``dcp.async_save``: the state is first copied to host memory (this rank's
            shards: what the write costs in memory), then written by a background thread while
            training goes on; the returned future completes on rank 0 only once every rank's
            shards and the index are on disk.
        process_group: The group of the background write's collectives; give it a group of its
            own (gloo) so that they never interleave with training's.

    Returns:
        The future of an asynchronous write, else None (the write has finished on every rank).
    """
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(folder), single_file_per_rank=True, sync_files=True)
    if asynchronous:
        # With the default stager the copy to host memory is done when this returns: a Future.
        return dcp.async_save(state, storage_writer=writer, process_group=process_group)  # type: ignore[return-value]
    dcp.save(state, storage_writer=writer, process_group=process_group)
    return None


def load_shards(model: "nn.Module", optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load a sharded checkpoint into a sharded model and its optimizer (collective). Each rank
    reads only the parts of its own shards, whatever the world size that wrote them (DCP
    reshards). The optimizer keeps its hyperparameters (lr, betas, ...: this run's settings), as
    every resume does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    keep = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    state = sharded_state(model, optimizer, init=True)
    dcp.load(state, storage_reader=_SafeReader(str(folder)), planner=_SafeLoadPlanner())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    for group, kept in zip(optimizer.param_groups, keep):
        group.update(kept)


def set_sharded_state(model: "nn.Module", optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put a :func:`sharded_state` (or a copy of it kept in memory) back, each rank its own shards; an
    optimizer state taken before the first step (empty) empties the optimizer's. The optimizer keeps
    its hyperparameters (lr, ...), as every resume does."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, state["model"])
    if not state["optimizer"]["state"]:
        optimizer.state.clear()
        return
    keep = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    for group, kept in zip(optimizer.param_groups, keep):
        group.update(kept)


def load_full(folder: Path, optimizer: bool = True) -> dict[str, Any]:
    """The full model and optimizer state of a sharded checkpoint, in this one process, without
    a process group (``dcp.load(..., no_dist=True)`` into tensors allocated from DCP's index).

    Costs the whole state in host memory once (every parameter and optimizer moment: 12 bytes per
    parameter for float32 AdamW), as reading a full file does; nothing is written to disk.
    ``optimizer=False`` reads the model only (4 bytes per float32 parameter): what ``diagnose``
    needs of each checkpoint.

    Returns:
        ``{"model": {name: tensor}, "optimizer": torch's positional optimizer state}``: the form
        of a full checkpoint file, so every reader of checkpoints works unchanged.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _SafeReader(str(folder))
    metadata = reader.read_metadata()
    template: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        path = (metadata.planner_data or {}).get(key, (key,))
        if not optimizer and path[0] == "optimizer":
            continue
        value: Any = torch.empty(item.size, dtype=item.properties.dtype) if isinstance(
            item, TensorStorageMetadata) else None
        _set_path(template, path, value)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": meant
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(template, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=True)
    out: dict[str, Any] = {"model": template.get("model", {})}
    if optimizer:
        out["optimizer"] = positional_optimizer_state(template.get("optimizer") or {"state": {}, "param_groups": []})
    return out


def positional_optimizer_state(named: dict[str, Any]) -> dict[str, Any]:
    """``get_optimizer_state_dict``'s form (keyed by parameter name) as torch's own
    ``optimizer.state_dict()`` (keyed by position), without the model: the positions are the
    order of the names in ``param_groups``, which is the optimizer's own."""
    order = [n for g in named["param_groups"] for n in g["params"]]
    index = {n: i for i, n in enumerate(order)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
              for g in named["param_groups"]]
    return {"state": {index[n]: v for n, v in named["state"].items()}, "param_groups": groups}


def _set_path(root: dict[str, Any], path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` (DCP's planner_data: dict keys and list indices) in ``root``."""
    node: Any = root
    for key, nxt in zip(path[:-1], path[1:]):
        child = (node[key] if key < len(node) else None) if isinstance(node, list) else node.get(key)
        if child is None:
            child = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                node.extend([None] * (key + 1 - len(node)))
                node[key] = child
            else:
                node[key] = child
        node = child
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


# --------------------------------------------------------------------------------------
# Reading without running code
# --------------------------------------------------------------------------------------

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's index holds its own metadata classes, torch sizes, dtypes and paths; nothing else loads."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"DCP's index (.metadata) refers to {module}.{name}, which a checkpoint's index does not hold; "
            "not loaded (it could run code)"
        )


def _reader_base() -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader


class _SafeReader(_reader_base()):  # type: ignore[misc]
    """``FileSystemReader`` whose index is read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _planner_base() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    return DefaultLoadPlanner


class _SafeLoadPlanner(_planner_base()):  # type: ignore[misc]
    """DCP's default planner, with its non-tensor items read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            _set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def local_tensors(obj: Any) -> list[Tensor]:
    """Every tensor of a nested state, DTensors as their local shards."""
    from stabletrain.distributed.norms import local_tensor

    if isinstance(obj, Tensor):
        return [local_tensor(obj)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in local_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in local_tensors(v)]
    return []
