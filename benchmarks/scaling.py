"""How the debugging tools' costs grow with the model and the batch: a table with log-log slopes.

The built-in language model at 4 sizes (dim 64/128/256/512, 1/2/4/8 layers, context 32, no
dropout) and 2 batch sizes (8, 32). For each configuration ``stabletrain.train`` runs with
``debug_args.nancapture`` on until step 1, where the embedding row of a token that only one
sample of the batch holds turns NaN (as in ``diagnose_speed.py``); then it measures:

* the capture: the size of ``nan_capture.pt`` and the time to write it;
* replay: ``load_nan_capture(path).replay()``;
* diagnose: ``stabletrain.diagnose`` in a process of its own (its imports done first, not
  counted): its time, its phases, its number of
  subset replays (the culprit-sample search) and the process's peak resident memory, next to the
  peak of a process that only loads the capture (the difference is what diagnose itself holds);
* the rollback snapshot (``on_instability.policy=rollback``): bytes of its CPU copy of the
  model, the AdamW state and the RNG states.

Each quantity is fitted as ``c * parameters ** a`` over the 4 sizes at each batch size (the slope
``a`` of the log-log line) and as ``c * batch ** b`` between the 2 batch sizes at each size; the
last lines extrapolate to a 1B-parameter model at batch 32 (an extrapolation of 4 points from
at most 25M parameters on a CPU: a guide to the growth, not a measurement). Scratch files go
under a temporary folder (``--tmp``, default /tmp). Takes a few minutes on 2 cores.

    python benchmarks/scaling.py [--threads 2] [--sizes 64x1,128x2,256x4,512x8] [--batches 8,32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine  # noqa: E402

CONTEXT = 32


class PoisonRareToken:
    """At ``step``, turn NaN the embedding row of a token found in exactly one sample of the batch."""

    def __init__(self, step: int = 1):
        self.step = step
        self.victim: tuple[int, int] | None = None

    def on_microbatch(self, trainer: Any, *, step: int, micro_step: int, batch: Any, indices: Any) -> None:
        if step != self.step or self.victim is not None:
            return
        ids = batch["input_ids"]
        rows_with = torch.stack([(ids == t).any(1) for t in range(trainer.model.vocab_size)]).sum(1)
        token = int(torch.nonzero(rows_with == 1)[0])
        row = int(torch.nonzero((ids == token).any(1))[0])
        with torch.no_grad():
            trainer.model.tok_emb.weight[token] = float("nan")
        self.victim = (int(indices[row]), token)


def model_args(dim: int, layers: int) -> dict[str, Any]:
    return {"n_layers": layers, "dim": dim, "n_heads": max(2, dim // 64), "context_length": CONTEXT,
            "dropout": 0.0, "warmup_steps": 0}


def capture(out: Path, dim: int, layers: int, batch: int) -> dict[str, Any]:
    """Train until the planted NaN is captured; the capture's path, size and write time."""
    import stabletrain
    from stabletrain.debug.nan_capture import monitor as nan_monitor

    written: dict[str, float] = {}
    real = nan_monitor.write_capture_file

    def timed(*args: Any, **kwargs: Any) -> Path:
        start = time.perf_counter()
        path = real(*args, **kwargs)
        written["seconds"] = time.perf_counter() - start
        return path

    nan_monitor.write_capture_file = timed  # type: ignore[assignment]
    poison = PoisonRareToken()
    try:
        stabletrain.train(out=out, steps=5, batch_size=batch, model_args=model_args(dim, layers), seed=0,
                          log_every_num_steps=1, checkpoint_every_num_steps=1000, num_workers=0,
                          trend_alerts={"enabled": False}, loggers={"tensorboard": {"enabled": False}},
                          debug_args={"nancapture": {"enabled": True}}, callbacks=[poison])
    except stabletrain.NaNDetectedError as err:
        path = Path(err.capture_path)
    else:
        raise RuntimeError(f"dim {dim} x {layers} layers, batch {batch}: the planted NaN was not captured")
    finally:
        nan_monitor.write_capture_file = real  # type: ignore[assignment]
    return {"path": str(path.parent), "capture_mb": path.stat().st_size / 2**20, "write_s": written["seconds"]}


def replay_seconds(folder: str) -> float:
    import stabletrain

    cap = stabletrain.load_nan_capture(folder)
    start = time.perf_counter()
    result = cap.replay()
    took = time.perf_counter() - start
    if not result.reproduced:
        raise RuntimeError(f"{folder}: the replay did not reproduce the NaN")
    return took


def snapshot_mb(dim: int, layers: int, batch: int) -> tuple[float, int]:
    """Bytes of a rollback snapshot after one AdamW step, and the model's parameter count."""
    from torch.utils.data import default_collate

    from stabletrain import RollbackSnapshots
    from stabletrain.config import load_settings
    from stabletrain.tasks import build_task

    task = build_task(load_settings({"out": "unused", "model_args": model_args(dim, layers), "batch_size": batch}))
    model = task.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.training_step(default_collate([task.dataset[i] for i in range(batch)])).backward()
    opt.step()
    snaps = RollbackSnapshots(model, opt)
    snaps.take(1)
    return snaps.nbytes / 2**20, sum(p.numel() for p in model.parameters())


def peak_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ``ru_maxrss``, not inherited from the
    process that forked it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child_main(ns: argparse.Namespace) -> None:
    torch.set_num_threads(ns.threads)
    import stabletrain

    if ns.load_only:
        stabletrain.load_nan_capture(ns.load_only).get_model()
        print(json.dumps({"peak_mb": peak_mb()}))
        return
    start = time.perf_counter()
    import stabletrain.debug.diagnose  # noqa: F401 (imports are not what grows with the model)
    import stabletrain.debug.replay  # noqa: F401

    imports = time.perf_counter() - start
    start = time.perf_counter()
    d = stabletrain.diagnose(ns.diagnose, write=False)
    print(json.dumps({"seconds": time.perf_counter() - start, "imports": imports, "subset_replays": d.data.replays,
                      "phases": d.timings, "verdict": str(d.verdict)[:80], "peak_mb": peak_mb()}))


