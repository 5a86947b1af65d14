"""Count host-device synchronisations.

``.item()``, ``bool(t)``, ``float(t)`` and ``if t:`` on a tensor all dispatch to
``aten._local_scalar_dense``, which on a GPU waits for every queued kernel. Counting that op
is how tests and benchmarks show that a tool keeps its statistics on the device::

    with CountSyncs() as syncs:
        train_step()
    print(syncs.count)

It counts on the CPU too (where a "sync" costs nothing), so the property can be tested on a
machine without a GPU. ``Tensor.tolist()`` and ``.cpu()`` copies are not counted on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountSyncs(TorchDispatchMode):
    """A TorchDispatchMode counting ``aten._local_scalar_dense`` calls while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))
