"""What logging gradient_norm where users look costs: loggers, per-layer norms, trend alerts.

Two measurements, both on this machine, side by side:

1. Per call: each logger's ``log_metrics`` with the metrics of one logged step (the 9 keys
   the trainer logs on CPU at 32-true: loss, gradient_norm, lr, epoch, samples, elapsed_s,
   steps_per_s, samples_per_s, eta_s; fp16 adds loss_scale, CUDA max_memory_gb), and with
   the per-layer norms of the benchmark model on top (94 more: 103 keys), the trend
   detector's ``update``, and ``layer_grad_norms`` with its read-back on the benchmark model.
2. End to end: ``stabletrain.train`` on the built-in default model (as in
   trainer_overhead.py; a small model, where a fixed cost per logged step weighs most),
   logging every 10 steps, with
   metrics.jsonl only and trend alerts off ("bare"), against the defaults (TensorBoard and
   trend alerts on), per-layer norms on, and all four loggers on. Interleaved rounds, median
   ratio of seconds per step.

W&B runs offline and MLflow on a local SQLite file, all inside a temporary folder.

    python benchmarks/logging_overhead.py [--steps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import bench_model_and_batches, machine  # noqa: E402

import stabletrain  # noqa: E402
from stabletrain.debug.grad_norm import compute_grad_norm, layer_grad_norms  # noqa: E402
from stabletrain.debug.trends import TrendDetector  # noqa: E402


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def per_call_table(tmp: Path) -> None:
    from stabletrain.loggers.jsonl import JsonlLogger
    from stabletrain.loggers.mlflow import MLflowLogger
    from stabletrain.loggers.tensorboard import TensorBoardLogger
    from stabletrain.loggers.wandb import WandbLogger

    model, batches = bench_model_and_batches(num_batches=1)
    model.training_step(batches[0]).backward()
    gn = compute_grad_norm(model.named_parameters())
    names, norms = layer_grad_norms(gn)
    base = {"loss": 2.5, "gradient_norm": 1.3, "lr": 1e-3, "epoch": 0.1, "samples": 320, "elapsed_s": 1.0,
            "steps_per_s": 9.0, "samples_per_s": 288.0, "eta_s": 50.0}
    layered = {**base, **{f"gradient_norm/{n}": float(v) for n, v in zip(names, norms.tolist())}}

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        loggers = {
            "metrics.jsonl": JsonlLogger(tmp / "calls" / "metrics.jsonl"),
            "TensorBoard": TensorBoardLogger(tmp / "calls" / "tensorboard"),
            "MLflow (async)": MLflowLogger(tmp / "calls", experiment_name="bench"),
            "W&B (offline)": WandbLogger(tmp / "calls", project="bench", mode="offline"),
        }
    steps = iter(range(10**9))
    print(f"\nper call, microseconds, back to back (MLflow's background writer competes for the GIL); "
          f"{len(layered)} keys with per-layer norms")
    print(f"{'':34}{f'{len(base)} keys':>10}{f'{len(layered)} keys':>10}")
    for name, logger in loggers.items():
        a = per_call_us(lambda logger=logger: logger.log_metrics(base, next(steps)), 200)
        b = per_call_us(lambda logger=logger: logger.log_metrics(layered, next(steps)), 200)
        print(f"{name + '.log_metrics':34}{a:>10.0f}{b:>10.0f}")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for logger in loggers.values():
            logger.close()

    detector = TrendDetector(warmup_steps=10)
    values = iter(range(10**9))
    t = per_call_us(
        lambda: detector.update(next(values), {"loss": 2.0, "gradient_norm": 1.0 + (next(values) % 7) / 10}), 2000)
    print(f"{'TrendDetector.update':34}{t:>10.0f}")
    t = per_call_us(lambda: layer_grad_norms(gn)[1].tolist(), 200)
    print(f"{f'layer_grad_norms + read-back ({len(names)})':34}{t:>10.0f}")
    t = per_call_us(lambda: compute_grad_norm(model.named_parameters()), 50)
    print(f"{'(for scale: compute_grad_norm)':34}{t:>10.0f}")


def run(out: Path, steps: int, **settings: Any) -> float:
    """Seconds per step inside stabletrain.train, first step to the last step's log."""
    marks: dict[str, float] = {}

    class Timer:
        def on_train_start(self, trainer):
            marks["start"] = time.perf_counter()

        def on_log(self, trainer, *, step, metrics):
            if step == steps - 1:
                marks["end"] = time.perf_counter()

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        stabletrain.train(
            out=out, steps=steps, callbacks=[Timer()], checkpoint_every_num_steps=10**9, log_every_num_steps=10,
            model_args={"warmup_steps": 10}, **settings,
        )
    return (marks["end"] - marks["start"]) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]  # results as they come
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for key, sub in (("WANDB_DIR", "wandb"), ("WANDB_CONFIG_DIR", "wandb_config"),
                         ("WANDB_CACHE_DIR", "wandb_cache"), ("WANDB_DATA_DIR", "wandb_data")):
            os.environ[key] = str(tmp / sub)
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
        print(f"machine: {machine()}")
        per_call_table(tmp)

        bare = {"loggers": {"tensorboard": {"enabled": False}}, "trend_alerts": {"enabled": False}}
        variants = {
            "bare (metrics.jsonl only)": bare,
            "defaults (+TensorBoard, +trend alerts)": {},
            "defaults + per-layer norms": {"gradient_norm_per_layer": True},
            "all four loggers": {"loggers": {"mlflow": {"enabled": True}, "wandb": {"enabled": True}}},
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(ns.rounds + 1):  # round 0 warms up, discarded
            for i, name in enumerate(names[r % len(names):] + names[: r % len(names)]):
                t = run(tmp / f"r{r}_{i}", ns.steps, **variants[name])
                if r:
                    times[name].append(t)
        print(f"\nend to end: built-in default model (2 layers, dim 128, batch 32), {ns.steps} steps, "
              f"logging every 10, {ns.rounds} interleaved rounds")
        print(f"{'':42}{'ms/step':>10}{'vs bare':>10}")
        base = times[names[0]]
        for name in names:
            ratio = statistics.median(t / b for t, b in zip(times[name], base))
            print(f"{name:42}{statistics.median(times[name]) * 1e3:>10.1f}{ratio:>9.3f}x")
        print(f"torch threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
