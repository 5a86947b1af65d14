"""Skip-aware optimizer steps: AdamW, Adam and SGD with the skip folded into their arithmetic.

:class:`~stabletrain.safety.skip_step.SkipStep` undoes a bad step for any optimizer by saving
parameters and state before the step and putting them back with ``torch.where`` after it: a
copy of everything, read and written twice per step. For torch's AdamW, Adam and SGD this module
runs the step itself, as torch runs it, with a device-side 0/1 factor where the update would
change something (the idea of OLMo-core's skip-step optimizers, written here for exactness):

* the gradient is masked to +0 on a skipped step (an integer AND on its bits: exact on a kept
  step, whatever the values, and no NaN/Inf survives on a skipped one);
* Adam: ``exp_avg.lerp_(grad, w)`` with ``w = 1 - beta1`` or 0, ``exp_avg_sq.mul_(b)`` with
  ``b = beta2`` or 1, the decoupled weight decay ``param.mul_(d)`` with ``d = 1 - lr * wd`` or 1,
  and ``denom.add_(e)`` with ``e = eps`` or inf, so that ``param.addcdiv_`` adds zero;
* SGD: the momentum buffer's ``mul_(m)`` with ``m = momentum`` or 1, and the update's direction
  masked like the gradient.

Each factor is a 0-dim tensor on the parameters' device holding the same float32/float64 value
torch rounds its Python scalar to, so a kept step does the same operations on the same values as
torch's own step (``_single_tensor_*`` or ``_multi_tensor_*``, whichever torch would pick). That
is checked, not assumed: :func:`agrees_with_torch` runs both on small tensors once per device,
dtype and configuration, and a configuration that does not match bitwise uses the copy.
No host synchronisation; no extra memory but one masked gradient at a time (one per parameter
group with foreach). A skipped step still counts in Adam's ``step`` (as the copy's does: 0-dim
counts are not restored). See docs/self_healing.md.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["supported", "skip_aware_step", "agrees_with_torch"]

_INT = {torch.float32: torch.int32, torch.float64: torch.int64}
#: (optimizer class, foreach, device type, dtype, configuration) -> does our step match torch's?
_AGREES: dict[tuple, bool] = {}


def _plain_tensor(p: Tensor) -> bool:
    return type(p) is torch.nn.Parameter or type(p) is Tensor


def _foreach(group: dict[str, Any]) -> bool:
    """Whether torch runs this group (not a fused one: :func:`_follows`) with its foreach implementation."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if group.get("foreach") is not None:
        return bool(group["foreach"])
    params = [p for p in group["params"] if p.grad is not None] or list(group["params"])
    return bool(_default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1])


def _follows(optimizer: Any, group: dict[str, Any]) -> bool:
    """Whether :func:`skip_aware_step` follows the path torch's step takes for this group: not with
    amsgrad, maximize, capturable, fused or tensor hyperparameters. Which of torch's operations the
    path runs (decoupled decay, momentum, ...) is :func:`_structure`'s, checked by :func:`agrees_with_torch`."""
    if any(group.get(k) for k in ("maximize", "capturable", "differentiable", "fused")):
        return False
    if isinstance(optimizer, torch.optim.SGD):
        return not (isinstance(group["lr"], Tensor) or isinstance(group["weight_decay"], Tensor))
    # Adam or AdamW: supported() takes no other type
    tensors = isinstance(group["lr"], Tensor) or any(isinstance(b, Tensor) for b in group["betas"])
    return not (group.get("amsgrad") or tensors)


