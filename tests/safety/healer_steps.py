"""One training step through the self-healing callback's hooks, in the trainer's order, for the
in-process healing tests (test_healing_lifecycle.py, test_healing_messages.py, test_healing_recovery.py):
their stub trainers differ, the order of the calls does not (training/loop.py, one microbatch); and the
model they train."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from stabletrain.debug.grad_norm import compute_grad_norm


class Net(nn.Module):
    """A regressor with ``training_step``, at the top level of a module with no constructor arguments:
    replay can import it and the sample search can copy it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 1)

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch):
        return nn.functional.mse_loss(self(batch["x"]), batch["y"])


def train_step(t: Any, h: Any, step: int, batch: Any, indices: list[int], forward: Callable[[Any], torch.Tensor]
               ) -> None:
    """Step ``step`` of stub trainer ``t`` with healer ``h``; ``forward(batch)`` is its loss."""
    h.on_step_start(t, step=step)
    t.microbatches_consumed += 1
    h.on_microbatch(t, step=step, micro_step=0, batch=batch, indices=torch.tensor(indices))
    loss = forward(batch)
    loss.backward()
    h.on_after_microbatch(t, step=step, micro_step=0, loss=loss)
    h.check(step, [loss.detach()], compute_grad_norm(t.model.named_parameters()).total)
    t.optimizer.step()
    h.after_step()
    t.optimizer.zero_grad()
    t.step = step + 1
    h.end_of_step()
