"""Make an optimizer step a no-op on the device when a flag says so, for any optimizer.

Two ways, chosen per step by :class:`SkipStep`:

* torch's AdamW, Adam and SGD, given the flag before the step (:meth:`~SkipStep.save` with
  ``skip``): the next ``optimizer.step()`` runs a skip-aware step
  (:mod:`stabletrain.safety.skip_aware`) that folds the flag into the update: no copy, no extra
  memory, a kept step bitwise torch's own (checked once per configuration against torch);
* any other optimizer (or a configuration the skip-aware step does not follow): parameters and
  per-parameter state are copied before ``optimizer.step()`` and put back with ``torch.where``
  where the flag is set (:meth:`~SkipStep.apply`); a kept step is the optimizer's own. Costs one
  copy of the parameters and state.

Neither reads the flag on the host. See docs/self_healing.md.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from stabletrain.distributed.norms import dtensor_type
from stabletrain.safety.skip_aware import skip_aware_step, supported

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


def _replaceable(own_step: Any) -> bool:
    """Whether an optimizer's instance-level ``step`` (None: the class's) may be replaced for a step:
    not when something else wrapped it, except torch's lr schedulers, whose wrapper only records
    that the step was called (the skip-aware step records it too)."""
    return own_step is None or bool(getattr(own_step, "_wrapped_by_lr_sched", False))


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
    """Before ``optimizer.step()``, :meth:`save`; after it, :meth:`apply`: where a device flag is
    set, the step leaves parameters and state as they were.

    Args:
        optimizer: The optimizer whose steps may be skipped.
        skip_aware: Use the skip-aware step for torch's AdamW, Adam and SGD when the flag is
            given to :meth:`save` (False: always the copy).

    Example::

        skipper = SkipStep(optimizer)
        skipper.save(skip)         # skip: a device bool; True leaves params and state unchanged
        optimizer.step()
        skipper.apply(skip)
    """

    def __init__(self, optimizer: Any, skip_aware: bool = True):
        self.optimizer = optimizer
        self.skip_aware = skip_aware
        self._live: list[Tensor] = []
        self._saved: list[Tensor] = []
        #: How the last :meth:`save` prepared the step: ``"skip_aware"`` or ``"copy"``.
        self.mode: Optional[str] = None
        self._installed: Any = None
        self._before: Any = None  # the instance's own step attribute, put back after ours
        self._checked: tuple[Any, bool] = (None, False)
        self.can_skip_aware()  # the check against torch (a few host reads, once) at setup, not in a step

    # ------------------------------------------------------------------ choosing

    def _signature(self) -> tuple:
        """What :func:`supported` and the check's configuration (``_structure``) depend on, cheap to
        compute every step: a change re-runs :func:`supported`."""
        opt = self.optimizer

        def of(g: dict[str, Any]) -> tuple:
            first = g["params"][0] if g["params"] else None
            where = None if first is None else (first.device, first.dtype, type(first))
            decay = g.get("weight_decay")
            return (id(g), len(g["params"]), g.get("foreach"), g.get("fused"), g.get("amsgrad"), g.get("maximize"),
                    g.get("capturable"), g.get("differentiable"), type(decay), bool(decay != 0),
                    g.get("momentum", 0) != 0, g.get("nesterov"), g.get("dampening", 0) != 0,
                    g.get("decoupled_weight_decay"), type(g.get("lr")), tuple(type(b) for b in g.get("betas", ())),
                    where)

        return (type(opt), tuple(of(g) for g in opt.param_groups))

    def can_skip_aware(self) -> bool:
        """Whether the next step can be the skip-aware one (see the module docstring)."""
        opt = self.optimizer
        if not self.skip_aware or not _replaceable(vars(opt).get("step")):
            return False
        sig = self._signature()
        if self._checked[0] != sig:
            self._checked = (sig, supported(opt))
        return self._checked[1]

    # ------------------------------------------------------------------ the two calls

    def save(self, skip: Optional[Tensor] = None) -> None:
        """Prepare the next ``optimizer.step()``: given ``skip`` (a device bool) and an optimizer
        the skip-aware step follows, that step will skip by itself; otherwise copy parameters
        and state into the saved buffers (allocated once, reused)."""
        self._uninstall()
        if skip is not None and self.can_skip_aware():
            self._install(~skip.reshape(()).to(torch.bool))
            self.mode = "skip_aware"
            return
        self.mode = "copy"
        live = optimizer_tensors(self.optimizer)
        same = len(live) == len(self._live) and all(a is b for a, b in zip(live, self._live))
        if not same:
            self._live = live
            self._saved = [t.detach().clone() for t in live]
        else:
            with torch.no_grad():
                torch._foreach_copy_(self._saved, [t.detach() for t in live])

    def apply(self, skip: Tensor) -> None:
        """After the step: where ``skip`` is true, put the saved values back (and zero state the
        step created); after a skip-aware step, nothing is left to do."""
        if self.mode == "skip_aware":
            self._uninstall()  # the step did it (or was not taken, e.g. a GradScaler's skip)
            return
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

    # ------------------------------------------------------------------ the skip-aware step

    def _install(self, keep: Tensor) -> None:
        """Replace ``optimizer.step`` for one call by the skip-aware step, with the optimizer's
        step hooks (torch's own wrapper runs them)."""
        before = vars(self.optimizer).get("step")

        def step(opt: Any, closure: Any = None) -> Any:
            self._uninstall()
            if before is not None:  # what an lr scheduler's wrapper of the step records
                opt._opt_called = True
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            with torch.no_grad():
                skip_aware_step(opt, keep)
            return loss

        bound = types.MethodType(torch.optim.Optimizer.profile_hook_step(step), self.optimizer)
        self.optimizer.step = bound
        self._installed, self._before = bound, before

    def _uninstall(self) -> None:
        if self._installed is not None and vars(self.optimizer).get("step") is self._installed:
            if self._before is not None:
                self.optimizer.step = self._before
            else:
                del self.optimizer.step
        self._installed = self._before = None

    @property
    def saved_bytes(self) -> int:
        """Bytes held by the saved copy (0 while only skip-aware steps were taken)."""
        return sum(t.numel() * t.element_size() for t in self._saved)
