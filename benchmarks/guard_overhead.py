"""The always-on guard's cost: step time and host synchronisations, side by side.

Timing: two copies of the built-in language model (defaults: 2 layers, dim 128, batch 32,
context 64; AdamW) train in one process, interleaved round by round, in the step the trainer
runs (forward, backward, the gradient norm it always computes, AdamW). One copy adds what the
trainer adds with ``guard.enabled=true`` (the default): ``check_gradients`` before the
optimizer step, ``check_update`` after it (one fused norm over parameters and AdamW state),
and the two host-side looks at the verdict (free on the CPU). The ratio is the median over
rounds of guarded / plain; goal <= 1.01x. Because CPU steps scatter by several percent, the
time of the guard's calls alone is measured too, with gradients and state present: the added
cost without the noise of the step.

Host synchronisations (``aten._local_scalar_dense``, counted with
``stabletrain.utils.sync``): per step of that loop, and per step of ``stabletrain.train``
itself with the guard on and off, with and without ``debug_args.nancapture`` (whose one read
per step carries the guard's verdict). Goals: 0 added on steps that are not logged, and with
nancapture on still +1.

    python benchmarks/guard_overhead.py [--rounds 60] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_sync, machine, median, to_device  # noqa: E402

import stabletrain  # noqa: E402
from stabletrain import compute_grad_norm  # noqa: E402
from stabletrain.config import load_settings  # noqa: E402
from stabletrain.safety.guard import StepGuard  # noqa: E402
from stabletrain.tasks import build_task  # noqa: E402
from stabletrain.utils.sync import CountSyncs, SyncsPerStep  # noqa: E402


def builtin_model_and_batches(n: int = 8, device: str = "cpu"):
    settings = load_settings({"out": "unused"})
    task = build_task(settings)
    bs = settings.batch_size
    batches = [default_collate([task.dataset[i * bs + j] for j in range(bs)]) for i in range(n)]
    return task.model.to(device), [to_device(b, device) for b in batches]


def make_step(model, batches, guarded: bool):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    guard = StepGuard(model, optimizer) if guarded else None
    data = itertools.cycle(batches)
    counter = itertools.count()

    def step() -> None:
        i = next(counter)
        loss = model.training_step(next(data))
        loss.backward()
        gn = compute_grad_norm(model.named_parameters())
        if guard is not None:
            guard.check_gradients(i, gn.total, [loss.detach()])
            guard.visible()
        optimizer.step()
        if guard is not None:
            guard.check_update(i)
        optimizer.zero_grad(set_to_none=True)
        if guard is not None:
            guard.visible()

    return step, guard


def interleaved_times(variants: dict, rounds: int, sync=lambda: None) -> dict[str, dict[str, list[float]]]:
    """Per round, one step of each variant in turn (order alternating), wall and CPU seconds;
    the first round is a warm-up."""
    names = list(variants)
    out = {n: {"wall": [], "cpu": []} for n in names}
    for r in range(rounds + 1):
        for name in (names if r % 2 else names[::-1]):
            sync()
            w0, c0 = time.perf_counter(), time.process_time()
            variants[name]()
            sync()
            w1, c1 = time.perf_counter(), time.process_time()
            if r:
                out[name]["wall"].append(w1 - w0)
                out[name]["cpu"].append(c1 - c0)
    return out


def guard_calls_alone(model, batch, n: int = 200, sync=lambda: None) -> float:
    """CPU seconds per step of the guard's calls alone (gradients and AdamW state present)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model.training_step(batch)
    loss.backward()
    optimizer.step()  # AdamW's state exists from now on
    gn = compute_grad_norm(model.named_parameters())
    guard = StepGuard(model, optimizer)
    sync()
    start = time.process_time()
    for i in range(n):
        guard.check_gradients(i, gn.total, [loss.detach()])
        guard.visible()
        guard.check_update(i)
        guard.visible()
    sync()
    return (time.process_time() - start) / n


def trainer_syncs(guard: bool, nancapture: bool, device: str = "cpu") -> dict[int, int]:
    counter = SyncsPerStep()
    with tempfile.TemporaryDirectory() as tmp:
        stabletrain.train(out=Path(tmp) / "run", accelerator=device, steps=12, log_every_num_steps=10,
                          checkpoint_every_num_steps=6,
                          callbacks=[counter], guard={"enabled": guard},
                          debug_args={"nancapture": {"enabled": nancapture}},
                          loggers={"tensorboard": {"enabled": False}})
    return counter.counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    ns = parser.parse_args()

    sync = device_sync(ns.device)
    base, batches = builtin_model_and_batches(device=ns.device)
    plain_step, _ = make_step(base, batches, guarded=False)
    guarded_step, _ = make_step(copy.deepcopy(base), batches, guarded=True)
    syncs = {}
    for name, fn in (("no guard", plain_step), ("guard", guarded_step)):
        with CountSyncs() as c:
            fn()
        syncs[name] = c.count
    times = interleaved_times({"no guard": plain_step, "guard": guarded_step}, rounds=ns.rounds, sync=sync)
    alone = guard_calls_alone(copy.deepcopy(base), batches[0], sync=sync)
    print(f"machine: {machine()}, device {ns.device}")
    print(f"model: built-in language model (defaults, batch 32), AdamW; {ns.rounds} rounds of one step per variant, "
          "interleaved")
    print(f"{'':12}{'wall ms/step':>14}{'CPU ms/step':>13}{'host syncs/step':>17}   (medians)")
    for name in ("no guard", "guard"):
        t = times[name]
        print(f"{name:12}{median(t['wall']) * 1e3:>14.1f}{median(t['cpu']) * 1e3:>13.1f}{syncs[name]:>17}")
    for kind in ("wall", "cpu"):
        ratios = [g / p for g, p in zip(times["guard"][kind], times["no guard"][kind])]
        q = statistics.quantiles(ratios, n=4)
        total = sum(times["guard"][kind]) / sum(times["no guard"][kind])
        print(f"ratio guard / no guard, {kind} time: median over rounds {median(ratios):.3f}x "
              f"(quartiles {q[0]:.3f}-{q[2]:.3f}), total {total:.3f}x")
    plain = median(times["no guard"]["cpu"])
    print(f"the guard's calls alone: {alone * 1e3:.3f} ms/step = {alone / plain * 100:.2f}% of a step's CPU time "
          f"-> {1 + alone / plain:.4f}x (goal <= 1.01x)")

    print("host syncs per step of stabletrain.train (12 steps, logged at 0, 10, 11; checkpoint after 6):")
    counts = {(g, n): trainer_syncs(g, n, ns.device) for g in (False, True) for n in (False, True)}
    quiet = [s for s in range(12) if s not in (0, 5, 10, 11)]
    for (g, n), c in counts.items():
        print(f"  guard {'on ' if g else 'off'} nancapture {'on ' if n else 'off'}: "
              f"steps not logged {sorted({c[s] for s in quiet})}, logged {[c[s] for s in (0, 10, 11)]}")
    added = {n: max(counts[(True, n)][s] - counts[(False, n)][s] for s in range(12)) for n in (False, True)}
    nan_added = max(counts[(True, True)][s] - counts[(True, False)][s] for s in quiet)
    print(f"added by the guard, any step: {added[False]} (nancapture off), {added[True]} (nancapture on); "
          f"nancapture on with the guard: +{nan_added} per step not logged (goals: 0, 0, +1)")


if __name__ == "__main__":
    main()