def supported(optimizer: Any) -> bool:
    """Whether :func:`skip_aware_step` can run ``optimizer``'s step (type, settings, plain float32/64
    parameters), and does so bitwise like torch on this device (:func:`agrees_with_torch`)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        return False  # a subclass may change the step
    for group in optimizer.param_groups:
        if not _follows(optimizer, group):
            return False
        foreach = _foreach(group)
        for p in group["params"]:
            if not _plain_tensor(p) or p.dtype not in _INT or p.is_sparse or p.is_complex():
                return False
            if not agrees_with_torch(type(optimizer), foreach, p.device, p.dtype, group):
                return False
    return True


def _foreach_by(op: str, tensors: list[Tensor], factor: Tensor) -> None:
    """``torch._foreach_{op}_(tensors, factor)`` with a 0-dim tensor ``factor``: on a GPU the foreach
    kernel reads it on the device; on the CPU that overload reads it back with ``.item()``, so the
    CPU goes tensor by tensor (the same arithmetic, checked by :func:`agrees_with_torch`)."""
    if factor.device.type == "cpu":
        for t in tensors:
            getattr(t, f"{op}_")(factor)
    else:
        getattr(torch, f"_foreach_{op}_")(tensors, factor)


def _mask(t: Tensor, bits: Tensor) -> Tensor:
    """``t`` where ``bits`` is all ones, +0 where it is 0: exact for any value (NaN, Inf)."""
    return torch.bitwise_and(t.view(_INT[t.dtype]), bits).view(t.dtype)


#: (value, device, dtype) -> a 0-dim tensor of it, made once and read by the steps' factors; at most
#: _MAX_CONSTANTS (a scheduled lr makes 1 - lr * wd a new value every step).
_CONSTANTS: dict[tuple, Tensor] = {}
_MAX_CONSTANTS = 64


def _constant(value: float, like: Tensor) -> Tensor:
    key = (value, like.device, like.dtype)
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return t


class _Factors:
    """The 0-dim factors of one step, per (device, dtype): a value when kept, another when skipped."""

    def __init__(self, keep: Tensor):
        self.keep = keep
        self._cache: dict[tuple, Tensor] = {}

    def pick(self, kept: float, skipped: float, like: Tensor) -> Tensor:
        key = (kept, skipped, like.device, like.dtype)
        t = self._cache.get(key)
        if t is None:
            keep = self.keep.to(like.device)
            t = self._cache[key] = torch.where(keep, _constant(kept, like), _constant(skipped, like))
        return t

    def bits(self, like: Tensor) -> Tensor:
        key = ("bits", like.device, like.dtype)
        t = self._cache.get(key)
        if t is None:
            ints = _INT[like.dtype]
            t = self._cache[key] = -(self.keep.to(device=like.device, dtype=ints))  # -1: all bits, or 0
        return t


def _adam_group(opt: Any, group: dict[str, Any], f: _Factors, foreach: bool) -> None:
    params: list[Tensor] = []
    grads: list[Tensor] = []
    exp_avgs: list[Tensor] = []
    exp_avg_sqs: list[Tensor] = []
    state_steps: list[Tensor] = []
    opt._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], state_steps)  # torch's own state init
    if not params:
        return
    beta1, beta2 = group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    decoupled = bool(group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW)))
    if foreach:
        _multi_adam(params, grads, exp_avgs, exp_avg_sqs, state_steps, f, lr, beta1, beta2, wd, eps, decoupled)
        return
    for i, param in enumerate(params):
        grad, exp_avg, exp_avg_sq, step_t = grads[i], exp_avgs[i], exp_avg_sqs[i], state_steps[i]
        step_t += 1
        if wd != 0:
            if decoupled:
                param.mul_(f.pick(1 - lr * wd, 1.0, param))
            else:
                grad = grad.add(param, alpha=wd)
        grad = _mask(grad, f.bits(grad))
        exp_avg.lerp_(grad, f.pick(1 - beta1, 0.0, exp_avg))
        exp_avg_sq.mul_(f.pick(beta2, 1.0, exp_avg_sq)).addcmul_(grad, grad, value=1 - beta2)
        step = step_t.item()  # a CPU tensor (not capturable): no device sync
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(f.pick(eps, float("inf"), exp_avg_sq))
        param.addcdiv_(exp_avg, denom, value=-step_size)


def _multi_adam(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                state_steps: list[Tensor], f: _Factors, lr: float, beta1: float, beta2: float, wd: float, eps: float,
                decoupled: bool) -> None:
    from torch.optim.optimizer import Optimizer

    grouped: Any = Optimizer._group_tensors_by_device_and_dtype(
        [params, grads, exp_avgs, exp_avg_sqs, state_steps])  # type: ignore[list-item]
    for (d_params, d_grads, d_exp_avgs, d_exp_avg_sqs, d_steps), _ in grouped.values():
        p0 = d_params[0]
        if d_steps[0].is_cpu:
            torch._foreach_add_(d_steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
        else:
            torch._foreach_add_(d_steps, 1)
        if wd != 0:
            if decoupled:
                _foreach_by("mul", d_params, f.pick(1 - lr * wd, 1.0, p0))
            else:
                d_grads = torch._foreach_add(d_grads, d_params, alpha=wd)
        bits = f.bits(p0)
        d_grads = [_mask(g, bits) for g in d_grads]
        w = f.pick(1 - beta1, 0.0, p0)
        for m, g in zip(d_exp_avgs, d_grads):  # no foreach lerp with a tensor weight
            m.lerp_(g, w)
        _foreach_by("mul", d_exp_avg_sqs, f.pick(beta2, 1.0, p0))
        torch._foreach_addcmul_(d_exp_avg_sqs, d_grads, d_grads, 1 - beta2)
        del d_grads
        bias_correction1 = [1 - beta1 ** s.item() for s in d_steps]
        bias_correction2 = [1 - beta2 ** s.item() for s in d_steps]
        step_size = [(lr / bc) * -1 for bc in bias_correction1]
        bias_correction2_sqrt = [bc**0.5 for bc in bias_correction2]
        exp_avg_sq_sqrt = torch._foreach_sqrt(d_exp_avg_sqs)
        torch._foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt)
        _foreach_by("add", list(exp_avg_sq_sqrt), f.pick(eps, float("inf"), p0))
        torch._foreach_addcdiv_(d_params, d_exp_avgs, exp_avg_sq_sqrt, step_size)


def _sgd_group(opt: Any, group: dict[str, Any], f: _Factors, foreach: bool) -> None:
    params: list[Tensor] = []
    grads: list[Tensor] = []
    bufs: list[Optional[Tensor]] = []
    opt._init_group(group, params, grads, bufs)
    if not params:
        return
    lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
    dampening, nesterov = group["dampening"], group["nesterov"]
    if foreach:
        _multi_sgd(params, grads, bufs, f, lr, wd, momentum, dampening, nesterov)
    else:
        for i, param in enumerate(params):
            grad = grads[i]
            if wd != 0:
                grad = grad.add(param, alpha=wd)
            bits = f.bits(grad)
            grad = _mask(grad, bits)
            if momentum != 0:
                buf = bufs[i]
                if buf is None:  # created by this step; zeros when it is skipped (as the copy restores)
                    buf = grad.detach().clone()
                    bufs[i] = buf
                else:
                    buf.mul_(f.pick(momentum, 1.0, buf)).add_(grad, alpha=1 - dampening)
                grad = _mask(grad.add(buf, alpha=momentum) if nesterov else buf, bits)
            param.add_(grad, alpha=-lr)
    if momentum != 0:
        for p, buf in zip(params, bufs):
            opt.state[p]["momentum_buffer"] = buf


def _multi_sgd(params: list[Tensor], grads: list[Tensor], bufs: list[Optional[Tensor]], f: _Factors, lr: float,
               wd: float, momentum: float, dampening: float, nesterov: bool) -> None:
    from torch.optim.optimizer import Optimizer

    grouped: Any = Optimizer._group_tensors_by_device_and_dtype(
        [params, grads, bufs], with_indices=True)  # type: ignore[list-item]
    for (d_params, d_grads, d_bufs), indices in grouped.values():
        p0 = d_params[0]
        if wd != 0:
            d_grads = torch._foreach_add(d_grads, d_params, alpha=wd)
        bits = f.bits(p0)
        d_grads = [_mask(g, bits) for g in d_grads]
        if momentum != 0:
            m = f.pick(momentum, 1.0, p0)
            if all(b is not None for b in d_bufs):
                have: list[Tensor] = [b for b in d_bufs if b is not None]
                _foreach_by("mul", have, m)
                torch._foreach_add_(have, d_grads, alpha=1 - dampening)
            else:
                have = []
                for i, b in enumerate(d_bufs):
                    if b is None:
                        b = d_bufs[i] = bufs[indices[i]] = d_grads[i].detach().clone()
                    else:
                        b.mul_(m).add_(d_grads[i], alpha=1 - dampening)
                    have.append(b)
            if nesterov:
                torch._foreach_add_(d_grads, have, alpha=momentum)
            else:
                d_grads = have
            d_grads = [_mask(g, bits) for g in d_grads]
        torch._foreach_add_(d_params, d_grads, alpha=-lr)


def skip_aware_step(optimizer: Any, keep: Tensor) -> None:
    """One step of ``optimizer`` (see :func:`supported`) that changes nothing where the device
    bool ``keep`` is False, and is torch's own step where it is True. Call under ``no_grad``."""
    f = _Factors(keep.reshape(()))
    is_adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    for group in optimizer.param_groups:
        foreach = _foreach(group)
        (_adam_group if is_adam else _sgd_group)(optimizer, group, f, foreach)


