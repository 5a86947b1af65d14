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


class SyncsPerStep:
    """A trainer callback counting host synchronisations per training step.

    Counts from each step's start to the next step's start (the step's logging and every
    callback included); the end-of-run checkpoint and anything after an exception are not
    part of a step. ``counts[step]`` is the number for that step::

        counter = SyncsPerStep()
        stabletrain.train(out="out/x", callbacks=[counter])
        print(counter.counts)
    """

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self._mode: CountSyncs | None = None
        self._step = -1

    def _close(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.counts[self._step] = self._mode.count
            self._mode = None

    def on_step_start(self, trainer: object, *, step: int) -> None:
        self._close()
        self._step, self._mode = step, CountSyncs()
        self._mode.__enter__()

    def on_checkpoint_save(self, trainer: object, *, step: int, state: Any) -> None:
        self._close()

    def on_train_end(self, trainer: object) -> None:
        self._close()

    def on_exception(self, trainer: object, *, exception: BaseException) -> None:
        self._close()
