"""Decide on the device whether a step is non-finite or spikes, with no host synchronisation.

:class:`SpikeDetector` keeps the last ``window`` good steps' log loss and log gradient norm in a
device buffer, the newest first; :meth:`~SpikeDetector.observe` returns the verdict as a device vector
``[bad, trigger, zscore, ratio, loss, gradient_norm]`` (triggers ``nonfinite_loss``,
``nonfinite_grad``, ``loss_spike``, ``grad_spike``). See docs/self_healing.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["SpikeDetector", "TRIGGERS", "VERDICT_FIELDS"]

#: Trigger names by code (0: the step is good).
TRIGGERS = ("none", "nonfinite_loss", "nonfinite_grad", "loss_spike", "grad_spike")
#: The verdict vector's entries, in order.
VERDICT_FIELDS = ("bad", "trigger", "zscore", "ratio", "loss", "gradient_norm")
_TINY = 1e-30
#: Good steps whose mean is the reference a new value is compared with.
REFERENCE_STEPS = 5
#: Successive differences of the log loss count at most this many times their median in the
#: noise: Gaussian noise's differences pass it with odds of 99.9%; a warm-up spike's do not.
CLIP = 5.0


class SpikeDetector:
    """Rolling z-score and max-ratio spike detection kept on the device.

    Args:
        window: Good steps in the rolling window.
        zscore: Threshold on ``(log x - mean) / std`` over the window.
        warmup: Good steps seen before spikes are judged (non-finite values always are).
        max_ratio: A loss above this many times the largest loss seen is a spike.
        min_std: Floor of the window's standard deviation of the log values.
        device: Where the state lives (the loss's device).

    Example::

        detector = SpikeDetector(device=loss.device)
        verdict = detector.observe(loss, grad_norm)   # device tensor; verdict[0] > 0: bad step
    """

    def __init__(self, window: int = 50, zscore: float = 6.0, warmup: int = 20, max_ratio: float = 10.0,
                 min_std: float = 0.05, device: Any = "cpu"):
        if window < 2 or warmup < 2:
            raise ValueError(f"window and warmup must be >= 2, got window={window}, warmup={warmup}")
        self.window, self.zscore, self.warmup = int(window), float(zscore), int(warmup)
        self.max_ratio, self.min_std = float(max_ratio), float(min_std)
        self.device = torch.device(device)
        #: The last ``window`` good steps' log loss (row 0) and log gradient norm (row 1), the newest
        #: first; the entries past the good steps seen are 0.
        self.buffer = torch.zeros(2, self.window, dtype=torch.float64, device=self.device)
        self.count = torch.zeros((), dtype=torch.int64, device=self.device)
        self.max_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._table = _weights(self.window).to(self.device)
        self._codes = torch.arange(1, len(TRIGGERS), device=self.device)
        self._nan = torch.full((3,), math.nan, dtype=torch.float64, device=self.device)
        self._limits = torch.tensor([self.max_ratio, math.inf], dtype=torch.float64, device=self.device)

    def observe(self, loss: Tensor, grad_norm: Tensor) -> Tensor:
        """Judge one step from its (mean) loss and total gradient norm; device ops only.

        Returns the float64 verdict vector ``[bad, trigger, zscore, ratio, loss, gradient_norm]``
        (``zscore``: of the value that triggered, NaN for non-finite triggers).
        """
        # About 80 small device ops, each launched from Python: what the step pays for the detector
        # (docs/benchmarks.md). What depends on the number of good steps alone is read from a table.
        w = self.window
        v = torch.stack([loss.detach().reshape(()).to(self.device, torch.float64),
                         grad_norm.detach().reshape(()).to(self.device, torch.float64)])
        # The log of a NaN or an Inf is never read: such a step is bad, and only good steps are written.
        x = v.clamp_min(_TINY).log_()
        # The weights for n = min(count, window) good steps (a 0-dim index would be read on the host).
        row = self._table.index_select(0, self.count.clamp(max=w).reshape(1)).reshape(-1)
        buf = self.buffer
        # Means: row 0 of the newest REFERENCE_STEPS good log losses, row 1 of the window's log norms.
        mean = (buf * row[:2 * w].view(2, w)).sum(1)
        # Loss noise from successive differences (von Neumann): a loss that falls fast in early
        # training does not widen it, as it would widen the window's plain std. Each difference
        # is capped at CLIP times their median, so that a spike the warm-up let into the window
        # (two huge differences, into and out of it) does not inflate the noise for the next
        # `window` steps and hide the same spike when it comes back. NaN marks what is not a pair.
        diff = (buf[0, :-1] - buf[0, 1:]).abs_().add_(row[3 * w:4 * w - 1])
        capped = torch.minimum(diff, torch.nanmedian(diff) * CLIP)
        # The gradient norm has no steady trend to discount but wanders (it rises early in
        # training): its z-score is against the whole window's mean and standard deviation.
        dev = (buf[1] - mean[1]).mul_(row[2 * w:3 * w])
        squares = torch.stack([capped.square_().nansum(), torch.dot(dev, dev)])
        std = squares.div_(row[4 * w - 1:]).sqrt_().clamp_min_(max(self.min_std, _TINY))
        z = (x - mean).div_(std)
        # A loss above max_ratio x the largest good loss (no rule while every good loss was 0); the
        # gradient norm's entry of the ratio is compared with inf: never above it.
        ratio = v / self.max_loss.clamp_min(_TINY)
        bad = (z > self.zscore) | ((ratio > self._limits) & (self.max_loss > 0))
        judged = bad & (self.count >= self.warmup)
        # The first condition that holds names the trigger (codes 1..4; 5: none). v - v is NaN for a
        # NaN or an Inf, 0 otherwise.
        first = torch.where(torch.cat([(v - v).ne(0), judged]), self._codes, len(TRIGGERS)).amin()
        trigger = first % len(TRIGGERS)
        good = first == len(TRIGGERS)
        self.buffer = torch.where(good, torch.cat([x[:, None], buf[:, :-1]], 1), buf)
        self.count = self.count + good
        self.max_loss = torch.where(good, torch.maximum(self.max_loss, v[0]), self.max_loss)
        score = torch.cat([self._nan, z, self._nan]).index_select(0, first.reshape(1))  # codes 3, 4: z
        head = torch.stack([trigger.clamp(max=1), trigger]).double()
        return torch.cat([head, score, ratio[:1], v])

    def state_dict(self) -> dict[str, Tensor]:
        """The detector's state (device copies: ``torch.save`` moves them with the rest of a
        checkpoint, no read of its own), for checkpoints: a resumed run judges the same."""
        return {"recent": self.buffer.clone(), "count": self.count.clone(), "max_loss": self.max_loss.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load :meth:`state_dict`'s output, or an older stabletrain's (a ring ``buffer`` whose newest
        entry is at ``(count - 1) % window``), on the device without reading it."""
        ring = "recent" not in state
        buffer = state["buffer" if ring else "recent"].to(self.device, torch.float64)
        if buffer.shape != self.buffer.shape:
            raise ValueError(f"the saved detector window holds {buffer.shape[1]} steps, this one {self.window}: "
                             "resume with the same on_instability.window")
        count = state["count"].to(self.device, torch.int64).reshape(())
        if ring:
            age = torch.arange(self.window, device=self.device)
            buffer = torch.where(age < count, buffer[:, (count - 1 - age) % self.window], 0.0)
        self.buffer = buffer
        self.count = count
        self.max_loss = state["max_loss"].to(self.device, torch.float64).reshape(())


