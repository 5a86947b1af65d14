"""The training loop on Lightning Fabric.

``train()`` validates settings, prepares the output folder and hands over to
:class:`Trainer`, whose ``fit -> train_step -> forward_backward`` is the whole loop. The
events it fires, and where, are listed in :mod:`stabletrain.events`; settings are in
docs/training.md. Setup, checks, the optimizer, step logging and checkpoint state live in the
modules beside this one (:mod:`stabletrain.training`); the guard and checkpoint health in
:mod:`stabletrain.safety`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from stabletrain.config import TrainSettings
from stabletrain.data.loader import build_loader
from stabletrain.debug.grad_norm import GradNorm, clip_grad_norm_with_total, compute_grad_norm
from stabletrain.errors import ConfigError, StabletrainError
from stabletrain.events import CallbackList
from stabletrain.loggers import Logger, build_loggers
from stabletrain.loggers.console import Console, format_duration
from stabletrain.runfiles.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    checkpoint_dir,
    is_sharded_checkpoint,
    load_checkpoint,
    newest_healthy,
    none_healthy_before,
    remove_temporaries,
    resolve_checkpoint,
    save_checkpoint,
)
from stabletrain.runfiles.lock import RunLock
from stabletrain.safety.interrupts import TrainingInterrupted, wait_for_launcher
from stabletrain.safety.net import SafetyNet
from stabletrain.safety.write_failures import is_write_failure, write_failed_error
from stabletrain.tasks import build_task, resolve_task_name
from stabletrain.training import checks, optim
from stabletrain.training import state as trainer_state
from stabletrain.training.checks import resolve_precision, validate_settings
from stabletrain.training.setup import (
    build_debug_callbacks,
    compile_module,
    make_fabric,
    prepare_out_dir,
    write_settings,
)
from stabletrain.training.step_log import StepClock, log_step
from stabletrain.utils.dist import max_over_ranks
from stabletrain.utils.rng import seed_everything, set_rng_state


@dataclass
class TrainResult:
    """What ``train()`` returns on rank 0 (other ranks get the same object with their rank)."""

    out: Path
    steps_done: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: Optional[Path] = None
    stop_reason: Optional[str] = None


def train(out: str | Path, **settings: Any) -> TrainResult:
    """Train a model and log ``gradient_norm`` at every logging step.

    Args:
        out: Output folder (metrics.jsonl, train.log, settings.json, checkpoints/, debug/).
        **settings: Any setting of :class:`stabletrain.config.TrainSettings`, nested groups as
            dicts, e.g. ``model_args={"lr": 3e-4}``. ``stabletrain train --help`` lists them.

    Returns:
        A :class:`TrainResult`.

    Raises:
        ConfigError: Invalid settings, listed all at once, before training starts.
        NonFiniteStepError: A step went non-finite (the guard, ``guard.enabled``); nothing
            damaged was saved, and the message names where to continue from.
        NonFiniteCheckpointError: A checkpoint would have held NaN/Inf; it was not written.
        TrainingInterrupted: SIGINT or SIGTERM; a checkpoint was written (``exit_code`` 130/143).

    Example::

        import stabletrain
        stabletrain.train(out="out/demo", steps=200, model_args={"lr": 1e-3})
    """
    return Trainer(validate_settings({"out": out, **settings})).fit()


class _TrainingStep(nn.Module):
    """Routes the model's ``training_step`` through Fabric's forward (autocast, DDP hooks).

    Fabric applies precision and DDP only around ``forward``; making ``training_step`` the
    forward of a thin wrapper gives every user model the same treatment on one device and many.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: Any) -> torch.Tensor:
        return self.model.training_step(batch)  # type: ignore[operator]


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, before FSDP2 shards them. A model given as an
    object was built by each process on its own (the script runs once per rank): unseeded, the
    processes hold different weights, and ``fully_shard`` keeps each rank's rows of its own copy,
    where DDP would have broadcast rank 0's. Over gloo (the tensors are still on the CPU)."""
    import torch.distributed as dist

    group: Any = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0, group=group)


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the meta device (no memory)."""
    import copy

    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def done_line(first: int, end: int, steps: int, seconds: float) -> str:
    """``Done: 500 steps in 0:03:10``; for a resumed run the steps of this run, where it began and
    the total: ``Done: steps 20-99 of 100 in 0:00:35 (80 steps in this run, resumed from step 20)``.
    Under 10 s the time has decimals: a short run did not take ``0:00:00``."""
    took = f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s" if seconds < 10 else format_duration(seconds)
    if first == 0:
        return f"Done: {end} steps in {took}"
    ran = end - first
    if ran <= 0:
        return f"Done: no step run in {took} (resumed at step {first} of {steps})"
    which = f"step {first}" if ran == 1 else f"steps {first}-{end - 1}"
    this_run = f"{ran} step{'s' if ran != 1 else ''} in this run"
    return f"Done: {which} of {steps} in {took} ({this_run}, resumed from step {first})"


def mechanisms_line(named: list[Any], best: Optional[CheckpointInfo], out: Path) -> str:
    """What a run that ends "Done" with a silent instability must still say (docs/mechanisms.md)."""
    first = named[0]
    which = "; ".join(f"{m.name}{' in ' + m.where if m.where else ''} from step {m.start_step}" for m in named)
    since = (f"the newest healthy checkpoint is {best.path} (step {best.step})" if best is not None
             else none_healthy_before(checkpoint_dir(out), first.start_step))
    return (f"The run finished, but not stable: {which} (named in its signals; docs/mechanisms.md). Checkpoints "
            f"written since step {first.start_step} are not healthy: {since}. Details: stabletrain report {out}")


class Trainer:
    """Runs one training job; see :mod:`stabletrain.events` for the loop it runs.

    What callbacks may use of it is :class:`stabletrain.events.TrainerLike`: ``fabric``,
    ``settings``, ``model`` (the user's module, unwrapped), ``optimizer``, ``scaler`` (fp16
    GradScaler or None), ``precision`` (resolved), ``out``, ``rank``, ``world_size``, ``step``,
    ``task``, ``console``, ``loggers``; methods ``any_rank``, ``max_over_ranks``,
    ``request_stop``, ``log_event``, ``resolved_settings``, ``checkpoint_state``,
    ``healthy_checkpoint``. ``safety`` holds the guard, checkpoint health and the stop signals
    (:mod:`stabletrain.safety.net`).
    """

    def __init__(self, settings: TrainSettings, fabric: Any = None):
        self.settings = settings
        self.out = Path(settings.out)
        self._fabric_given = fabric
        self.step = 0
        self.microbatches_consumed = 0
        #: Dataset indices the loader skips (quarantined by the self-healing; see safety/quarantine.py).
        self.quarantined: frozenset[int] = frozenset()
        self.stop_reason: Optional[str] = None
        self.console = Console(None, enabled=False)
        #: FSDP2 (``strategy=fsdp``): parameters are DTensor shards; see docs/distributed.md.
        self.sharded = False
        self.loggers: list[Logger] = []
        self.last_metrics: dict[str, float] = {}
        #: ``out/.lock`` while this process writes the run (:mod:`stabletrain.runfiles.lock`).
        self.lock: Optional[RunLock] = None
        #: A failed write on this process (full disk, ...): the run stops after the step, every rank with it.
        self.write_failure: Optional[OSError] = None
        #: ``"full"`` (one file from rank 0) or ``"sharded"`` (every rank its shards; FSDP2 only).
        self.checkpoint_layout = "full"
        #: The sharded checkpoints' writer (:mod:`stabletrain.training.sharded_checkpoints`), None for full files.
        self.checkpoints: Any = None

    # ----------------------------------------------------------------------------- setup

    def _make_fabric(self) -> Any:
        return self._fabric_given if self._fabric_given is not None else make_fabric(self.settings)

    def _check_dataset_size(self, world_size: int) -> list[str]:
        """The loader drops incomplete microbatches: every rank needs at least one full one."""
        return checks.dataset_size_problems(self.settings, world_size)

    def _prepare_out_dir(self) -> None:
        prepare_out_dir(self.settings, self.out)

    def fit(self) -> TrainResult:
        """Validate, launch (one process per device when distributed), train, clean up."""
        fabric: Any = None
        fabric_problems: list[str] = []
        try:
            fabric = self._make_fabric()
        except ConfigError as exc:
            fabric_problems = exc.problems  # reported with every other problem below
        # Before launch we are the first process: check and prepare out/ once. Processes
        # started by the launcher (rank > 0) skip the out/ checks; rank 0 owns the folder.
        # Without a Fabric no process was launched: this is the first one.
        first = fabric is None or fabric.global_rank == 0
        problems = checks.setup_problems(
            self.settings, None if fabric is None else fabric.world_size, is_rank_zero=first,
            fabric_problems=fabric_problems,
        )
        if problems:
            raise ConfigError(problems)  # before the lock: invalid settings write nothing, not even out/
        assert fabric is not None  # the checks raised otherwise
        # The run lock: a second writer is refused before it changes anything in out/.
        self.lock = RunLock(self.out).acquire() if first else None
        try:
            if first:
                again = checks.out_dir_problems(self.settings)  # another run may have finished in between
                if again:
                    raise ConfigError(again)
                self._prepare_out_dir()
                remove_temporaries(self.out)  # left by a killed run; the lock says none is writing
            self.fabric = fabric
            return fabric.launch(self._run)
        finally:
            if self.lock is not None:
                self.lock.release()

    def _run(self, fabric: Any = None) -> TrainResult:
        state, source = self._set_up()
        if state is not None and source is not None:
            # Restored last so that nothing in setup (model init, loader setup) draws from the RNGs.
            rng = trainer_state.rng_state_for(self, state)
            if rng is not None:
                set_rng_state(rng)
            self.callbacks("on_checkpoint_load", self, state=state)
            trainer_state.continue_history(self, state, source)
            note = trainer_state.resharding_note(self, state)
            if note is not None:
                self.console.info(note)
        self.safety.start()
        try:
            try:
                self._loop()
            except OSError as exc:
                if not is_write_failure(exc):
                    raise
                raise write_failed_error(self, exc) from None
        except BaseException as exc:
            self.callbacks("on_exception", self, exception=exc)
            self._report_exception(exc)
            if isinstance(exc, TrainingInterrupted) and self.rank > 0:
                self._close()
                wait_for_launcher()
            raise
        finally:
            self.settle_checkpoints()
            self.safety.close()
            self._close()
        return TrainResult(
            out=self.out,
            steps_done=self.step,
            last_metrics=dict(self.last_metrics),
            checkpoint=checkpoint_dir(self.out) / "last.ckpt",
            stop_reason=self.stop_reason,
        )

    def _set_up(self) -> tuple[Optional[dict[str, Any]], Optional[Path]]:
        """Everything before the first step on this process; the checkpoint state resumed from
        and its file (None, None when starting afresh)."""
        fabric = self.fabric
        s = self.settings
        self.rank = fabric.global_rank
        self.world_size = fabric.world_size
        self.is_rank_zero = self.rank == 0
        self.precision = getattr(fabric.strategy.precision, "precision", resolve_precision(s.precision, s.accelerator))
        self.scaler = getattr(fabric.strategy.precision, "scaler", None)
        if self.is_rank_zero:
            self.out.mkdir(parents=True, exist_ok=True)
            self.console = Console(self.out / "train.log")
            if self.lock is not None and self.lock.took_over:
                self.console.info(self.lock.took_over)
        fabric.barrier()

        seed_everything(s.seed)
        self.task = build_task(s)
        self.model = self.task.model
        source = Path(s.resume_from) if s.resume_from is not None else (
            checkpoint_dir(self.out) / "last.ckpt" if s.resume_interrupted else None)
        from stabletrain.distributed.fsdp import is_sharded

        self.sharded = is_sharded(fabric)
        self.checkpoint_layout = checks.checkpoint_layout(s, self.sharded)
        state = None
        shards: Optional[Path] = None  # a sharded checkpoint that a sharded run loads with DCP, after sharding
        if source is not None:
            source = resolve_checkpoint(source)
            if self.sharded and is_sharded_checkpoint(source):
                shards = source
            state = load_checkpoint(source, tensors=shards is None)
            trainer_state.check_resume(self, state, source)
            if shards is None:
                self.model.load_state_dict(state["model"])  # under FSDP2 too: every rank, before sharding
        if self.sharded:
            self._set_up_sharded(state, shards)
        else:
            self.optimizer = optim.build_optimizer(self.model, s.model_args)
            if state is not None:
                self._load_optimizer_state(state["optimizer"])
            module = compile_module(_TrainingStep(self.model), s.torch_compile_args)
            self.fabric_module, self.fabric_optimizer = fabric.setup(module, self.optimizer)
        if state is not None:
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.step = int(state["step"])
            self.microbatches_consumed = int(state["data"]["microbatches_consumed"])

        self.microbatch_size = s.batch_size // (self.world_size * s.gradient_accumulation_steps)
        self.build_loader()
        self.loggers = build_loggers(s, self.out) if self.is_rank_zero else []
        self.callbacks = CallbackList([*build_debug_callbacks(self), *s.callbacks])
        self.safety = SafetyNet(self)
        if state is not None and self.safety.guard is not None:
            self.safety.guard.load_state_dict(state.get("guard") or {})
        if self.checkpoint_layout == "sharded":
            from stabletrain.training.sharded_checkpoints import ShardedCheckpoints

            self.checkpoints = ShardedCheckpoints(self)
        if self.is_rank_zero:
            write_settings(self)
        return state, source

    def _set_up_sharded(self, state: Optional[dict[str, Any]], shards: Optional[Path] = None) -> None:
        """FSDP2: shard first (``fully_shard`` replaces every parameter by a sharded one), then
        build the optimizer from the sharded parameters and load its state (docs/distributed.md);
        from a sharded checkpoint (``shards``) each rank loads its part of model and optimizer."""
        from stabletrain.distributed.checkpoint_state import load_optimizer_checkpoint

        self._skeleton = _meta_copy(self.model)  # the structure, no memory: for replays in one process
        if state is None and shards is None and isinstance(self.settings.model, nn.Module) and self.world_size > 1:
            _broadcast_from_rank0(self.model)
        # Compiled after sharding: Fabric unwraps a compiled module, shards it, and compiles the result.
        module = compile_module(_TrainingStep(self.model), self.settings.torch_compile_args)
        self.fabric_module = self.fabric.setup_module(module)
        self.optimizer = optim.build_optimizer(self.model, self.settings.model_args)
        self.fabric_optimizer = self.fabric.setup_optimizers(self.optimizer)
        if shards is not None:
            from stabletrain.distributed.dcp import load_shards

            load_shards(self.model, self.optimizer, shards)
        elif state is not None:
            load_optimizer_checkpoint(self.model, self.optimizer, state["optimizer"])

    def build_loader(self) -> None:
        """(Re)build the data loader at ``microbatches_consumed`` (resume, re-runs)."""
        s = self.settings
        num_workers = s.num_workers
        if num_workers == "auto":
            num_workers = 0 if self.task.in_memory else min(8, max(0, (os.cpu_count() or 1) - 1))
        self.loader, self.sampler = build_loader(
            self.task.dataset,
            microbatch_size=self.microbatch_size,
            seed=s.seed,
            rank=self.rank,
            world_size=self.world_size,
            start=self.microbatches_consumed,
            num_workers=int(num_workers),
            pin_memory=self.fabric.device.type == "cuda",
            exclude=self.quarantined,
        )
        self.data_iter = iter(self.loader)

    def _report_exception(self, exc: BaseException) -> None:
        """Errors that end a run go to train.log too (the console gets them from the CLI)."""
        from stabletrain.safety.stop_messages import keyboard_interrupt_message

        try:
            if isinstance(exc, KeyboardInterrupt):
                self.console.info(keyboard_interrupt_message(self))
            elif not isinstance(exc, TrainingInterrupted):
                self.console.log_only(f"ERROR {type(exc).__name__}: {exc}")
        except OSError:  # train.log on a full disk: the error still reaches the user
            pass

    def resume_advice(self, failing_step: Optional[int] = None, loss_nonfinite: Optional[bool] = None,
                      reason: str = "") -> str:
        """Where to continue after a failure at ``failing_step``: the newest healthy checkpoint,
        why, and the command to paste (or ``overwrite=true`` when there is none)."""
        from stabletrain.safety.stop_messages import failure_remedy, mechanisms_note, resume_advice

        if failing_step is None:
            return resume_advice(self, None)[0]
        # A failure: the command carries what to change (the same settings fail again), and says so.
        remedy = failure_remedy(self, failing_step, loss_nonfinite=bool(loss_nonfinite),
                                skipped_steps=reason == "skipped_steps")
        note = mechanisms_note(self, failing_step)
        return (note + " " if note else "") + resume_advice(self, failing_step, extra=remedy.change or None,
                                                            note=remedy.why)[0]

    def healthy_checkpoint(self, before_step: Optional[int] = None) -> Optional[CheckpointInfo]:
        """The newest checkpoint of this run recorded healthy (see :mod:`stabletrain.safety.checkpoint_health`)."""
        return newest_healthy(checkpoint_dir(self.out), before_step=before_step)

    def _load_optimizer_state(self, saved: dict[str, Any]) -> None:
        """Load a checkpoint's optimizer state, keeping this run's hyperparameters (lr, momentum, ...)."""
        optim.load_optimizer_state(self.optimizer, saved)

    def resolved_settings(self) -> dict[str, Any]:
        """The settings as run (JSON-compatible): resolved task, precision and world size."""
        data = self.settings.to_json_dict()
        data["task"] = resolve_task_name(self.settings)
        data["precision"] = self.precision
        data["world_size"] = self.world_size
        return data

    # ------------------------------------------------------------------------------ loop

    def _loop(self) -> None:
        s = self.settings
        self.callbacks("on_train_start", self)
        self.clock = StepClock(steps_at_last=self.step)
        first = self.step  # above 0 when resumed
        while self.step < s.steps and self.stop_reason is None:
            self.train_step()
            self.step += 1
            if self.checkpoints is not None:
                self.checkpoints.poll()  # an asynchronous write that finished is committed
            self.safety.end_of_step()
            if self.lock is not None:
                self.lock.heartbeat()
            if self.safety.write_failed:
                raise write_failed_error(self, self.write_failure)
            if self.step % s.checkpoint_every_num_steps == 0 and self.step < s.steps and self.stop_reason is None:
                self._save_checkpoint(periodic=True)
        if self.stop_reason is not None and self.safety.interrupted is None:
            # A signal's stop is said once, by interrupt_message below, with the checkpoint and command.
            self.console.info(f"Stopped after step {self.step - 1}: {self.stop_reason}")
        path = self._save_checkpoint(periodic=False, final=True)
        self.callbacks("on_train_end", self)
        if self.safety.interrupted is not None:
            from stabletrain.safety.stop_messages import interrupt_message

            last = path or checkpoint_dir(self.out) / "last.ckpt"
            text, command = interrupt_message(self, self.safety.interrupted, last)
            self.console.info(text)
            raise TrainingInterrupted(text, signal_name=self.safety.interrupted, step=self.step,
                                      checkpoint=checkpoint_dir(self.out) / "last.ckpt", command=command)
        if self.is_rank_zero:
            loss = self.last_metrics.get("loss", float("nan"))
            self.console.info(
                f"{done_line(first, self.step, s.steps, time.perf_counter() - self.clock.start)}, "
                f"final loss {loss:.4f}. Checkpoint: {checkpoint_dir(self.out) / 'last.ckpt'}"
            )
            named = self.safety.health.mechanisms.found if self.safety.health.mechanisms is not None else []
            if named:
                self.console.info(mechanisms_line(named, self.healthy_checkpoint(), self.out))

    def train_step(self) -> None:
        """One optimizer step: accumulate microbatches, norm, guard, clip, step, guard, log."""
        s = self.settings
        step = self.step
        cb = self.callbacks
        cb("on_step_start", self, step=step)
        lr = self._set_lr(step)
        accum = s.gradient_accumulation_steps
        losses = []
        batches = []  # (dataset indices, batch): a failure's message names the samples
        for micro_step in range(accum):
            indices, batch = next(self.data_iter)
            batch = self.fabric.to_device(batch)
            batches.append((indices, batch))
            self.microbatches_consumed += 1
            cb("on_microbatch", self, step=step, micro_step=micro_step, batch=batch, indices=indices)
            with self.fabric.no_backward_sync(self.fabric_module, enabled=micro_step < accum - 1):
                loss = self.forward_backward(step, micro_step, batch)
            losses.append(loss.detach())

        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        gn = compute_grad_norm(self.model.named_parameters())
        cb("on_after_backward", self, step=step, grad_norm=gn)
        self.safety.check_gradients(step, losses, gn.total, batches)  # on the device; stops here when already known
        if s.gradient_clip_val > 0:
            clip_grad_norm_with_total(gn.params, s.gradient_clip_val, gn.total)
        cb("on_before_optimizer_step", self, step=step)
        self.fabric_optimizer.step()
        self.safety.check_update(step)
        self.optimizer.zero_grad(set_to_none=True)
        cb("on_after_optimizer_step", self, step=step)

        logged = step % s.log_every_num_steps == 0 or step + 1 == s.steps or self.stop_reason is not None
        if logged and not self.safety.replaying:
            self._log_step(step, losses, gn, lr)

    def forward_backward(self, step: int, micro_step: int, batch: Any) -> torch.Tensor:
        """Forward through Fabric (precision, DDP), then backward of loss / accumulation steps."""
        loss = self.fabric_module(batch)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = "" if not isinstance(loss, torch.Tensor) else f" of shape {tuple(loss.shape)}"
            raise StabletrainError(f"training_step must return a scalar loss tensor, got {type(loss).__name__}{shape}")
        self.callbacks("on_before_backward", self, step=step, micro_step=micro_step, loss=loss)
        self.fabric.backward(loss / self.settings.gradient_accumulation_steps)
        self.callbacks("on_after_microbatch", self, step=step, micro_step=micro_step, loss=loss)
        return loss

    # -------------------------------------------------------------------- schedule, logs

    def lr_factor(self, step: int) -> float:
        """Multiplier of each parameter group's base lr at ``step``."""
        return optim.lr_factor(self.settings, step)

    def _set_lr(self, step: int) -> float:
        factor = self.lr_factor(step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
        return self.optimizer.param_groups[0]["lr"]

    def _log_step(self, step: int, losses: list[torch.Tensor], gn: GradNorm, lr: float) -> None:
        try:
            log_step(self, step, losses, gn, lr)
        except OSError as exc:  # a full disk under metrics.jsonl: stop after this step, every rank together
            if not is_write_failure(exc):
                raise
            self.write_failure = self.write_failure or exc

    def log_event(self, event: dict[str, Any]) -> None:
        """Give every logger an event row (rank 0 only), e.g. ``{"event": "resume", "step": 100}``."""
        if self.is_rank_zero:
            for logger in self.loggers:
                logger.log_event(event)

    # ------------------------------------------------------------------- for callbacks

    def any_rank(self, flag: bool | torch.Tensor) -> bool:
        """True on every rank when ``flag`` is true on any rank: one host read (which carries
        the guard's verdict too), and one all-reduce when distributed.

        Every rank must call it at the same point of the step.
        """
        return self.safety.any_rank(flag)

    def max_over_ranks(self, value: float | torch.Tensor) -> float:
        """The largest ``value`` (a number or a scalar tensor) over all ranks, on every rank:
        one host read, and one all-reduce when distributed.

        Every rank must call it at the same point of the step.
        """
        return max_over_ranks(value, self.fabric)

    def request_stop(self, reason: str) -> None:
        """Finish the current step (log it, checkpoint it), then stop training."""
        if self.stop_reason is None:
            self.stop_reason = reason

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self, on_cpu: bool = False, layout: Optional[str] = None) -> dict[str, Any]:
        """The resumable state between steps; ``step`` is the next step to run.

        Collective when distributed (the RNG states of all ranks are gathered). ``on_cpu``:
        a copy on the CPU instead of references to the live tensors. ``layout`` (FSDP2):
        ``"sharded"`` for each rank's own shards, ``"full"`` for the state gathered on rank 0; by
        default the checkpoints' (``checkpoint_layout``)."""
        return trainer_state.checkpoint_state(self, on_cpu, layout)

    def _save_checkpoint(self, periodic: bool, final: bool = False) -> Optional[Path]:
        """Checkpoint the state after ``self.step`` completed steps (rank 0 writes; under
        ``checkpoint_format=sharded`` every rank its shards), once it is verified finite; its
        health goes into it. ``final``: the end of training (never asynchronous)."""
        if self.checkpoints is not None:
            self.checkpoints.finish()  # one write at a time: the previous asynchronous one first
        state = self.checkpoint_state()
        self.callbacks("on_checkpoint_save", self, step=self.step, state=state)
        state["health"] = self.safety.verify(state)
        if self.checkpoints is not None:
            return self.checkpoints.save(state, periodic=periodic, final=final)
        path = None
        if self.is_rank_zero:
            try:
                path = save_checkpoint(state, self.out, periodic=periodic, keep=self.settings.max_checkpoints_to_keep)
            except OSError as exc:  # full disk, read-only or vanished folder: nothing was half-written
                if not is_write_failure(exc):
                    raise
                self.write_failure = exc
        failed = self.write_failure is not None
        if self.world_size > 1:  # also the barrier: every rank waits for rank 0's write, and stops with it
            failed = self.max_over_ranks(float(failed)) > 0
        if failed:
            raise write_failed_error(self, self.write_failure)
        return path

    def unsharded_model(self) -> nn.Module:
        """Under FSDP2: the model as it was before sharding, its parameters and buffers allocated
        empty on the CPU (full size: a capture's weights are loaded into it), for replays in this
        process (the self-healing's search for culprit samples, its diagnosis)."""
        import copy

        model = copy.deepcopy(self._skeleton)
        return model.to_empty(device="cpu")

    def settle_checkpoints(self) -> None:
        """Before a stop message names a checkpoint: an asynchronous write still running is waited
        for and committed (no collective; see :class:`~stabletrain.training.sharded_checkpoints.ShardedCheckpoints`)."""
        if self.checkpoints is not None:
            self.checkpoints.close()

    def _close(self) -> None:
        for logger in self.loggers:
            try:
                logger.close()
            except OSError as exc:  # its last flush on a full disk: the run's error says so already
                if not is_write_failure(exc):
                    raise
        self.console.close()


__all__ = ["train", "Trainer", "TrainResult", "resolve_precision", "CheckpointError"]
