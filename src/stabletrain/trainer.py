"""The training loop on Lightning Fabric.

``train()`` validates settings, prepares the output folder and hands over to
:class:`Trainer`, whose ``fit -> train_step -> forward_backward`` is the whole loop. The
events it fires, and where, are listed in :mod:`stabletrain.events`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from stabletrain import __version__, trainer_checks
from stabletrain.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    load_checkpoint,
    resume_conflicts,
    save_checkpoint,
)
from stabletrain.checkpoint import CheckpointInfo, newest_healthy
from stabletrain.config import TrainSettings
from stabletrain.data.loader import build_loader
from stabletrain.debug.grad_norm import GradNorm, clip_grad_norm_with_total, compute_grad_norm, layer_grad_norms
from stabletrain.errors import ConfigError, StabletrainError
from stabletrain.events import CallbackList
from stabletrain.loggers import Logger, build_loggers
from stabletrain.loggers.console import Console, format_duration, progress_line
from stabletrain.safety import SafetyNet
from stabletrain.signals import TrainingInterrupted, wait_for_launcher
from stabletrain.tasks import build_task, resolve_task_name
from stabletrain.trainer_checks import resolve_precision, settings_warnings, validate_settings
from stabletrain.utils.dist import max_over_ranks
from stabletrain.utils.io import atomic_write_text
from stabletrain.utils.rng import get_rng_state, seed_everything, set_rng_state
from stabletrain.utils.text import shell_path

#: Files and folders a run writes directly under ``out/``; ``overwrite=True`` removes these only.
RUN_OUTPUTS = (
    "metrics.jsonl",
    "train.log",
    "settings.json",
    "checkpoints",
    "debug",
    "report",
    "tensorboard",
    "mlflow.db",
    "mlruns",
    "wandb",
)


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
        return self.model.training_step(batch)


class Trainer:
    """Runs one training job; see :mod:`stabletrain.events` for the loop it runs.

    What callbacks may use of it is :class:`stabletrain.events.TrainerLike`: ``fabric``,
    ``settings``, ``model`` (the user's module, unwrapped), ``optimizer``, ``scaler`` (fp16
    GradScaler or None), ``precision`` (resolved), ``out``, ``rank``, ``world_size``, ``step``,
    ``task``, ``console``, ``loggers``; methods ``any_rank``, ``max_over_ranks``,
    ``request_stop``, ``log_event``, ``resolved_settings``, ``checkpoint_state``,
    ``healthy_checkpoint``. ``safety`` holds the guard, checkpoint health and the stop signals
    (:mod:`stabletrain.safety`).
    """

    def __init__(self, settings: TrainSettings, fabric: Any = None):
        self.settings = settings
        self.out = Path(settings.out)
        self._fabric_given = fabric
        self.step = 0
        self.microbatches_consumed = 0
        self.stop_reason: Optional[str] = None
        self.console = Console(None, enabled=False)
        self.loggers: list[Logger] = []
        self.last_metrics: dict[str, float] = {}

    # ----------------------------------------------------------------------------- setup

    def _make_fabric(self) -> Any:
        if self._fabric_given is not None:
            return self._fabric_given
        from lightning_fabric import Fabric

        s = self.settings
        available = trainer_checks.available_accelerators()
        if s.accelerator not in available:
            # Fabric's own error for 'gpu' names no alternative; say what this machine has.
            raise ConfigError(
                f"accelerator: {s.accelerator!r} is not available on this machine; "
                f"available here: {', '.join(available)}"
            )
        try:
            return Fabric(
                accelerator=s.accelerator,
                devices=s.devices,
                num_nodes=s.num_nodes,
                strategy=s.strategy,
                precision=resolve_precision(s.precision, s.accelerator),
            )
        except (ValueError, RuntimeError, TypeError, ImportError) as exc:
            raise ConfigError(
                f"accelerator/devices/strategy/precision: Lightning Fabric refused "
                f"accelerator={s.accelerator!r}, devices={s.devices!r}, strategy={s.strategy!r}, "
                f"precision={s.precision!r}: {exc}"
            ) from None

    def _check_dataset_size(self, world_size: int) -> list[str]:
        """The loader drops incomplete microbatches: every rank needs at least one full one."""
        return trainer_checks.dataset_size_problems(self.settings, world_size)

    def _prepare_out_dir(self) -> None:
        resuming = self.settings.resume_interrupted or self.settings.resume_from is not None
        if self.settings.overwrite and not resuming and self.out.is_dir():
            for name in RUN_OUTPUTS:
                path = self.out / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
        self.out.mkdir(parents=True, exist_ok=True)

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
        problems = trainer_checks.setup_problems(
            self.settings, None if fabric is None else fabric.world_size, is_rank_zero=first,
            fabric_problems=fabric_problems,
        )
        if problems:
            raise ConfigError(problems)
        assert fabric is not None  # the checks raised otherwise
        if first:
            self._prepare_out_dir()
        self.fabric = fabric
        return fabric.launch(self._run)

    def _run(self, fabric: Any = None) -> TrainResult:
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
        fabric.barrier()

        seed_everything(s.seed)
        self.task = build_task(s)
        self.model = self.task.model
        source = s.resume_from if s.resume_from is not None else (
            checkpoint_dir(self.out) / "last.ckpt" if s.resume_interrupted else None)
        state = None
        if source is not None:
            state = load_checkpoint(source)
            self._check_resume(state, Path(source))
            self.model.load_state_dict(state["model"])
        self.optimizer = self._build_optimizer()
        if state is not None:
            self._load_optimizer_state(state["optimizer"])
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.step = int(state["step"])
            self.microbatches_consumed = int(state["data"]["microbatches_consumed"])

        module: nn.Module = _TrainingStep(self.model)
        compile_args = s.torch_compile_args
        if not compile_args.disable:
            module = torch.compile(  # type: ignore[assignment]
                module,
                mode=compile_args.mode,
                backend=compile_args.backend,
                fullgraph=compile_args.fullgraph,
                dynamic=compile_args.dynamic,
            )
        self.fabric_module, self.fabric_optimizer = fabric.setup(module, self.optimizer)
        self.microbatch_size = s.batch_size // (self.world_size * s.gradient_accumulation_steps)
        self.build_loader()
        self.loggers = build_loggers(s, self.out) if self.is_rank_zero else []
        self.callbacks = CallbackList([*_build_debug_callbacks(self), *s.callbacks])
        self.safety = SafetyNet(self)
        if self.is_rank_zero:
            self._write_settings()
        if state is not None:
            # Restored last so that nothing above (model init, loader setup) draws from the RNGs.
            set_rng_state(state["rng"][self.rank])
            self.callbacks("on_checkpoint_load", self, state=state)
            self._resumed(state, Path(source))  # type: ignore[arg-type]
        self.safety.start()
        try:
            self._loop()
        except BaseException as exc:
            self.callbacks("on_exception", self, exception=exc)
            self._report_exception(exc)
            if isinstance(exc, TrainingInterrupted) and self.rank > 0:
                self._close()
                wait_for_launcher()
            raise
        finally:
            self.safety.close()
            self._close()
        return TrainResult(
            out=self.out,
            steps_done=self.step,
            last_metrics=dict(self.last_metrics),
            checkpoint=checkpoint_dir(self.out) / "last.ckpt",
            stop_reason=self.stop_reason,
        )

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
        )
        self.data_iter = iter(self.loader)

    def _check_resume(self, state: dict[str, Any], source: Path) -> None:
        saved = json.loads(state["settings"])
        current = self.resolved_settings()
        problems = resume_conflicts(saved, current)
        which = "resume_from" if self.settings.resume_from is not None else "resume_interrupted"
        if self.settings.steps <= int(state["step"]):
            problems.append(
                f"steps: the checkpoint already holds {int(state['step'])} steps; "
                f"set steps above that to train on (got {self.settings.steps})"
            )
        from stabletrain.checkpoint_health import nonfinite_entries

        bad = nonfinite_entries(state)
        if bad:
            from stabletrain.checkpoint import list_checkpoints

            others = [c for c in list_checkpoints(checkpoint_dir(self.out))
                      if c.healthy and c.path.resolve() != source.resolve()]
            best = others[-1] if others else None
            fix = (f"resume_from={shell_path(best.path)} (step {best.step}, healthy)" if best
                   else "overwrite=true (no healthy checkpoint)")
            problems.append(f"{which}: {source} holds NaN/Inf ({', '.join(bad[:4])}); continue from {fix} instead")
        if problems:
            raise ConfigError(problems)

    def _resumed(self, state: dict[str, Any], source: Path) -> None:
        """Continue the run's history (health, trends) and say where it resumed from."""
        from stabletrain.run_history import read_run

        health = state.get("health") if isinstance(state.get("health"), dict) else None
        if health and isinstance(health.get("initial_weight_norm"), float):
            self.safety.health.initial_weight_norm = health["initial_weight_norm"]
        metrics = self.out / "metrics.jsonl"
        if metrics.is_file():
            for row in read_run(metrics).rows:
                if row["step"] < self.step:
                    self.safety.health.observe(row["step"], row)
        verdict = "healthy" if health and health.get("healthy") else "not healthy"
        note = "" if health is None else f" ({verdict}: {health.get('why')})"
        self.console.info(f"Resumed from step {self.step}: {source}{note}")
        self.log_event({"event": "resume", "step": self.step, "checkpoint": str(source)})

    def _report_exception(self, exc: BaseException) -> None:
        """Errors that end a run go to train.log too (the console gets them from the CLI)."""
        from stabletrain.stop_messages import keyboard_interrupt_message

        if isinstance(exc, KeyboardInterrupt):
            self.console.info(keyboard_interrupt_message(self))
        elif not isinstance(exc, TrainingInterrupted):
            self.console.log_only(f"ERROR {type(exc).__name__}: {exc}")

    def resume_advice(self, failing_step: Optional[int] = None) -> str:
        """Where to continue after a failure at ``failing_step``: the newest healthy checkpoint,
        why, and the command to paste (or ``overwrite=true`` when there is none)."""
        from stabletrain.stop_messages import resume_advice

        return resume_advice(self, failing_step)[0]

    def healthy_checkpoint(self, before_step: Optional[int] = None) -> Optional[CheckpointInfo]:
        """The newest checkpoint of this run recorded healthy (see :mod:`stabletrain.checkpoint_health`)."""
        return newest_healthy(checkpoint_dir(self.out), before_step=before_step)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        args = self.settings.model_args
        configure = getattr(self.model, "configure_optimizer", None)
        if callable(configure):
            optimizer = configure(args)
        else:
            decay, no_decay = [], []
            for p in self.model.parameters():
                if p.requires_grad:
                    (decay if p.ndim >= 2 else no_decay).append(p)
            groups = [
                {"params": decay, "weight_decay": args.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ]
            groups = [g for g in groups if g["params"]]
            if args.optimizer == "adamw":
                optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=args.betas)
            else:
                optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum)
        for group in optimizer.param_groups:
            group.setdefault("base_lr", group["lr"])
        return optimizer

    def _load_optimizer_state(self, saved: dict[str, Any]) -> None:
        # The saved param groups carry the old run's hyperparameters (lr, weight decay, SGD
        # momentum, AdamW betas, ...); keep those of the optimizer just built from this run's
        # settings, so that e.g. a lower model_args.lr or another momentum takes effect on
        # resume. Only the optimizer's state (moments, step counts) comes from the checkpoint.
        keep = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(saved)
        for group, kept in zip(self.optimizer.param_groups, keep):
            group.update(kept)

    def resolved_settings(self) -> dict[str, Any]:
        """The settings as run (JSON-compatible): resolved task, precision and world size."""
        data = self.settings.to_json_dict()
        data["task"] = resolve_task_name(self.settings)
        data["precision"] = self.precision
        data["world_size"] = self.world_size
        return data

    def _write_settings(self) -> None:
        resolved = self.resolved_settings()
        resolved["model_meta"] = self.task.model_meta
        text = json.dumps(resolved, indent=2)
        atomic_write_text(text + "\n", self.out / "settings.json")
        for logger in self.loggers:
            logger.log_hyperparams(resolved)
        n_params = sum(p.numel() for p in self.model.parameters())
        self.console.info(f"stabletrain {__version__} | torch {torch.__version__} | out: {self.out}")
        self.console.info(
            f"task {resolve_task_name(self.settings)}: {self.task.model_name or type(self.model).__name__} "
            f"with {n_params:,} parameters, "
            f"{len(self.task.dataset):,} samples | device {self.fabric.device} x {self.world_size} | "
            f"precision {self.precision} | microbatch {self.microbatch_size} x "
            f"{self.settings.gradient_accumulation_steps} accumulation x {self.world_size} devices"
        )
        for warning in [*settings_warnings(self.settings), *self.task.warnings]:
            self.console.info(f"Warning: {warning}")
        self.console.log_only("resolved settings:\n" + text)

    # ------------------------------------------------------------------------------ loop

    def _loop(self) -> None:
        s = self.settings
        self.callbacks("on_train_start", self)
        self._t_start = self._t_last = time.perf_counter()
        self._steps_at_last_log = self.step
        while self.step < s.steps and self.stop_reason is None:
            self.train_step()
            self.step += 1
            self.safety.end_of_step()
            if self.step % s.checkpoint_every_num_steps == 0 and self.step < s.steps and self.stop_reason is None:
                self._save_checkpoint(periodic=True)
        if self.stop_reason is not None:
            self.console.info(f"Stopped after step {self.step - 1}: {self.stop_reason}")
        path = self._save_checkpoint(periodic=False)
        self.callbacks("on_train_end", self)
        if self.safety.interrupted is not None:
            from stabletrain.stop_messages import interrupt_message

            last = path or checkpoint_dir(self.out) / "last.ckpt"
            text, command = interrupt_message(self, self.safety.interrupted, last)
            self.console.info(text)
            raise TrainingInterrupted(text, signal_name=self.safety.interrupted, step=self.step,
                                      checkpoint=checkpoint_dir(self.out) / "last.ckpt", command=command)
        if self.is_rank_zero:
            elapsed = time.perf_counter() - self._t_start
            loss = self.last_metrics.get("loss", float("nan"))
            self.console.info(
                f"Done: {self.step} steps in {format_duration(elapsed)}, final loss {loss:.4f}. "
                f"Checkpoint: {checkpoint_dir(self.out) / 'last.ckpt'}"
            )

    def train_step(self) -> None:
        """One optimizer step: accumulate microbatches, norm, guard, clip, step, guard, log."""
        s = self.settings
        step = self.step
        cb = self.callbacks
        cb("on_step_start", self, step=step)
        lr = self._set_lr(step)
        accum = s.gradient_accumulation_steps
        losses = []
        for micro_step in range(accum):
            indices, batch = next(self.data_iter)
            batch = self.fabric.to_device(batch)
            self.microbatches_consumed += 1
            cb("on_microbatch", self, step=step, micro_step=micro_step, batch=batch, indices=indices)
            with self.fabric.no_backward_sync(self.fabric_module, enabled=micro_step < accum - 1):
                loss = self.forward_backward(step, micro_step, batch)
            losses.append(loss.detach())

        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        gn = compute_grad_norm(self.model.named_parameters())
        cb("on_after_backward", self, step=step, grad_norm=gn)
        self.safety.check_gradients(step, losses, gn.total)  # on the device; stops here when already known
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
            raise StabletrainError(
                f"training_step must return a scalar loss tensor, got "
                f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}"
            )
        self.callbacks("on_before_backward", self, step=step, micro_step=micro_step, loss=loss)
        self.fabric.backward(loss / self.settings.gradient_accumulation_steps)
        self.callbacks("on_after_microbatch", self, step=step, micro_step=micro_step, loss=loss)
        return loss

    # -------------------------------------------------------------------- schedule, logs

    def lr_factor(self, step: int) -> float:
        """Multiplier of each parameter group's base lr at ``step``."""
        args = self.settings.model_args
        if args.warmup_steps and step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        if args.lr_schedule == "constant":
            return 1.0
        span = max(1, self.settings.steps - args.warmup_steps)
        progress = min(1.0, (step - args.warmup_steps) / span)
        floor = args.min_lr_ratio
        if args.lr_schedule == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def _set_lr(self, step: int) -> float:
        factor = self.lr_factor(step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
        return self.optimizer.param_groups[0]["lr"]

    def _log_step(self, step: int, losses: list[torch.Tensor], gn: GradNorm, lr: float) -> None:
        loss = torch.stack(losses).float().mean()
        task_names, task_values = _training_metrics(self.model, loss.device)
        if self.world_size > 1:
            # Every rank saw as many samples: the mean over ranks is the metric over all of them.
            reduced = self.fabric.all_reduce(torch.cat([loss.reshape(1), task_values]), reduce_op="mean")
            loss, task_values = reduced[0], reduced[1:]
        values = [loss, gn.total.to(loss.device)]
        if self.scaler is not None:
            values.append(_scale_tensor(self.scaler, loss.device))
            guard = self.safety.guard
            values.append(guard.skipped_total if guard is not None else torch.full((), math.nan))
        flat = torch.stack([v.float().reshape(()).to(loss.device) for v in values]).double()
        layer_names: list[str] = []
        if self.settings.gradient_norm_per_layer:
            layer_names, layer_norms = layer_grad_norms(gn)
            flat = torch.cat([flat, layer_norms.to(loss.device).double()])
        flat = torch.cat([flat, task_values.double()])
        terms = self.safety.verdict_terms()
        n_flat = len(flat)
        if terms is not None:
            flat = torch.cat([flat, terms.to(loss.device)])
        host = flat.tolist()  # the step's one sync, the guard's verdict with it
        now = time.perf_counter()
        steps_since = max(1, step + 1 - self._steps_at_last_log)
        dt = now - self._t_last
        steps_per_s = steps_since / dt if dt > 0 else float("nan")
        metrics: dict[str, float] = {
            "loss": host[0],
            "gradient_norm": host[1],
            "lr": lr,
            "epoch": self.microbatches_consumed / self.sampler.batches_per_epoch,
            "samples": (step + 1) * self.settings.batch_size,
            "elapsed_s": now - self._t_start,
            "steps_per_s": steps_per_s,
            "samples_per_s": steps_per_s * self.settings.batch_size,
            "eta_s": (self.settings.steps - step - 1) / steps_per_s if steps_per_s > 0 else float("nan"),
        }
        if self.scaler is not None:
            metrics["loss_scale"] = host[2]
            if math.isfinite(host[3]):
                metrics["skipped_steps"] = host[3]
        if layer_names:
            offset = len(values)
            metrics.update({f"gradient_norm/{n}": host[offset + i] for i, n in enumerate(layer_names)})
        metrics.update(zip(task_names, host[n_flat - len(task_names) : n_flat]))
        if self.fabric.device.type == "cuda":
            metrics["max_memory_gb"] = torch.cuda.max_memory_allocated(self.fabric.device) / 2**30
        self._t_last, self._steps_at_last_log = now, step + 1
        self.last_metrics = metrics
        if self.is_rank_zero:
            for logger in self.loggers:
                logger.log_metrics(metrics, step)
            self.console.progress(progress_line(step, self.settings.steps, metrics))
        self.safety.health.observe(step, metrics)
        self.callbacks("on_log", self, step=step, metrics=metrics)
        self.safety.absorb(host[n_flat:], stopped_at=step)

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

    def checkpoint_state(self, on_cpu: bool = False) -> dict[str, Any]:
        """The resumable state between steps; ``step`` is the next step to run.

        Collective when distributed (the RNG states of all ranks are gathered). ``on_cpu``:
        a copy on the CPU instead of references to the live tensors."""
        rng = get_rng_state()
        if self.world_size > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, rng)
            rng_all = gathered
        else:
            rng_all = [rng]
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "rng": rng_all,
            "data": {"microbatches_consumed": self.microbatches_consumed},
            "settings": json.dumps(self.resolved_settings()),
            "model_meta": json.dumps(self.task.model_meta),
            "callbacks": {},
            "stabletrain_version": __version__,
            "torch_version": str(torch.__version__),
        }
        if on_cpu:
            from torch.utils._pytree import tree_map

            state = tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x, state)
        return state

    def _save_checkpoint(self, periodic: bool) -> Optional[Path]:
        """Checkpoint the state after ``self.step`` completed steps (rank 0 writes), once it is
        verified finite; its health goes into it."""
        state = self.checkpoint_state()
        self.callbacks("on_checkpoint_save", self, step=self.step, state=state)
        state["health"] = self.safety.verify(state)
        path = None
        if self.is_rank_zero:
            path = save_checkpoint(state, self.out, periodic=periodic, keep=self.settings.max_checkpoints_to_keep)
        self.fabric.barrier()
        return path

    def _close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.console.close()


