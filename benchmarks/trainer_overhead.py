"""The trainer's own overhead: stabletrain.train against a minimal hand-written Fabric loop.

Both train the built-in language model with the same settings, data, optimizer and schedule,
interleaved step by step in one process: at the start of each stabletrain step, a callback
runs one step of the minimal loop (a second copy of the model) and times it. stabletrain's
step time is everything between the end of that minimal step and the next one — forward,
backward, gradient norm, optimizer, schedule, logging (metrics.jsonl, TensorBoard when
installed, the progress line), trend alerts, events. Adjacent steps see the same machine
state, so noise largely cancels. The ratio is stabletrain's time per step over the minimal
loop's; 1.00x means no overhead. Goal: at most 1.03x.

    python benchmarks/trainer_overhead.py [--steps 400]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import machine
from torch.utils.data import DataLoader

import stabletrain
from stabletrain.config import load_settings
from stabletrain.tasks import build_task


class MinimalLoop:
    """The loop a user would write by hand with Lightning Fabric, one step at a time."""

    def __init__(self, settings: dict):
        from lightning_fabric import Fabric

        s = load_settings({"out": "unused", **settings})
        self.s = s
        fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
        task = build_task(s)
        args = s.model_args
        optimizer = torch.optim.AdamW(task.model.parameters(), lr=args.lr, betas=args.betas,
                                      weight_decay=args.weight_decay)

        def factor(step: int) -> float:
            if step < args.warmup_steps:
                return (step + 1) / args.warmup_steps
            progress = (step - args.warmup_steps) / max(1, s.steps - args.warmup_steps)
            return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        self.fabric = fabric
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        self.model, self.optimizer = fabric.setup(task.model, optimizer)
        loader = DataLoader(task.dataset, batch_size=s.batch_size, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(s.seed))
        self.loader = fabric.setup_dataloaders(loader)
        self.batches = self._forever()
        self.step_index = 0

    def _forever(self):
        while True:
            yield from self.loader

    def step(self) -> None:
        batch = next(self.batches)
        loss = self.model.training_step(batch)
        self.fabric.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.step_index % self.s.log_every_num_steps == 0:
            print(f"minimal loop step {self.step_index} loss {loss.item():.4f}", end="\r")
        self.step_index += 1


class Interleave:
    """stabletrain callback: one minimal-loop step before each stabletrain step, both timed."""

    def __init__(self, minimal: MinimalLoop, skip: int):
        self.minimal = minimal
        self.skip = skip
        self.ours: list[float] = []
        self.base: list[float] = []
        self._end_of_minimal: float | None = None

    def on_step_start(self, trainer, *, step):
        now = time.perf_counter()
        if self._end_of_minimal is not None and step > self.skip:
            self.ours.append(now - self._end_of_minimal)
        t0 = time.perf_counter()
        self.minimal.step()
        t1 = time.perf_counter()
        if step >= self.skip:
            self.base.append(t1 - t0)
        self._end_of_minimal = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the figures")
    ns = parser.parse_args()
    settings = {"steps": ns.steps, "log_every_num_steps": 10, "model_args": {"warmup_steps": 10}}

    minimal = MinimalLoop(settings)
    inter = Interleave(minimal, skip=ns.warmup)
    with tempfile.TemporaryDirectory() as tmp:
        stabletrain.train(out=Path(tmp) / "run", callbacks=[inter], checkpoint_every_num_steps=10**9, **settings)
    n = min(len(inter.ours), len(inter.base))
    ours, base = inter.ours[:n], inter.base[:n]
    ratios = [o / b for o, b in zip(ours, base)]
    q = statistics.quantiles(ratios, n=4)
    print()
    print(f"machine: {machine()}")
    print(f"model: built-in language model (defaults), batch 32; {n} steps interleaved step by step")
    print(f"{'':24}{'ms/step (median)':>18}{'ms/step (mean)':>16}")
    print(f"{'minimal Fabric loop':24}{statistics.median(base) * 1e3:>18.1f}{statistics.mean(base) * 1e3:>16.1f}")
    print(f"{'stabletrain.train':24}{statistics.median(ours) * 1e3:>18.1f}{statistics.mean(ours) * 1e3:>16.1f}")
    print(f"ratio stabletrain / minimal: {sum(ours) / sum(base):.3f}x of total time; "
          f"per-step ratio median {statistics.median(ratios):.3f}x (quartiles {q[0]:.3f}-{q[2]:.3f})")


if __name__ == "__main__":
    main()
