"""Why an optimizer step made values non-finite, measured once the guard has stopped.

Host reads are fine here: this runs on the failure path only. It names the parameters and
optimizer state entries holding NaN/Inf, and for Adam-type optimizers checks the classic
float16 trap: ``eps`` below the dtype's resolution and a second moment that underflowed to 0,
which turn the update into x / 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from stabletrain.distributed.norms import local_tensor

__all__ = ["describe_optimizer_damage", "explain_optimizer_damage", "optimizer_name", "smallest_positive"]

_DTYPE_NAMES = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64",
}


def describe_optimizer_damage(failure: Any, model: nn.Module, optimizer: Any) -> None:
    """Fill in ``failure``'s (a :class:`stabletrain.safety.guard.GuardFailure`) parameters and
    state entries holding NaN/Inf, and why (host reads)."""
    names = {id(p): n for n, p in model.named_parameters()}
    counts = {}
    for n, p in model.named_parameters():
        bad = int((~torch.isfinite(local_tensor(p.detach()))).sum())  # FSDP2: this rank's shard
        if bad:
            counts[n] = bad
    failure.param_names = list(counts)
    failure.param_counts = counts
    if not counts:
        # Nothing non-finite: the guard's norm overflowed. Name the largest weight instead.
        sizes = {n: float(local_tensor(p.detach()).abs().max()) for n, p in model.named_parameters()
                 if local_tensor(p).numel()}
        if sizes:
            failure.largest_name = max(sizes, key=lambda n: sizes[n])
            failure.largest_abs = sizes[failure.largest_name]
    if optimizer is None:
        return
    failure.optimizer = optimizer_name(optimizer)
    entries = []
    for p, st in optimizer.state.items():
        for key, v in st.items():
            if (isinstance(v, Tensor) and v.is_floating_point() and v.numel()
                    and not bool(torch.isfinite(local_tensor(v)).all())):
                entries.append(f"{names.get(id(p), '?')}: {key}")
    failure.state_entries = entries
    failure.explanation = explain_optimizer_damage(model, optimizer, set(counts))
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    if not counts and not entries and isinstance(lr, (int, float)):
        failure.explanation = (f"The learning rate is {lr:g}: one step moves a weight by up to about lr (Adam) "
                               "or lr x its gradient (SGD).")


def optimizer_name(optimizer: Any) -> str:
    """``torch.optim.AdamW`` for torch's optimizers, else ``module.QualName``."""
    cls = type(optimizer)
    if cls.__module__.startswith("torch.optim"):
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def smallest_positive(dtype: torch.dtype) -> float:
    """The smallest positive value of a floating dtype (subnormals included)."""
    return float(torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype)))


def explain_optimizer_damage(model: nn.Module, optimizer: Any, bad_params: set[str]) -> str:
    """Why an optimizer step made values non-finite, from what can be measured now.

    For Adam-type optimizers (``exp_avg_sq`` and ``eps``): whether eps is 0 in the
    parameters' dtype and how many second-moment entries are 0 (squared gradients that
    underflowed), which turns the update into x / 0. Otherwise: whether the parameters
    overflowed while the state stayed finite (lr x update beyond the dtype's range).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    reasons = []
    for group in optimizer.param_groups:
        eps = group.get("eps")
        lr = group.get("lr")
        for p in group["params"]:
            name = names.get(id(p), "?")
            if name not in bad_params:
                continue
            st = optimizer.state.get(p, {})
            dtype = p.dtype
            smallest = smallest_positive(dtype)
            v = st.get("exp_avg_sq")
            if isinstance(v, Tensor) and isinstance(eps, (int, float)):
                eps_in_dtype = float(torch.tensor(eps, dtype=dtype))
                zeros = int((local_tensor(v.detach()) == 0).sum())
                if eps_in_dtype == 0 or zeros:
                    why = f"{type(optimizer).__name__} divides exp_avg by sqrt(exp_avg_sq) + eps"
                    if eps_in_dtype == 0:
                        why += (f": eps={eps:g} is 0 in {_DTYPE_NAMES.get(dtype, dtype)} (its smallest positive "
                                f"value is {smallest:.2g})")
                    if zeros:
                        why += (f"{',' if eps_in_dtype == 0 else ':'} and exp_avg_sq holds {zeros:,} zero(s) in {name} "
                                f"(squared gradients below {smallest:.2g} underflow to 0)")
                    why += ", so the update is x / 0 = Inf, or 0 / 0 = NaN where exp_avg is 0 too"
                    reasons.append(why)
                    break
            state_finite = all(bool(torch.isfinite(local_tensor(t)).all()) for t in st.values()
                               if isinstance(t, Tensor) and t.is_floating_point())
            if state_finite and dtype.is_floating_point:
                big = float(torch.finfo(dtype).max)
                reasons.append(f"{name}'s optimizer state is finite, but the parameter is not: the update "
                               f"(lr {lr:g} x step) took it beyond {_DTYPE_NAMES.get(dtype, dtype)}'s range "
                               f"(largest value {big:.3g})" if isinstance(lr, (int, float)) else
                               f"{name}'s optimizer state is finite, but the parameter is not: the update overflowed")
                break
        if reasons:
            break
    if not reasons:
        return ""
    text = reasons[0] + "."
    dtype = next((p.dtype for n, p in model.named_parameters() if n in bad_params), None)
    if dtype in (torch.float16, torch.bfloat16):
        text += (" With precision=16-true or bf16-true the optimizer runs in that type too: train with "
                 "precision=16-mixed or bf16-mixed (float32 weights and optimizer state) or precision=32-true.")
    return text
