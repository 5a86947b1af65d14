"""Sharded (FSDP2) and multi-node training: the pieces that do not live in the trainer.

* :mod:`~stabletrain.distributed.fsdp`: which modules become FSDP2 units (:func:`fsdp_units`),
  :func:`parallelize` for Lightning Fabric's ``ModelParallelStrategy``, and
  :func:`fabric_strategy`, which turns ``strategy="fsdp"`` into what Fabric needs on CPU and GPU.
* :mod:`~stabletrain.distributed.norms`: the mesh reduction that makes
  :func:`stabletrain.debug.grad_norm.compute_grad_norm` global under sharding.
* :mod:`~stabletrain.distributed.shards`: each rank's shard of a state in a file-safe form,
  reassembled into the full state in one process; full state dicts gathered on rank 0.

Nothing here is imported by ``import stabletrain``; ``torch.distributed`` is imported only
when a function needs it. ``docs/design/fsdp.md`` records what was measured and why.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FSDP_STRATEGY_NAMES": "stabletrain.distributed.fsdp",
    "FSDP2Strategy": "stabletrain.distributed.fsdp",
    "fabric_strategy": "stabletrain.distributed.fsdp",
    "fsdp_units": "stabletrain.distributed.fsdp",
    "is_sharded": "stabletrain.distributed.fsdp",
    "parallelize": "stabletrain.distributed.fsdp",
    "SHARDS_FORMAT": "stabletrain.distributed.shards",
    "ShardError": "stabletrain.distributed.shards",
    "gather_full_state": "stabletrain.distributed.shards",
    "load_full_state": "stabletrain.distributed.shards",
    "local_shards": "stabletrain.distributed.shards",
    "reassemble": "stabletrain.distributed.shards",
    "replicated_mismatches": "stabletrain.distributed.shards",
}

__all__ = list(_EXPORTS)  # noqa: PLE0605 (the names are the keys above)


def __getattr__(name: str) -> Any:
    # Lazy, like stabletrain/__init__: debug/grad_norm.py imports .norms on every start, and
    # that must not import Lightning Fabric's strategies.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'stabletrain.distributed' has no attribute {name!r}")
