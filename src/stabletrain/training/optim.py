"""The trainer's optimizer and learning-rate schedule, built from ``model_args`` (see docs/training.md)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stabletrain.config import ModelArgs, TrainSettings


def build_optimizer(model: nn.Module, args: ModelArgs) -> torch.optim.Optimizer:
    """The model's own ``configure_optimizer(args)`` when it has one, else AdamW or SGD with weight
    decay on matrices only (groups ``decay`` and ``no_decay``); every group records its ``base_lr``
    for the schedule."""
    configure = getattr(model, "configure_optimizer", None)
    if callable(configure):
        optimizer = configure(args)
    else:
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for p in model.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        # Named: the names key the per-group signals (signals/weight_rms/decay, docs/mechanisms.md).
        groups = [
            {"params": decay, "weight_decay": args.weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        ]
        groups = [g for g in groups if g["params"]]
        if args.optimizer == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=args.betas, eps=args.eps)
        else:
            optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum)
    for group in optimizer.param_groups:
        group.setdefault("base_lr", group["lr"])
    return optimizer


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load a checkpoint's optimizer state but keep the hyperparameters of ``optimizer``."""
    # The saved param groups carry the old run's hyperparameters (lr, weight decay, SGD
    # momentum, AdamW betas, ...); keep those of the optimizer just built from this run's
    # settings, so that e.g. a lower model_args.lr or another momentum takes effect on
    # resume. Only the optimizer's state (moments, step counts) comes from the checkpoint.
    keep = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, kept in zip(optimizer.param_groups, keep):
        group.update(kept)


def lr_factor(settings: TrainSettings, step: int) -> float:
    """Multiplier of each parameter group's base lr at ``step``: warmup, then the schedule."""
    args = settings.model_args
    if args.warmup_steps and step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return 1.0
    span = max(1, settings.steps - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / span)
    floor = args.min_lr_ratio
    if args.lr_schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
