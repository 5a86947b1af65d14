"""What the Lightning, Hugging Face Trainer and Accelerate integrations share.

Each integration maps its framework's hooks onto one :class:`StepTools` (``begin_step``,
``before_forward``, ``after_forward``, ``before_last_backward``, ``grads_final``, ``read_signals``,
``end_step``), which drives the plain-loop tools as ``stabletrain.train`` does, with one host read
per step at most (with nancapture on; see ``device_reads``), one more on logged steps for the
mechanism signals (read after the optimizer step, which the framework's own reads precede), and
every decision a collective all ranks reach. With several processes the guard's check after the
optimizer step is agreed over ranks too, a step later (the error names the step that failed): on the
next step's first collective read (underflow_overflow's decision, nancapture's), or by an
asynchronous all-reduce read at the next step's end, by then landed.
See docs/integrations/.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from stabletrain import (
    GradNorm,
    MechanismMonitor,
    NaNCaptureMonitor,
    NaNDetectedError,
    NonFiniteStepError,
    StepGuard,
    TrendDetector,
    UnderflowOverflowError,
    UnderflowOverflowMonitor,
    compute_grad_norm,
    layer_grad_norms,
)
from stabletrain.debug.mechanisms.alerts import alert_text as mechanism_alert_text
from stabletrain.debug.mechanisms.rules import MechanismDetector, RuleContext
from stabletrain.integrations.device_reads import (
    GUARD_FAILED,
    LaggedAgreement,
    all_reduce,
    decode_status,
    dist_rank_and_world,
    encode_status,
    inner_optimizer,
    pending_scale,
    read_pair,
)
from stabletrain.integrations.framework_advice import next_actions
from stabletrain.integrations.healing import StepHealing, parse_on_instability
from stabletrain.integrations.tool_settings import Settings, parse_settings, parse_tool_settings
from stabletrain.safety.guard import join_rank_failures, next_steps_text
from stabletrain.safety.healing import RecoveryLimitError
from stabletrain.utils.dist import leading_message

_log = logging.getLogger("stabletrain")

#: Under fp16 loss scaling, the SCALER_PATIENCE-th step in a row whose only non-finite values
#: are gradients is an error for underflow_overflow (the GradScaler skips single ones).
SCALER_PATIENCE = 10


# --------------------------------------------------------------------------------------
# The tools of one run
# --------------------------------------------------------------------------------------


@dataclass
class StepValues:
    """What one optimizer step's decision produced.

    Attributes:
        step: The optimizer step (numbered from 0).
        grad_norm: The :class:`~stabletrain.GradNorm` (device tensors), pre-clip and unscaled.
        gradient_norm: Its total on the host, when it was read (every step with nancapture,
            else on logging steps); None otherwise.
        loss: The mean loss of the step's microbatches on the host, when read and known.
        alerts: Trend alerts this step opened (``Episode`` objects).
    """

    step: int
    grad_norm: GradNorm
    gradient_norm: Optional[float] = None
    loss: Optional[float] = None
    alerts: list[Any] = field(default_factory=list)


#: In underflow_overflow's decision over ranks (codes 0-2): the guard's check after the last optimizer
#: step failed on a rank.
_GUARD_CODE = 4.0

#: ``StepGuard.check_gradients(skip=...)``: record the values, flag nothing (nancapture decided on them).
_SKIP = torch.ones((), dtype=torch.bool)

#: The last line of the guard's message here: nancapture captures steps whose loss or gradients go
#: non-finite (before the optimizer step), which this one's were not.
_STATE_NEXT_STEPS = (
    "Next: fix the optimizer step (see above) and restart from weights saved before this step. nancapture "
    "captures steps whose loss or gradients go non-finite, not this one; `stabletrain train` with "
    "debug_args.nancapture.enabled=true captures an optimizer step that fails and replays it (docs/blowups.md)."
)


class StepTools:
    """stabletrain's tools for one training run of a framework (see the module docstring).

    Args:
        model: The user's module, unwrapped (its parameter and module names are reported).
        framework: ``"lightning"``, ``"transformers"`` or ``"accelerate"`` (for advice).
        out_dir: Run folder: ``out_dir/debug/`` receives the reports and captures.
        debug_args: ``DebugArgs`` (or a dict): underflow_overflow and nancapture.
        trend_alerts: ``TrendAlertArgs`` (or a dict).
        rank, world_size: This process; default: from ``torch.distributed``.
        scaler: The fp16 ``GradScaler`` of the run, if any.
        precision: The run's precision as a Lightning Fabric name (replay uses it).
        gradient_accumulation_steps: Microbatches per optimizer step (replay divides each
            loss by it before backward, as training did).
        step_fn: ``step_fn(model, batch, *step_args) -> loss`` for replay; a function of
            ``stabletrain.integrations`` is found by replay from the capture.
        model_meta: Stored in the capture (a model builder for replay, see ``debug/replay/capture.py``), with the
            framework, ``lr`` and ``clipping`` added (for diagnose's next actions).
        replay_command: The command the NaN error shows; default: derived from the model.
        warmup_steps: Spikes before this step are tolerated by the trend alerts.
        lr, clipping: For concrete next actions in alerts.
        optimizer: The torch optimizer, for the mechanism signals' weight, update and Adam values
            (``debug_args.mechanisms``, on by default); it can be given later (:meth:`set_optimizer`).
        guard: After each optimizer step (:meth:`end_step`), check that the optimizer state is
            still finite, as ``stabletrain train``'s guard does, and raise
            :class:`~stabletrain.NonFiniteStepError` naming the entries if not (an Inf in Adam's
            ``exp_avg_sq`` freezes a weight while every weight stays finite; a non-finite weight
            shows in the next forward pass). On the device, no host sync in one process. With
            several processes (DDP; under FSDP2 each rank checks its own shards) the verdict is
            agreed over ranks and every rank raises at the same point, a step later (the error names
            the step that failed): on the next step's first collective read (underflow_overflow's
            decision or nancapture's; no added read), else by an asynchronous all-reduce read at the
            next :meth:`end_step`, by then landed (on a GPU a wait for a copy a step back, not for
            the running step).
            :meth:`finish` reads the last step's.
        on_instability: ``stabletrain train``'s ``on_instability`` settings (a dict or
            ``OnInstabilityArgs``): ``policy="skip_step"`` skips the update of a non-finite or spiking
            step (:class:`~stabletrain.integrations.healing.StepHealing`); ``stop``, the default, leaves
            stopping to nancapture and the guard; ``rollback`` is refused.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        framework: str,
        out_dir: Union[str, Path],
        debug_args: Settings = None,
        trend_alerts: Settings = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        scaler: Any = None,
        precision: str = "32-true",
        gradient_accumulation_steps: Optional[int] = None,
        step_fn: Optional[Callable[..., Tensor]] = None,
        model_meta: Optional[dict[str, Any]] = None,
        replay_command: Optional[str] = None,
        warmup_steps: int = 0,
        lr: Optional[float] = None,
        clipping: bool = False,
        optimizer: Any = None,
        guard: bool = True,
        on_instability: Settings = None,
    ):
        d_rank, d_world = dist_rank_and_world()
        self.model = model
        self.framework = framework
        self.out_dir = Path(out_dir)
        self.debug_args, self.trend_args = parse_tool_settings(debug_args, trend_alerts)
        self.rank = d_rank if rank is None else int(rank)
        self.world_size = d_world if world_size is None else int(world_size)
        self.scaler = scaler if scaler is not None and getattr(scaler, "is_enabled", lambda: False)() else None
        self.precision = precision
        self.lr, self.clipping = lr, clipping
        uo_args, nan_args = self.debug_args.underflow_overflow, self.debug_args.nancapture
        self.nan: Optional[NaNCaptureMonitor] = None
        if nan_args.enabled:
            folder = self.out_dir / "debug" / "nan_capture"
            self.nan = NaNCaptureMonitor(
                model, folder, rank=self.rank, world_size=self.world_size, scaler=self.scaler,
                max_skipped_steps=nan_args.max_skipped_steps, precision=precision,
                gradient_accumulation_steps=gradient_accumulation_steps, step_fn=step_fn,
                # diagnose words its next actions in the framework's settings (debug.advice.FRAMEWORK_TERMS).
                model_meta={**(model_meta or {}), "framework": framework, "lr": lr, "clipping": clipping,
                            "optimizer": _optimizer_name(optimizer)},
                any_rank=self._nan_any_rank, replay_command=replay_command,
            )
        self.uo: Optional[UnderflowOverflowMonitor] = None
        if uo_args.enabled:
            # Decided here, collectively, at two points per step (auto_check=False), as the trainer does.
            self.uo = UnderflowOverflowMonitor(
                model, out_dir=self.out_dir / "debug", rank=self.rank, max_frames_to_save=uo_args.max_frames_to_save,
                trace_batch_nums=uo_args.trace_batch_nums, include_backward=uo_args.include_backward, auto_check=False,
            )
        heal = parse_on_instability(on_instability)
        #: ``on_instability.policy=skip_step``; None with ``stop``. In Lightning the decision is taken inside
        #: ``optimizer.step(closure)``: the copy, not the skip-aware step.
        self.healing = (StepHealing(heal, rank=self.rank, world_size=self.world_size,
                                    skip_aware=framework != "lightning") if heal.policy == "skip_step" else None)
        self._indices: list[Any] = []
        self.detector = TrendDetector(self.trend_args, warmup_steps=warmup_steps) if self.trend_args.enabled else None
        mechanisms = self.debug_args.mechanisms
        #: The mechanism signals (docs/mechanisms.md), armed on the steps ``begin_step`` is told are logged.
        self.signals: Optional[MechanismMonitor] = None
        #: The rules that name a mechanism from the signals of each logged step (docs/mechanisms.md#mechanisms).
        self.mechanisms: Optional[MechanismDetector] = None
        self._optimizer: Any = None
        self._last_loss: Optional[float] = None
        #: The check after the optimizer step (``guard``), once the optimizer is known.
        self.update_guard: Optional[StepGuard] = None
        self._want_guard = guard
        #: With several processes and nancapture off: the guard's verdict, agreed a step later.
        self._agreement = LaggedAgreement()
        self.step: Optional[int] = None
        self.in_step = False
        if mechanisms.enabled:
            self.signals = MechanismMonitor(model, updates=mechanisms.updates, report=self._signals_notice)
            if mechanisms.alerts:
                self.mechanisms = MechanismDetector(mechanisms, RuleContext(
                    precision=precision, optimizer=_optimizer_name(optimizer) if optimizer is not None else None,
                    lr=lr))
            if optimizer is not None:
                self.set_optimizer(optimizer)
        if optimizer is not None:
            self._arm_guard(optimizer)
        #: Every trend alert and mechanism so far, as the event rows ``stabletrain train`` writes to
        #: metrics.jsonl (``event``: ``trend_alert``, ``mechanism`` or ``mechanism_end``).
        self.alerts: list[dict[str, Any]] = []
        self.micro_step = -1
        self.decided = False
        self._losses: list[Tensor] = []
        #: How the step's loss follows from its microbatch losses: None, their mean; a number, their sum
        #: times it (the Hugging Face Trainer when the model takes ``num_items_in_batch``: each
        #: microbatch's loss is its share of the step's, and with ``average_tokens_across_devices``
        #: of all ranks' tokens, which the Trainer multiplies back by the number of processes).
        self.loss_sum_scale: Optional[float] = None
        self._total: Optional[Tensor] = None
        self._read: Optional[tuple[float, float]] = None
        self._uo_skipped = 0
        self._closed = False
        self._cleanups: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ per step

    def begin_step(self, step: int, *, log_signals: bool = False) -> None:
        """Optimizer step ``step`` (numbered from 0) begins; before its first forward pass.
        ``log_signals``: the step will be logged, so measure the mechanism signals."""
        self.step, self.micro_step, self.in_step, self.decided = int(step), -1, True, False
        self._losses = []
        self._indices = []
        if self.update_guard is not None:  # once: what the optimizer state was before the first step
            self.update_guard.check_before(self.step)
        if self.signals is not None:
            self.signals.begin_step(log=log_signals, probe=False)
        if self.nan is not None:
            self.nan.begin_step(step)
        if self.uo is not None:
            self.uo.set_step(step)

    def before_forward(self, batch: Any, indices: Any = None, step_args: Sequence[Any] = ()) -> None:
        """A microbatch, exactly as the model receives it, just before its forward pass (the
        RNG states are taken here, so dropout replays the same)."""
        if not self.in_step:
            raise RuntimeError("StepTools.before_forward: begin_step(step) was not called for this step")
        self.micro_step += 1
        if indices is not None:
            self._indices.append(indices)
        if self.uo is not None:
            self.uo.micro_step = self.micro_step
        if self.nan is not None:
            self.nan.collect_batch(batch, indices, step_args=step_args)
        if self.signals is not None:
            self.signals.start_probe()  # until after_forward

    def after_forward(self, loss: Any) -> None:
        """The loss the step function returned for the last microbatch (before any division
        by the accumulation steps or loss scaling)."""
        if self.signals is not None:
            self.signals.stop_probe()
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            return
        loss = loss.detach().reshape(())
        self._losses.append(loss)
        if self.nan is not None:
            self.nan.collect_loss(loss)
        if self.uo is not None:
            self.uo.record_loss(loss)

    def before_last_backward(self) -> None:
        """Just before the step's last backward pass: underflow_overflow decides on every
        forward value of the step (one collective read). Raises on every rank."""
        if self.uo is not None and not self.uo.tracing:
            self._guard(self._uo_decide, "forward")

    def grads_final(self, optimizer: Any = None, *, read: bool = False) -> StepValues:
        """The gradients are final (after the last backward and DDP's reduction), before
        clipping and the optimizer step: compute the pre-clip, unscaled gradient norm and
        decide. Raises ``UnderflowOverflowError`` or ``NaNDetectedError`` on every rank.

        Args:
            optimizer: The step's optimizer: under fp16, whether its gradients were already
                unscaled is read from the scaler's state for it.
            read: Also bring the gradient norm and the loss to the host (a logging step).
        """
        if self.step is None:
            raise RuntimeError("StepTools.grads_final: begin_step(step) was not called")
        if optimizer is not None:
            self._arm_guard(optimizer)
        gn = compute_grad_norm(self.model.named_parameters())
        scale = pending_scale(self.scaler, optimizer)
        if scale is not None and gn.per_param:
            # Still scaled (an fp16 step before the framework un-scales): divide the norms,
            # not the gradients, so the framework's own unscale_ runs as usual.
            inv = scale.to(gn.total.device).double().reciprocal().float()
            gn = GradNorm(total=gn.total * inv, per_param=list(torch._foreach_mul(gn.per_param, inv)),
                          names=gn.names, params=gn.params)
        self.decided = True
        self._read = None
        if self.uo is not None:
            if self.uo.tracing:
                if self.uo.has_records:
                    self.uo.write_trace()
            elif self.uo.include_backward:
                self._guard(self._uo_decide, "backward")
        if self.nan is not None:
            self._total = gn.total
            self._guard(self.nan.check_and_capture, gn)  # one read, in _nan_any_rank
            if self.update_guard is not None and self.scaler is None and self._losses:
                # nancapture found this step's losses and gradient norm finite on every rank (else it
                # raised): the guard keeps them for its message should the optimizer step fail ("from
                # finite gradients (loss, gradient norm)"). Not under fp16, where a skipped step passes
                # with a non-finite norm. Nothing is flagged (skip) and nothing read.
                self.update_guard.check_gradients(self.step, gn.total, [self._step_loss()], skip=_SKIP)
        elif read:
            self._read = read_pair(gn.total, self._step_loss())
        if self.healing is not None:
            if self.healing.guard is None:
                raise RuntimeError("on_instability.policy=skip_step: the optimizer is not known; pass it to check() "
                                   "(Accelerate) or StepTools(optimizer=...)")
            self.healing.check(self.step, self._step_loss(), gn.total, self._indices, scaled=self.scaler is not None)
        values = StepValues(self.step, gn)
        if self._read is not None:
            norm, loss = self._read
            values.gradient_norm = norm
            values.loss = loss if self._losses else None
            self._last_loss = values.loss
            if read:
                values.alerts = self.observe(self.step, gradient_norm=norm, loss=values.loss)
        return values

    def end_step(self) -> bool:
        """The optimizer step is done. True when underflow_overflow's
        ``abort_after_batch_num`` asks to stop training after this step.

        Raises:
            NonFiniteStepError: The optimizer step left an optimizer state entry
                non-finite (``guard``); on a GPU it may be raised a step or two later, when the
                verdict's copy to the host has landed, still naming this step.
        """
        if self.healing is not None and self.step is not None:
            # Before the guard looks at the state: the copy of a bad step is put back first.
            self._guard(self.healing.after_step, self.step)
        guard = self.update_guard
        if guard is not None and self.step is not None:
            guard.check_update(self.step)
            if self.world_size == 1:
                self._guard(guard.raise_if_failed, False, None, _STATE_NEXT_STEPS)
            elif self.nan is None:
                # No read per step to ride on: the last step's verdict, agreed asynchronously, is
                # read now, and this step's agreement starts.
                self._guard(self._read_agreement, self.step)
                self._agreement.start(self._guard_failed())
        self.in_step = False
        stop = self.debug_args.underflow_overflow.abort_after_batch_num
        return self.uo is not None and stop is not None and self.step is not None and self.step >= stop

    def finish(self) -> None:
        """Training ended normally, after the last :meth:`end_step`: read the guard's verdict of
        the last optimizer step, which no later step's read carries (one host read; with several
        processes a collective every rank must call). Nothing after :meth:`close`.

        Raises:
            NonFiniteStepError: That step (or one whose verdict had not landed yet, on a GPU)
                left an optimizer state entry non-finite.
        """
        if self.healing is not None and not self._closed:
            self._guard(self.healing.finish)
        guard = self.update_guard
        if self._closed or guard is None or self.step is None:
            return
        if self.world_size == 1:
            self._guard(guard.raise_if_failed, True, self.step, _STATE_NEXT_STEPS)
        elif self._agreement.pending:  # nancapture off: the last step's agreement, started in its end_step
            self._guard(self._read_agreement, self.step)
        else:  # nancapture on: its read in the next step would have carried it; one read of its own
            self._agreement.start(self._guard_failed())
            self._guard(self._read_agreement, self.step)

    def _guard_failed(self) -> Tensor:
        """A device bool: this rank's guard recorded a failed step (no host sync)."""
        assert self.update_guard is not None
        return self.update_guard.pending()[0] >= 0

    def _read_agreement(self, stopped_at: int) -> None:
        """The guard's verdict agreed over ranks by the last :class:`LaggedAgreement` started; if
        any rank failed, raise on every rank."""
        if self._agreement.result():
            self._guard_stop(stopped_at)

    def _guard_stop(self, stopped_at: int) -> None:
        """Raise the guard's error on every rank, once the ranks agreed that one failed (collective).
        The ranks' findings are joined (each rank checked its own state, or its shards under FSDP2),
        and every rank reports the message of the lowest rank that found the failure itself."""
        guard = self.update_guard
        assert guard is not None
        host = guard.read()  # the failure path may wait
        own = guard.failure(host, stopped_at=stopped_at)
        failure = join_rank_failures(own)
        advice = _STATE_NEXT_STEPS if failure.before != "already" else next_steps_text(failure)
        message, leader = leading_message(1 if own.step >= 0 else 0, failure.describe() + "\n" + advice)
        raise NonFiniteStepError(message, failure, other_rank=leader != self.rank)

    def set_optimizer(self, optimizer: Any) -> None:
        """The step's optimizer (a framework's wrapper is unwrapped), for the mechanism signals
        and the check after its step."""
        if self.signals is not None:
            self._optimizer = inner_optimizer(optimizer)
            self.signals.set_optimizer(self._optimizer)
        self._arm_guard(optimizer)

    def _arm_guard(self, optimizer: Any) -> None:
        if self.healing is not None:
            self.healing.arm(optimizer)
        if self._want_guard and self.update_guard is None:
            # The optimizer state only: a parameter gone non-finite shows in the next forward pass
            # (nancapture, the trend alerts), and a third of the cost; weights the callback first
            # sees may also be finite but too large for a float32 norm already, which no step did.
            self.update_guard = StepGuard(self.model, inner_optimizer(optimizer), check_parameters=False,
                                          rank=self.rank, world_size=self.world_size)
            if self.in_step and self.step is not None:  # armed within a step, before its optimizer step
                self.update_guard.check_before(self.step)

    def read_signals(self) -> dict[str, float]:
        """After the optimizer step of a step ``begin_step`` was told is logged: the
        ``signals/...`` values as host floats (one host read); {} on other steps. The mechanism
        rules read them (with the step's loss and lr, when known): a mechanism they name is warned
        about on rank 0 and recorded in :attr:`alerts` as a ``mechanism`` row."""
        if self.signals is None or not self.signals.armed:
            return {}
        values = self.signals.values()
        if self.mechanisms is not None and self.step is not None:
            self._name_mechanisms(self.step, values)
        return values

    def _name_mechanisms(self, step: int, values: dict[str, float]) -> None:
        assert self.mechanisms is not None
        row: dict[str, Any] = dict(values)
        if self._last_loss is not None:
            row["loss"] = self._last_loss
        groups = getattr(self._optimizer, "param_groups", None)
        if groups:
            row["lr"] = float(groups[0].get("lr", math.nan))
        for m in self.mechanisms.update(step, row):
            self.alerts.append(m.to_event())
            if self.rank == 0:
                _log.warning(mechanism_alert_text(m, self.mechanisms.context))
        for m in self.mechanisms.closed_now:
            self.alerts.append(m.end_event(step))

    def _signals_notice(self, notice: Any) -> None:
        if self.rank == 0:
            _log.warning("stabletrain signals: %s.", notice.text)

    def layer_norms(self, values: StepValues) -> dict[str, float]:
        """``gradient_norm/<parameter or module>`` of a step, on the host (one read)."""
        names, norms = layer_grad_norms(values.grad_norm)
        return {f"gradient_norm/{n}": v for n, v in zip(names, norms.tolist())}

    # ------------------------------------------------------------------ trend alerts

    def observe(self, step: int, *, gradient_norm: Optional[float] = None, loss: Optional[float] = None) -> list[Any]:
        """Feed one logged step to the trend alerts; warn (rank 0) and return the new alerts."""
        if self.detector is None:
            return []
        metrics: dict[str, float] = {}
        if gradient_norm is not None:
            metrics["gradient_norm"] = float(gradient_norm)
        if loss is not None:
            metrics["loss"] = float(loss)
        if self.scaler is not None:
            metrics["loss_scale"] = math.nan  # single skipped fp16 steps are expected
        opened = self.detector.update(step, metrics)
        if not opened:
            return []
        lines = []
        for episode in opened:
            event = episode.to_event()
            event["actions"] = next_actions(episode.kind, self.framework, lr=self.lr, clipping=self.clipping,
                                            precision=self.precision)
            skipped = (self.healing.skipped(episode.start_step, step)
                       if self.healing is not None and episode.kind == "nonfinite" else None)
            if skipped is not None:  # the update never reached the weights: no resume or lr to advise
                event["actions"] = [
                    f"the update of step {skipped} was not applied (on_instability.policy=skip_step); if such steps "
                    "recur, capture one with debug_args.nancapture.enabled=true and on_instability.policy=stop, and "
                    "diagnose it"]
            self.alerts.append(event)
            lines.append(f"WARNING {episode.describe()}.")
            lines.extend(f"  next: {a}" for a in event["actions"] if not episode.follows)
        if self.rank == 0:
            _log.warning("\n".join(lines))
        return opened

    # ------------------------------------------------------------------ cleanup

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (after the run, or when a decision raised)."""
        return self._closed

    def add_cleanup(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on :meth:`close`, also when a decision raises (an integration removes
        its wrappers there: the Hugging Face Trainer has no exception hook)."""
        self._cleanups.append(fn)

    def close(self) -> None:
        """Remove every hook and let go of held batches (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for fn in self._cleanups:
            fn()
        if self.signals is not None:
            self.signals.close()
        if self.nan is not None:
            self.nan.close()
        if self.uo is not None:
            self.uo.close()
        if self.detector is not None:
            self.detector.finish()

    # ------------------------------------------------------------------ internals

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a decision; on a stabletrain stop, remove the hooks before the error leaves."""
        try:
            return fn(*args)
        except (NaNDetectedError, UnderflowOverflowError, NonFiniteStepError, RecoveryLimitError):
            self.close()
            raise

    def _step_loss(self) -> Tensor:
        """The step's loss as the framework reports it (see :attr:`loss_sum_scale`), on the device."""
        if not self._losses:
            return torch.zeros((), dtype=torch.float32, device=self._device())
        device = self._losses[0].device
        stacked = torch.stack([loss.float().to(device) for loss in self._losses])
        return stacked.mean() if self.loss_sum_scale is None else stacked.sum() * self.loss_sum_scale

    def _device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _nan_any_rank(self, flag: Tensor) -> bool:
        """The monitor's decision over ranks, read with the norm and the loss in one go."""
        assert self._total is not None
        status = encode_status(flag, self._total)
        if self.update_guard is not None:
            # The last optimizer step's check rides on this read: with several processes it is where
            # the ranks agree; in one process on a GPU, where end_step's look found no verdict landed yet.
            status = torch.where(self._guard_failed().to(status.device), GUARD_FAILED, status)
        status = all_reduce(status, "min")
        value, loss = read_pair(status, self._step_loss())
        if value == GUARD_FAILED:
            assert self.step is not None, "decided within a step"
            self._guard_stop(self.step)
        failed, norm = decode_status(value)
        self._read = (norm, loss)
        return failed

    def _uo_decide(self, phase: str) -> None:
        uo = self.uo
        assert uo is not None
        code = uo.nonfinite_code()
        if self.update_guard is not None:
            # The last optimizer step's check rides on this read too: its failure came first.
            code = torch.maximum(code, _GUARD_CODE * self._guard_failed().float().to(code.device))
        worst = float(all_reduce(code, "max"))  # the one host read of this decision
        if worst >= _GUARD_CODE:
            assert self.step is not None, "decided within a step"
            self._guard_stop(self.step)
        if worst == 0:
            uo.accept()
            if phase == "backward":
                self._uo_skipped = 0
            return
        if worst == 1 and self.scaler is not None:
            # Only scaled gradients are non-finite: the GradScaler skips this step.
            if phase == "forward":
                return  # an earlier microbatch's gradients: judged once, after the last backward
            self._uo_skipped += 1
            if self._uo_skipped < SCALER_PATIENCE:
                uo.accept()
                return
        votes = torch.zeros(self.world_size, dtype=torch.float32, device=code.device)
        votes[self.rank] = (code > 0).float()
        detected = [r for r, v in enumerate(all_reduce(votes, "sum").tolist()) if v > 0]
        uo.fail(detected_by=detected, phase="forward" if worst == 2 else "backward")


#: Importable from here as before the split; they live in tool_settings, device_reads and framework_advice.
__all__ = [
    "SCALER_PATIENCE",
    "Settings",
    "StepTools",
    "StepValues",
    "all_reduce",
    "decode_status",
    "dist_rank_and_world",
    "encode_status",
    "inner_optimizer",
    "next_actions",
    "parse_settings",
    "parse_tool_settings",
    "pending_scale",
    "read_pair",
]


def _optimizer_name(optimizer: Any) -> Optional[str]:
    """The torch optimizer's class (``torch.optim.AdamW``) under a framework's wrapper, for diagnose's
    advice (it depends on the optimizer); None when not known."""
    from stabletrain.debug.optimizer_damage import optimizer_name

    inner = optimizer
    for _ in range(3):  # Accelerate's AcceleratedOptimizer, Lightning's wrappers
        nxt = getattr(inner, "optimizer", None) or getattr(inner, "_optimizer", None)
        if nxt is None or nxt is inner:
            break
        inner = nxt
    return optimizer_name(inner) if inner is not None and hasattr(inner, "param_groups") else None
