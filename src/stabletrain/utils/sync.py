"""Count host-device synchronisations.

``with CountSyncs() as syncs: ...`` counts, on the CPU as on a GPU, the points where the host would
wait for the device (``.item()`` and friends, ops whose output size depends on the values such as
``nonzero``, ``torch.equal``, copies to the host; ``syncs.count``, ``syncs.by_op``), so tests and
benchmarks can show that a tool keeps its statistics on the device. See docs/benchmarks.md.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

#: Dispatcher ops that make the host wait for the device, whatever their arguments.
SYNC_OPS = frozenset(
    op
    for op in (
        _aten._local_scalar_dense.default,
        _aten.nonzero.default,
        _aten.masked_select.default,
        _aten.equal.default,
        _aten.allclose.default,
        _aten._unique.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
    )
)

#: Ops that sync only with some arguments: a boolean mask index, or no ``output_size``.
_MASK_INDEX_OPS = frozenset((_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default))
_REPEAT_INTERLEAVE = frozenset((_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor))

#: Tensor methods that copy to the host, counted at the Python level (the dispatcher does not
#: see them on the CPU).
_HOST_COPY_METHODS = ("tolist", "numpy", "cpu")


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _syncs(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    if func in SYNC_OPS:
        return True
    if func in _MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(_is_mask(i) for i in indices or ())
    if func in _REPEAT_INTERLEAVE:
        return kwargs.get("output_size") is None
    return False


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` is a blocking copy to the CPU."""
    if kwargs.get("non_blocking") or any(a is True for a in args[1:]):
        return False
    target = kwargs.get("device", args[0] if args else None)
    # Only the literal "cpu" says "to the host": a torch.device variable is the training device,
    # which is the CPU in a CPU run and the GPU in a GPU run.
    return isinstance(target, str) and torch.device(target).type == "cpu"


class CountSyncs(TorchDispatchMode):
    """Counts host synchronisations (see the module docstring for which) while active.

    ``count`` is the total; ``by_op`` maps each op or method name to its count.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.by_op: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Callable[..., Any]] = {}

    def _add(self, name: str) -> None:
        self.count += 1
        self.by_op[name] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            self._add(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)

    def __enter__(self) -> "CountSyncs":
        super().__enter__()
        self._patch()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._unpatch()
        super().__exit__(*exc)

    def _patch(self) -> None:
        counter = self

        def copying(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
            def method(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                counter._add(name)
                return original(t, *args, **kwargs)

            return method

        def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if _to_host(args, kwargs):
                counter._add("to_cpu")
            return original_to(t, *args, **kwargs)

        for name in _HOST_COPY_METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, copying(name, self._saved[name]))
        original_to = self._saved["to"] = torch.Tensor.to
        torch.Tensor.to = to  # type: ignore[method-assign,assignment]

    def _unpatch(self) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()


class SyncsPerStep:
    """A trainer callback counting host synchronisations per training step.

    Counts from each step's start to the next step's start (the step's logging and every
    callback included); the end-of-run checkpoint and anything after an exception are not
    part of a step. ``counts[step]`` is the number for that step, ``ops[step]`` what they were::

        counter = SyncsPerStep()
        stabletrain.train(out="out/x", callbacks=[counter])
        print(counter.counts)
    """

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.ops: dict[int, dict[str, int]] = {}
        self._mode: CountSyncs | None = None
        self._step = -1

    def _close(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.counts[self._step] = self._mode.count
            self.ops[self._step] = dict(self._mode.by_op)
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
