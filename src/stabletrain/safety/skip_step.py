"""Make an optimizer step a no-op on the device when a flag says so, for any optimizer.

:class:`SkipStep` saves the parameters and per-parameter optimizer state before ``optimizer.step()``
(:meth:`~SkipStep.save`) and puts them back with ``torch.where`` where the device flag is set
(:meth:`~SkipStep.apply`): no host read, a kept step is bitwise the optimizer's own. Costs one copy of
the parameters and state. See docs/self_healing.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["SkipStep", "optimizer_tensors"]


def optimizer_tensors(optimizer: Any) -> list[Tensor]:
    """The parameters and the floating per-parameter state tensors (not 0-dim counts), in a
    fixed order."""
    out: list[Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(p)
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, Tensor) and v.is_floating_point() and v.ndim > 0:
                    out.append(v)
    return out


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
