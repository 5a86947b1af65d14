"""The total gradient norm (``gradient_norm``), kept on the device.

:func:`compute_grad_norm` gives the pre-clipping L2 norm over all gradients, once per optimizer
step, from one fused ``torch._foreach_norm`` per device and dtype accumulated in float32, with no
host read; :func:`clip_grad_norm_with_total` clips with it and :func:`layer_grad_norms` gives the
per-layer norms (``gradient_norm_per_layer``). Global under FSDP2 (:mod:`stabletrain.distributed.norms`).
See docs/gradient_norm.md.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

import torch
from torch import Tensor

from stabletrain.distributed.norms import local_grad


@dataclass
class GradNorm:
    """Gradient norms of one optimizer step, still on the device.

    Attributes:
        total: Scalar float32 tensor, the L2 norm over all gradients. A finite total means
            every gradient element is finite; the reverse does not hold: finite elements
            whose squares overflow float32 (an element above about 1.8e19, since
            float32 ends at 3.4e38) give an infinite total too.
        per_param: One float32 scalar tensor per parameter in ``names`` order.
        names: Parameter names that had a gradient.
        params: The parameters, in the same order (for clipping).
    """

    total: Tensor
    per_param: list[Tensor]
    names: list[str]
    params: list[Tensor]

    def nonfinite_names(self) -> list[str]:
        """Names of the parameters whose float32 gradient norm is not finite (one host sync):
        those holding a NaN or Inf element, and also those whose finite elements are too large
        for a float32 norm. ``stabletrain.debug.nan_capture.nonfinite_grad_names`` checks the
        elements themselves."""
        if not self.per_param:
            return []
        finite = torch.isfinite(torch.stack(self.per_param)).tolist()
        return [n for n, ok in zip(self.names, finite) if not ok]


def compute_grad_norm(named_parameters: Iterable[tuple[str, Tensor]]) -> GradNorm:
    """L2 norms of all gradients, per parameter and in total, accumulated in float32.

    Args:
        named_parameters: ``model.named_parameters()`` or any (name, tensor) pairs; tensors
            without ``.grad`` are skipped.

    Returns:
        A :class:`GradNorm` whose tensors live on the gradients' device(s).
    """
    names: list[str] = []
    params: list[Tensor] = []
    grads: list[Tensor] = []
    reduce_keys: list[tuple] = []
    for name, p in named_parameters:
        if p.grad is not None:
            names.append(name)
            params.append(p)
            local, key = local_grad(p.grad)
            grads.append(local)
            reduce_keys.append(key)
    if not grads:
        return GradNorm(torch.zeros((), dtype=torch.float32), [], [], [])

    # _foreach_norm fuses per device and dtype; group so that each call is homogeneous.
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, g in enumerate(grads):
        groups[(g.device, g.dtype)].append(i)
    per_param: list[Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for (_, dtype), idx in groups.items():
        tensors = [grads[i].to_dense() if grads[i].is_sparse else grads[i] for i in idx]
        if dtype == torch.float64:  # 64-true: _foreach_norm refuses to narrow; the result is float32 all the same
            norms = [n.float() for n in torch._foreach_norm(tensors, 2, dtype=torch.float64)]
        else:
            norms = list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
        for i, n in zip(idx, norms):
            per_param[i] = n
    devices = {n.device for n in per_param}
    if any(reduce_keys):  # sharded: local norms -> global ones, one all-reduce of their squares
        from stabletrain.distributed.norms import sum_squares_over_mesh

        squares = sum_squares_over_mesh(torch.stack(per_param).square(), reduce_keys)
        per_param = list(squares.sqrt().unbind())
        total = squares.sum().sqrt()
    elif len(devices) == 1:
        total = torch.linalg.vector_norm(torch.stack(per_param), 2)
    else:  # model spread over several devices: gather the scalars on the first one
        first = per_param[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in per_param]), 2)
    return GradNorm(total=total, per_param=per_param, names=names, params=params)


def layer_grad_norms(gn: GradNorm) -> tuple[list[str], Tensor]:
    """Per-parameter and per-module gradient norms as one float32 device tensor, no host sync.

    Built from ``gn.per_param`` (the norms behind ``gn.total``), so nothing reads the
    gradients again. A module's norm is the square root of the sum of its parameters'
    squared norms, over every module that holds a parameter at any depth (``blocks.0.attn``,
    ``blocks.0``, ``blocks``); the root module is ``gn.total`` itself and is left out.

    Args:
        gn: The result of :func:`compute_grad_norm`.

    Returns:
        ``(names, norms)``: the parameter names first (in ``gn.names`` order), then module
        names (in first-seen order), and a 1-D tensor of the same length on ``gn.total``'s device.

    Example::

        gn = compute_grad_norm(model.named_parameters())
        names, norms = layer_grad_norms(gn)
        if step % 100 == 0:
            print(dict(zip(names, norms.tolist())))    # one host sync for all of them
    """
    if not gn.per_param:
        return [], torch.zeros(0, dtype=torch.float32, device=gn.total.device)
    device = gn.total.device
    per_param = torch.stack([n.to(device) for n in gn.per_param])
    modules, module_idx, param_idx = _module_membership(tuple(gn.names))
    if not modules:
        return list(gn.names), per_param
    squares = per_param.square()
    module_sq = torch.zeros(len(modules), dtype=squares.dtype, device=device)
    module_sq.index_add_(0, module_idx.to(device), squares[param_idx.to(device)])
    return [*gn.names, *modules], torch.cat([per_param, module_sq.sqrt()])


@lru_cache(maxsize=8)
def _module_membership(names: tuple[str, ...]) -> tuple[list[str], Tensor, Tensor]:
    """Modules above each parameter, as (module names, module index, parameter index) pairs."""
    modules: dict[str, int] = {}
    module_idx: list[int] = []
    param_idx: list[int] = []
    for p, name in enumerate(names):
        parts = name.split(".")
        for depth in range(1, len(parts)):
            module = ".".join(parts[:depth])
            m = modules.setdefault(module, len(modules))
            module_idx.append(m)
            param_idx.append(p)
    return list(modules), torch.tensor(module_idx, dtype=torch.long), torch.tensor(param_idx, dtype=torch.long)


def clip_grad_norm_with_total(params: list[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale gradients so their total norm is at most ``max_norm``, reusing an already
    computed ``total_norm`` (no second pass over the gradients, no host sync).

    A non-finite ``total_norm`` leaves non-finite gradients non-finite; it never hides them.
    """
    if max_norm <= 0 or not params:
        return
    # The local shard of a DTensor gradient is scaled in place: the same coefficient on every rank.
    grads = [local_grad(p.grad)[0] for p in params if p.grad is not None]
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    # Group by device and dtype so each _foreach_mul_ is homogeneous.
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    for (device, dtype), gs in groups.items():
        torch._foreach_mul_(gs, coef.to(device=device, dtype=dtype))
