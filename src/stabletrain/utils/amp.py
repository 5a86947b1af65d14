"""Reading an fp16 ``torch.amp.GradScaler`` without host synchronisation.

``GradScaler``'s public getters (``get_scale()``, the return of ``step()``) read its device
tensors on the host; the debugging tools decide on the device, so they read the scaler's
per-optimizer state instead. That private state is read here only, in one place to adapt
when torch changes it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor


def _stage(state: Any) -> Optional[str]:
    return getattr(state.get("stage"), "name", None) if isinstance(state, dict) else None


def scaler_found_inf(scaler: Any, device: torch.device) -> Optional[Tensor]:
    """A device bool: did the GradScaler find an Inf/NaN gradient (and so skip this step)?

    Read from the flags ``scaler.unscale_(optimizer)`` leaves per device; None before the
    gradients are un-scaled. No host synchronisation.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return None
    flags = [
        f.reshape(()).to(device)
        for state in states.values()
        if _stage(state) == "UNSCALED"
        for f in state.get("found_inf_per_device", {}).values()
    ]
    if not flags:
        return None
    return torch.stack(flags).sum() > 0


def already_unscaled(scaler: Any, optimizer: Any) -> bool:
    """Has ``scaler.unscale_(optimizer)`` run this step (``optimizer`` unwrapped)?"""
    states = getattr(scaler, "_per_optimizer_states", None)
    state = states.get(id(optimizer)) if isinstance(states, dict) else None
    return _stage(state) == "UNSCALED"


def live_scale(scaler: Any) -> Optional[Tensor]:
    """The scaler's scale tensor itself (on its device); None before its first use."""
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, Tensor) else None


def scale_tensor(scaler: Any, device: torch.device) -> Tensor:
    """The GradScaler's current scale as a device tensor (``get_scale()`` would sync)."""
    scale = live_scale(scaler)
    return scale.to(device) if scale is not None else torch.tensor(float(scaler.get_scale()), device=device)


def scale_value(scaler: Any) -> Optional[float]:
    """The current scale on the host (a sync: failure paths only); None before its first use."""
    scale = live_scale(scaler)
    return None if scale is None else float(scale)
