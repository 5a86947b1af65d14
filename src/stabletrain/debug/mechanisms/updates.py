"""Optimizer statistics: per-group weight RMS and relative update, and Adam's epsilon regime.

The update of a logged step is measured, not reconstructed from the optimizer's formulas, so
it holds for any optimizer: just before ``optimizer.step()`` the trainable parameters are
copied into a buffer (allocated on the first logged step and reused: one copy of the
parameters in their own dtype; this rank's shard under FSDP2), and just after it the buffer
becomes ``w_before - w_after``. Norms are one ``torch._foreach_norm`` per device and dtype; under
FSDP2 the squared norms of the shards are summed over the mesh (one all-reduce), so every value
is global. Nothing is read back to the host here.

The Adam family is any optimizer whose state has ``exp_avg_sq`` (``max_exp_avg_sq`` with
``amsgrad``) and whose groups have ``betas`` and ``eps``: an entry is in the eps regime when
``sqrt(v / (1 - beta2**step)) < eps``, i.e. ``v < eps**2 * (1 - beta2**step)``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Optional

import torch
from torch import Tensor

from stabletrain.debug.mechanisms import keys
from stabletrain.distributed.norms import ReduceKey, local_grad


def local_part(t: Tensor) -> tuple[Tensor, ReduceKey]:
    """This rank's part of ``t`` and the groups its squared norm sums over (a DTensor shard's
    placements decide it, parameter or gradient alike; a plain tensor is whole)."""
    return local_grad(t.detach())


def squared_norms(tensors: list[Tensor], reduce_keys: list[ReduceKey]) -> Tensor:
    """The squared L2 norm of each tensor, float64, on the first tensor's device; global
    (summed over the mesh) for shards."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        by_kind[(t.device, t.dtype)].append(i)
    norms: list[Optional[Tensor]] = [None] * len(tensors)
    for (_, dtype), idx in by_kind.items():
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        for i, n in zip(idx, torch._foreach_norm([tensors[i] for i in idx], 2, dtype=acc)):
            norms[i] = n
    device = tensors[0].device
    squares = torch.stack([n.to(device) for n in norms if n is not None]).double().square()
    if any(reduce_keys):
        from stabletrain.distributed.norms import sum_squares_over_mesh

        squares = sum_squares_over_mesh(squares, reduce_keys)
    return squares


