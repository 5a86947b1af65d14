"""The compiled training step with each tool on, against compile alone (torch.compile, inductor).

Each variant is a ``stabletrain.train`` run of the benchmark language model (benchmarks/common.py) with
``torch_compile_args.disable=false``; the time per step is taken from its metrics rows (``elapsed_s``)
over the steps after the first ``--warmup`` (which compile), and the variants are run in turn, in rotated
order, ``--rounds`` times in one process; the medians are compared with compile alone (every tool off:
guard, trend alerts, mechanism signals). ``--fsdp`` runs them under strategy=fsdp on one process.

    python benchmarks/compile_tools.py [--steps 40] [--warmup 10] [--rounds 2] [--backend inductor] [--fsdp]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import BENCH_SETTINGS, machine

import stabletrain
from stabletrain.loggers.jsonl import read_metrics

OFF: dict[str, Any] = {"guard": {"enabled": False}, "trend_alerts": {"enabled": False},
                       "debug_args": {"mechanisms": {"enabled": False}}}


def variants() -> dict[str, dict[str, Any]]:
    def on(**changes: Any) -> dict[str, Any]:
        merged = {k: dict(v) for k, v in OFF.items()}
        for k, v in changes.items():
            if k == "debug_args":
                merged["debug_args"] = {**merged["debug_args"], **v}
            else:
                merged[k] = v
        return merged

    return {
        "compile alone": on(),
        "+ guard": on(guard={"enabled": True}),
        "+ gradient_norm_per_layer": on(gradient_norm_per_layer=True),
        "+ nancapture": on(debug_args={"nancapture": {"enabled": True}}),
        "+ trend alerts": on(trend_alerts={"enabled": True}),
        "+ skip_step": on(on_instability={"policy": "skip_step"}),
        "+ signals (no probes)": on(debug_args={"mechanisms": {"enabled": True, "probes": False}}),
        "+ signals (probes: logged steps eager)": on(debug_args={"mechanisms": {"enabled": True}}),
        "defaults (guard, trend alerts, signals)": {},
    }


def step_seconds(out: Path, warmup: int) -> float:
    rows = [r for r in read_metrics(out / "metrics.jsonl")[0] if "elapsed_s" in r]
    first = next(r for r in rows if r["step"] >= warmup)
    last = rows[-1]
    return (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--fsdp", action="store_true")
    args = parser.parse_args()
    base = {**BENCH_SETTINGS, "steps": args.steps, "log_every_num_steps": args.log_every, "num_workers": 0,
            "checkpoint_every_num_steps": 10_000, "torch_compile_args": {"disable": False, "backend": args.backend},
            "accelerator": "cpu"}
    if args.fsdp:
        base.update(strategy="fsdp", devices=1)
    kinds = variants()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        names = list(kinds)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                out = Path(tmp) / f"{r}_{len(times[name])}_{abs(hash(name))}"
                stabletrain.train(out=out, **base, **kinds[name])
                times[name].append(step_seconds(out, args.warmup))
    alone = statistics.median(times["compile alone"])
    print(f"compiled step time with each tool (median of {args.rounds} runs, steps {args.warmup}-{args.steps - 1}, "
          f"log_every_num_steps={args.log_every}, backend {args.backend}{', fsdp' if args.fsdp else ''}; "
          f"loaded machine: {machine()})")
    for name, values in times.items():
        t = statistics.median(values)
        runs = ", ".join(f"{v * 1000:.0f}" for v in values)
        print(f"  {name:<42} {t * 1000:8.1f} ms/step  {t / alone:5.2f}x  ({runs})")


if __name__ == "__main__":
    main()
