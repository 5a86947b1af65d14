"""``on_instability.policy=skip_step`` in the integrations: a bad step's update is not applied.

The same detector and skip as ``stabletrain train`` and the plain-loop
:class:`~stabletrain.InstabilityGuard`: decided on the device when the gradients are final (before
clipping), the framework's own ``optimizer.step()`` then changes nothing where the step was bad.
The host learns of a recovery at once in one process (on a GPU when its verdict has landed), a step
later with several (every rank the same steps), logs it and counts it;
past ``max_recoveries`` the run stops with :class:`~stabletrain.RecoveryLimitError`. No capture
is written per recovery (``stabletrain train`` writes one); ``rollback`` is not offered here.
See docs/integrations/ and docs/self_healing.md.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import Tensor

from stabletrain.config import OnInstabilityArgs
from stabletrain.errors import ConfigError
from stabletrain.integrations.device_reads import inner_optimizer
from stabletrain.integrations.tool_settings import Settings, parse_settings
from stabletrain.safety.healing import RecoveryLimitError
from stabletrain.safety.instability_guard import InstabilityGuard, Recovery

__all__ = ["StepHealing", "parse_on_instability"]

_log = logging.getLogger("stabletrain")


def parse_on_instability(value: Settings) -> OnInstabilityArgs:
    """``on_instability`` for an integration: ``stop`` (the default) or ``skip_step``.

    Raises:
        ConfigError: A bad value, or ``rollback`` (the framework owns the data order and the
            checkpoints a rollback would have to restore).
    """
    args: OnInstabilityArgs = parse_settings(OnInstabilityArgs, value, "on_instability")
    if args.policy == "rollback":
        raise ConfigError([
            "on_instability.policy: rollback is not available in the integrations (the framework owns the data "
            "order and the state a rollback restores); use skip_step, or stabletrain train, or a loop you write "
            "with InstabilityGuard and RollbackSnapshots (docs/self_healing.md)"])
    return args


class StepHealing:
    """Skips the update of a non-finite or spiking step in a framework's loop.

    Args:
        args: ``on_instability`` with ``policy="skip_step"``.
        rank, world_size: This process and how many; with several, the step's loss is averaged over
            them on the device (the gradient norm is already global), so every rank reaches the same
            verdict. Each rank records its own samples.
        skip_aware: Let the framework's next ``optimizer.step()`` skip by itself (torch's AdamW,
            Adam, SGD; no copy). False where the decision is taken inside that call (Lightning's
            closure): the parameters and state are copied before the update and put back after.
    """

    def __init__(self, args: OnInstabilityArgs, *, rank: int = 0, world_size: int = 1, skip_aware: bool = True):
        self.args = args
        self.rank, self.world_size = rank, world_size
        self.skip_aware = skip_aware
        self.guard: Optional[InstabilityGuard] = None
        #: Every recovery so far, as the ``{"event": "recovery", ...}`` rows of ``stabletrain train``.
        self.recoveries: list[dict[str, Any]] = []
        self._checked = False
        self._saved: Optional[dict[str, Any]] = None  # a resumed run's detector, loaded once armed

    def arm(self, optimizer: Any) -> None:
        """The run's optimizer (a framework's wrapper is unwrapped); once."""
        if self.guard is not None:
            return
        a = self.args
        self.guard = InstabilityGuard(
            inner_optimizer(optimizer), window=a.window, zscore=a.zscore, warmup=a.warmup, max_ratio=a.max_ratio,
            min_std=a.min_std, all_reduce=self._mean if self.world_size > 1 else None)
        if not self.skip_aware and self.guard.skipper is not None:
            self.guard.skipper.skip_aware = False
        if self._saved is not None:
            self.guard.load_state_dict(self._saved)
            self._saved = None

    def state_dict(self) -> dict[str, Any]:
        """For the framework's checkpoint: the spike detector's recent steps (device copies, not
        read) and the recoveries so far, so that a resumed run judges its first steps as the
        original would have and counts on towards ``max_recoveries``."""
        state: dict[str, Any] = {"recoveries": [dict(r) for r in self.recoveries]}
        if self._saved is not None:  # loaded but not armed yet: keep it
            state["detector"] = self._saved["detector"]
        elif self.guard is not None:
            state.update(self.guard.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (before or after :meth:`arm`). The recoveries
        list stays the same object (the callback's ``recoveries`` is it)."""
        self.recoveries[:] = [dict(r) for r in state.get("recoveries", [])]
        if "detector" in state:
            if self.guard is not None:
                self.guard.load_state_dict(state)
            else:
                self._saved = {"detector": state["detector"]}

    def _mean(self, t: Tensor) -> Tensor:
        import torch.distributed as dist

        total = t.detach().clone()
        dist.all_reduce(total)  # a sum (gloo has no average), on the device: no host read
        return total / self.world_size

    def check(self, step: int, loss: Tensor, grad_norm: Tensor, samples: Any, scaled: bool) -> None:
        """Judge the step (device ops). ``scaled``: fp16 loss scaling is on, so a non-finite norm with a
        finite loss is the GradScaler's own skip (it skips the step and lowers its scale), not a recovery."""
        assert self.guard is not None, "arm(optimizer) first"
        found = ~torch.isfinite(grad_norm.detach().reshape(())) if scaled else None
        self.guard.check(step, loss, grad_norm, samples=samples, found_inf=found)
        self._checked = True
        if self.world_size == 1:
            # What the host has already (at once on a CPU; no wait on a GPU), so that a trend alert on
            # this step knows; with several processes every rank handles the same steps, a step later.
            self._handle(self.guard.poll())

    def after_step(self, step: int) -> None:
        """The framework's optimizer step of ``step`` is done: undo it where it was bad (the copy;
        a skip-aware step did it already), then handle the verdicts of the steps before it."""
        if self.guard is None or not self._checked:
            return
        self._checked = False
        self.guard.after_step()
        found = self.guard.take_before(step)
        if self.world_size == 1:
            found += self.guard.poll()
        self._handle(found)

    def skipped(self, first: int, last: int) -> Optional[int]:
        """The first step in ``[first, last]`` whose update was skipped, as far as the host knows."""
        return next((r["step"] for r in self.recoveries if first <= r["step"] <= last and r["action"] != "stop"), None)

    def finish(self) -> None:
        """Training ended: the verdicts not handled yet (the last step's)."""
        if self.guard is not None:
            self._handle(self.guard.poll(wait=True))

    def _handle(self, found: list[Recovery]) -> None:
        for rec in found:
            done = len(self.recoveries)
            row = {**rec.to_row(), "recovery": done + 1}
            samples = f"; samples {rec.samples}" if rec.samples else ""
            if samples and self.world_size > 1:
                samples += f" (rank {self.rank}'s of {self.world_size})"
            if done >= self.args.max_recoveries:
                row["action"] = "stop"
                self.recoveries.append(row)
                raise RecoveryLimitError(
                    f"Step {rec.step}: {rec.description}, after {done} recoveries (on_instability.max_recoveries="
                    f"{self.args.max_recoveries}): stopping. Its update was not applied{samples}. The recoveries "
                    "are in `recoveries` of the callback or StepMonitor: bad steps one after another point at the "
                    "updates (a lower learning rate), scattered ones at the data; capture one with "
                    "debug_args.nancapture.enabled=true and on_instability.policy=stop, and diagnose it.",
                    rec.step, done)
            self.recoveries.append(row)
            _log.warning("Recovered step %d: %s; update skipped (on_instability.policy=skip_step, recovery %d of at "
                         "most %d)%s", rec.step, rec.description, done + 1, self.args.max_recoveries, samples)
