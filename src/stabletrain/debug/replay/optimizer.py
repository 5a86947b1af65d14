"""Replay a captured optimizer step (``reason = "optimizer_step"``): load the parameters, gradients
and optimizer state saved right before it, run one step, and say what the guard's checks would see.

``stabletrain replay`` and :meth:`NaNCapture.replay` use it on an optimizer-step capture;
:func:`stabletrain.debug.optimizer_step.diagnose_optimizer_step` explains the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from stabletrain.debug.optimizer_damage import RangeTrip, range_trips

__all__ = ["OptimizerStepOutcome", "replay_optimizer_step", "build_optimizer"]


@dataclass
class OptimizerStepOutcome:
    """What one replayed optimizer step left behind.

    Attributes:
        optimizer: The optimizer's class, as captured (``torch.optim.AdamW``).
        rebuilt: Whether the optimizer could be rebuilt from the capture (torch.optim only).
        nonfinite_params: Parameter -> number of NaN/Inf values after the step.
        nonfinite_state: ``"<param>: <entry>"`` of the state entries holding NaN/Inf after it.
        trips: The tensors whose check fails although every value is finite (their float32
            L2 norm overflows), largest first: what the guard's check saw.
        largest_param: (name, max |w|) of the largest parameter after the step.
        optimizer_obj: The rebuilt optimizer (None when not rebuilt).
    """

    optimizer: str
    rebuilt: bool
    nonfinite_params: dict[str, int] = field(default_factory=dict)
    nonfinite_state: list[str] = field(default_factory=list)
    trips: list[RangeTrip] = field(default_factory=list)
    largest_param: tuple[str, float] = ("", float("nan"))
    optimizer_obj: Any = None

    @property
    def nonfinite(self) -> bool:
        return bool(self.nonfinite_params or self.nonfinite_state)

    @property
    def check_fails(self) -> bool:
        """The guard's check after the step fails: a value is non-finite, or a norm overflows."""
        return self.nonfinite or bool(self.trips)


def build_optimizer(name: str, model: nn.Module, names: list[str], state_dict: dict[str, Any]) -> Any:
    """The torch.optim optimizer ``name`` over ``model``'s parameters (in the captured order
    ``names``), with ``state_dict`` loaded; None for an optimizer outside torch.optim."""
    cls_name = name.rsplit(".", 1)[-1]
    cls = getattr(torch.optim, cls_name, None) if name.startswith("torch.optim.") else None
    if cls is None:
        return None
    params = dict(model.named_parameters())
    groups = [{"params": [params[names[i]] for i in g["params"]]} for g in state_dict["param_groups"]]
    optimizer = cls(groups, lr=float(state_dict["param_groups"][0].get("lr", 1e-3)))
    optimizer.load_state_dict(state_dict)
    return optimizer


def replay_optimizer_step(model: nn.Module, part: Any, entry: dict[str, Any], device: torch.device,
                          dtype: Optional[torch.dtype] = None) -> OptimizerStepOutcome:
    """Load the captured parameters, gradients and optimizer state of ``part`` (a rank's capture;
    ``entry`` its ``optimizer_step`` record), converted to ``dtype`` if given, run one optimizer
    step, and measure what is non-finite or beyond the checks' range afterwards."""
    names = list(entry["param_names"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            src = part.params[n]
            p.data = src.to(device=device, dtype=dtype or src.dtype, copy=True)
            g = entry["grads"].get(n)
            p.grad = None if g is None else g.to(device=device, dtype=dtype or g.dtype, copy=True)
        for n, b in model.named_buffers():
            if n in part.buffers:
                b.data = part.buffers[n].to(device=device, copy=True)
    state_dict = entry["state_dict"]
    if dtype is not None:
        state_dict = {"param_groups": state_dict["param_groups"], "state": {
            i: {k: (v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() and k != "step" else v)
                for k, v in st.items()} for i, st in state_dict["state"].items()}}
    optimizer = build_optimizer(entry["optimizer"], model, names, state_dict)
    if optimizer is None:
        return OptimizerStepOutcome(entry["optimizer"], rebuilt=False)
    optimizer.step()
    by_id = {id(p): n for n, p in model.named_parameters()}
    bad_params = {n: int((~torch.isfinite(p.detach())).sum()) for n, p in model.named_parameters()
                  if not bool(torch.isfinite(p.detach()).all())}
    state = {f"{by_id.get(id(p), '?')}: {k}": v for p, st in optimizer.state.items() for k, v in st.items()
             if isinstance(v, Tensor) and v.is_floating_point() and v.numel()}
    bad_state = [k for k, v in state.items() if not bool(torch.isfinite(v).all())]
    params = {n: p.detach() for n, p in model.named_parameters() if p.numel()}
    trips = [] if bad_params or bad_state else range_trips(params, "parameter") + range_trips(state, "optimizer state")
    sizes = {n: float(p.abs().max()) for n, p in params.items()}
    largest = max(sizes.items(), key=lambda kv: kv[1]) if sizes else ("", float("nan"))
    trips.sort(key=lambda t: -t.abs_max)
    return OptimizerStepOutcome(entry["optimizer"], True, bad_params, bad_state, trips, largest, optimizer)
