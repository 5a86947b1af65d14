"""Make an optimizer step a no-op on the device when a flag says so, for any optimizer.

:class:`SkipStep` saves the parameters and per-parameter optimizer state before ``optimizer.step()``
(:meth:`~SkipStep.save`) and puts them back with ``torch.where`` where the device flag is set
(:meth:`~SkipStep.apply`): no host read, a kept step is bitwise the optimizer's own. Costs one copy of
the parameters and state. See docs/self_healing.md.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from stabletrain.distributed.norms import dtensor_type

__all__ = ["SkipStep", "optimizer_tensors"]


def optimizer_tensors(optimizer: Any) -> list[Tensor]:
    """The parameters and the floating per-parameter state tensors (not 0-dim counts), in a
    fixed order. Under FSDP2 each rank's local shards (:func:`local_view`): the step is saved and
    restored per shard, on the device, with the flag every rank agreed on."""
    out: list[Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(local_view(p))
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, Tensor) and v.is_floating_point() and v.ndim > 0:
                    out.append(local_view(v))
    return out


#: id(DTensor) -> (a weak reference to it, its local view); an entry goes when its DTensor does. (Not a
#: WeakKeyDictionary: that compares keys with ``==``, which for tensors is elementwise.)
_LOCAL_VIEWS: dict[int, tuple[Any, Tensor]] = {}


def local_view(t: Tensor) -> Tensor:
    """``t`` itself, or for an FSDP2 DTensor its local shard: the same view object on every call
    (``to_local()`` makes a new one each time, and the saved copies are matched to the live
    tensors by identity), sharing the shard's memory, so writing it writes the DTensor."""
    dt = dtensor_type()
    if dt is None or not isinstance(t, dt):
        return t
    with torch.no_grad():
        local = t.to_local()
    key = id(t)
    entry = _LOCAL_VIEWS.get(key)
    if entry is not None and entry[0]() is t:
        view = entry[1]
        if view.data_ptr() == local.data_ptr() and view.shape == local.shape:
            return view
    # The first call, or the shard moved: its memory from now on.
    _LOCAL_VIEWS[key] = (weakref.ref(t, lambda _, k=key: _LOCAL_VIEWS.pop(k, None)), local)  # type: ignore[misc]
    return local


class SkipStep:
    """Save before ``optimizer.step()``, restore after it where a device flag is set.

    Example::

        skipper = SkipStep(optimizer)
        skipper.save()
        optimizer.step()
        skipper.apply(skip)        # skip: a device bool; True leaves params and state unchanged
    """

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer
        self._live: list[Tensor] = []
        self._saved: list[Tensor] = []

    def save(self) -> None:
        """Copy parameters and state into the saved buffers (allocated once, reused)."""
        live = optimizer_tensors(self.optimizer)
        same = len(live) == len(self._live) and all(a is b for a, b in zip(live, self._live))
        if not same:
            self._live = live
            self._saved = [t.detach().clone() for t in live]
        else:
            with torch.no_grad():
                torch._foreach_copy_(self._saved, [t.detach() for t in live])

    def apply(self, skip: Tensor) -> None:
        """Where ``skip`` is true, put the saved values back (and zero state the step created)."""
        old = {id(t): s for t, s in zip(self._live, self._saved)}
        flags: dict[torch.device, Tensor] = {}
        with torch.no_grad():
            for t in optimizer_tensors(self.optimizer):
                flag = flags.get(t.device)
                if flag is None:
                    flag = flags[t.device] = skip.reshape(()).to(t.device, torch.bool)
                saved = old.get(id(t))
                if saved is None:  # created by this step: what the optimizer starts from is zeros
                    saved = torch.zeros_like(t)
                torch.where(flag, saved, t, out=t)

    @property
    def saved_bytes(self) -> int:
        """Bytes held by the saved copy."""
        return sum(t.numel() * t.element_size() for t in self._saved)
