"""Every tool's cost in one run: step-time ratios and host syncs, side by side, and a regression record.

One process trains a copy of the benchmark model (built-in transformer LM, 4 layers, dim 256,
batch 16, context 128; see ``common.py``) per variant, all from the same weights on the same
batches, interleaved round by round (one step of each variant per round, the order rotated), so
that load changes on a shared machine hit every variant alike:

* ``plain``: forward, backward, AdamW, ``zero_grad``; on a logged step (every 10th, as the
  trainer's default) the loss is read back.
* ``gradient_norm``: plus ``compute_grad_norm`` each step, read back with the loss on logged
  steps: the step ``stabletrain.train`` always runs. Every tool below is this plus the tool, and
  its ratio is over this loop.
* ``guard``: ``StepGuard.check_gradients`` / ``check_update`` / ``visible`` (``guard.enabled``).
* ``nancapture``: ``NaNCaptureMonitor``'s calls (``debug_args.nancapture``; one host read per step).
* ``underflow_overflow``: ``UnderflowOverflowMonitor`` forward and backward, deciding at the end
  of each (two host reads per step).
* ``trend_alerts``: ``TrendDetector.update`` on the logged steps' host values.
* ``skip_step``: ``InstabilityGuard`` (spike detector, the skip on the device) around AdamW.
* ``rollback``: ``skip_step``'s guard plus a ``RollbackSnapshots`` snapshot every 50 steps
  (``on_instability.rollback_steps``); the snapshot's cost is measured apart and added per step.
* ``mechanisms``: ``MechanismMonitor`` armed on logged steps (``debug_args.mechanisms``).
* ``accelerate``: an Accelerate loop with stabletrain's ``StepMonitor`` (gradient_norm, nancapture,
  trend alerts), over the same Accelerate loop without it (``accelerate_plain``); skipped when
  accelerate is not installed. Lightning's and HF Trainer's own loops cannot be interleaved step
  by step in one process: ``integrations_overhead.py`` measures them.
* ``all``: every tool above at once (one ``InstabilityGuard`` for skip_step and rollback).

A variant's step time is ``(9 x median unlogged + median logged) / 10`` over the rounds (a logged
step costs more in every variant); its ratio over its base keeps each round's pairing: the median
of the per-round ratios of unlogged steps and that of logged ones, weighted 9:1 by the base's time;
the spread is the quartiles of the per-round ratios of unlogged steps. Host syncs are counted on
one unlogged and one logged step of each variant with ``stabletrain.utils.sync.CountSyncs`` (CPU
AdamW's own ``.item()`` per parameter is in every variant: the added ones are what the tool costs).

The ratios are written to ``benchmarks/record.json`` with ``--record``; any later run compares
with the record and names the variants that got worse by more than the two runs' noise (2.5 times
the combined standard error of the two medians, at least 0.5%). Not a CI gate: run it before
resolving an issue that touches a tool's hot path. ``--inject NAME=0.05`` adds busy work worth
5% of a plain step to variant NAME, to see the comparison flag it.

``--ab PATH/src`` runs the same variants in two worker processes, one importing stabletrain from
``PATH/src`` (e.g. a checkout of main) and one from this tree, alternating round by round: the
same code measured side by side, before and after a change.

On a shared, loaded machine use ``--clock cpu --threads 1``: CPU time of one thread is far less
disturbed by other processes than wall time (it still is by their use of the caches).

    python benchmarks/all_tools.py [--rounds 20] [--clock wall|cpu] [--threads N] [--variants a,b]
                                   [--record] [--markdown] [--inject NAME=FRACTION] [--ab PATH/src]

On an idle machine, the one command that measures, compares with the record, updates it and
prints the table for the README: ``python benchmarks/all_tools.py --record --markdown``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_model_and_batches, machine, median  # noqa: E402

RECORD = Path(__file__).resolve().parent / "record.json"
LOG_EVERY = 10
ROLLBACK_EVERY = 50
#: Variant -> the variant its ratio is taken over.
BASES = {"plain": None, "gradient_norm": "plain", "accelerate_plain": "plain", "accelerate": "accelerate_plain"}
ALL = ["plain", "gradient_norm", "guard", "nancapture", "underflow_overflow", "trend_alerts", "skip_step",
       "rollback", "mechanisms", "accelerate_plain", "accelerate", "all"]


def base_of(name: str) -> Optional[str]:
    return BASES.get(name, "gradient_norm")


# ------------------------------------------------------------------------------ the variants


class Variant:
    """One copy of the model and its optimizer, and the tools of one variant: ``step(i)`` is one
    training step, logged when ``i % LOG_EVERY == 0``."""

    def __init__(self, name: str, model: torch.nn.Module, batches: list[Any], out: Path, accelerator: Any = None):
        from stabletrain import (
            InstabilityGuard,
            MechanismMonitor,
            NaNCaptureMonitor,
            RollbackSnapshots,
            TrendDetector,
            UnderflowOverflowMonitor,
        )
        from stabletrain.safety.guard import StepGuard

        self.name = name
        self.model = model
        self.batches = batches
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.extra: Optional[Callable[[], None]] = None  # --inject
        every = name == "all"
        on = {name} | ({"guard", "nancapture", "underflow_overflow", "trend_alerts", "skip_step", "rollback",
                        "mechanisms"} if every else set())
        self.norm = name != "plain" and name != "accelerate_plain"
        self.guard = StepGuard(model, self.optimizer) if "guard" in on else None
        self.nan = NaNCaptureMonitor(model, out_dir=out / name / "nan") if "nancapture" in on else None
        self.uo = UnderflowOverflowMonitor(model, out_dir=out / name / "uo") if "underflow_overflow" in on else None
        self.trends = TrendDetector() if "trend_alerts" in on else None
        self.skip = InstabilityGuard(self.optimizer) if on & {"skip_step", "rollback"} else None
        self.snapshots = (RollbackSnapshots(model, self.optimizer, every=ROLLBACK_EVERY, extra=(self.skip,))
                          if "rollback" in on else None)
        self.signals = (MechanismMonitor(model, self.optimizer, report=lambda notice: None)
                        if "mechanisms" in on else None)
        self.accelerator = accelerator
        self.monitor = None
        if accelerator is not None:
            from stabletrain.integrations.accelerate import StepMonitor

            self.model, self.optimizer = accelerator.prepare(model, self.optimizer)
            self.inner = accelerator.unwrap_model(self.model)
            if name == "accelerate":
                self.monitor = StepMonitor(accelerator, self.model, out_dir=out / name,
                                           debug_args={"nancapture": {"enabled": True},
                                                       "mechanisms": {"enabled": False}})

    def step(self, i: int) -> None:
        if self.accelerator is not None:
            return self._accelerate_step(i)
        logged = i % LOG_EVERY == 0
        batch = self.batches[i % len(self.batches)]
        loss = self._forward(i, batch, logged)
        loss.backward()
        gn = self._before_optimizer_step(i, loss)
        if self.extra is not None:
            self.extra()
        self.optimizer.step()
        if self.skip is not None:
            self.skip.after_step()
            self.skip.poll()
        if self.guard is not None:
            self.guard.check_update(i)
        self.optimizer.zero_grad(set_to_none=True)
        if self.guard is not None:
            self.guard.visible()
        if logged:
            self._log(i, loss, gn)

    def _forward(self, i: int, batch: Any, logged: bool) -> torch.Tensor:
        if self.snapshots is not None:
            self.snapshots.maybe_take(i)
        if self.uo is not None:
            self.uo.set_step(i)
        if self.nan is not None:
            self.nan.begin_step(i)
            self.nan.collect_batch(batch)
        if self.signals is not None:
            self.signals.begin_step(log=logged, probe=False)
            with self.signals.probing():
                loss = self.model.training_step(batch)
        else:
            loss = self.model.training_step(batch)
        if self.nan is not None:
            self.nan.collect_loss(loss)
        return loss

    def _before_optimizer_step(self, i: int, loss: torch.Tensor) -> Any:
        if not self.norm:
            return None
        from stabletrain import compute_grad_norm

        gn = compute_grad_norm(self.model.named_parameters())
        if self.nan is not None:
            self.nan.check_and_capture(gn)
        if self.guard is not None:
            self.guard.check_gradients(i, gn.total, [loss.detach()])
            self.guard.visible()
        if self.skip is not None:
            self.skip.check(i, loss, gn.total)
        return gn

    def _log(self, i: int, loss: torch.Tensor, gn: Any) -> None:
        values = [loss.detach().reshape(1)] + ([gn.total.reshape(1)] if gn is not None else [])
        if self.signals is not None:
            self.signals.after_step()
            values += [v.reshape(1).to(loss.device) for v in self.signals.device_values().values()]
        host = torch.cat([v.float() for v in values]).tolist()  # the logged step's one read
        if self.trends is not None:
            self.trends.update(i, {"loss": host[0], "gradient_norm": host[1]})

    def _accelerate_step(self, i: int) -> None:
        batch = self.batches[i % len(self.batches)]
        monitor = self.monitor
        if monitor is not None:
            monitor.begin_step(i)
            monitor.collect_batch(batch)
        loss = self.inner.training_step(batch)
        if monitor is not None:
            monitor.collect_loss(loss)
        self.accelerator.backward(loss)
        if monitor is not None:
            monitor.check(self.optimizer, read=i % LOG_EVERY == 0)
        if self.extra is not None:
            self.extra()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.end_step()
        elif i % LOG_EVERY == 0:
            loss.detach().reshape(1).tolist()

    def snapshot_seconds(self, clock: Callable[[], float], n: int = 5) -> float:
        """Median seconds of one rollback snapshot (model, AdamW state, RNG to the CPU)."""
        assert self.snapshots is not None
        times = []
        for k in range(n):
            start = clock()
            self.snapshots.take(10_000 + k)
            times.append(clock() - start)
        return median(times)


def build(names: list[str], out: Path) -> dict[str, Variant]:
    base, batches = bench_model_and_batches(num_batches=4)
    accelerator = None
    if any(n.startswith("accelerate") for n in names):
        try:
            from accelerate import Accelerator
        except ImportError:
            print("accelerate is not installed (pip install -e '.[accelerate]'): skipping the accelerate variants")
            names = [n for n in names if not n.startswith("accelerate")]
        else:
            accelerator = Accelerator(cpu=True)  # one Accelerator prepares every copy
    return {n: Variant(n, copy.deepcopy(base), batches, out,
                       accelerator if n.startswith("accelerate") else None) for n in names}


def busy_work(seconds: float) -> Callable[[], None]:
    """A function that does about ``seconds`` of real tensor work (calibrated here)."""
    a = torch.randn(256, 256)
    start = time.process_time()
    n = 0
    while time.process_time() - start < 0.2:
        a @ a
        n += 1
    per = (time.process_time() - start) / n
    reps = max(1, round(seconds / per))

    def work() -> None:
        for _ in range(reps):
            a @ a

    return work


# ------------------------------------------------------------------------------ measuring


def clock_of(kind: str) -> Callable[[], float]:
    return time.process_time if kind == "cpu" else time.perf_counter


def count_syncs(variants: dict[str, Variant], start: int) -> dict[str, tuple[int, int]]:
    """Host syncs of one unlogged and one logged step of each variant."""
    from stabletrain.utils.sync import CountSyncs

    out = {}
    logged = start + (-start) % LOG_EVERY
    unlogged = logged + 1
    for name, v in variants.items():
        counts = []
        for i in (unlogged, logged):
            with CountSyncs() as syncs:
                v.step(i)
            counts.append(syncs.count)
        out[name] = (counts[0], counts[1])
    return out


class Rounds:
    """Per-round step times of each variant, one step each per round, order rotated."""

    def __init__(self, variants: dict[str, Variant], clock: Callable[[], float]):
        self.variants, self.clock = variants, clock
        self.i = 0
        self.times: dict[str, list[float]] = {n: [] for n in variants}
        self.logged: list[bool] = []

    def run(self, warmup: bool = False) -> dict[str, float]:
        names = list(self.variants)
        k = self.i % len(names)
        got = {}
        for name in names[k:] + names[:k]:
            start = self.clock()
            self.variants[name].step(self.i)
            got[name] = self.clock() - start
        if not warmup:
            for name, t in got.items():
                self.times[name].append(t)
            self.logged.append(self.i % LOG_EVERY == 0)
        self.i += 1
        return got


def summarise(times: dict[str, list[float]], logged: list[bool], extra_s: dict[str, float]) -> dict[str, dict]:
    """Per variant: expected step seconds, ratio over its base, quartiles and standard error.

    The ratio keeps each round's pairing (the load of a round cancels): the median of per-round
    ratios over unlogged steps and over logged ones, weighted by the base's time in each (9:1),
    plus ``extra_s`` (seconds per step measured apart, e.g. a snapshot every 50 steps)."""
    def split(ts: list[float]) -> tuple[list[float], list[float]]:
        return [t for t, lg in zip(ts, logged) if not lg], [t for t, lg in zip(ts, logged) if lg]

    def expected(ts: list[float]) -> float:
        u, lg = split(ts)
        return median(u) if not lg else ((LOG_EVERY - 1) * median(u) + median(lg)) / LOG_EVERY

    step = {n: expected(ts) + extra_s.get(n, 0.0) for n, ts in times.items()}
    out: dict[str, dict] = {}
    for name, ts in times.items():
        base = base_of(name)
        row: dict[str, Any] = {"ms": step[name] * 1e3, "base": base}
        if base is not None and base in times:
            per = [t / b for t, b in zip(ts, times[base])]
            per_u, per_l = split(per)
            base_u, base_l = split(times[base])
            if per_l:
                w_u, w_l = (LOG_EVERY - 1) * median(base_u), median(base_l)
                ratio = (w_u * median(per_u) + w_l * median(per_l)) / (w_u + w_l)
                base_step = (w_u + w_l) / LOG_EVERY
            else:
                ratio, base_step = median(per_u), median(base_u)
            ratio += (extra_s.get(name, 0.0) - extra_s.get(base, 0.0)) / base_step
            q = sorted(per_u)
            q1, q3 = q[len(q) // 4], q[(3 * len(q)) // 4]
            row.update(ratio=ratio, q1=q1, q3=q3, se=0.93 * (q3 - q1) / math.sqrt(max(1, len(q))))
        out[name] = row
    return out


# ------------------------------------------------------------------------------ printing, record


def print_table(rows: dict[str, dict], syncs: dict[str, tuple[int, int]], notes: dict[str, str]) -> None:
    print(f"{'variant':<20}{'ms/step':>9}{'ratio':>8}  {'quartiles':<13}{'over':<16}"
          f"{'+syncs/step':>12}{'+syncs logged':>15}")
    for name, row in rows.items():
        base = row["base"]
        if "ratio" in row:
            ratio, q = f"{row['ratio']:.3f}x", f"{row['q1']:.3f}-{row['q3']:.3f}"
        else:
            ratio, q = "1", ""
        s = syncs.get(name)
        b = syncs.get(base) if base else None
        added = ((f"{s[0] - b[0]:+d}", f"{s[1] - b[1]:+d}") if s and b
                 else (f"({s[0]})", f"({s[1]})") if s else ("", ""))
        print(f"{name:<20}{row['ms']:>9.1f}{ratio:>8}  {q:<13}{base or '':<16}{added[0]:>12}{added[1]:>15}"
              f"{'  ' + notes[name] if name in notes else ''}")


WHAT = {
    "plain": "plain loop: forward, backward, AdamW",
    "gradient_norm": "gradient_norm (always on in the trainer)",
    "guard": "guard (`guard.enabled`, on by default)",
    "nancapture": "nancapture (`debug_args.nancapture`)",
    "underflow_overflow": "underflow_overflow, forward and backward (`debug_args.underflow_overflow`)",
    "trend_alerts": "trend alerts (`trend_alerts`, on by default)",
    "skip_step": "skip_step (`on_instability.policy=skip_step`)",
    "rollback": "rollback (`on_instability.policy=rollback`), snapshot every 50 steps included",
    "mechanisms": "mechanism signals (`debug_args.mechanisms`, on by default)",
    "accelerate_plain": "an Accelerate loop",
    "accelerate": "Accelerate with `StepMonitor` (gradient_norm, nancapture, trend alerts)",
    "all": "all of the above together (not Accelerate)",
}


def print_markdown(rows: dict[str, dict], syncs: dict[str, tuple[int, int]], meta: dict[str, Any]) -> None:
    """The table as Markdown, for the README and docs/benchmarks.md."""
    print(f"\n{meta['date']}, {meta['machine']}, {meta['clock']} clock, {meta['rounds']} rounds; {meta['model']}\n")
    print("| tool | step time, median ratio (quartiles) | over | host syncs added per step (logged step) |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        if "ratio" not in row:
            continue
        s, b = syncs.get(name), syncs.get(row["base"])
        added = f"{s[0] - b[0]:+d} ({s[1] - b[1]:+d})" if s and b else ""
        print(f"| {WHAT.get(name, name)} | **{row['ratio']:.3f}x** ({row['q1']:.3f}-{row['q3']:.3f}) | "
              f"{row['base']} | {added} |")


def compare(rows: dict[str, dict], meta: dict[str, Any], path: Path) -> None:
    """Name the variants whose ratio got worse than recorded by more than the noise."""
    if not path.exists():
        print(f"\nno record at {path} yet (--record writes one)")
        return
    rec = json.loads(path.read_text())
    same = {k: (rec.get(k), meta[k]) for k in ("clock", "threads", "model") if rec.get(k) != meta[k]}
    print(f"\ncompared with the record of {rec.get('date')} ({rec.get('machine')}; clock {rec.get('clock')}, "
          f"{rec.get('threads')} thread(s), {rec.get('rounds')} rounds):")
    if same:
        print("  not like for like, differences: "
              + ", ".join(f"{k} recorded {a} now {b}" for k, (a, b) in same.items()))
    worse = []
    for name, row in rows.items():
        old = rec.get("variants", {}).get(name)
        if "ratio" not in row or not old or "ratio" not in old:
            continue
        diff = row["ratio"] - old["ratio"]
        noise = max(0.005, 2.5 * math.sqrt(row["se"] ** 2 + old.get("se", 0.0) ** 2))
        verdict = "WORSE" if diff > noise else "better" if diff < -noise else "same within noise"
        if verdict == "WORSE":
            worse.append(name)
        print(f"  {name:<20} recorded {old['ratio']:.3f}x, now {row['ratio']:.3f}x ({diff:+.3f}, noise "
              f"{noise:.3f}): {verdict}")
    print(f"  worse than recorded: {', '.join(worse) if worse else 'none'}")


def write_record(rows: dict[str, dict], syncs: dict[str, tuple[int, int]], meta: dict[str, Any], path: Path) -> None:
    variants = {}
    for name, row in rows.items():
        entry = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
        s, b = syncs.get(name), syncs.get(row["base"]) if row["base"] else None
        if s and b:
            entry["added_syncs"] = [s[0] - b[0], s[1] - b[1]]
        variants[name] = entry
    path.write_text(json.dumps({**meta, "variants": variants}, indent=1) + "\n")
    print(f"\nrecorded: {path}")


# ------------------------------------------------------------------------------ A/B


def worker(names: list[str], clock: str, threads: Optional[int]) -> None:
    """Serve rounds on stdin/stdout for ``--ab``: ``round`` -> one step of each variant (JSON)."""
    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        variants = build(names, Path(tmp))
        rounds = Rounds(variants, clock_of(clock))
        import stabletrain

        print(json.dumps({"ready": str(Path(stabletrain.__file__).parent), "names": list(variants)}), flush=True)
        for line in sys.stdin:
            if line.strip() != "round":
                break
            print(json.dumps(rounds.run(warmup=True)), flush=True)


def ab(other_src: str, names: list[str], rounds: int, clock: str, threads: Optional[int]) -> None:
    here = str(Path(__file__).resolve().parents[1] / "src")
    procs = {}
    for label, src in (("A", str(Path(other_src).resolve())), ("B", here)):
        env = {**os.environ, "PYTHONPATH": src}
        cmd = [sys.executable, __file__, "--worker", "--variants", ",".join(names), "--clock", clock]
        if threads:
            cmd += ["--threads", str(threads)]
        procs[label] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    ready = {label: json.loads(p.stdout.readline()) for label, p in procs.items()}  # type: ignore[union-attr]
    for label, info in ready.items():
        print(f"{label}: stabletrain from {info['ready']}")
    names = ready["A"]["names"]
    times: dict[str, dict[str, list[float]]] = {label: {n: [] for n in names} for label in procs}
    logged: list[bool] = []
    for r in range(rounds + 1):
        for label in (("A", "B") if r % 2 else ("B", "A")):
            p = procs[label]
            p.stdin.write("round\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
            got = json.loads(p.stdout.readline())  # type: ignore[union-attr]
            if r:
                for n, t in got.items():
                    times[label][n].append(t)
        if r:
            logged.append(r % LOG_EVERY == 0)
    for p in procs.values():
        p.stdin.close()  # type: ignore[union-attr]
        p.wait()
    summary = {label: summarise(times[label], logged, {}) for label in procs}
    print(f"\nA/B, {rounds} rounds alternating A and B, {clock} clock; "
          f"A = {ready['A']['ready']}, B = {ready['B']['ready']}")
    print(f"{'variant':<20}{'A ratio':>9}{'B ratio':>9}{'B/A step':>10}  (ratios over each one's base; "
          "B/A: the variant's step time in B over A, per round, median)")
    for n in names:
        a, b = summary["A"][n], summary["B"][n]
        per = [tb / ta for tb, ta in zip(times["B"][n], times["A"][n])]
        ra = f"{a['ratio']:.3f}x" if "ratio" in a else "1"
        rb = f"{b['ratio']:.3f}x" if "ratio" in b else "1"
        print(f"{n:<20}{ra:>9}{rb:>9}{median(per):>9.3f}x")


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (one step of each variant each)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--variants", default=",".join(ALL), help=f"comma-separated, of {','.join(ALL)}")
    parser.add_argument("--record", action="store_true", help=f"write the ratios to {RECORD.name}")
    parser.add_argument("--record-file", type=Path, default=RECORD)
    parser.add_argument("--inject", action="append", default=[], metavar="NAME=FRACTION",
                        help="add busy work worth FRACTION of a plain step to variant NAME (to test the comparison)")
    parser.add_argument("--ab", default=None, metavar="PATH/src", help="A/B against the stabletrain in PATH/src")
    parser.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    names = [n for n in ns.variants.split(",") if n]
    unknown = [n for n in names if n not in ALL]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; available: {', '.join(ALL)}")
    for n in list(names):  # a ratio needs its base
        b = base_of(n)
        while b is not None and b not in names:
            names.insert(0, b)
            b = base_of(b)
    names = [n for n in ALL if n in names]
    if ns.worker:
        return worker(names, ns.clock, ns.threads)
    if ns.ab:
        return ab(ns.ab, names, ns.rounds, ns.clock, ns.threads)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    clock = clock_of(ns.clock)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        variants = build(names, Path(tmp))
        rounds = Rounds(variants, clock)
        for _ in range(2):
            rounds.run(warmup=True)
        for spec in ns.inject:
            name, _, fraction = spec.partition("=")
            plain = median([rounds.run(warmup=True)["plain"] for _ in range(3)])
            variants[name].extra = busy_work(float(fraction) * plain)
            print(f"injected: busy work of about {float(fraction) * plain * 1e3:.0f} ms per step into {name}")
        syncs = count_syncs(variants, start=rounds.i)
        rounds.i += 2 * LOG_EVERY
        rounds.i += (-rounds.i) % LOG_EVERY  # the first timed round is a logged one
        for _ in range(ns.rounds):
            rounds.run()
        extra = {}
        notes = {}
        if "rollback" in variants:
            snap = variants["rollback"].snapshot_seconds(clock)
            extra["rollback"] = snap / ROLLBACK_EVERY
            notes["rollback"] = (f"snapshot {snap * 1e3:.1f} ms every {ROLLBACK_EVERY} steps "
                                 f"({variants['rollback'].snapshots.nbytes / 2**20:.1f} MB), included")
        if "all" in variants:
            snap = variants["all"].snapshot_seconds(clock)
            extra["all"] = snap / ROLLBACK_EVERY
    rows = summarise(rounds.times, rounds.logged, extra)
    n_params = sum(p.numel() for p in variants["plain"].model.parameters())
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(), "clock": ns.clock,
            "threads": torch.get_num_threads(), "rounds": ns.rounds,
            "model": f"benchmark LM ({n_params / 1e6:.1f}M parameters, batch 16, context 128)"}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{meta['date']}, {meta['machine']}, {ns.clock} clock, load average {load:.1f} at the end "
          f"({os.cpu_count()} CPUs); {meta['model']}, AdamW; {ns.rounds} rounds, one step of each variant per "
          f"round, interleaved; every {LOG_EVERY}th step logged; took {time.time() - started:.0f} s")
    print_table(rows, syncs, notes)
    if ns.markdown:
        print_markdown(rows, syncs, meta)
    compare(rows, meta, ns.record_file)
    if ns.record:
        if ns.inject:
            print("not recorded: --inject was given")
        else:
            write_record(rows, syncs, meta, ns.record_file)


if __name__ == "__main__":
    main()
