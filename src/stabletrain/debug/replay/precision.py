"""The precisions a replay runs in: Fabric's names, the plugin that computes as training did, and the
dtype the parameters take. See ``docs/nancapture.md``."""

from __future__ import annotations

from typing import Any, Optional

import torch

from stabletrain.config.types import REPLAY_PRECISIONS

_ALIASES = {
    "32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed", "half": "16-true", "double": "64-true"
}
_TRUE_DTYPES = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}


def normalize_precision(precision: Any) -> str:
    """Fabric's precision names; raises ValueError listing the valid ones."""
    text = _ALIASES.get(str(precision), str(precision))
    if text not in REPLAY_PRECISIONS:
        raise ValueError(f"precision: cannot replay in {precision!r}; valid: {', '.join(REPLAY_PRECISIONS)}")
    return text


def precision_plugin(precision: str, device_type: str, loss_scale: Optional[float] = None) -> Any:
    """The Lightning Fabric precision plugin the trainer runs ``precision`` with.

    Replay drives forward and backward through the same plugin (input conversion, autocast,
    output conversion, loss scaling) so that it computes what training computed. For
    ``"16-mixed"`` the GradScaler starts at ``loss_scale`` (the captured scale); unlike
    ``Fabric(precision="16-mixed")`` this also works on the CPU.
    """
    from lightning_fabric.plugins import (
        DoublePrecision,
        HalfPrecision,
        MixedPrecision,
        Precision,
    )

    precision = normalize_precision(precision)
    if precision == "32-true":
        return Precision()
    if precision == "64-true":
        return DoublePrecision()
    if precision == "bf16-mixed":
        return MixedPrecision("bf16-mixed", device_type)
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler(device_type, init_scale=float(loss_scale or 2.0**16))
        return MixedPrecision("16-mixed", device_type, scaler=scaler)
    return HalfPrecision(precision)  # type: ignore[arg-type]


def replay_dtype(target: str, captured: str) -> Optional[torch.dtype]:
    """The dtype floating parameters get for a replay in ``target``; None keeps the captured dtypes."""
    if target in _TRUE_DTYPES:
        return _TRUE_DTYPES[target]
    if target == "32-true":  # whatever the parameters were stored in: 32-true computes in float32
        return torch.float32
    if captured in _TRUE_DTYPES:  # a half/double run replayed in 32-bit or mixed precision
        return torch.float32
    return None
