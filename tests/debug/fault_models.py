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


class BCENet(nn.Module):
    """Logistic regression ``sigmoid(w . x)`` trained with a hand-written binary cross-entropy,
    ``-(y log p + (1 - y) log(1 - p))``. In bfloat16 (8 significant bits) ``sigmoid(z)``
    rounds to exactly 1 for z above about 6.2, so ``log(1 - p)`` is ``log(0) = -inf``; float32
    keeps ``1 - p`` nonzero up to z of about 16. ``w = [0.5, -0.5, 0.25, 0.25]``, so a sample
    with ``x = [20, 0, 0, 0]`` has z = 10: -inf in bfloat16 only."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[0.5, -0.5, 0.25, 0.25]]))
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(x)).squeeze(-1)

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        p, y = self(batch["x"]), batch["y"]
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


class BCEData(Dataset):
    """``n`` samples, label ``y = [x . (1, -1, 0.5, 0.5) > 0]``; ``plant={index: v}`` sets ``x = [v, 0, 0, 0]``."""

    def __init__(self, n: int = 64, plant: dict[int, float] | None = None):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 4, generator=g)
        self.y = (self.x @ torch.tensor([1.0, -1.0, 0.5, 0.5]) > 0).float()
        for i, v in (plant or {}).items():
            self.x[i] = torch.tensor([v, 0.0, 0.0, 0.0])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class RunningNorm(nn.Module):
    """Standardises inputs by running statistics held in buffers (as an observation
    normaliser does), updated from each training batch in the forward pass."""

    def __init__(self, n: int, momentum: float = 0.1):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("var", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.lerp_(x.mean(0), self.momentum)
                self.var.lerp_(x.var(0, correction=0), self.momentum)
        return (x - self.mean) / torch.sqrt(self.var + 1e-5)


class NormNet(nn.Module):
    """Regression net ``fc2(tanh(fc1(norm(x))))`` with running input statistics in ``norm``;
    takes :class:`FaultData` batches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = RunningNorm(4)
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.norm(x))))

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(self(batch["x"]), batch["y"])


class BNNet(FaultNet):
    """FaultNet (no fault) with a BatchNorm1d after fc1: in training mode it normalises with
    the batch's statistics, so its running statistics do not affect the loss."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.gate(self.bn(self.fc1(x)), s))
