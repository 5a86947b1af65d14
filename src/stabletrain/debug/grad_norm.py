"""The total gradient norm, kept on the device.

``gradient_norm`` is the L2 norm over all parameter gradients. It is computed once per
optimizer step, after the whole gradient-accumulation cycle and after fp16 un-scaling, and
before clipping, so with clipping on it is the pre-clipping norm. Per-parameter norms come
from one fused ``torch._foreach_norm`` per device and dtype, accumulated in float32 so that
fp16/bf16 gradients cannot overflow the sum of squares (fp16 overflows near 256**2).

Nothing here reads a value back to the host: the result stays a device tensor until a
logger asks for it, so steps that are not logged pay no synchronisation.

Use it in any PyTorch loop::

    loss.backward()
    gn = compute_grad_norm(model.named_parameters())
    clip_grad_norm_with_total(gn.params, max_norm=1.0, total_norm=gn.total)   # optional
    optimizer.step()
    if step % 10 == 0:
        print(float(gn.total))

Logged keys:

=================  ==========================================================
``gradient_norm``  L2 norm over all parameter gradients (pre-clipping)
=================  ==========================================================
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor


@dataclass
class GradNorm:
    """Gradient norms of one optimizer step, still on the device.

    Attributes:
        total: Scalar float32 tensor, the L2 norm over all gradients. It is finite exactly
            when every gradient element is finite.
        per_param: One float32 scalar tensor per parameter in ``names`` order.
        names: Parameter names that had a gradient.
        params: The parameters, in the same order (for clipping).
    """

    total: Tensor
    per_param: list[Tensor]
    names: list[str]
    params: list[Tensor]

    def nonfinite_names(self) -> list[str]:
        """Names of the parameters whose gradient holds a NaN or Inf (one host sync)."""
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
    for name, p in named_parameters:
        if p.grad is not None:
            names.append(name)
            params.append(p)
            grads.append(p.grad)
    if not grads:
        return GradNorm(torch.zeros((), dtype=torch.float32), [], [], [])

    # _foreach_norm fuses per device and dtype; group so that each call is homogeneous.
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, g in enumerate(grads):
        groups[(g.device, g.dtype)].append(i)
    per_param: list[Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for (device, _), idx in groups.items():
        tensors = [grads[i].to_dense() if grads[i].is_sparse else grads[i] for i in idx]
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        for i, n in zip(idx, norms):
            per_param[i] = n
    devices = {n.device for n in per_param}
    if len(devices) == 1:
        total = torch.linalg.vector_norm(torch.stack(per_param), 2)
    else:  # model spread over several devices: gather the scalars on the first one
        first = per_param[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in per_param]), 2)
    return GradNorm(total=total, per_param=per_param, names=names, params=params)


def clip_grad_norm_with_total(params: list[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale gradients so their total norm is at most ``max_norm``, reusing an already
    computed ``total_norm`` (no second pass over the gradients, no host sync).

    A non-finite ``total_norm`` leaves non-finite gradients non-finite; it never hides them.
    """
    if max_norm <= 0 or not params:
        return
    grads = [p.grad for p in params if p.grad is not None]
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    # Group by device and dtype so each _foreach_mul_ is homogeneous.
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    for (device, dtype), gs in groups.items():
        torch._foreach_mul_(gs, coef.to(device=device, dtype=dtype))
