"""The trainer's own overhead: stabletrain.train against a minimal hand-written Fabric loop.

Both train the built-in language model (same settings, same data, same optimizer and
schedule, both print the loss every 10 steps) in one process, interleaved round by round
so that machine noise hits both alike. The ratio is stabletrain's time per step over the
minimal loop's, so 1.00x means no overhead. Goal: at most 1.03x.

    python benchmarks/trainer_overhead.py [--steps 60] [--rounds 5]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import stabletrain
from stabletrain.config import load_settings
from stabletrain.tasks import build_task


def stabletrain_run(out: Path, steps: int, settings: dict) -> float:
    """Seconds per step inside stabletrain.train, from the first step to the last step's log."""
    marks: dict[str, float] = {}

    class Timer:
        def on_train_start(self, trainer):
            marks["start"] = time.perf_counter()

        def on_log(self, trainer, *, step, metrics):
            if step == steps - 1:
                marks["end"] = time.perf_counter()

    stabletrain.train(out=out, steps=steps, callbacks=[Timer()], checkpoint_every_num_steps=10**9, **settings)
    return (marks["end"] - marks["start"]) / steps


def minimal_fabric_run(steps: int, settings: dict) -> float:
    """The loop a user would write by hand with Lightning Fabric."""
    from lightning_fabric import Fabric

    s = load_settings({"out": "unused", **settings})
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    torch.manual_seed(s.seed)
    task = build_task(s)
    model = task.model
    args = s.model_args
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=args.betas, weight_decay=args.weight_decay)

    def factor(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, s.steps - args.warmup_steps)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    model, optimizer = fabric.setup(model, optimizer)
    loader = DataLoader(task.dataset, batch_size=s.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(s.seed))
    loader = fabric.setup_dataloaders(loader)
    it = iter(loader)
    start = time.perf_counter()
    for step in range(steps):
        batch = next(it)
        loss = model.training_step(batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % s.log_every_num_steps == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.4f}", end="\r")
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    ns = parser.parse_args()
    settings = {"steps": ns.steps, "log_every_num_steps": 10, "model_args": {"warmup_steps": 10}}

    ours, base = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ns.rounds + 1):  # round 0 warms up caches and allocators, discarded
            t_base = minimal_fabric_run(ns.steps, settings)
            t_ours = stabletrain_run(Path(tmp) / f"r{r}", ns.steps, {k: v for k, v in settings.items() if k != "steps"})
            if r:
                base.append(t_base)
                ours.append(t_ours)
    ratios = [o / b for o, b in zip(ours, base)]
    print()
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"model: built-in language model (defaults), batch 32, {ns.steps} steps x {ns.rounds} rounds")
    print(f"{'':24}{'ms/step (median)':>18}{'steps/s':>10}")
    print(f"{'minimal Fabric loop':24}{statistics.median(base) * 1e3:>18.1f}{1 / statistics.median(base):>10.2f}")
    print(f"{'stabletrain.train':24}{statistics.median(ours) * 1e3:>18.1f}{1 / statistics.median(ours):>10.2f}")
    print(f"ratio stabletrain / minimal: median {statistics.median(ratios):.3f}x, "
          f"per round {', '.join(f'{x:.3f}' for x in ratios)}")


if __name__ == "__main__":
    main()
