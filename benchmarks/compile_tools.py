"""The compiled training step with each tool on, against compile alone (torch.compile, inductor).

Each variant is a ``stabletrain.train`` run of the benchmark language model (benchmarks/common.py) with
``torch_compile_args.disable=false``. Interleaved step by step in one process (as trainer_overhead.py):
at the start of each of its steps a callback runs one step of a reference loop (the same model compiled
alone, AdamW, no tool, one fixed batch, compiled once for the whole process) and times it; the variant's
step is the time between the end of that reference step and the next one. Adjacent steps see the same
machine, so the per-step ratio variant / reference cancels most noise; a tool's cost is its variant's
median ratio over the "compile alone" variant's (every tool off: guard, trend alerts, mechanism signals).
The steps before ``--warmup`` (which compile) are left out. ``--fsdp``: under strategy=fsdp on one process.

    OMP_NUM_THREADS=1 python benchmarks/compile_tools.py [--steps 40] [--warmup 8] [--backend inductor] [--fsdp]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import BENCH_SETTINGS, bench_model_and_batches, machine

import stabletrain

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


class Reference:
    """The benchmark model compiled alone with AdamW, stepped on one fixed batch."""

    def __init__(self, backend: str):
        import torch

        model, batches = bench_model_and_batches(num_batches=1)
        self.step_fn = torch.compile(model.training_step, backend=backend)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.batch = batches[0]

    def step(self) -> None:
        self.step_fn(self.batch).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class Interleave:
    """stabletrain callback: one reference step before each stabletrain step, both timed."""

    def __init__(self, reference: Reference, skip: int):
        self.reference, self.skip = reference, skip
        self.ratios: list[float] = []
        self._ref: float = 0.0
        self._end: float | None = None

    def on_step_start(self, trainer: Any, *, step: int) -> None:
        now = time.perf_counter()
        if self._end is not None and step > self.skip:
            self.ratios.append((now - self._end) / self._ref)
        t0 = time.perf_counter()
        self.reference.step()
        self._end = time.perf_counter()
        self._ref = self._end - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
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
    reference = Reference(args.backend)
    for _ in range(args.warmup):  # its compile, before any variant's
        reference.step()
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, kind) in enumerate(kinds.items()):
            inter = Interleave(reference, skip=args.warmup)
            stabletrain.train(out=Path(tmp) / str(i), callbacks=[inter], **base, **kind)
            ratios[name] = inter.ratios
    alone = statistics.median(ratios["compile alone"])
    print(f"compiled step with each tool against compile alone ({args.backend}{', fsdp' if args.fsdp else ''}; "
          f"steps {args.warmup + 1}-{args.steps - 1} of each run, each timed against the reference step run just "
          f"before it; log_every_num_steps={args.log_every}; {machine()})")
    for name, values in ratios.items():
        q = statistics.quantiles(values, n=4)
        print(f"  {name:<42} {statistics.median(values) / alone:5.2f}x  (per-step ratio to the reference: median "
              f"{statistics.median(values):.2f}, quartiles {q[0]:.2f}-{q[2]:.2f})")


if __name__ == "__main__":
    main()
