"""What nancapture reads from a model: its precision, its persistent buffers, and which gradients are
non-finite or largest. Replay uses the same functions, so a replay judges a step as training did.
See ``docs/nancapture.md``."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn

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
    """Names of the parameters whose gradient has a NaN or Inf element (one host sync)."""
    names, flags = [], []
    for name, p in named_parameters:
        if p.grad is not None:
            names.append(name)
            flags.append(torch.isfinite(p.grad).all().to("cpu" if p.grad.device.type == "meta" else p.grad.device))
    if not flags:
        return []
    devices = {f.device for f in flags}
    first = next(iter(devices))
    finite = torch.stack([f.to(first) for f in flags]).tolist()
    return [n for n, ok in zip(names, finite) if not ok]


def largest_abs_grads(named_parameters: Any, k: int = 5) -> list[tuple[str, float]]:
    """The ``k`` parameters with the largest ``|gradient|`` element, largest first, as
    (name, value) pairs (one host sync; for the failure path and offline replay)."""
    names, maxima = [], []
    for name, p in named_parameters:
        if p.grad is not None and p.grad.numel():
            names.append(name)
            maxima.append(p.grad.detach().abs().amax().to("cpu", torch.float64))
    if not maxima:
        return []
    values = torch.stack(maxima).tolist()
    ranked = sorted(zip(names, values), key=lambda nv: -nv[1] if not math.isnan(nv[1]) else math.inf)
    return ranked[:k]

