"""The trainer's safety net: the guard, checkpoint verification and health, stop signals.

:class:`SafetyNet` joins the guard (:mod:`stabletrain.safety.guard`), the finite check and health of
every checkpoint (:mod:`stabletrain.safety.checkpoint_health`) and SIGINT/SIGTERM handling
(:mod:`stabletrain.safety.interrupts`), so that the trainer never loses the run. See docs/blowups.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from stabletrain.runfiles.checkpoint import SHARDED, CheckpointError, checkpoint_dir
from stabletrain.safety.checkpoint_health import HealthTracker, nonfinite_entries, verify_tensors
from stabletrain.safety.guard import ORIGIN_OPTIMIZER, VERDICT_LEN, NonFiniteStepError, StepGuard, join_rank_failures
from stabletrain.safety.interrupts import StopSignals
from stabletrain.utils.dist import leading_message

_NO_STEP = -1e18
_GUARD_LEN = VERDICT_LEN


class NonFiniteCheckpointError(CheckpointError):
    """A checkpoint was not written because the state holds NaN/Inf; the previous file stays.

    Attributes:
        step: Steps done in the refused state.
        entries: What is non-finite (``model <name>``, ``optimizer state <key> of <param>``, ...).
    """

    def __init__(self, message: str, step: int, entries: list[str]):
        super().__init__(message)
        self.step = step
        self.entries = list(entries)

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.step, self.entries))


class SafetyNet:
    """Owned by a :class:`~stabletrain.training.loop.Trainer`; see the module docstring."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        s = trainer.settings
        self.guard: Optional[StepGuard] = None
        if s.guard.enabled:
            self.guard = StepGuard(
                trainer.model, trainer.optimizer, scaler=trainer.scaler,
                max_skipped_steps=s.debug_args.nancapture.max_skipped_steps,
                rank=trainer.rank, world_size=trainer.world_size,
            )
        self.health = HealthTracker(s.trend_alerts, warmup_steps=s.model_args.warmup_steps,
                                    mechanisms=_mechanism_detector(trainer))
        self.signals = StopSignals()
        self.interrupted: Optional[str] = None
        self._group: Any = None
        self._agree = np.zeros(4, dtype=np.int64)
        #: A write failed on some rank (the trainer's ``write_failure``): every rank stops after this step.
        self.write_failed = False
        self._agree_t = torch.from_numpy(self._agree)
        self._last: Optional[tuple[list[Tensor], Tensor]] = None
        self._skipped_before: Optional[Tensor] = None
        self.step_batches: Optional[tuple[int, list[Any], list[Tensor]]] = None
        self.replaying = False
        #: The self-healing of ``on_instability`` (a trainer callback too), None under ``stop``.
        self.healer: Any = next((c for c in trainer.callbacks.callbacks if getattr(c, "is_healer", False)), None)
        #: The state training started from, kept on the CPU only with nancapture on in a fresh
        #: run (one copy of the weights), so that an optimizer-step failure before the first
        #: checkpoint can be re-run and captured.
        self.start_state: Optional[dict[str, Any]] = None

    # ------------------------------------------------------------------ setup

    def start(self) -> None:
        t = self.trainer
        if t.world_size > 1:
            import torch.distributed as dist

            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        # Under FSDP2 each rank keeps its own shards (1/world size of the model), nothing gathered.
        if t.settings.debug_args.nancapture.enabled and t.step == 0:
            self.start_state = t.checkpoint_state(on_cpu=True, layout="sharded" if t.sharded else None)
        if self.health.initial_weight_norm is None:  # one read, before the first step
            self.health.initial_weight_norm = self._weight_norm()
        self.signals.install()

    def close(self) -> None:
        self.signals.restore()

    def _weight_norm(self) -> float:
        """The L2 norm of the model's weights now: the full model's under FSDP2 too, summed from
        the shards' squared norms (one all-reduce, nothing gathered; once, at the start)."""
        t = self.trainer
        if not t.sharded:
            return float(verify_tensors({"model": t.model.state_dict()}, t.fabric.device)[3])
        square = verify_tensors({"model": t.model.state_dict()}, t.fabric.device, rank=t.rank)[3]
        if t.world_size > 1:
            square = t.fabric.all_reduce(square.clone(), reduce_op="sum")
        return float(square.sqrt())

    # ------------------------------------------------------------------ every step

    def check_gradients(self, step: int, losses: list[Tensor], grad_norm: Tensor,
                        batches: Optional[list[Any]] = None) -> None:
        self._last = (losses, grad_norm)
        # The guard's count of fp16 skips before this step: a checkpoint after it tells whether the
        # GradScaler skipped it (its non-finite norm is then the scaler's rule, not a sick state).
        self._skipped_before = self.guard.skipped_total if self.guard is not None else None
        #: This step's microbatches as (dataset indices, batch) and their device losses: a stop's
        #: message names the samples of the microbatch whose loss went non-finite (read on failure only).
        self.step_batches = (step, batches or [], losses)
        if self.replaying:
            return
        skip = self.healer.check(step, losses, grad_norm) if self.healer is not None else None
        if self.guard is None:
            return
        self.guard.check_gradients(step, grad_norm, losses, skip=skip)
        if self.trainer.world_size == 1:
            host = self.guard.visible()  # free: already on the host, or None
            if host is not None and host[0] >= 0:
                self.fail(host, stopped_at=step)

    def check_update(self, step: int) -> None:
        if self.healer is not None and not self.replaying:
            self.healer.after_step()  # undo a bad step's update before anything looks at it
        if self.guard is not None and not self.replaying:
            self.guard.check_update(step)

    def end_of_step(self) -> None:
        """After each step: stop on a signal, or on a guard verdict the host already has;
        under DDP the ranks agree first (one host all-reduce)."""
        t = self.trainer
        host = self.guard.visible() if self.guard is not None else None
        bad_step = int(host[0]) if host is not None and host[0] >= 0 else None
        signal_flag = self.signals.received is not None
        self.write_failed = getattr(t, "write_failure", None) is not None
        other_step = None
        if t.world_size > 1:
            import torch.distributed as dist

            # A host tensor over NumPy memory: the ranks exchange 32 bytes, nothing waits for a GPU.
            self._agree[:] = (int(signal_flag), int(bad_step is not None),
                              -(bad_step if bad_step is not None else 2**62), int(self.write_failed))
            dist.all_reduce(self._agree_t, op=dist.ReduceOp.MAX, group=self._group)
            signal_any, any_bad, neg, write_failed = (int(x) for x in self._agree)
            self.write_failed = bool(write_failed)
            signal_flag = bool(signal_any)
            if any_bad and bad_step is None:
                host = self.guard.read()  # type: ignore[union-attr]  # the failure path may wait
                other_step = -neg
            elif any_bad:
                other_step = -neg
        if (host is not None and host[0] >= 0) or other_step is not None:
            self.fail(host, stopped_at=t.step - 1, other_step=other_step)  # type: ignore[arg-type]
        if self.healer is not None:
            self.healer.end_of_step()
        if signal_flag and self.interrupted is None:
            self.interrupted = self.signals.received or "SIGTERM"  # another rank's signal: stop with it
            t.request_stop(f"{self.interrupted} received")

    # ------------------------------------------------------------------ sync points

    def verdict_terms(self) -> Optional[Tensor]:
        """The guard's verdict to stack into a read (float64, device), agreed over ranks."""
        if self.guard is None or self.replaying:
            return None
        state = self.guard.pending()
        if self.trainer.world_size == 1:
            return state
        bad = state[0] >= 0
        enc = torch.stack([bad.double(), torch.where(bad, -state[0], torch.full_like(state[0], _NO_STEP))])
        enc = self.trainer.fabric.all_reduce(enc.clone(), reduce_op="max")
        return torch.cat([state, enc.to(state.device)])

    def absorb(self, host: list[float], stopped_at: int) -> None:
        """Take the verdict's host values from a read; stop if a step went bad on any rank."""
        if self.guard is None or not host:
            return
        local = host[:_GUARD_LEN]
        self.guard.absorb(local)
        if self.trainer.world_size == 1:
            if local[0] >= 0:
                self.fail(local, stopped_at)
            return
        if host[_GUARD_LEN] > 0:
            self.fail(local, stopped_at, other_step=int(-host[_GUARD_LEN + 1]))

    def any_rank(self, flag: Any) -> bool:
        """``flag`` on any rank, with the guard's "failed" folded into the same scalar (2):
        nancapture's one read per step carries the guard's verdict too."""
        t = self.trainer
        value = torch.as_tensor(flag, dtype=torch.float32, device=t.fabric.device).reshape(()).clone()
        if self.guard is not None and not self.replaying:
            value = torch.maximum(value, 2.0 * (self.guard.pending()[0] >= 0).float().to(value.device))
        if t.world_size > 1:
            value = t.fabric.all_reduce(value, reduce_op="max")
        read = float(value)  # the one host read
        if read >= 2:
            host = self.guard.read()  # type: ignore[union-attr]  # failure path
            other = None
            if t.world_size > 1:
                terms = self.verdict_terms()
                other = int(-terms.tolist()[_GUARD_LEN + 1]) if terms is not None else None
            self.fail(host, stopped_at=t.step, other_step=other)
        return read > 0

    # ------------------------------------------------------------------ checkpoints

    def verify(self, state: dict[str, Any]) -> dict[str, Any]:
        """Verify ``state`` finite on the device and judge its health (one host read, with the
        guard's verdict). Returns the ``health`` entry; raises when it must not be written."""
        t = self.trainer
        device = t.fabric.device
        # A sharded checkpoint's state is this rank's shards: flags and squared norms summed over the ranks.
        sharded = state.get("layout") == SHARDED
        flags = verify_tensors(state, device, rank=t.rank if sharded else None)
        if self._last is not None and self._last[0]:
            losses, gn = self._last
            loss = torch.stack([x.reshape(()).float().to(device) for x in losses]).mean()
            gn = gn.reshape(()).float().to(device)
        else:
            loss = gn = torch.full((), math.nan, device=device)
        if t.world_size > 1:
            flags = t.fabric.all_reduce(flags.clone(), reduce_op="sum" if sharded else "max")
            loss = t.fabric.all_reduce(loss.clone(), reduce_op="mean")
        if sharded:
            flags = torch.cat([flags[:3], flags[3:].sqrt()])
        skipped = torch.zeros(1, dtype=torch.float64, device=device)
        if self.guard is not None and self.guard.scaler is not None and self._skipped_before is not None:
            skipped = (self.guard.skipped_total > self._skipped_before).double().reshape(1).to(device)
        parts = [flags, loss.double().reshape(1), gn.double().reshape(1), skipped]
        terms = self.verdict_terms()
        if terms is not None:
            parts.append(terms.to(device))
        host = torch.cat(parts).tolist()  # the checkpoint's one host read
        self.absorb(host[7:], stopped_at=t.step - 1)
        scaler_bad = any(isinstance(v, float) and not math.isfinite(v) for v in (state.get("scaler") or {}).values())
        if any(host[:3]) or scaler_bad:
            self._refuse(state)
        last_step = t.step - 1 if self._last is not None else -1
        return self.health.assess(int(state["step"]), last_step=last_step, loss=host[4], gradient_norm=host[5],
                                  weight_norm=host[3], scaler_skipped=host[6] > 0)

    def _refuse(self, state: dict[str, Any]) -> None:
        from stabletrain.safety.stop_messages import failure_remedy, resume_advice

        t = self.trainer
        names = [n for n, _ in t.model.named_parameters()]
        entries = nonfinite_entries(state, names)
        if state.get("layout") == SHARDED and t.world_size > 1:  # each rank found its shards': join them
            from stabletrain.utils.dist import gather_names

            entries = gather_names(entries)
        remedy = failure_remedy(t, t.step)  # the command must not repeat the failure unchanged
        advice, _, _ = resume_advice(t, t.step, extra=remedy.change or None, note=remedy.why)
        kept = checkpoint_dir(t.out) / "last.ckpt"
        message = (
            f"Refused to write the checkpoint after step {t.step - 1}: the state holds NaN/Inf in "
            f"{', '.join(entries) or 'a tensor'}. The previous checkpoint stays "
            f"({kept if kept.exists() else 'none yet'}); "
            f"training stopped. {advice}"
        )
        if self.guard is None:
            message += " The guard is off (guard.enabled=false): turn it on to stop at the step that went bad."
        t.log_event({"event": "checkpoint_refused", "step": t.step, "nonfinite": entries})
        raise NonFiniteCheckpointError(message, t.step, entries)

    # ------------------------------------------------------------------ failing

    def _log_failure_rows(self, failure: Any) -> None:
        """Rows for the last finite step and the failing step, when not logged already, so that
        metrics.jsonl, the report and its plots show how the run ended."""
        t = self.trainer
        last_logged = t.clock.steps_at_last - 1
        base = t.optimizer.param_groups[0].get("base_lr", t.settings.model_args.lr)
        for step, loss, gn in ((failure.previous_step, failure.previous_loss, failure.previous_gradient_norm),
                               (failure.step, failure.loss, failure.gradient_norm)):
            if step < 0 or step <= last_logged:
                continue
            row = {"loss": loss, "gradient_norm": gn, "lr": base * t.lr_factor(step),
                   "samples": (step + 1) * t.settings.batch_size}
            if t.is_rank_zero:
                for logger in t.loggers:
                    logger.log_metrics(row, step)
            last_logged = step

    def fail(self, host: Optional[list[float]], stopped_at: int, other_step: Optional[int] = None) -> None:
        """Raise the guard's error (every rank does, at the same point)."""
        from stabletrain.safety.stop_messages import guard_message

        assert self.guard is not None
        t = self.trainer
        settle = getattr(t, "settle_checkpoints", None)
        if settle is not None:
            # An asynchronous checkpoint still being written is committed first: the re-run of an
            # optimizer step and the message look for checkpoints; every rank sees it once rank 0 has.
            settle()
            if t.world_size > 1:
                t.fabric.barrier()
        if host is None:
            host = self.guard.read()
        failure = self.guard.failure(host, stopped_at=stopped_at, other_rank_step=other_step if host[0] < 0 else None)
        found_here = failure.step >= 0  # in this rank's own tensors (its shards, under FSDP2)
        if t.sharded and t.world_size > 1:  # each rank read its own shards: every rank names all ranks' tensors
            failure = join_rank_failures(failure)
        capture: Optional[Path] = None
        if failure.origin == ORIGIN_OPTIMIZER and failure.step >= 0 and t.settings.debug_args.nancapture.enabled:
            from stabletrain.safety.optimizer_capture import capture_optimizer_step

            capture = capture_optimizer_step(t, failure)
        message, best, command = guard_message(t, failure, capture)
        leader = t.rank
        if t.world_size > 1:
            # Every rank reports the message of the rank closest to the cause (its own loss non-finite,
            # then its own finding): a rank that saw only the NaN gradients averaged in from another
            # rank's loss must not name another cause (see utils.dist.leading_message).
            # Under FSDP2 every rank names all ranks' tensors, but a rank whose own shards are finite does not lead.
            level = 2 if found_here and "loss" in failure.nonfinite else (1 if found_here else 0)
            message, leader = leading_message(level, message, t.fabric)
        self._log_failure_rows(failure)
        t.log_event({
            "event": "nonfinite_step", "step": failure.step if failure.step >= 0 else failure.other_rank_step,
            "origin": failure.origin, "nonfinite": failure.nonfinite, "stopped_at": failure.stopped_at,
            "param_names": failure.param_names[:20], "state_entries": failure.state_entries[:20],
        })
        raise NonFiniteStepError(message, failure, capture_path=capture,
                                 checkpoint=None if best is None else best.path, command=command,
                                 other_rank=leader != t.rank)


def _mechanism_detector(trainer: Any) -> Any:
    """The mechanism rules for the checkpoints' health (None when the signals are off)."""
    s = trainer.settings
    if not s.debug_args.mechanisms.enabled:
        return None
    from stabletrain.debug.mechanisms.rules import MechanismDetector, RuleContext

    context = RuleContext.from_settings(s.to_json_dict())
    context.precision = getattr(trainer, "precision", None) or context.precision
    return MechanismDetector(s.debug_args.mechanisms, context)
