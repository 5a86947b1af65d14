"""Decide on the device whether a step is non-finite or spikes, with no host synchronisation.

:class:`SpikeDetector` keeps the last ``window`` good steps' log loss and log gradient norm in a
device ring buffer; :meth:`~SpikeDetector.observe` returns the verdict as a device vector
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
        self.buffer = torch.zeros(2, self.window, dtype=torch.float64, device=self.device)
        self.count = torch.zeros((), dtype=torch.int64, device=self.device)
        self.max_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._slots = torch.arange(self.window, device=self.device)

    def observe(self, loss: Tensor, grad_norm: Tensor) -> Tensor:
        """Judge one step from its (mean) loss and total gradient norm; device ops only.

        Returns the float64 verdict vector ``[bad, trigger, zscore, ratio, loss, gradient_norm]``
        (``zscore``: of the value that triggered, NaN for non-finite triggers).
        """
        loss_v = loss.detach().reshape(()).double().to(self.device)
        gn_v = grad_norm.detach().reshape(()).double().to(self.device)
        nf_loss, nf_grad = ~torch.isfinite(loss_v), ~torch.isfinite(gn_v)
        x = torch.log(torch.stack([loss_v, gn_v]).nan_to_num(0.0, 0.0, 0.0).clamp_min(_TINY))
        n = torch.clamp(self.count, max=self.window)
        age = (self.count - 1 - self._slots) % self.window  # 0: the newest good step
        recent = ((age < REFERENCE_STEPS) & (age < n)).double()
        mean = (self.buffer * recent).sum(1) / recent.sum().clamp_min(1)
        # Noise from successive differences (von Neumann): a loss that falls fast in early
        # training does not widen it, as it would widen the window's plain std. Each difference
        # is capped at CLIP times their median, so that a spike the warm-up let into the window
        # (two huge differences, into and out of it) does not inflate the noise for the next
        # `window` steps and hide the same spike when it comes back.
        pairs = age <= n - 2
        diff = (self.buffer - torch.roll(self.buffer, 1, dims=1)).abs()
        cap = CLIP * torch.nanmedian(torch.where(pairs, diff, math.nan), dim=1).values.nan_to_num(0.0)
        capped = torch.minimum(diff, cap[:, None])
        var_vn = (capped**2 * pairs).sum(1) / (2 * pairs.sum().clamp_min(1))
        floor = max(self.min_std, _TINY)
        z_loss = (x[0] - mean[0]) / var_vn[0].sqrt().clamp_min(floor)
        # The gradient norm has no steady trend to discount but wanders (it rises early in
        # training): its z-score is against the whole window's mean and standard deviation.
        valid = (self._slots < n).double()
        w_mean = (self.buffer[1] * valid).sum() / n.clamp_min(1)
        w_var = ((self.buffer[1] - w_mean) ** 2 * valid).sum() / (n - 1).clamp_min(1)
        z = torch.stack([z_loss, (x[1] - w_mean) / w_var.sqrt().clamp_min(floor)])
        judged = self.count >= self.warmup
        spike = judged & (z > self.zscore)
        ratio = loss_v / self.max_loss.clamp_min(_TINY)
        ratio_bad = judged & (self.max_loss > 0) & (ratio > self.max_ratio)
        loss_bad = spike[0] | ratio_bad
        trigger = torch.where(nf_loss, 1, torch.where(nf_grad, 2, torch.where(loss_bad, 3,
                                                                              torch.where(spike[1], 4, 0))))
        nan = torch.full((), math.nan, dtype=torch.float64, device=self.device)
        score = torch.where(trigger == 3, z[0], torch.where(trigger == 4, z[1], nan))
        bad = trigger > 0
        good = ~bad
        slot = (self._slots == self.count % self.window) & good
        self.buffer = torch.where(slot, x[:, None], self.buffer)
        self.count = self.count + good.long()
        self.max_loss = torch.where(good, torch.maximum(self.max_loss, loss_v), self.max_loss)
        return torch.stack([bad.double(), trigger.double(), score, ratio, loss_v, gn_v])

    def state_dict(self) -> dict[str, Tensor]:
        """The detector's state (device copies: ``torch.save`` moves them with the rest of a
        checkpoint, no read of its own), for checkpoints: a resumed run judges the same."""
        return {"buffer": self.buffer.clone(), "count": self.count.clone(), "max_loss": self.max_loss.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        buffer = state["buffer"].to(self.device, torch.float64)
        if buffer.shape != self.buffer.shape:
            raise ValueError(f"the saved detector window holds {buffer.shape[1]} steps, this one {self.window}: "
                             "resume with the same on_instability.window")
        self.buffer = buffer
        self.count = state["count"].to(self.device, torch.int64).reshape(())
        self.max_loss = state["max_loss"].to(self.device, torch.float64).reshape(())


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
