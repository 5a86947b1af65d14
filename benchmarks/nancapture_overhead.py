"""nancapture's cost per optimizer step, side by side with the same loop without it.

Both variants train their own copy of the benchmark model (built-in transformer LM, 4
layers, dim 256, batch 16; see ``benchmarks/common.py``) with AdamW in a plain loop that
computes the gradient norm, as the trainer always does. The monitored variant adds what
``debug_args.nancapture`` adds in the trainer: ``begin_step`` (persistent buffers copied on
the device), ``collect_batch`` (a reference and the RNG states), ``collect_loss`` and
``check_and_capture`` reusing the norm (one host sync). Steps are interleaved round by
round (one step each by default, so that load changes on a shared machine hit both alike);
the ratio is the median over rounds of monitored / plain, goal <= 1.05x. The time of the
monitor's calls alone is printed too: the added cost without the noise of the step.
It also counts host synchronisations per step (``aten._local_scalar_dense``), goal: +1.

    python benchmarks/nancapture_overhead.py [--rounds 30] [--repeats 1] [--accum 1] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_model_and_batches, device_sync, interleaved, machine, median  # noqa: E402

from stabletrain import NaNCaptureMonitor, compute_grad_norm  # noqa: E402
from stabletrain.utils.sync import CountSyncs  # noqa: E402


def make_step(model, batches, accum: int, monitor: NaNCaptureMonitor | None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = itertools.cycle(batches)
    counter = itertools.count()

    def step() -> None:
        i = next(counter)
        if monitor is not None:
            monitor.begin_step(i)
        for _ in range(accum):
            batch = next(data)
            if monitor is not None:
                monitor.collect_batch(batch)
            loss = model.training_step(batch)
            if monitor is not None:
                monitor.collect_loss(loss)
            (loss / accum).backward()
        gn = compute_grad_norm(model.named_parameters())
        if monitor is not None:
            monitor.check_and_capture(gn)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def monitor_calls_alone(model, batch, accum: int, n: int = 200, sync=lambda: None) -> float:
    """Seconds per step of just the monitor's calls (gradients present, norm precomputed):
    the added cost without the noise of the step around it."""
    import time

    with tempfile.TemporaryDirectory() as tmp:
        monitor = NaNCaptureMonitor(model, out_dir=tmp)
        loss = model.training_step(batch)
        loss.backward()
        gn = compute_grad_norm(model.named_parameters())
        sync()
        start = time.perf_counter()
        for i in range(n):
            monitor.begin_step(i)
            for _ in range(accum):
                monitor.collect_batch(batch)
                monitor.collect_loss(loss)
            monitor.check_and_capture(gn)
        sync()
        elapsed = (time.perf_counter() - start) / n
        model.zero_grad(set_to_none=True)
    return elapsed


def quantile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def syncs_per_step(step) -> int:
    with CountSyncs() as counter:
        step()
    return counter.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1, help="steps per variant per round")
    parser.add_argument("--accum", type=int, default=1, help="microbatches (of 16) per optimizer step")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    ns = parser.parse_args()

    sync = device_sync(ns.device)
    base, batches = bench_model_and_batches(num_batches=8, device=ns.device)
    plain_model, monitored_model = base, copy.deepcopy(base)
    with tempfile.TemporaryDirectory() as tmp:
        monitor = NaNCaptureMonitor(monitored_model, out_dir=tmp)
        variants = {
            "no monitor": make_step(plain_model, batches, ns.accum, None),
            "NaNCaptureMonitor": make_step(monitored_model, batches, ns.accum, monitor),
        }
        syncs = {name: syncs_per_step(fn) for name, fn in variants.items()}
        times = interleaved(variants, repeats=ns.repeats, rounds=ns.rounds, sync=sync)
    alone = monitor_calls_alone(copy.deepcopy(base), batches[0], ns.accum, sync=sync)
    plain, monitored = times["no monitor"], times["NaNCaptureMonitor"]
    ratios = [m / p for m, p in zip(monitored, plain)]
    print(f"machine: {machine()}, device {ns.device}")
    print(f"model: benchmark LM (4 layers, dim 256, batch 16), {ns.accum} microbatch(es) per step, "
          f"{ns.repeats} steps x {ns.rounds} rounds per variant, interleaved")
    print(f"{'':22}{'ms/step (median)':>18}{'host syncs/step':>17}")
    for name in variants:
        print(f"{name:22}{median(times[name]) * 1e3:>18.1f}{syncs[name]:>17}")
    print(f"ratio NaNCaptureMonitor / no monitor: median over rounds {median(ratios):.3f}x "
          f"(quartiles {quantile(ratios, 0.25):.3f}-{quantile(ratios, 0.75):.3f}; goal <= 1.05x, +1 sync)")
    print(f"the monitor's calls alone: {alone * 1e3:.3f} ms/step = {alone / median(plain) * 100:.2f}% of a plain step")


if __name__ == "__main__":
    main()