def agrees_with_torch(cls: type, foreach: bool, device: torch.device, dtype: torch.dtype,
                      group: dict[str, Any]) -> bool:
    """Whether :func:`skip_aware_step` gives bitwise torch's result for ``cls`` with ``group``'s
    settings on ``device`` and ``dtype`` (three kept steps from fresh state, with values that
    exercise every operation), and leaves everything unchanged on a skipped step with NaN and
    Inf gradients. Checked once per configuration; an error counts as a mismatch."""
    import inspect

    accepted = inspect.signature(cls).parameters
    settings = {k: v for k, v in group.items() if k in accepted and k != "params"}
    settings["foreach"] = foreach
    # The operations run depend on these, not on the values of lr, betas, eps, ...: checked once.
    structure = _structure(cls, group)
    key = (cls, foreach, torch.device(device).type, dtype, structure)
    hit = _AGREES.get(key)
    if hit is not None:
        return hit
    try:
        gen = torch.Generator().manual_seed(0)
        shapes = [(5, 3), (7,), (1,)]
        init = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).to(device) for s in shapes]
        grads = [[torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).to(device) * 10 ** (k - 2)
                  for s in shapes] for k in range(3)]
        ref = [torch.nn.Parameter(t.clone()) for t in init]
        ours = [torch.nn.Parameter(t.clone()) for t in init]
        ref_opt, our_opt = cls(ref, **settings), cls(ours, **settings)
        keep = torch.ones((), dtype=torch.bool, device=device)
        ok = True
        with torch.no_grad():
            for step_grads in grads:
                for a, b, g in zip(ref, ours, step_grads):
                    a.grad, b.grad = g.clone(), g.clone()
                ref_opt.step()
                skip_aware_step(our_opt, keep)
                ok = ok and all(_same_bits(a, b) for a, b in zip(ref, ours))
                ok = ok and all(_same_bits(x, y) for x, y in _states(ref_opt, our_opt, ref, ours))
            before = [b.detach().clone() for b in ours]
            state_before = [[v.clone() for v in our_opt.state[b].values() if isinstance(v, Tensor) and v.ndim]
                            for b in ours]
            for b in ours:
                g = torch.full_like(b, float("nan"))
                g.view(-1)[0] = float("inf")
                b.grad = g
            skip_aware_step(our_opt, ~keep)
            ok = ok and all(_same_bits(x, b) for x, b in zip(before, ours))
            for b, saved in zip(ours, state_before):
                now = [v for v in our_opt.state[b].values() if isinstance(v, Tensor) and v.ndim]
                ok = ok and all(_same_bits(x, y) for x, y in zip(saved, now))
    except Exception:  # an operation this device or dtype lacks: use the copy
        ok = False
    _AGREES[key] = ok
    return ok


def _structure(cls: type, group: dict[str, Any]) -> tuple:
    """What in a group's settings selects torch's operations (not their values)."""
    if issubclass(cls, torch.optim.SGD):
        return ("sgd", group["weight_decay"] != 0, group["momentum"] != 0, bool(group["nesterov"]),
                group["dampening"] != 0)
    return ("adam", bool(group.get("decoupled_weight_decay", issubclass(cls, torch.optim.AdamW))),
            group["weight_decay"] != 0)


def _states(a_opt: Any, b_opt: Any, a_params: list[Any], b_params: list[Any]) -> list[tuple[Tensor, Tensor]]:
    pairs = []
    for a, b in zip(a_params, b_params):
        sa, sb = a_opt.state[a], b_opt.state[b]
        if set(sa) != set(sb):
            raise ValueError("different state keys")
        pairs += [(sa[k], sb[k]) for k in sa if isinstance(sa[k], Tensor)]
    return pairs


def _same_bits(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = _INT.get(a.dtype)
    if ints is None:
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.detach().view(ints), b.detach().view(ints)))