def in_child(args: list[str], threads: int) -> dict[str, Any]:
    """This script with ``args`` in a fresh process; its last line, JSON."""
    proc = subprocess.run([sys.executable, __file__, *args, "--threads", str(threads)], capture_output=True,
                          text=True)
    if proc.returncode:
        raise RuntimeError(f"{args}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-12)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def fit_at(xs: list[float], ys: list[float], x: float) -> float:
    a = slope(xs, ys)
    lx, ly = [math.log(v) for v in xs], [math.log(max(v, 1e-12)) for v in ys]
    c = sum(ly) / len(ly) - a * sum(lx) / len(lx)
    return math.exp(c + a * math.log(x))


METRICS = [("capture_mb", "capture MB"), ("write_s", "write s"), ("replay_s", "replay s"),
           ("diagnose_s", "diagnose s"), ("subset_replays", "subset replays"), ("diagnose_mb", "diagnose +MB"),
           ("snapshot_mb", "snapshot MB")]
#: Peaks include the interpreter and torch (about 0.9 GB here): printed, not fitted.
PEAKS = [("diagnose_peak_mb", "diagnose peak MB"), ("load_peak_mb", "loading peak MB")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", default="64x1,128x2,256x4,512x8", help="dim x layers, comma-separated")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--tmp", default=None, help="scratch folder (default: a temporary one under /tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--diagnose", help=argparse.SUPPRESS)
    parser.add_argument("--load-only", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.diagnose or ns.load_only:
        return child_main(ns)
    torch.set_num_threads(ns.threads)
    sizes = [tuple(int(v) for v in s.split("x")) for s in ns.sizes.split(",")]
    batches = [int(b) for b in ns.batches.split(",")]
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory(dir=ns.tmp) as tmp:
        for dim, layers in sizes:
            for batch in batches:
                cap = capture(Path(tmp) / f"d{dim}_l{layers}_b{batch}", dim, layers, batch)
                diag = in_child(["--diagnose", cap["path"]], ns.threads)
                diag_rss, load_rss = diag["peak_mb"], in_child(["--load-only", cap["path"]], ns.threads)["peak_mb"]
                snap, n_params = snapshot_mb(dim, layers, batch)
                row = {"dim": dim, "layers": layers, "batch": batch, "params": n_params, **cap,
                       "replay_s": replay_seconds(cap["path"]), "diagnose_s": diag["seconds"],
                       "subset_replays": diag["subset_replays"], "phases": diag["phases"],
                       "diagnose_mb": diag_rss - load_rss, "diagnose_peak_mb": diag_rss, "load_peak_mb": load_rss,
                       "snapshot_mb": snap}
                row.pop("path")
                rows.append(row)
                print(f"  dim {dim:4d} x {layers} layers ({n_params / 1e6:6.2f}M), batch {batch:3d}: capture "
                      f"{row['capture_mb']:.2f} MB in {row['write_s']:.2f} s, replay {row['replay_s']:.2f} s, "
                      f"diagnose {row['diagnose_s']:.1f} s ({row['subset_replays']} subset replays; "
                      + ", ".join(f"{k} {v:.1f}" for k, v in diag["phases"].items())
                      + f"), diagnose peak {diag_rss:.0f} MB (+{row['diagnose_mb']:.0f} over loading), "
                      f"snapshot {snap:.2f} MB", flush=True)
    print(f"\n{time.strftime('%Y-%m-%d')}, {machine()}, load average {os.getloadavg()[0]:.1f}; "
          f"built-in LM, context {CONTEXT}; took {time.time() - started:.0f} s")
    header = f"{'params':>9}{'batch':>6}" + "".join(f"{label:>16}" for _, label in METRICS)
    print(header)
    for r in rows:
        print(f"{r['params'] / 1e6:>8.2f}M{r['batch']:>6}" + "".join(f"{r[k]:>16.3g}" for k, _ in METRICS)
              + "   peaks: " + ", ".join(f"{label} {r[k]:.0f}" for k, label in PEAKS))
    print("log-log slope against parameters (at each batch size):")
    for b in batches:
        at = [r for r in rows if r["batch"] == b]
        print(f"{'':9}{b:>6}" + "".join(f"{slope([r['params'] for r in at], [r[k] for r in at]):>16.2f}"
                                       for k, _ in METRICS))
    if len(batches) > 1:
        print(f"log-log slope against batch ({batches[0]} -> {batches[-1]}), at each size:")
        for dim, layers in sizes:
            at = [r for r in rows if (r["dim"], r["layers"]) == (dim, layers)]
            lo, hi = at[0], at[-1]
            print(f"{lo['params'] / 1e6:>8.2f}M{'':6}" + "".join(
                f"{slope([lo['batch'], hi['batch']], [lo[k], hi[k]]):>16.2f}" for k, _ in METRICS))
    big = [r for r in rows if r["batch"] == batches[-1]]
    print(f"extrapolated to 1B parameters at batch {batches[-1]} (from the fit above; a guide, not a measurement):")
    print(f"{'1000.00M':>9}{batches[-1]:>6}" + "".join(
        f"{fit_at([r['params'] for r in big], [r[k] for r in big], 1e9):>16.3g}" for k, _ in METRICS))
    if ns.json:
        ns.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine(), "rows": rows},
                                      indent=1))


if __name__ == "__main__":
    main()
