"""Why an optimizer step made values non-finite, measured once the guard has stopped.

Host reads are fine here: this runs on the failure path only. It names the parameters and
optimizer state entries holding NaN/Inf, and for Adam-type optimizers checks the classic
float16 trap: ``eps`` below the dtype's resolution and a second moment that underflowed to 0,
which turn the update into x / 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from stabletrain.distributed.norms import local_tensor

__all__ = ["describe_optimizer_damage", "explain_optimizer_damage", "optimizer_name", "smallest_positive",
           "RangeTrip", "range_trips", "explain_trips", "explain_state_overflow", "NORM_OVERFLOW_AT",
           "FLOAT32_MAX"]

#: The guard's check after an optimizer step (``stabletrain.safety.guard.finite_norms``) takes the
#: float32 L2 norm of all parameters, and of all optimizer state: finite values beyond about
#: sqrt(float32's largest value) overflow its squares, and the check fails as if a value were Inf.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
NORM_OVERFLOW_AT = math.sqrt(FLOAT32_MAX)


@dataclass
class RangeTrip:
    """A tensor, every value finite, that makes the guard's norm check fail.

    Attributes:
        name: ``head.weight`` (a parameter) or ``head.weight: exp_avg_sq`` (an optimizer state entry).
        kind: ``"parameter"`` or ``"optimizer state"``.
        abs_max: Its largest ``|value|``.
        alone: Its own float32 L2 norm overflows (False: only the total over all tensors does).
        square_sum: The sum of the squares the norm adds up, in float64: of this tensor's values
            (``alone``), else of every tensor's of its kind. Past float32's largest value
            (:data:`FLOAT32_MAX`) the float32 norm is inf, whatever the largest value alone.
        numel: How many values that sum is over.
    """

    name: str
    kind: str
    abs_max: float
    alone: bool = True
    square_sum: float = math.nan
    numel: int = 0

    def overflow_text(self) -> str:
        """Why the norm overflowed: ``the squares of its 128 values sum to 3.9e+39, past float32's largest
        value 3.4e+38``, and the size at which one value alone does it."""
        of = f"its {self.numel:,} values" if self.alone else f"all {self.numel:,} values of the {self.kind}"
        alone = "" if self.alone else ", though no tensor's norm overflows alone"
        return (f"the squares of {of} sum to {self.square_sum:.3g}, past float32's largest value {FLOAT32_MAX:.3g}, so "
                f"the float32 L2 norm the guard checks overflows{alone} (one value alone does it from about "
                f"{NORM_OVERFLOW_AT:.2g})")

    def describe(self) -> str:
        """``head.weight: exp_avg_sq (optimizer state) reaches |v| 3.1e+21``."""
        what = "|w|" if self.kind == "parameter" else "|v|"
        return f"{self.name} ({self.kind}) reaches {what} {self.abs_max:.4g}"


def range_trips(named: Mapping[str, Tensor], kind: str) -> list[RangeTrip]:
    """The tensors of ``named`` (finite) whose float32 L2 norm overflows; when none does alone
    but the norm over all of them does (what the guard checks), the largest one."""
    norms, sizes, squares, counts = {}, {}, {}, {}
    for n, t in named.items():
        local = local_tensor(t.detach())
        if not local.is_floating_point() or not local.numel():
            continue
        norms[n] = torch.linalg.vector_norm(local.float())
        sizes[n] = float(local.abs().max())
        squares[n], counts[n] = float(local.double().pow(2).sum()), local.numel()
    if not norms:
        return []
    alone = [RangeTrip(n, kind, sizes[n], square_sum=squares[n], numel=counts[n])
             for n, v in norms.items() if not math.isfinite(float(v))]
    if alone:
        return sorted(alone, key=lambda t: -t.abs_max)
    if math.isfinite(float(torch.linalg.vector_norm(torch.stack(list(norms.values()))))):
        return []
    top = max(sizes, key=lambda n: sizes[n])
    return [RangeTrip(top, kind, sizes[top], alone=False, square_sum=sum(squares.values()),
                      numel=sum(counts.values()))]

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
    sizes = {n: float(local_tensor(p.detach()).abs().max()) for n, p in model.named_parameters()
             if local_tensor(p).numel()}
    if sizes:
        failure.largest_name = max(sizes, key=lambda n: sizes[n])
        failure.largest_abs = sizes[failure.largest_name]
    state = {}
    if optimizer is not None:
        state = {f"{names.get(id(p), '?')}: {key}": v for p, st in optimizer.state.items() for key, v in st.items()
                 if isinstance(v, Tensor) and v.is_floating_point() and v.numel()}
    entries = [k for k, v in state.items() if not bool(torch.isfinite(local_tensor(v)).all())]
    if not counts and not entries:
        # Nothing non-finite: a norm the guard checks overflowed. Name the tensors that made it.
        trips = []
        if "parameters" in failure.nonfinite:
            trips += range_trips(dict(model.named_parameters()), "parameter")
        if "optimizer_state" in failure.nonfinite:
            trips += range_trips(state, "optimizer state")
        failure.trips = trips
    if optimizer is None:
        return
    failure.optimizer = optimizer_name(optimizer)
    failure.state_entries = entries
    failure.explanation = explain_optimizer_damage(model, optimizer, set(counts))
    if not failure.explanation and entries and not counts:
        failure.explanation = explain_state_overflow(model, optimizer)
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    if not counts and not entries:
        failure.explanation = explain_trips(failure.trips, lr, failure.gradient_norm, failure.optimizer)


def explain_state_overflow(model: nn.Module, optimizer: Any) -> str:
    """Adam's second moment went non-finite while the weights stayed finite: the squared gradient
    overflowed the state's dtype, and the update ``exp_avg / (sqrt(exp_avg_sq) + eps)`` is 0 there
    from then on (the weight stops training, silently). "" when that is not what happened."""
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            v = optimizer.state.get(p, {}).get("exp_avg_sq")
            if not isinstance(v, Tensor) or not v.is_floating_point():
                continue
            # An overflow: +Inf entries only (a NaN says something else went wrong), the weights finite.
            local = local_tensor(v.detach())
            bad = int(torch.isposinf(local).sum())
            if not bad or bool(torch.isnan(local).any()) or not bool(torch.isfinite(local_tensor(p.detach())).all()):
                continue
            dtype = _DTYPE_NAMES.get(v.dtype, v.dtype)
            big = float(torch.finfo(v.dtype).max)
            betas = group.get("betas")
            beta2 = betas[1] if isinstance(betas, (tuple, list)) and len(betas) > 1 else None
            at = (f"; (1 - beta2) x g^2 passes it from |g| of about {math.sqrt(big / (1 - beta2)):.3g}"
                  if isinstance(beta2, float) and beta2 < 1 else "")
            text = (f"exp_avg_sq holds {bad:,} Inf value(s) in {names.get(id(p), '?')} while the weights are "
                    f"finite: the squared gradient overflowed {dtype} (largest value {big:.3g}{at}), so the update "
                    "exp_avg / (sqrt(exp_avg_sq) + eps) is 0 there: those weights would stop training, silently.")
            if v.dtype in (torch.float16, torch.bfloat16):
                text += (" With precision=16-true or bf16-true the optimizer runs in that type too: train with "
                         "precision=16-mixed or bf16-mixed (float32 weights and optimizer state) or precision=32-true.")
            return text
    return ""


def explain_trips(trips: list[RangeTrip], lr: Any, gradient_norm: float, optimizer: str = "") -> str:
    """Why a norm overflowed with every value finite: the weights (the update's size, lr) or the
    optimizer state (a second moment holds squared gradients: the gradients are exploding)."""
    weights = [t for t in trips if t.kind == "parameter"]
    state = [t for t in trips if t.kind == "optimizer state"]
    parts = []
    if weights and isinstance(lr, (int, float)):
        from stabletrain.debug import advice

        family = advice.optimizer_family(optimizer)
        label = advice.optimizer_label(optimizer)
        how = {"adam": f"{label} moves a weight by about lr per step, whatever the gradient",
               "sgd": f"{label} moves a weight by lr x its gradient"}.get(
            family, "one step moves a weight by up to about lr (Adam) or lr x its gradient (SGD)")
        parts.append(f"The learning rate is {lr:g}: {how}.")
    if state:
        t = state[0]
        # The step's gradient norm when it was checked (NaN: check_gradients was not called for it).
        norm = f" (gradient norm {gradient_norm:.4g})" if math.isfinite(gradient_norm) else ""
        if t.name.endswith("exp_avg_sq"):
            # exp_avg_sq is an average of squared gradients, so a value v needs a gradient of at least sqrt(v).
            parts.append(f"{t.name.split(': ')[-1]} holds an average of squared gradients: {t.abs_max:.3g} needs a "
                         f"gradient of at least {math.sqrt(t.abs_max):.3g}{norm}: the gradients are exploding, not "
                         "the weights.")
        else:
            parts.append(f"{t.name} is past what its float32 norm holds{norm}.")
    return " ".join(parts)


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
