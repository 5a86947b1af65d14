"""Small models and datasets with faults planted at known samples, for the nancapture tests.

Importable by the tests and by ``stabletrain replay --model tests/debug/nan_models.py:PoisonNet``;
run as a script it trains PoisonNet with DDP on 2 CPU processes (see ``ddp_main`` and
``ddp_healthy_main``).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class InjectGrad(torch.autograd.Function):
    """Identity in the forward pass; adds ``value`` to the gradient in the backward pass.

    With ``value`` 0 the gradient is unchanged bit for bit; with NaN, +Inf or -Inf the
    gradient of exactly one parameter becomes non-finite while the loss stays finite.
    """

    @staticmethod
    def forward(ctx, w, value):
        ctx.save_for_backward(value)
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        (value,) = ctx.saved_tensors
        return grad + value.to(grad.dtype), None


class PoisonNet(nn.Module):
    """Regression MLP with dropout whose ``fc2.weight`` gradient takes a sample's ``grad_poison``."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x, poison=None):
        h = self.drop(torch.tanh(self.fc1(x)))
        w = self.fc2.weight if poison is None else InjectGrad.apply(self.fc2.weight, poison)
        return F.linear(h, w, self.fc2.bias)

    def training_step(self, batch):
        return F.mse_loss(self(batch["x"], batch["grad_poison"].sum()), batch["y"])


class SpikeNet(PoisonNet):
    """PoisonNet plus a positive parameter ``s`` fitted by ``s * c - log(s)`` (minimum at ``s = 1/c``).

    An outlier batch (large ``c``) gives ``s`` a large gradient; with too high a learning
    rate one SGD step pushes ``s`` below 0 and the next step's ``log(s)`` is NaN. With a
    lower learning rate the same batch is harmless: the failure is the learning rate's.
    """

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(()))

    def training_step(self, batch):
        return super().training_step(batch) + self.s * batch["c"].mean() - torch.log(self.s)


class L1Net(nn.Module):
    """Linear regression fitted by L1 loss. An input of 1e20 in a batch of 4 gives a finite
    loss and finite gradients (``|d loss / d weight|`` = 1e20 / 4 = 2.5e19), but squared they
    exceed float32's 3.4e38: the float32 gradient norm overflows to inf."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def training_step(self, batch):
        return F.l1_loss(self.fc(batch["x"]), batch["y"])


class PoisonData(Dataset):
    """64 regression samples; ``grad_poison={index: value}`` plants gradient faults,
    ``input_poison={index: value}`` plants a value in a sample's input, ``spikes={index: c}``
    outliers for :class:`SpikeNet` (``c`` is 1 elsewhere)."""

    def __init__(self, n=64, grad_poison=None, input_poison=None, spikes=None):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        self.poison = torch.zeros(n)
        self.c = torch.ones(n)
        for i, v in (grad_poison or {}).items():
            self.poison[i] = v
        for i, v in (input_poison or {}).items():
            self.x[i, 0] = v
        for i, v in (spikes or {}).items():
            self.c[i] = v

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "grad_poison": self.poison[i], "c": self.c[i]}


class PlainNet(nn.Module):
    """A model without training_step: a plain loop computes its loss with :func:`plain_step_fn`."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def forward(self, x):
        return self.body(x)


class SizedNet(nn.Module):
    """PlainNet's shape with a constructor argument: no command can build it without one."""

    def __init__(self, hidden):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.GELU(), nn.Dropout(0.2), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.body(x)


def plain_step_fn(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def samples_of_step(step, *, n=64, batch_size=8, accum=1, world_size=1, rank=0, seed=0):
    """Dataset indices the trainer feeds rank ``rank`` in optimizer step ``step`` (first epoch)."""
    from stabletrain.data.loader import ResumableBatchSampler

    micro = batch_size // (world_size * accum)
    batches = ResumableBatchSampler(n, micro, seed, rank, world_size).epoch_batches(0)
    return [i for m in range(accum) for i in batches[step * accum + m]]


def ddp_main(out, poison_step, nancapture=True):
    """PoisonNet on 2 CPU processes; a NaN input in one sample that only rank 1 sees at ``poison_step``
    (``nancapture`` False: the guard alone stops it)."""
    import stabletrain

    victim = samples_of_step(poison_step, world_size=2, rank=1)[1]
    stabletrain.train(
        out=out,
        model=PoisonNet(),
        data=PoisonData(input_poison={victim: float("nan")}),
        steps=6,
        batch_size=8,
        devices=2,
        strategy="ddp",
        accelerator="cpu",
        num_workers=0,
        log_every_num_steps=1,
        checkpoint_every_num_steps=2,
        model_args={"lr": 0.01, "warmup_steps": 0},
        debug_args={"nancapture": {"enabled": nancapture}},
    )


class SaveSyncedGrads:
    """Saves this rank's gradients after the last backward pass of ``step`` (DDP has synced
    them by then) to ``<out>/synced_grads_rank{rank}.pt``."""

    def __init__(self, step):
        self.step = step

    def on_after_microbatch(self, trainer, *, step, micro_step, loss):
        if step == self.step and micro_step == trainer.settings.gradient_accumulation_steps - 1:
            grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
            torch.save(grads, trainer.out / f"synced_grads_rank{trainer.rank}.pt")


def ddp_healthy_main(out, capture_step):
    """PoisonNet on 2 CPU processes with clean data and 2 accumulation steps; every rank's
    monitor is made to capture the healthy step ``capture_step`` (as if another rank had
    failed), and the gradients DDP synced at that step are saved next to the captures."""
    import stabletrain
    from stabletrain.debug import nan_capture

    flag = nan_capture.NaNCaptureMonitor._failure_flag

    def forced(self, gn):
        return flag(self, gn) | torch.tensor(self.step == capture_step, device=gn.total.device)

    nan_capture.NaNCaptureMonitor._failure_flag = forced
    stabletrain.train(
        out=out,
        model=PoisonNet(),
        data=PoisonData(),
        steps=4,
        batch_size=8,
        gradient_accumulation_steps=2,
        devices=2,
        strategy="ddp",
        accelerator="cpu",
        num_workers=0,
        model_args={"lr": 0.01, "warmup_steps": 0},
        callbacks=[SaveSyncedGrads(capture_step)],
        debug_args={"nancapture": {"enabled": True}},
    )


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[3] == "healthy":
        ddp_healthy_main(sys.argv[1], int(sys.argv[2]))
    else:
        ddp_main(sys.argv[1], int(sys.argv[2]), nancapture=not (len(sys.argv) > 3 and sys.argv[3] == "guard"))
