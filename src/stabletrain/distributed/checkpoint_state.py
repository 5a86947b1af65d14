"""The trainer's checkpoints under FSDP2: one full file written by rank 0, in the format of an
unsharded run (model keys of the unsharded model, torch's positional optimizer state), so that
every reader of checkpoints (resume on any number of processes, the health check, diagnose,
replay) works unchanged. See docs/distributed.md ("Checkpoints").
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from stabletrain.distributed.shards import gather_full_state, load_full_state


def _names_in_optimizer_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter name of each position of ``optimizer.state_dict()`` (groups in order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]) if id(p) not in names]
    if missing:
        raise ValueError(
            f"the optimizer holds {len(missing)} parameter(s) that are not parameters of the model (positions "
            f"{missing[:5]}); under FSDP2 build the optimizer after sharding, from the sharded model's parameters"
        )
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def optimizer_state_by_position(
    named: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``named`` (``get_optimizer_state_dict``'s form, keyed by parameter name) in torch's own
    ``optimizer.state_dict()`` form, keyed by position."""
    index = {n: i for i, n in enumerate(_names_in_optimizer_order(model, optimizer))}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
              for g in named["param_groups"]]
    return {"state": {index[n]: v for n, v in named["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(
    positional: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_position`."""
    order = _names_in_optimizer_order(model, optimizer)
    if len(order) != sum(len(g["params"]) for g in positional["param_groups"]):
        raise ValueError(
            f"the checkpoint's optimizer state has {sum(len(g['params']) for g in positional['param_groups'])} "
            f"parameters, this optimizer {len(order)}: it comes from another model or optimizer setup"
        )
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [order[i] for i in g["params"]]}
              for g in positional["param_groups"]]
    return {"state": {order[int(i)]: v for i, v in positional["state"].items()}, "param_groups": groups}


def gather_checkpoint_parts(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full model state and positional optimizer state on rank 0's CPU, ``({}, {})`` on the
    other ranks. Collective: every rank must call it."""
    model_state, named = gather_full_state(model, optimizer)
    if not model_state:
        return {}, {}
    return model_state, optimizer_state_by_position(named, model, optimizer)


def load_optimizer_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer, positional: Optional[dict[str, Any]]
) -> None:
    """Put a checkpoint's positional optimizer state into the optimizer of a sharded model,
    keeping the optimizer's own hyperparameters (lr, betas, ...: this run's settings), as an
    unsharded resume does. Collective; only rank 0's ``positional`` is read (the others may pass
    None)."""
    keep = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    named = optimizer_state_by_name(positional, model, optimizer) if positional else {}
    load_full_state(model, optimizer, optim_state=named)
    for group, kept in zip(optimizer.param_groups, keep):
        group.update(kept)

