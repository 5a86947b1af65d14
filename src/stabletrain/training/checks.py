"""The trainer's setup checks: every configuration problem at once, before anything is
written or trained.

:func:`validate_settings` (what ``train()`` calls first) reports pydantic's problems together
with those of the checks that do not read a rejected value; :func:`setup_problems` is the full
set, run once Lightning Fabric knows the world size. Each problem names the setting, the value
and what to do instead. The checks that need no torch live in :mod:`stabletrain.training.preflight`
(``stabletrain train`` runs them before it loads torch) and are part of these.
:func:`settings_warnings` are the valid settings that are probably not what was meant; the
run's header prints them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from stabletrain.config import IMAGE_MODEL_ARGS, LANGUAGE_MODEL_ARGS, TrainSettings, load_settings, partial_settings
from stabletrain.data.loader import samples_needed
from stabletrain.errors import ConfigError
from stabletrain.loggers import check_loggers
from stabletrain.tasks import check_task, num_samples, resolve_task_name
from stabletrain.training.preflight import out_dir_problems

#: Settings the task checks (model name, data) read; with one of them rejected they cannot run.
_TASK_CHECK_KEYS = (
    "task",
    "model",
    "data",
    "transform_args",
    *(f"model_args.{k}" for k in LANGUAGE_MODEL_ARGS + IMAGE_MODEL_ARGS),
)


def validate_settings(settings: dict[str, Any]) -> TrainSettings:
    """:func:`~stabletrain.config.load_settings`, reporting more mistakes when some values are invalid.

    When pydantic rejects values, the checks that do not read them (the data path, the
    model name, the out folder, the loggers) still run on the other settings, and their
    problems join pydantic's in one :class:`ConfigError`.

    Raises:
        ConfigError: Every problem found, one line each.

    Example::

        validate_settings({"out": "out/x", "steps": 0, "data": "missing.txt"})
        # ConfigError: Invalid settings (2 problems): steps: ..., data: file not found: missing.txt ...
    """
    try:
        return load_settings(settings)
    except ConfigError as exc:
        partial, rejected = partial_settings(settings)
        if partial is None:
            raise
        more = problems_despite(partial, rejected)
        if not more:
            raise
        raise ConfigError(exc.problems + more) from None


def setup_problems(
    settings: TrainSettings, world_size: Optional[int], is_rank_zero: bool, fabric_problems: Sequence[str] = ()
) -> list[str]:
    """Every configuration problem; ``world_size`` is None when Fabric refused the settings
    (``fabric_problems``), and the checks that need it are skipped then."""
    s = settings
    task_problems = check_task(s)
    problems = list(task_problems)
    if world_size is not None:
        per_step = world_size * s.gradient_accumulation_steps
        if s.batch_size % per_step:
            problems.append(
                f"batch_size: {s.batch_size} is not divisible by devices x num_nodes x "
                f"gradient_accumulation_steps = {world_size} x {s.gradient_accumulation_steps} = {per_step}; "
                f"use a multiple of {per_step}, e.g. {max(per_step, s.batch_size // per_step * per_step)}"
            )
        elif not any(p.startswith("data:") for p in task_problems):
            problems.extend(dataset_size_problems(s, world_size))
    problems.extend(check_loggers(s, try_import=is_rank_zero))
    problems.extend(debug_problems(s))
    problems.extend(sharding_problems(s))
    problems.extend(fabric_problems)
    if is_rank_zero:
        problems.extend(out_dir_problems(s))
    return problems


def problems_despite(settings: TrainSettings, rejected: list[str]) -> list[str]:
    """The checks that read none of the ``rejected`` settings (see :func:`validate_settings`)."""

    def reads(*keys: str) -> bool:
        return any(r == k or r.startswith(k + ".") or k.startswith(r + ".") for r in rejected for k in keys)

    s = settings
    problems = []
    if not reads(*_TASK_CHECK_KEYS):
        problems.extend(check_task(s))
    elif not reads("data") and isinstance(s.data, (str, os.PathLike)) and not Path(s.data).exists():
        problems.append(f"data: not found: {s.data}")
    if not reads("loggers"):
        problems.extend(check_loggers(s))
    if not reads("out", "overwrite", "resume_interrupted", "resume_from"):
        problems.extend(out_dir_problems(s))
    return problems


def dataset_size_problems(settings: TrainSettings, world_size: int) -> list[str]:
    """The loader drops incomplete microbatches: every rank needs at least one full one."""
    s = settings
    try:
        n = num_samples(s)
    except (OSError, ValueError, TypeError):
        return []  # unreadable data; building the task reports it
    accum = s.gradient_accumulation_steps
    microbatch = s.batch_size // (world_size * accum)
    needed = samples_needed(microbatch, world_size)
    if n >= needed:
        return []
    name = resolve_task_name(s)
    if s.data is None:
        what = f"the built-in {name} data"
    elif isinstance(s.data, (str, os.PathLike)):
        what = str(s.data)
    else:
        what = f"the dataset ({type(s.data).__name__})"
    unit = ""
    if name == "language_model":
        unit = f" (windows of model_args.context_length + 1 = {s.model_args.context_length + 1} tokens)"
    if world_size == 1 and accum == 1:
        need = f"one batch of batch_size={s.batch_size} needs {needed}"
    else:
        need = (
            f"batch_size={s.batch_size} / (devices x num_nodes x gradient_accumulation_steps = "
            f"{world_size} x {accum}) = {microbatch} samples per microbatch, on each of {world_size} "
            f"process(es), needs {needed}"
        )
    if n >= world_size:
        largest = n // world_size * world_size * accum
        fix = f"lower batch_size to {largest} or less, or give more data"
    else:
        fix = f"give at least {world_size} samples (one per process) or use fewer devices"
    if name == "language_model":
        fix += " (or lower model_args.context_length)"
    return [f"data: {what} holds {n} samples{unit}, too few: {need}; {fix}"]


def settings_warnings(settings: TrainSettings) -> list[str]:
    """Settings that are valid but probably not what was meant, one sentence each."""
    warnings = []
    args = settings.model_args
    if args.warmup_steps >= settings.steps:
        tenth = settings.steps // 10
        example = f"e.g. {tenth}, a tenth of steps" if tenth else "e.g. 0, no warmup"
        peak = "reaches model_args.lr only at the last step" if args.warmup_steps == settings.steps else (
            f"never reaches model_args.lr={args.lr:g} (it ends at {settings.steps / args.warmup_steps:.0%} of it)"
        )
        warnings.append(
            f"model_args.warmup_steps={args.warmup_steps} is not below steps={settings.steps}: the learning rate "
            f"rises for the whole run, {peak}, and the {args.lr_schedule} schedule after warmup never starts; "
            f"lower model_args.warmup_steps ({example}) or raise steps"
        )
    return warnings


def available_accelerators() -> list[str]:
    """The accelerator names Fabric can use on this machine, ``auto`` first."""
    from lightning_fabric.accelerators import ACCELERATOR_REGISTRY

    registry = ACCELERATOR_REGISTRY
    names = [n for n in registry.available_accelerators() if registry[n]["accelerator"].is_available()]
    if "cuda" in names or "mps" in names:
        names.append("gpu")
    return ["auto", *sorted(names)]


def debug_problems(settings: TrainSettings) -> list[str]:
    """Problems with debug_args; each debugging tool adds its checks here."""
    from stabletrain.debug import underflow_overflow

    return [*underflow_overflow.check_settings(settings)]


def is_fsdp(settings: TrainSettings) -> bool:
    """``strategy`` is fsdp or fsdp2: FSDP2 (see docs/distributed.md)."""
    return settings.strategy in ("fsdp", "fsdp2")


def checkpoint_layout(settings: TrainSettings, sharded: bool) -> str:
    """``"sharded"`` or ``"full"``: what ``checkpoint_format`` means for a run that does (``sharded``)
    or does not shard its model. ``auto`` is sharded under FSDP2: a model sharded because it does
    not fit one device is not gathered on one rank to be saved."""
    fmt = settings.checkpoint_format
    if fmt == "auto":
        return "sharded" if sharded else "full"
    return fmt


def checkpoint_problems(settings: TrainSettings) -> list[str]:
    """``checkpoint_format=sharded`` and ``checkpoint_async`` need FSDP2's shards."""
    s = settings
    problems = []
    if s.checkpoint_format == "sharded" and not is_fsdp(s):
        problems.append(
            f"checkpoint_format: sharded needs strategy=fsdp (each rank writes the shards it holds); with "
            f"strategy={s.strategy} every rank holds the whole model, which checkpoint_format=full writes in one "
            "file; use checkpoint_format=full (or auto)"
        )
    if s.checkpoint_async and (s.checkpoint_format == "full" or not is_fsdp(s)):
        problems.append(
            "checkpoint_async: asynchronous saves are for sharded checkpoints (strategy=fsdp with "
            f"checkpoint_format=sharded or auto; here strategy={s.strategy}, checkpoint_format={s.checkpoint_format}); "
            "set checkpoint_async=false"
        )
    return problems


def sharding_problems(settings: TrainSettings) -> list[str]:
    """What sharding (``strategy=fsdp``) needs of the other settings, said before anything starts."""
    return checkpoint_problems(settings)


def resolve_precision(precision: str, accelerator: str) -> str:
    """'auto' becomes bf16-mixed on a GPU that supports it, else 32-true."""
    if precision != "auto":
        return precision
    if accelerator in ("auto", "cuda", "gpu") and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"
