"""What the benchmarks share: the benchmark model and a side-by-side timer.

The benchmark model is the built-in transformer language model at a size where one
training step takes a few hundred milliseconds on 2 CPU cores (4 layers, dim 256, 8 heads,
context 128, batch 16, dropout 0.1; 3.3M parameters).
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Any, Callable

import torch
from torch.utils.data import default_collate

from stabletrain.config import load_settings
from stabletrain.tasks import build_task

BENCH_MODEL_ARGS: dict[str, Any] = {"n_layers": 4, "n_heads": 8, "dim": 256, "context_length": 128, "dropout": 0.1}
BENCH_SETTINGS: dict[str, Any] = {"model_args": BENCH_MODEL_ARGS, "batch_size": 16}


def bench_model_and_batches(num_batches: int = 8, seed: int = 0,
                            device: str = "cpu") -> tuple[torch.nn.Module, list[Any]]:
    """A fresh benchmark model and ``num_batches`` microbatches of its data, on ``device``."""
    settings = load_settings({"out": "unused", "seed": seed, **BENCH_SETTINGS})
    task = build_task(settings)
    bs = settings.batch_size
    batches = [default_collate([task.dataset[i * bs + j] for j in range(bs)]) for i in range(num_batches)]
    return task.model.to(device), [to_device(b, device) for b in batches]


def to_device(batch: Any, device: str) -> Any:
    """``batch`` (a tensor, or a dict / list / tuple of them) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def device_sync(device: str) -> Callable[[], None]:
    """What a timer calls before reading the clock: waits for queued GPU work (nothing on the CPU).
    Timing code calls it outside the steps whose host syncs are counted."""
    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def interleaved(variants: dict[str, Callable[[], None]], repeats: int, rounds: int,
                sync: Callable[[], None] = lambda: None,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of each variant, measured round-robin so machine noise hits all alike.

    Each round runs every variant ``repeats`` times in turn (order rotated per round); the
    first round is a warm-up and is discarded. Returns per-round mean seconds per call.
    ``sync`` runs before each clock reading (``device_sync``: a GPU's queued work counts).
    ``clock``: ``time.perf_counter`` (wall) or ``time.process_time`` (CPU time of this process:
    on a loaded machine, with one torch thread, far less disturbed by other processes).
    """
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn = variants[name]
            sync()
            start = clock()
            for _ in range(repeats):
                fn()
            sync()
            if r:
                times[name].append((clock() - start) / repeats)
    return times


def machine() -> str:
    return f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def median(xs: list[float]) -> float:
    return statistics.median(xs)
