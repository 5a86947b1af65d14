"""on_instability: does recovery work, what does it cost when nothing happens, does it detect.

Three parts, on a small built-in language model (1 layer, dim 64, 4 heads, context 32,
batch 16, lr 3e-3, 300 steps by default: the default 500-step LM takes ~3 minutes a run on 2
shared CPU cores, too long for 4 policies x 3 seeds):

* ``recovery``: faults injected into the LM: a NaN-poisoned sample (the embedding output of
  its microbatch turns NaN) in the batches of steps 100 and 200 (it comes back when its
  epoch does), and a transient lr spike x100 for 5 steps at step 150 (once: a re-run of those
  steps after a rollback gets the normal lr). Per seed: a clean run, and the faulty run with
  ``stop``, ``skip_step`` and ``rollback``, and ``skip_nan``: ``skip_step`` with the NaN samples
  only (no lr spike): steps done, recoveries, and the final loss (the
  mean over the last 20 steps, a single batch's loss being noisy), side by side. Goal: skip
  and rollback finish within 2% of the clean run averaged over 3 seeds; stop ends at the
  first fault.
* ``cost``: step time with ``skip_step`` on and off, two copies of the default built-in LM
  (2 layers, dim 128, context 64, batch 32) in one process,
  interleaved round by round (the detector, the save and the restore of params and AdamW
  state around ``optimizer.step()``); host syncs per step of ``stabletrain.train`` with the
  policy on and off; a rollback snapshot's time and size.
* ``detection``: recoveries in clean runs (false alarms, goal 0) and planted faults not
  recovered in the faulty ones (misses, goal 0).

    python benchmarks/self_healing.py [--steps 300] [--seeds 3] [--parts recovery,cost,detection]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleaved, machine, median  # noqa: E402

import stabletrain  # noqa: E402
from stabletrain.data.loader import ResumableBatchSampler  # noqa: E402

MODEL_ARGS = {"n_layers": 1, "n_heads": 4, "dim": 64, "context_length": 32, "lr": 3e-3, "warmup_steps": 20}
BATCH = 16


class Faults:
    """The injected faults, as a trainer callback: NaN-poisoned samples and one lr spike."""

    def __init__(self, poisoned: set[int], lr_spike_at: int | None):
        self.poisoned, self.lr_spike_at = poisoned, lr_spike_at
        self._spiked: set[int] = set()
        self._hook: Any = None
        self._poison_now = False

    def on_train_start(self, trainer: Any) -> None:
        def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
            return output * float("nan") if self._poison_now else output

        self._hook = trainer.model.tok_emb.register_forward_hook(hook)

    def on_microbatch(self, trainer: Any, *, step: int, micro_step: int, batch: Any, indices: Any) -> None:
        self._poison_now = any(int(i) in self.poisoned for i in indices)

    def on_before_optimizer_step(self, trainer: Any, *, step: int) -> None:
        at = self.lr_spike_at
        if at is not None and at <= step < at + 5 and step not in self._spiked:
            self._spiked.add(step)  # transient: a re-run of this step gets the normal lr
            for group in trainer.optimizer.param_groups:
                group["lr"] *= 100

    def on_train_end(self, trainer: Any) -> None:
        if self._hook is not None:
            self._hook.remove()


def _dataset_size(seed: int) -> int:
    from stabletrain.config import load_settings
    from stabletrain.tasks import build_task

    return len(build_task(load_settings(_settings("unused", seed, 10))).dataset)


def _settings(out: Any, seed: int, steps: int, **more: Any) -> dict[str, Any]:
    return {"out": out, "seed": seed, "steps": steps, "batch_size": BATCH, "model_args": MODEL_ARGS,
            "num_workers": 0, "log_every_num_steps": 1, "checkpoint_every_num_steps": 10_000,
            "overwrite": True, "trend_alerts": {"enabled": False},
            "loggers": {"tensorboard": {"enabled": False}}, **more}


def _run(folder: Path, name: str, seed: int, steps: int, policy: str, faults: Faults | None) -> dict[str, Any]:
    out = folder / f"{name}_{seed}"
    error = None
    start = time.perf_counter()
    try:
        stabletrain.train(**_settings(out, seed, steps, on_instability={"policy": policy, "diagnose": False},
                                      callbacks=[faults] if faults else []))
    except stabletrain.StabletrainError as exc:
        error = type(exc).__name__
    from stabletrain.runfiles.history import read_run

    history = read_run(out / "metrics.jsonl")
    losses = [r["loss"] for r in history.rows if math.isfinite(r["loss"])]  # skipped NaN steps are logged too
    recoveries = [e for e in history.events if e.get("event") == "recovery"]
    return {"steps": len(history.rows), "final": statistics.fmean(losses[-20:]), "recoveries": recoveries,
            "error": error, "seconds": time.perf_counter() - start}


def recovery(folder: Path, steps: int, seeds: int) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in ("clean", "stop", "skip_step", "rollback", "skip_nan")}
    planted_steps = [steps // 3, 2 * steps // 3]
    for seed in range(seeds):
        sampler = ResumableBatchSampler(_dataset_size(seed), BATCH, seed)
        poisoned = {sampler.epoch_batches(0)[s][0] for s in planted_steps}
        spike = steps // 2
        rows["clean"].append(_run(folder, "clean", seed, steps, "skip_step", None))
        for policy in ("stop", "skip_step", "rollback"):
            rows[policy].append(_run(folder, policy, seed, steps, policy, Faults(poisoned, spike)))
        # skip_step cannot undo an update it let through (the lr spike's): the NaN samples alone.
        rows["skip_nan"].append(_run(folder, "skip_nan", seed, steps, "skip_step", Faults(poisoned, None)))
    print(f"\nRecovery: LM {MODEL_ARGS}, batch {BATCH}, {steps} steps; NaN sample at steps {planted_steps}, "
          f"lr x100 for 5 steps at {steps // 2}")
    print(f"{'run':10s} {'seed':>4s} {'steps':>6s} {'recoveries':>10s} {'final loss':>10s} {'vs clean':>9s}  end")
    summary = {}
    for name, runs in rows.items():
        for seed, r in enumerate(runs):
            rel = r["final"] / rows["clean"][seed]["final"]
            print(f"{name:10s} {seed:4d} {r['steps']:6d} {len(r['recoveries']):10d} {r['final']:10.4f} "
                  f"{rel:9.4f}  {r['error'] or 'completed'}  "
                  + " ".join(f"{e['step']}:{e['trigger']}" for e in r["recoveries"]))
        mean_rel = statistics.fmean(r["final"] / c["final"] for r, c in zip(runs, rows["clean"]))
        summary[name] = {"mean_final_vs_clean": mean_rel, "completed": sum(r["error"] is None for r in runs),
                         "steps": [r["steps"] for r in runs], "recoveries": [len(r["recoveries"]) for r in runs]}
        done = f"{summary[name]['completed']}/{len(runs)} completed"
        print(f"{name:10s} mean final loss / clean: {mean_rel:.4f} ({done})")
    summary["_runs"] = rows
    return summary


def cost(rounds: int, clock: Any = time.perf_counter) -> dict[str, Any]:
    from torch.utils.data import default_collate

    from stabletrain.config import load_settings
    from stabletrain.debug.grad_norm import compute_grad_norm
    from stabletrain.safety.instability_guard import InstabilityGuard
    from stabletrain.tasks import build_task
    from stabletrain.utils.sync import CountSyncs

    # The default built-in LM (2 layers, dim 128, context 64, batch 32): the run the goal is about.
    task = build_task(load_settings({"out": "unused"}))
    bs = 32
    batches = [default_collate([task.dataset[i * bs + j] for j in range(bs)]) for i in range(8)]
    models = {n: copy.deepcopy(task.model) for n in ("off", "skip_step")}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-3) for n, m in models.items()}
    guard = InstabilityGuard(opts["skip_step"])
    count = {"n": 0}

    def step(name: str) -> None:
        model, opt = models[name], opts[name]
        batch = batches[count["n"] % len(batches)]
        count["n"] += 1
        loss = model.training_step(batch)
        loss.backward()
        gn = compute_grad_norm(model.named_parameters())
        if name == "skip_step":
            guard.check(count["n"], loss, gn.total)
            opt.step()
            guard.after_step()
            guard.poll()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    times = interleaved({n: (lambda n=n: step(n)) for n in models}, repeats=5, rounds=rounds, clock=clock)
    ratios = [a / b for a, b in zip(times["skip_step"], times["off"])]
    with CountSyncs() as syncs:
        for _ in range(5):
            step("skip_step")
    with CountSyncs() as plain:
        for _ in range(5):
            step("off")
    added = (syncs.count - plain.count) / 5
    # The guard's own calls, without the noise of the step: the guarded optimizer step (check, the
    # skip-aware or copying step, undo, poll) against torch's own step of the same optimizer,
    # alternating, gradients present; on the clock of the side-by-side (CPU time with 2 or more torch
    # threads also counts their spin-waits between the small ops: use --clock cpu with --threads 1).
    model = models["skip_step"]
    opt = opts["skip_step"]
    loss = model.training_step(batches[0])
    loss.backward()
    gn = compute_grad_norm(model.named_parameters()).total
    guarded, plain = [], []
    for i in range(60):
        t0 = clock()
        guard.check(i, loss, gn)
        opt.step()
        guard.after_step()
        guard.poll()
        t1 = clock()
        opt.step()
        t2 = clock()
        if i >= 10:
            guarded.append(t1 - t0)
            plain.append(t2 - t1)
    own_ms = (median(guarded) - median(plain)) * 1e3
    mode = guard.skipper.mode if guard.skipper is not None else None
    saved_mb = guard.skipper.saved_bytes / 2**20 if guard.skipper is not None else 0.0
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\nCost when nothing happens ({n_params:,} parameters, {rounds} rounds of 5 steps, AdamW)")
    print(f"step time off {median(times['off']) * 1e3:.1f} ms, skip_step {median(times['skip_step']) * 1e3:.1f} ms: "
          f"median ratio {median(ratios):.3f}x; the guard's own calls {own_ms:.2f} ms/step "
          f"({own_ms / (median(times['off']) * 1e3) * 100:.2f}% of a step; the step taken: {mode}, "
          f"{saved_mb:.1f} MB held for it); added host syncs per step in the loop: {added:g}")
    trainer_syncs = _trainer_syncs()
    snap = _snapshot_cost()
    return {"ratio": median(ratios), "off_ms": median(times["off"]) * 1e3,
            "skip_ms": median(times["skip_step"]) * 1e3, "own_ms": own_ms, "mode": mode, "saved_mb": saved_mb,
            "loop_added_syncs": added,
            "trainer_syncs": trainer_syncs, "snapshot": snap, "params": n_params}


def _trainer_syncs() -> dict[str, Any]:
    from stabletrain.utils.sync import SyncsPerStep

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("stop", "skip_step", "rollback"):
            counter = SyncsPerStep()
            stabletrain.train(**_settings(Path(tmp) / policy, 0, 30, log_every_num_steps=10,
                                          on_instability={"policy": policy, "rollback_steps": 50},
                                          callbacks=[counter]))
            unlogged = [c for s, c in counter.counts.items() if s % 10 and s not in (0, 29)]
            out[policy] = {"unlogged_max": max(unlogged), "logged": counter.counts[10]}
    print("host syncs per stabletrain.train step (not logged / logged): "
          + ", ".join(f"{p} {v['unlogged_max']}/{v['logged']}" for p, v in out.items()))
    return out


def _snapshot_cost() -> dict[str, float]:
    from stabletrain.safety.healing import snapshot_bytes

    sizes: dict[str, float] = {}

    class Probe:
        def on_train_end(self, trainer: Any) -> None:
            n = 20
            t0 = time.perf_counter()
            for _ in range(n):
                state = trainer.checkpoint_state(on_cpu=True)
            sizes["ms"] = (time.perf_counter() - t0) / n * 1e3
            sizes["mb"] = snapshot_bytes(state) / 2**20
            params = sum(p.numel() for p in trainer.model.parameters())
            sizes["bytes_per_param"] = snapshot_bytes(state) / params

    with tempfile.TemporaryDirectory() as tmp:
        stabletrain.train(**_settings(Path(tmp) / "snap", 0, 3, callbacks=[Probe()]))
    print(f"rollback snapshot: {sizes['ms']:.1f} ms, {sizes['mb']:.2f} MB ({sizes['bytes_per_param']:.1f} bytes "
          "per parameter: weights, AdamW moments, RNG, data position)")
    return sizes


def detection(folder: Path, steps: int, seeds: int, faulty: dict[str, Any] | None) -> dict[str, Any]:
    false_alarms = []
    for seed in range(seeds):
        r = _run(folder, "clean_detect", seed, steps, "skip_step", None)
        false_alarms.append(len(r["recoveries"]))
    misses = None
    if faulty is not None:
        # Planted NaN steps not recovered by skip_step (NaN samples only), and lr spikes whose
        # damage rollback did not catch within the 5 spiked steps and the one after.
        misses = []
        planted = [steps // 3, 2 * steps // 3]
        for r, rb in zip(faulty["_runs"]["skip_nan"], faulty["_runs"]["rollback"]):
            got = {e["step"] for e in r["recoveries"] if e["trigger"] == "nonfinite_loss"}
            spike = steps // 2
            caught = any(spike <= e["step"] <= spike + 5 and e["trigger"] != "nonfinite_loss" for e in rb["recoveries"])
            misses.append(sum(s not in got for s in planted) + (not caught))
    print(f"\nDetection (defaults: window 50, zscore 6, warmup 20, max_ratio 10): false alarms in {seeds} clean "
          f"runs of {steps} steps: {false_alarms}; missed faults per seed (2 NaN samples, 1 lr spike): {misses}")
    return {"false_alarms": false_alarms, "misses": misses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--parts", default="recovery,cost,detection")
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cost: wall or CPU time")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    print(f"self-healing benchmark, {time.strftime('%Y-%m-%d')}, {machine()}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if "recovery" in parts:
            results["recovery"] = recovery(folder, args.steps, args.seeds)
        if "cost" in parts:
            results["cost"] = cost(args.rounds, time.process_time if args.clock == "cpu" else time.perf_counter)
        if "detection" in parts:
            results["detection"] = detection(folder, args.steps, args.seeds, results.get("recovery"))
    if args.json:
        results.get("recovery", {}).pop("_runs", None)
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
