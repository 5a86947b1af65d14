"""Skip a non-finite or spiking step in any PyTorch loop: detect, decide and skip on the device.

:class:`InstabilityGuard` joins a :class:`~stabletrain.safety.spike_detector.SpikeDetector` and a
:class:`~stabletrain.safety.skip_step.SkipStep`: :meth:`~InstabilityGuard.check` decides on the device,
:meth:`~InstabilityGuard.step` runs the optimizer step and undoes it when bad, and
:meth:`~InstabilityGuard.poll` returns the recoveries the host can already see. See docs/self_healing.md.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import Tensor

from stabletrain.safety.skip_step import SkipStep
from stabletrain.safety.spike_detector import VERDICT_FIELDS, SpikeDetector, describe_trigger, trigger_name
from stabletrain.utils.amp import scaler_found_inf

__all__ = ["InstabilityGuard", "Recovery"]

_N = len(VERDICT_FIELDS)


@dataclass
class Recovery:
    """One bad step the guard acted on (host values)."""

    step: int
    trigger: str
    zscore: float
    ratio: float
    loss: float
    gradient_norm: float
    action: str
    samples: list[int] = field(default_factory=list)
    description: str = ""

    def to_row(self) -> dict[str, Any]:
        """The ``{"event": "recovery", ...}`` row written to metrics.jsonl."""
        return {
            "event": "recovery", "step": self.step, "trigger": self.trigger, "action": self.action,
            "zscore": _jf(self.zscore), "ratio": _jf(self.ratio), "loss": _jf(self.loss),
            "gradient_norm": _jf(self.gradient_norm), "samples": list(self.samples),
            "skipped_samples": list(self.samples),
        }


def _jf(x: float) -> Any:
    return x if math.isfinite(x) else str(x)


class _HostSlots:
    """A ring of host buffers for verdicts on their way to the host (pinned on a GPU), with
    NumPy views taken once: reading one later is a plain memory read, never a host copy."""

    def __init__(self, device: torch.device, n: int = 16):
        cuda = device.type == "cuda"
        if cuda:
            self.buffers = [torch.empty(_N, dtype=torch.float64, pin_memory=True) for _ in range(n)]
            self.views = [b.numpy() for b in self.buffers]
        else:  # NumPy memory seen as tensors: no Tensor.numpy() call (which sync counters count) for host memory
            self.views = [np.empty(_N, dtype=np.float64) for _ in range(n)]
            self.buffers = [torch.from_numpy(v) for v in self.views]
        self.events: list[Any] = [torch.cuda.Event() if cuda else None for _ in range(n)]
        self.next = 0


class _Pending:
    """A step's verdict on its way to the host."""

    def __init__(self, step: int, verdict: Tensor, samples: Any, slots: _HostSlots):
        self.step, self.samples = step, samples
        self.slot = slots.next
        slots.next = (slots.next + 1) % len(slots.buffers)
        self.view, self.event = slots.views[self.slot], slots.events[self.slot]
        if self.event is not None:
            slots.buffers[self.slot].copy_(verdict, non_blocking=True)
            self.event.record()
        else:
            slots.buffers[self.slot].copy_(verdict)  # host memory already: no device to wait for

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def values(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return [float(v) for v in self.view]


class InstabilityGuard:
    """Detect bad steps and skip their updates on the device; see the module docstring.

    Args:
        optimizer: The optimizer whose steps are guarded.
        window: Good steps in the detector's rolling window (these five are
            :class:`~stabletrain.safety.spike_detector.SpikeDetector`'s thresholds).
        zscore: Threshold on ``(log x - mean) / std`` over the window.
        warmup: Good steps seen before spikes are judged (non-finite values always are).
        max_ratio: A loss above this many times the largest loss seen is a spike.
        min_std: Floor of the window's standard deviation of the log values.
        skip: Undo bad steps (False: only detect and record).
        all_reduce: ``fn(tensor) -> tensor``, the mean over ranks, under DDP.
        action: The action recorded in each :class:`Recovery` (the trainer's rollback says so).
        scaler: The fp16 ``GradScaler``, if any: a step it skips on its own (its scaled gradients
            overflowed while the loss is finite; it lowers its scale and goes on) is not a bad
            step here. Without it every such step counts towards ``max_recoveries``: a healthy
            fp16 run, whose scale backs off a few times at the start and after each growth, would
            be stopped. Read from the flags of ``scaler.unscale_(optimizer)``, before :meth:`check`.
    """

    def __init__(self, optimizer: Any, *, window: int = 50, zscore: float = 6.0, warmup: int = 20,
                 max_ratio: float = 10.0, min_std: float = 0.05, skip: bool = True,
                 all_reduce: Optional[Callable[[Tensor], Tensor]] = None, action: str = "skip_step",
                 scaler: Any = None):
        self.optimizer = optimizer
        self.scaler = scaler
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        self.detector = SpikeDetector(window, zscore, warmup, max_ratio, min_std, device=device)
        self.skipper = SkipStep(optimizer) if skip else None
        self.all_reduce = all_reduce
        self.action = action
        #: The last step's device verdict ``[bad, trigger, zscore, ratio, loss, gradient_norm]``.
        self.verdict: Optional[Tensor] = None
        self._pending: deque[_Pending] = deque()
        self._slots = _HostSlots(device)
        self._early: list[Recovery] = []  # resolved because the ring was full, not yet returned

    def check(self, step: int, loss: Tensor | list[Tensor], grad_norm: Tensor, samples: Any = None,
              found_inf: Optional[Tensor] = None) -> Tensor:
        """Judge step ``step`` on the device; returns the device bool "skip this update".

        Call it once the gradients are final (after un-scaling under fp16), before clipping
        (a clipped NaN stays NaN, a clipped spike no longer looks like one) and before the
        optimizer step. ``loss``: the step's loss, or its microbatches' losses (averaged).
        ``samples``: the step's sample indices (kept on the host until the verdict is read).
        ``found_inf``: a device bool, the fp16 GradScaler will skip this step (default: read
        from ``scaler``'s flags, which exist once ``scaler.unscale_`` ran; give it when the
        gradients are still scaled, e.g. as ``~isfinite(grad_norm)``).
        """
        losses = loss if isinstance(loss, (list, tuple)) else [loss]
        mean = torch.stack([x.detach().reshape(()).float() for x in losses]).mean()
        if self.all_reduce is not None:
            mean = self.all_reduce(mean)
        verdict = self.detector.observe(mean, grad_norm)
        found = found_inf.to(verdict.device) if found_inf is not None else (
            scaler_found_inf(self.scaler, verdict.device) if self.scaler is not None else None)
        if found is not None:
            # The GradScaler's own skip (no update, a lower scale): neither bad nor a trigger. The
            # detector kept the step out of its window already (only good steps go in).
            overflow = found & torch.isfinite(mean.to(verdict.device))
            verdict = torch.cat([torch.where(overflow, 0.0, verdict[:2]), verdict[2:]])
        self.verdict = verdict
        if len(self._pending) == len(self._slots.buffers):  # the device is 16 steps behind: wait for the oldest
            self._early.extend(self._resolve(self._pending.popleft()))
        self._pending.append(_Pending(int(step), self.verdict, samples, self._slots))  # indices read only if bad
        bad = self.verdict[0] > 0
        if self.skipper is not None:
            self.skipper.save(bad)  # torch's AdamW/Adam/SGD: the step itself skips (skip_aware.py)
        return bad

    @property
    def bad(self) -> Tensor:
        """The last checked step's device bool (False before the first check)."""
        if self.verdict is None:
            return torch.zeros((), dtype=torch.bool)
        return self.verdict[0] > 0

    def step(self, optimizer_step: Optional[Callable[[], Any]] = None) -> Any:
        """Run ``optimizer.step()`` (or ``optimizer_step()``, e.g. ``lambda: scaler.step(opt)``),
        then undo it on the device if the checked step was bad."""
        result = optimizer_step() if optimizer_step is not None else self.optimizer.step()
        self.after_step()
        return result

    def after_step(self) -> None:
        """Undo the optimizer step just taken if the checked step was bad (device ops)."""
        if self.skipper is not None and self.verdict is not None:
            self.skipper.apply(self.bad)

    def poll(self, wait: bool = False) -> list[Recovery]:
        """The bad steps whose verdicts reached the host, oldest first; ``wait``: all of them
        (one host synchronisation on a GPU)."""
        found, self._early = self._early, []
        while self._pending and (wait or self._pending[0].ready()):
            found.extend(self._resolve(self._pending.popleft()))
        return found

    def ready_count(self) -> int:
        """How many pending verdicts the host can read now, oldest first."""
        n = 0
        for p in self._pending:
            if not p.ready():
                break
            n += 1
        return n

    def take_before(self, step: int) -> list[Recovery]:
        """Resolve the pending verdicts of the steps before ``step``, waiting for them if needed
        (on a GPU their copies left a step ago): every rank resolves the same steps."""
        return self.take(sum(1 for p in self._pending if p.step < step))

    def take(self, n: int) -> list[Recovery]:
        """Resolve the ``n`` oldest pending verdicts (ranks agree on ``n`` under DDP)."""
        found, self._early = self._early, []
        for _ in range(min(n, len(self._pending))):
            found.extend(self._resolve(self._pending.popleft()))
        return found

    def _resolve(self, pending: _Pending) -> list[Recovery]:
        bad, code, z, ratio, loss, gn = pending.values()
        if bad <= 0:
            return []
        return [Recovery(step=pending.step, trigger=trigger_name(code), zscore=z, ratio=ratio, loss=loss,
                         gradient_norm=gn, action=self.action, samples=_as_list(pending.samples),
                         description=describe_trigger(code, z, ratio, self.detector.max_ratio))]

    def state_dict(self) -> dict[str, Any]:
        return {"detector": self.detector.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["detector"])


def _as_list(samples: Any) -> list[int]:
    if samples is None:
        return []
    if isinstance(samples, Tensor):
        return [int(x) for x in samples.reshape(-1).tolist()]  # host indices (the loader's), no device
    out: list[int] = []
    for s in samples:
        out.extend(_as_list(s) if isinstance(s, (list, tuple, Tensor)) else [int(s)])
    return out
