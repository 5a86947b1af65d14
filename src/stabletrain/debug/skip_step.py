"""Make an optimizer step a no-op on the device when a flag says so, for any optimizer.

:class:`SkipStep` copies the parameters and the optimizer's per-parameter state tensors into
buffers kept for the purpose (:meth:`~SkipStep.save`, before ``optimizer.step()``), and after
the step puts the old values back where the device flag is set (:meth:`~SkipStep.apply`,
``torch.where`` into the live tensors). No host synchronisation, and:

* a step that is not skipped is the optimizer's own step, so the result is bitwise what
  ``torch.optim.AdamW``, ``SGD`` or any user optimizer computes;
* a skipped step leaves parameters and moments bitwise unchanged, even when the gradients
  were NaN (``torch.where`` selects, it does not multiply);
* 0-dim state (AdamW's ``step`` count, kept on the CPU) is not restored: the step count
  advances on a skipped step, as the lr schedule does (restoring a CPU count from a device
  flag would need a host read). AdamW's bias correction then uses a count one higher, which
  matters only in the first few dozen steps (``1 - beta2**t``);
* state a skipped first step created (AdamW's moments, SGD's momentum buffer) is zeroed,
  which is what AdamW starts from; SGD with ``dampening=0`` then computes the same next step.

The price is memory: one copy of the parameters and of the state (12 bytes per float32
parameter with AdamW), plus two passes over them per step. The fp16 GradScaler is untouched:
it skips overflowing steps itself and updates its scale as usual.
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
