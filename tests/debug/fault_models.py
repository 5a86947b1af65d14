"""Models and data with numerical faults planted at known samples, for the diagnose tests.

:class:`FaultNet` computes ``fc2(gate(fc1(x), s))``; the :class:`Gate` holds one planted
fault, triggered only by samples whose ``s`` (or ``x``) takes a trigger value. Every other
sample is computed safely, so the fault's sample, op, module and phase are known.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

#: fault -> (what the culprit sample gets, the op that goes non-finite, the phase)
FAULTS = {
    "log0": ({"s": 0.0}, "aten.log.default", "forward"),              # log(0) = -inf
    "div0": ({"s": 0.0}, "aten.div.Tensor", "forward"),               # h / 0 = +-inf
    "sqrt_neg": ({"s": -1.0}, "aten.sqrt.default", "forward"),        # sqrt(-1) = nan
    "sqrt_at_0": ({"s": 0.0}, "aten.div.Tensor", "backward"),         # sqrt(0) = 0, d/du sqrt(u) = inf
    "square": ({"x": 2000.0}, "aten.mul.Tensor", "forward"),          # (1e3)^2 > 65504: inf in float16 only
}


class Gate(nn.Module):
    """Where the planted fault lives: a functional op on the hidden features ``h`` and ``s``."""

    def __init__(self, fault: str):
        super().__init__()
        self.fault = fault

    def forward(self, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        s = s[:, None]
        if self.fault == "log0":
            return h + torch.log(s)
        if self.fault == "div0":
            return h / s
        if self.fault == "sqrt_neg":
            return h * torch.sqrt(s)
        if self.fault == "sqrt_at_0":
            return torch.sqrt(s * h * h)
        if self.fault == "square":
            return h * h * 1e-3
        return h


class FaultNet(nn.Module):
    """Regression net ``fc2(gate(fc1(x), s))`` with the planted fault in ``gate``."""

    def __init__(self, fault: str = "none"):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 16)
        self.gate = Gate(fault)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.gate(self.fc1(x), s))

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(self(batch["x"], batch["s"]), batch["y"])


def LogFaultNet() -> FaultNet:
    """FaultNet with the log(0) fault, built without arguments (for ``--model file.py:LogFaultNet``)."""
    return FaultNet("log0")


class FaultData(Dataset):
    """``n`` samples with ``s`` in [0.5, 1.5]; ``plant={index: {"s": value} or {"x": value}}``."""

    def __init__(self, n: int = 64, plant: dict[int, dict[str, float]] | None = None):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 4, generator=g)
        self.s = 0.5 + torch.rand(n, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        for i, values in (plant or {}).items():
            if "s" in values:
                self.s[i] = values["s"]
            if "x" in values:
                self.x[i] = values["x"]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "s": self.s[i], "y": self.y[i]}


class FlakyNet(nn.Module):
    """A linear model whose output turns NaN when a source of randomness that no capture
    holds says so, like a flaky kernel or a flipped bit: ``fires`` gives, call by call, whether
    a forward pass is hit (then False forever)."""

    def __init__(self, fires: list[bool] = ()):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 1)
        self.fires = list(fires)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        if self.fires and self.fires.pop(0):
            out = out + torch.full_like(out, float("nan"))
        return out

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(self(batch["x"]), batch["y"])
