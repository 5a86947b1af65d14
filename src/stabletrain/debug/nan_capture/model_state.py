"""What nancapture reads from a model: its precision, its persistent buffers, and which gradients are
non-finite or largest. Replay uses the same functions, so a replay judges a step as training did.
See ``docs/nancapture.md``."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn

from stabletrain.distributed.norms import local_grad, sum_squares_over_mesh

_TRUE_PRECISIONS = {torch.float16: "16-true", torch.bfloat16: "bf16-true", torch.float64: "64-true"}
_MIXED_PRECISIONS = {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}


def infer_precision(model: nn.Module, autocast_dtype: Optional[torch.dtype] = None) -> str:
    """The Lightning Fabric precision a plain loop runs ``model`` in: the dtype holding most of
    its floating-point parameters ("16-true", "bf16-true", "64-true"), else, for float32
    parameters, the autocast dtype seen during the step ("16-mixed", "bf16-mixed"), else "32-true"."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    dtype = max(sizes, key=lambda d: sizes[d]) if sizes else torch.float32
    if dtype in _TRUE_PRECISIONS:
        return _TRUE_PRECISIONS[dtype]
    return _MIXED_PRECISIONS.get(autocast_dtype, "32-true") if autocast_dtype is not None else "32-true"


def persistent_buffers(model: nn.Module) -> list[tuple[str, Tensor]]:
    """(name, tensor) of the buffers that ``state_dict`` saves, named as in ``state_dict``."""
    out = []
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def nonfinite_grad_names(named_parameters: Any) -> list[str]:
    """Names of the parameters whose gradient has a NaN or Inf element (one host sync).

    Under FSDP2 (DTensor gradients) each rank checks its own shard and the counts are summed over
    the mesh in one all-reduce, so every rank returns the same, global names. That is a collective:
    every rank must call it (nancapture does, on the failure path, which all ranks take together).
    """
    names, flags, keys = [], [], []
    for name, p in named_parameters:
        if p.grad is not None:
            grad, key = local_grad(p.grad)
            names.append(name)
            keys.append(key)
            flags.append((~torch.isfinite(grad)).any().to("cpu" if grad.device.type == "meta" else grad.device))
    if not flags:
        return []
    first = flags[0].device
    bad = torch.stack([f.to(first) for f in flags]).float()
    if any(keys):
        bad = sum_squares_over_mesh(bad, keys)  # a sum of 0/1 flags: > 0 where any shard is bad
    return [n for n, count in zip(names, bad.tolist()) if count > 0]


def largest_abs_grads(named_parameters: Any, k: int = 5) -> list[tuple[str, float]]:
    """The ``k`` parameters with the largest ``|gradient|`` element, largest first, as
    (name, value) pairs (one host sync; for the failure path and offline replay).

    Under FSDP2 each rank reads its own shard (``to_local()``) and the maxima are reduced over the
    mesh (one all-reduce, a collective every rank must call), so the values are global.
    """
    names, maxima, keys = [], [], []
    for name, p in named_parameters:
        if p.grad is not None and p.grad.numel():
            grad, key = local_grad(p.grad)
            names.append(name)
            keys.append(key)
            # An empty shard (FSDP's trailing ranks of a small tensor) contributes 0.
            local = grad.detach().abs().amax() if grad.numel() else grad.new_zeros(())
            maxima.append(local.to(torch.float64))
    if not maxima:
        return []
    first = maxima[0].device
    stacked = torch.stack([m.to(first) for m in maxima])
    if any(keys):
        stacked = _max_over_mesh(torch.nan_to_num(stacked, nan=math.inf), keys)
    values = stacked.tolist()
    ranked = sorted(zip(names, values), key=lambda nv: -nv[1] if not math.isnan(nv[1]) else math.inf)
    return ranked[:k]


def _max_over_mesh(values: Tensor, keys: list[Any]) -> Tensor:
    """``values[i]`` maximised over the groups ``keys[i]`` (one all-reduce per distinct group set)."""
    import torch.distributed as dist

    out = values.clone()
    for key in dict.fromkeys(k for k in keys if k):
        index = torch.tensor([i for i, k in enumerate(keys) if k == key], device=values.device)
        part = out.index_select(0, index)
        for group in key:
            dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
        out.index_copy_(0, index, part)
    return out
