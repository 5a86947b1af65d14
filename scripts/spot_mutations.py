"""Plant named mutations one at a time and check that the fast test layer catches each.

A mutation is a one-line change to the code that a test was written to catch (a regression that
happened, or the heart of a promise). For each, the script applies it, runs the named test files
with the default (fast) layer, restores the file, and reports whether a test failed:

    python scripts/spot_mutations.py            # all
    python scripts/spot_mutations.py clip_clamp # one, by name
    python scripts/spot_mutations.py --list

Exit status 1 when a mutation survives. It is a spot check of chosen mutations, not a mutation
score; the file is restored even when the run is interrupted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "stabletrain"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # under src/stabletrain
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # test files or node ids, run with the fast layer's options
    why: str


MUTATIONS = [
    Mutation(
        "clip_clamp", "debug/grad_norm.py",
        "coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)", "coef = max_norm / (total_norm + 1e-6)",
        ("tests/debug/test_grad_norm.py",),
        "clipping scales gradients up when their norm is below the clip value",
    ),
    Mutation(
        "innermost_backward_culprit", "debug/underflow_overflow/attribution.py",
        'consumer = innermost(site.roles, "input")', 'consumer = outermost(site.roles, "input")',
        ("tests/debug/test_underflow_overflow.py", "tests/debug/test_attribution_regressions.py"),
        "a non-finite gradient is blamed on the outermost module that took the tensor, not the one that made it",
    ),
    Mutation(
        "two_culprit_samples", "debug/diagnose/search.py",
        "MAX_CULPRIT_SETS = 3", "MAX_CULPRIT_SETS = 1",
        ("tests/debug/test_diagnose.py", "tests/debug/diagnose/test_diagnose_search.py"),
        "diagnose stops after the first culprit sample when two samples are bad",
    ),
    Mutation(
        "training_warmup", "training/optim.py",
        "return (step + 1) / args.warmup_steps", "return 1.0",
        ("tests/training/test_loop.py",),
        "the lr warmup is skipped (training/)",
    ),
    Mutation(
        "safety_skip_step_moments", "safety/skip_step.py",
        "for t in optimizer_tensors(self.optimizer):",
        'for t in [p for g in self.optimizer.param_groups for p in g["params"]]:',
        ("tests/safety/test_self_healing.py",),
        "a skipped step restores the parameters but not the optimizer state (safety/)",
    ),
    Mutation(
        "runfiles_rotation_keeps_healthy", "runfiles/checkpoint.py",
        "if path != protect:", "if True:",
        ("tests/runfiles/test_checkpoint.py", "tests/safety/test_checkpoint_health.py"),
        "rotation deletes the newest healthy checkpoint (runfiles/)",
    ),
    Mutation(
        "guard_optimizer_state_check", "safety/guard.py",
        "flags[4] = ~torch.isfinite(finite_norms(state, self.device))", "pass",
        ("tests/safety/test_optimizer_state_overflow.py",),
        "the guard no longer checks the optimizer state after the step (an Inf exp_avg_sq with finite weights)",
    ),
    Mutation(
        "checkpoint_optimizer_state", "safety/checkpoint_health.py",
        'optimizer = finite_norms(_floating((state.get("optimizer") or {}).get("state", {})), device)',
        "optimizer = model",
        ("tests/safety/test_optimizer_state_overflow.py",),
        "checkpoint verification checks the model twice and the optimizer state not at all",
    ),
]


def run(mutation: Mutation) -> tuple[bool, float, str]:
    """Apply ``mutation``, run its tests, restore; (caught, seconds, last line of pytest's output)."""
    path = SRC / mutation.file
    original = path.read_text(encoding="utf-8")
    if original.count(mutation.old) != 1:
        raise SystemExit(f"{mutation.name}: {mutation.old!r} occurs {original.count(mutation.old)} times in {path}")
    start = time.perf_counter()
    try:
        path.write_text(original.replace(mutation.old, mutation.new), encoding="utf-8")
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests],
            cwd=ROOT, capture_output=True, text=True,
        )
    finally:
        path.write_text(original, encoding="utf-8")
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return result.returncode != 0, time.perf_counter() - start, lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s) {sorted(unknown)}; available: {', '.join(m.name for m in MUTATIONS)}")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file}: {m.why}")
        return 0
    survived = []
    for m in chosen:
        caught, seconds, last = run(m)
        print(f"{m.name:34} {'caught' if caught else 'SURVIVED'} ({seconds:.0f} s; {last})", flush=True)
        if not caught:
            survived.append(m.name)
    print(f"{len(chosen) - len(survived)}/{len(chosen)} caught" + (f"; survived: {survived}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