class UpdateStats:
    """The optimizer-side signals of one optimizer (see the module docstring).

    Args:
        optimizer: The torch optimizer (not a framework's wrapper).
        param_names: ``id(parameter) -> name`` in the model.
        updates: Measure the update (costs the buffer); False: weight RMS and Adam only.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param_names: dict[int, str], updates: bool = True):
        self.optimizer = optimizer
        self.param_names = param_names
        self.updates = updates
        self.names: list[str] = []
        self._params: list[Tensor] = []
        self._groups: list[tuple[str, int, int]] = []
        self._numel: list[int] = []
        self._buffer: list[Tensor] = []
        self._before_sq: Optional[Tensor] = None
        self._delta_sq: Optional[Tensor] = None
        self._layout()

    def _layout(self) -> None:
        """Parameters in group order (each once), their names, and each group's slice."""
        params: list[Tensor] = []
        groups: list[tuple[str, int, int]] = []
        seen: set[int] = set()
        used: set[str] = set()
        for i, group in enumerate(self.optimizer.param_groups):
            name = group.get("name")
            name = keys.safe_name(name) if isinstance(name, str) and name else f"group{i}"
            name = name if name not in used else f"{name}_{i}"
            used.add(name)
            start = len(params)
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
            if len(params) > start:
                groups.append((name, start, len(params)))
        self._params, self._groups = params, groups
        self.names = [self.param_names.get(id(p), f"<parameter {i}>") for i, p in enumerate(params)]
        self._numel = [p.numel() for p in params]  # a DTensor's numel is the global one

    @property
    def group_names(self) -> list[str]:
        return [name for name, _, _ in self._groups]

    def _locals(self) -> tuple[list[Tensor], list[ReduceKey]]:
        parts = [local_part(p) for p in self._params]
        return [t for t, _ in parts], [k for _, k in parts]

    def reset(self) -> None:
        """A new step: forget a half-measured update (one whose step never ran)."""
        self._before_sq = self._delta_sq = None

    def before_step(self) -> None:
        """Just before ``optimizer.step()`` of a logged step: keep the weights."""
        self._delta_sq = None
        if not self.updates:
            return
        self._layout()
        tensors, reduce_keys = self._locals()
        if not tensors:
            return
        if [(b.shape, b.dtype, b.device) for b in self._buffer] != [(t.shape, t.dtype, t.device) for t in tensors]:
            self._buffer = [torch.empty_like(t) for t in tensors]
        torch._foreach_copy_(self._buffer, tensors)
        self._before_sq = squared_norms(tensors, reduce_keys)

    def after_step(self) -> None:
        """Just after ``optimizer.step()``: the buffer becomes ``w_before - w_after``."""
        if not self.updates or self._before_sq is None:
            return
        tensors, reduce_keys = self._locals()
        torch._foreach_sub_(self._buffer, tensors)
        self._delta_sq = squared_norms(self._buffer, reduce_keys)

    def values(self) -> dict[str, Tensor]:
        """Device scalars of the step: ``weight_rms/<group>`` always; ``update_rms/<group>``,
        ``update_rms_max`` and ``update_rms_argmax`` when a step ran since :meth:`before_step`;
        ``adam_eps_fraction`` for the Adam family."""
        out: dict[str, Tensor] = {}
        if not self._params:
            return out
        tensors, reduce_keys = self._locals()
        weight_sq = squared_norms(tensors, reduce_keys)
        for name, start, stop in self._groups:
            numel = sum(self._numel[start:stop])
            out[f"{keys.WEIGHT_RMS}/{name}"] = (weight_sq[start:stop].sum() / max(1, numel)).sqrt().float()
        if self._delta_sq is not None and self._before_sq is not None:
            out.update(self._update_values(self._before_sq, self._delta_sq))
        fraction = self.adam_eps_fraction()
        if fraction is not None:
            out[keys.ADAM_EPS_FRACTION] = fraction
        self._before_sq = self._delta_sq = None
        return out

    def _update_values(self, before_sq: Tensor, delta_sq: Tensor) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, start, stop in self._groups:
            out[f"{keys.UPDATE_RMS}/{name}"] = (delta_sq[start:stop].sum().sqrt()
                                                / before_sq[start:stop].sum().sqrt()).float()
        # A tensor that was all zeros (a fresh bias) has no relative update: left out (-1).
        ratio = torch.where(before_sq > 0, delta_sq.sqrt() / before_sq.sqrt(), -1.0)
        top, where = ratio.max(dim=0)
        out[keys.UPDATE_RMS_MAX] = torch.where(top < 0, math.nan, top).float()
        out[keys.UPDATE_RMS_ARGMAX] = where.float()
        return out

    def is_adam_family(self) -> bool:
        """Whether any parameter's state holds a second moment and its group ``betas`` and ``eps``."""
        return any(self._second_moment(group, p) is not None
                   for group in self.optimizer.param_groups for p in group["params"])

    def _second_moment(self, group: dict[str, Any], p: Tensor) -> Optional[tuple[Tensor, Any]]:
        if "betas" not in group or "eps" not in group:
            return None
        state = self.optimizer.state.get(p)
        if not state:
            return None
        v = state.get("max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq")
        step = state.get("step")
        return (v, step) if isinstance(v, Tensor) and step is not None else None

    def adam_eps_fraction(self) -> Optional[Tensor]:
        """Fraction of second-moment entries with ``sqrt(v_hat) < eps`` (float32 device scalar);
        None when the optimizer is not of the Adam family."""
        counts: list[Tensor] = []
        reduce_keys: list[ReduceKey] = []
        total = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                found = self._second_moment(group, p)
                if found is None:
                    continue
                v, step = found
                local, key = local_part(v)
                # step is a CPU tensor (or on the device when capturable): the threshold stays a
                # tensor where it is, so nothing is read back to the host.
                threshold = (1 - group["betas"][1] ** step) * group["eps"] ** 2
                local = local.float() if local.dtype == torch.float16 else local  # eps**2 underflows float16
                counts.append((local < threshold).sum())
                reduce_keys.append(key)
                total += v.numel()
        if not counts:
            return None
        device = counts[0].device
        stacked = torch.stack([c.to(device) for c in counts]).double()
        if any(reduce_keys):
            from stabletrain.distributed.norms import sum_squares_over_mesh

            stacked = sum_squares_over_mesh(stacked, reduce_keys)  # sums any values, not only squares
        return (stacked.sum() / total).float()