def _scale_tensor(scaler: Any, device: torch.device) -> torch.Tensor:
    """The GradScaler's current scale as a device tensor (``get_scale()`` would sync)."""
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        return scale.to(device)
    return torch.tensor(float(scaler.get_scale()), device=device)


def _training_metrics(model: nn.Module, device: torch.device) -> tuple[list[str], torch.Tensor]:
    """The model's ``training_metrics()`` (see :mod:`stabletrain.tasks.base`) as names and one
    float32 device vector, read later with the step's other values."""
    read = getattr(model, "training_metrics", None)
    metrics = read() if callable(read) else {}
    values = [v.detach().float().reshape(()).to(device) for v in metrics.values()]
    return list(metrics), torch.stack(values) if values else torch.zeros(0, device=device)


def _build_debug_callbacks(trainer: Trainer) -> list[Any]:
    """The debugging tools turned on in ``debug_args``, as callbacks."""
    callbacks: list[Any] = []
    debug = trainer.settings.debug_args
    if debug.nancapture.enabled:
        from stabletrain.debug.nan_capture import NaNCaptureCallback

        callbacks.append(NaNCaptureCallback(debug.nancapture))
    if debug.underflow_overflow.enabled:
        from stabletrain.debug.underflow_overflow import UnderflowOverflowCallback

        callbacks.append(UnderflowOverflowCallback(debug.underflow_overflow))
    if trainer.settings.on_instability.policy != "stop":
        from stabletrain.healing import Healer

        callbacks.append(Healer(trainer))
    if trainer.settings.trend_alerts.enabled:
        from stabletrain.debug.trends import TrendAlerts

        callbacks.append(TrendAlerts())
    return callbacks


__all__ = ["train", "Trainer", "TrainResult", "resolve_precision", "CheckpointError"]