def _weights(window: int) -> Tensor:
    """Row ``n`` (good steps in the window, 0 to ``window``): what :meth:`SpikeDetector.observe` needs
    that depends on ``n`` alone, float64: the mean weights of the loss (1/k on the newest k =
    min(n, REFERENCE_STEPS)) and of the gradient norm (1/n on the newest n); 1 on the n valid
    entries; 0 on the n - 1 successive pairs and NaN on the others; the divisors of the squares,
    2 max(n - 1, 1) and max(n - 1, 1)."""
    w = window
    table = torch.zeros(w + 1, 4 * w + 1, dtype=torch.float64)
    for n in range(w + 1):
        k = min(n, REFERENCE_STEPS)
        table[n, :k] = 1.0 / max(k, 1)
        table[n, w:w + n] = 1.0 / max(n, 1)
        table[n, 2 * w:2 * w + n] = 1.0
        table[n, 3 * w + max(n - 1, 0):4 * w - 1] = math.nan
        table[n, 4 * w - 1:] = torch.tensor([2.0 * max(n - 1, 1), float(max(n - 1, 1))], dtype=torch.float64)
    return table


def trigger_name(code: float) -> str:
    """The trigger's name for a verdict's code."""
    i = int(code)
    return TRIGGERS[i] if 0 <= i < len(TRIGGERS) else f"unknown({code})"


def describe_trigger(code: float, zscore: float, ratio: float, max_ratio: float) -> str:
    """``loss_spike (z=8.1)``, ``loss_spike (12.0x the largest loss)``, ``nonfinite_grad``."""
    name = trigger_name(code)
    if name == "loss_spike" and math.isfinite(ratio) and ratio > max_ratio:
        return f"{name} ({ratio:.1f}x the largest loss seen)"
    if name in ("loss_spike", "grad_spike") and math.isfinite(zscore):
        return f"{name} (z={zscore:.1f})"
    return name


__all__ += ["trigger_name", "describe_trigger"]
