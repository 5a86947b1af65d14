"""The mechanism signals' cost (debug_args.mechanisms): step time and host syncs, side by side.

Timing: two copies of the built-in language model (defaults: 2 layers, dim 128, 4 heads, batch
32, context 64; AdamW) train in one process, interleaved round by round. A round is
``--log-every`` steps (default 10, the trainer's ``log_every_num_steps``) of which the first is
logged: both copies read their logged values back once (the loss; with the signals, the loss and
every ``signals/...`` value in the same read), as the trainer does. One copy runs what the
trainer runs with the signals on: a ``MechanismMonitor`` armed on the logged step, probing its
forward pass, taking the update through the optimizer's hooks. The ratio is the median over
rounds of signals / plain (goal <= 1.02x); a logged step alone is also timed against a plain one,
the cost the signals put on that step.

Host synchronisations (counted with ``stabletrain.utils.sync``): per step of
``stabletrain.train`` with the signals on and off (goal: the same on every step, logged or not).
On a GPU, also the synchronising CUDA calls of one logged step of each copy, counted with
``torch.cuda.set_sync_debug_mode("warn")``, which sees what the counter cannot (e.g. a blocking
copy of a CPU tensor to the GPU); goal: as many with the signals as without.

    python benchmarks/mechanism_signals.py [--rounds 30] [--log-every 10] [--device cpu|cuda]
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
from typing import Callable

import torch
from torch.utils.data import default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_sync, machine, median, to_device  # noqa: E402

import stabletrain  # noqa: E402
from stabletrain import MechanismMonitor  # noqa: E402
from stabletrain.config import load_settings  # noqa: E402
from stabletrain.tasks import build_task  # noqa: E402
from stabletrain.utils.sync import SyncsPerStep  # noqa: E402


def builtin_model_and_batches(n: int = 8, device: str = "cpu"):
    settings = load_settings({"out": "unused"})
    task = build_task(settings)
    bs = settings.batch_size
    batches = [default_collate([task.dataset[i * bs + j] for j in range(bs)]) for i in range(n)]
    return task.model.to(device), [to_device(b, device) for b in batches]


def make_step(model, batches, signals: bool) -> Callable[[bool], None]:
    """``step(logged)``: one training step; on a logged step the values are read back once."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    monitor = MechanismMonitor(model, optimizer, report=lambda notice: None) if signals else None
    data = itertools.cycle(batches)

    def step(logged: bool) -> None:
        if monitor is not None:
            monitor.begin_step(log=logged, probe=False)
            with monitor.probing():
                loss = model.training_step(next(data))
        else:
            loss = model.training_step(next(data))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if logged:
            values = [loss.detach().reshape(1)]
            if monitor is not None:
                monitor.after_step()
                values += [v.reshape(1).to(loss.device) for v in monitor.device_values().values()]
            torch.cat(values).tolist()  # the logged step's one read

    return step


def interleaved_rounds(variants: dict[str, Callable[[bool], None]], rounds: int, log_every: int,
                       sync: Callable[[], None]) -> dict[str, list[float]]:
    """Seconds per round (``log_every`` steps, the first logged) of each variant, alternating which
    goes first; the first round is a warm-up."""
    names = list(variants)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for name in (names if r % 2 else names[::-1]):
            sync()
            start = time.perf_counter()
            for i in range(log_every):
                variants[name](i == 0)
            sync()
            if r:
                out[name].append(time.perf_counter() - start)
    return out


def logged_step_alone(variants: dict[str, Callable[[bool], None]], n: int, sync: Callable[[], None]) -> dict:
    """Seconds of one logged step of each variant, interleaved, ``n`` times after a warm-up."""
    out: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(n + 1):
        for name, step in variants.items():
            sync()
            start = time.perf_counter()
            step(True)
            sync()
            if r:
                out[name].append(time.perf_counter() - start)
    return out


def cuda_syncs_of_a_logged_step(step: Callable[[bool], None]) -> int:
    """Synchronising CUDA calls of one logged step (its one read included), as torch's sync
    debug mode reports them."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def trainer_syncs(signals: bool, device: str) -> dict[int, int]:
    counter = SyncsPerStep()
    with tempfile.TemporaryDirectory() as tmp:
        stabletrain.train(out=Path(tmp) / "run", accelerator=device, steps=12, log_every_num_steps=10,
                          checkpoint_every_num_steps=6, callbacks=[counter],
                          debug_args={"mechanisms": {"enabled": signals}},
                          loggers={"tensorboard": {"enabled": False}})
    return counter.counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=10, help="steps per round, the first one logged")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    ns = parser.parse_args()

    sync = device_sync(ns.device)
    base, batches = builtin_model_and_batches(device=ns.device)
    variants = {"plain": make_step(base, batches, signals=False),
                "signals": make_step(copy.deepcopy(base), batches, signals=True)}
    rounds = interleaved_rounds(variants, ns.rounds, ns.log_every, sync)
    alone = logged_step_alone(variants, max(10, ns.rounds // 2), sync)
    print(f"machine: {machine()}, device {ns.device}")
    print(f"model: built-in language model (defaults, batch 32), AdamW; {ns.rounds} rounds of {ns.log_every} steps "
          "(the first logged) per variant, interleaved")
    per_step = {name: [t / ns.log_every for t in ts] for name, ts in rounds.items()}
    print(f"{'':10}{'ms/step':>10}{'logged step ms':>16}   (medians)")
    for name in variants:
        print(f"{name:10}{median(per_step[name]) * 1e3:>10.1f}{median(alone[name]) * 1e3:>16.1f}")
    ratios = [s / p for s, p in zip(rounds["signals"], rounds["plain"])]
    q = statistics.quantiles(ratios, n=4)
    print(f"ratio signals / plain at one logged step in {ns.log_every}: median over rounds {median(ratios):.3f}x "
          f"(quartiles {q[0]:.3f}-{q[2]:.3f}; goal <= 1.02x)")
    logged = [s / p for s, p in zip(alone["signals"], alone["plain"])]
    print(f"a logged step alone, signals / plain: median {median(logged):.3f}x")

    counts = {signals: trainer_syncs(signals, ns.device) for signals in (False, True)}
    logged_steps = (0, 10, 11)
    quiet = [s for s in range(12) if s not in (*logged_steps, 5)]
    print("host syncs per step of stabletrain.train (12 steps, logged at 0, 10, 11; checkpoint after 6):")
    for signals, c in counts.items():
        print(f"  signals {'on ' if signals else 'off'}: steps not logged {sorted({c[s] for s in quiet})}, "
              f"logged {[c[s] for s in logged_steps]}")
    added = max(counts[True][s] - counts[False][s] for s in range(12))
    print(f"added by the signals, any step: {added} (goal 0)")
    if torch.device(ns.device).type == "cuda":
        cuda = {name: cuda_syncs_of_a_logged_step(step) for name, step in variants.items()}
        print(f"synchronising CUDA calls in a logged step: plain {cuda['plain']}, signals {cuda['signals']} "
              "(goal: equal)")


if __name__ == "__main__":
    main()
