"""Mutation testing of the protection layer with mutmut 3: a score, and every survivor explained.

For each group below, the script copies ``src/``, ``tests/`` and ``pyproject.toml`` into
``.mutation/<group>/`` (ignored by git), adds a ``[tool.mutmut]`` section that mutates only the
group's modules and runs only the group's test files (the fast layer, serially: ``-n 0``), and
runs ``mutmut run`` there. mutmut writes every mutant of a function into a trampoline, runs the
group's tests once to learn which tests reach which function, then runs each mutant against
those tests only (fastest first, stopping at the first failure), two at a time.

A surviving mutant is either killed by a test or listed in ``scripts/mutation_equivalents.toml``
with its reason: ``equivalent`` (no observable behaviour can differ) or ``accelerator`` (it differs
only for tensors on a GPU, which the fast tests cannot place). The score is
``caught / (mutants - listed)``, where caught counts mutants killed by a failing test or a
timeout; a mutant no test reaches counts as a survivor.

    pip install mutmut==3.8.1                     # not a dependency of the package
    python scripts/mutation_test.py               # every group (see --list)
    python scripts/mutation_test.py guard skip    # some groups
    python scripts/mutation_test.py --report      # the score of the last runs, without running
    python scripts/mutation_test.py --try healing _ordinal -- tests/safety/test_healing_messages.py
                          # this checkout's tests against the last run's unexplained survivors whose
                          # name holds "_ordinal", one pytest per mutant: killed or not, in seconds

Results stay in ``.mutation/<group>/mutants/`` and mutmut reuses them for functions whose source did
not change (a change to a group's test files makes it judge every mutant again); survivors not
listed as equivalent are tried again on every run; ``--fresh`` starts a group again. The survivors' diffs go to
``.mutation/survivors.txt``. Exit status 1 when a survivor is neither killed nor listed as equivalent.
Not a CI gate (too slow): run it before resolving a change to these modules.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser, as a package (mutmut depends on toml there)
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutation"
EQUIVALENTS = ROOT / "scripts" / "mutation_equivalents.toml"
MUTMUT_VERSION = "3.8.1"


@dataclass(frozen=True)
class Group:
    name: str
    modules: tuple[str, ...]  # under src/
    tests: tuple[str, ...]  # test files or node ids, run with the fast layer's options


# module -> the fast tests written for it: its unit tests first, then the in-process runs that
# assert its promises. A survivor runs every selected test that reaches its function, so the
# in-process runs over ~5 s (resumed runs, capture + diagnose chains, which reach every module)
# are left out with --deselect: the spot mutations and the fast layer still run them.
_SLOW_GUARD = ("--deselect=tests/safety/test_guard.py::test_16_true_adamw_capture_diagnose_explains_and_reproduces_"
               "the_optimizer_step",
               "--deselect=tests/safety/test_guard.py::test_fp16_skipped_steps_are_normal_until_too_many_in_a_row[10]")
_SLOW_HEALTH = (
    "--deselect=tests/safety/test_checkpoint_health.py::test_resume_from_the_healthy_checkpoint_continues_and_the_"
    "loss_recovers",
    "--deselect=tests/safety/test_checkpoint_health.py::test_resume_refuses_a_checkpoint_holding_nan_and_names_the_"
    "healthy_one",
    "--deselect=tests/safety/test_checkpoint_health.py::test_rotation_keeps_the_newest_healthy_checkpoint_even_with_"
    "keep_0",
)
_SLOW_CHECKPOINT = (
    "--deselect=tests/runfiles/test_checkpoint.py::test_killed_writer_never_leaves_a_corrupt_file",
    "--deselect=tests/runfiles/test_checkpoint.py::test_interrupted_then_resumed_run_is_bitwise_identical",
    "--deselect=tests/runfiles/test_torn_files.py::test_resume_and_report_after_torn_line",
)
GROUPS = [
    Group("skip", ("stabletrain/safety/skip_step.py", "stabletrain/safety/skip_aware.py",
                   "stabletrain/safety/rollback_snapshot.py"),
          ("tests/safety/test_skip_step.py", "tests/safety/test_skip_aware.py",
           "tests/safety/test_rollback_snapshot.py", "tests/safety/test_self_healing.py")),
    Group("detector", ("stabletrain/safety/spike_detector.py",),
          ("tests/safety/test_spike_detector.py", "tests/safety/test_self_healing.py")),
    Group("interrupts", ("stabletrain/safety/interrupts.py",), ("tests/safety/test_interrupts.py",)),
    Group("guard", ("stabletrain/safety/guard.py",),
          ("tests/safety/test_step_guard.py", "tests/safety/test_guard_messages.py",
           "tests/safety/test_guard_first_step.py", "tests/safety/test_guard_sharded.py",
           "tests/safety/test_optimizer_state_overflow.py",
           "tests/safety/test_guard.py", *_SLOW_GUARD)),
    Group("health", ("stabletrain/safety/checkpoint_health.py",),
          ("tests/safety/test_health_tracker.py", "tests/safety/test_optimizer_state_overflow.py",
           "tests/safety/test_checkpoint_health.py", *_SLOW_HEALTH)),
    Group("checkpoint", ("stabletrain/runfiles/checkpoint.py",),
          ("tests/runfiles/test_checkpoint_files.py", "tests/runfiles/test_checkpoint.py",
           "tests/training/test_sharded_checkpoints.py",
           "tests/runfiles/test_torn_files.py", "tests/safety/test_checkpoint_health.py", *_SLOW_CHECKPOINT,
           *_SLOW_HEALTH)),
    Group("net", ("stabletrain/safety/net.py",),
          ("tests/safety/test_safety_net.py", "tests/safety/test_optimizer_state_overflow.py",
           "tests/safety/test_guard.py", "tests/safety/test_checkpoint_health.py", "tests/safety/test_interrupts.py",
           "tests/safety/test_write_failures.py", *_SLOW_GUARD, *_SLOW_HEALTH)),
    Group("healing", ("stabletrain/safety/healing.py",),
          ("tests/safety/test_healing_messages.py", "tests/safety/test_healing_recovery.py",
           "tests/safety/test_healing_lifecycle.py", "tests/safety/test_self_healing.py")),
]

#: mutmut's exit codes (mutmut.stats): what each means here.
# 2: pytest was interrupted: a KeyboardInterrupt the mutant raised escaped the tests (no one presses
# Ctrl-C in the mutants' processes).
CAUGHT = {1: "killed", 3: "killed", 2: "interrupted", 36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout",
          255: "timeout", 37: "type check"}
SURVIVED = {0: "survived", 33: "no tests"}


def _sync(src: Path, dst: Path) -> None:
    """Copy ``src`` into ``dst``, rewriting only files whose bytes differ (mutmut reads mtimes to
    reuse the results of unchanged files)."""
    for path in src.rglob("*"):
        if "__pycache__" in path.parts or path.is_dir():
            continue
        target = dst / path.relative_to(src)
        if target.exists() and target.read_bytes() == path.read_bytes():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def prepare(group: Group, fresh: bool) -> Path:
    work = WORK / group.name
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    _sync(ROOT / "src", work / "src")
    _sync(ROOT / "tests", work / "tests")
    config = "\n".join([
        "", "[tool.mutmut]",
        'source_paths = ["src/"]',
        "only_mutate = " + json.dumps([f"src/{m}" for m in group.modules]),
        "pytest_add_cli_args_test_selection = " + json.dumps(list(group.tests)),
        # Serial in each mutant's process (xdist off), no cache writes; the fast layer's addopts stay.
        'pytest_add_cli_args = ["-n", "0", "-p", "no:cacheprovider"]',
        # torch is not fork-safe after its thread pools start: fork the mutants from a clean server.
        'process_isolation = "forkserver"',
        # A mutant times out after (its tests' time + 10 s) x 15 of CPU, half that of wall time: mutmut's
        # 1 s was too short for pytest's start in a forked child on a loaded 2-core machine.
        "timeout_constant = 10.0",
        "",
    ])
    # A survivor is tried again on every run (a new test may kill it), unless it is listed as
    # equivalent (each one runs every test that reaches it: minutes of a run); a caught or listed
    # mutant keeps its result until its function's source changes (mutmut then forgets it itself).
    equivalents = load_equivalents()
    for module in group.modules:
        meta = work / "mutants" / "src" / (module + ".meta")
        if meta.exists():
            data = json.loads(meta.read_text())
            mutated = (work / "mutants" / "src" / module).read_text(encoding="utf-8")
            codes = data["exit_code_by_key"]
            data["exit_code_by_key"] = {k: (v if v in CAUGHT or _listed(k, v, mutated, equivalents) else None)
                                        for k, v in codes.items()}
            meta.write_text(json.dumps(data, indent=4))
    # mutmut keeps its map of which test reaches which function from run to run and adds only new
    # tests to it: a test whose calls changed, or a function renamed, would keep a stale map (its
    # mutants judged "survived" or "no tests" without the tests that reach them). Map afresh each
    # run: the group's tests once, a minute or two.
    (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8") + config
    target = work / "pyproject.toml"
    if not target.exists() or target.read_text(encoding="utf-8") != text:
        target.write_text(text, encoding="utf-8")
    return work


def _listed(name: str, code: object, mutated: str, equivalents: list[dict[str, str]]) -> bool:
    """Whether mutant ``name``, judged a survivor (``code``), is listed as equivalent."""
    if code not in SURVIVED:
        return False
    old, new = _changes(name, mutated)
    return is_listed(readable(name), old, new, equivalents) is not None


def run_group(group: Group, children: int, fresh: bool) -> float:
    work = prepare(group, fresh)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the mutants' src, not this checkout's
    env["OMP_NUM_THREADS"] = "1"  # one thread per mutant process, `children` processes
    mutmut = Path(sys.executable).parent / "mutmut"
    start = time.perf_counter()
    with open(work / "mutmut.log", "w") as log:
        result = subprocess.run([str(mutmut), "run", "--max-children", str(children)], cwd=work, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        tail = (work / "mutmut.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{group.name}: mutmut run exited {result.returncode}; the end of {work}/mutmut.log:\n{tail}")
    return seconds


# ------------------------------------------------------------------------------------------
# Results and equivalents
# ------------------------------------------------------------------------------------------


def readable(mutant: str) -> str:
    """``stabletrain.safety.guard.StepGuard.check_update`` from mutmut's mangled name."""
    name = mutant.partition("__mutmut_")[0]
    module, _, func = name.rpartition(".")
    if func.startswith("xǁ"):
        _, cls, meth = func.split("ǁ")
        return f"{module}.{cls}.{meth}"
    return f"{module}.{func.removeprefix('x_')}"


def _changed_lines(diff: str) -> tuple[str, str]:
    old = [line[1:].strip() for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    new = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return "\n".join(old), "\n".join(new)


def load_equivalents() -> list[dict[str, str]]:
    if not EQUIVALENTS.exists():
        return []
    entries = tomllib.loads(EQUIVALENTS.read_text(encoding="utf-8")).get("equivalent", [])
    for e in entries:
        missing = {"function", "old", "new", "why"} - set(e)
        if missing or not e["why"].strip():
            raise SystemExit(f"{EQUIVALENTS}: an entry lacks {sorted(missing) or ['a reason']}: {e}")
        e.setdefault("kind", "equivalent")
        if e["kind"] not in ("equivalent", "accelerator"):
            raise SystemExit(f"{EQUIVALENTS}: kind must be equivalent or accelerator: {e}")
    return entries


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def is_listed(function: str, old: str, new: str, equivalents: list[dict[str, str]]) -> dict[str, str] | None:
    for e in equivalents:
        if e["function"] == function and _norm(e["old"]) == _norm(old) and _norm(e["new"]) == _norm(new):
            return e
    return None


def group_results(group: Group) -> list[dict[str, object]]:
    """Every mutant of the group: name, function, status and, for survivors, the changed lines."""
    work = WORK / group.name
    rows: list[dict[str, object]] = []
    for module in group.modules:
        meta = work / "mutants" / "src" / (module + ".meta")
        if not meta.exists():
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        mutated = (work / "mutants" / "src" / module).read_text(encoding="utf-8")
        for name, code in codes.items():
            status = CAUGHT.get(code) or SURVIVED.get(code) or ("not run" if code is None else f"exit {code}")
            row: dict[str, object] = {"name": name, "function": readable(name), "status": status}
            if code not in CAUGHT:
                row["old"], row["new"] = _changes(name, mutated)
            rows.append(row)
    return rows


def _changes(name: str, mutated: str) -> tuple[str, str]:
    """The lines mutant ``name`` removes and adds, read from the mutants file ``mutated``."""
    return _changed_lines(_diff(name, mutated))


def _diff(name: str, mutated: str) -> str:
    """The mutant's function against the original one, as a unified diff (read from the mutants file)."""
    mangled = name.rpartition(".")[2]
    func = mangled.partition("__mutmut_")[0]
    orig_name = func + "__mutmut_orig"
    mutant = _function_text(mutated, mangled)
    original = _function_text(mutated, orig_name)
    if mutant is None or original is None:
        return ""
    mutant = mutant.replace(mangled, "f", 1)
    original = original.replace(orig_name, "f", 1)
    return "\n".join(difflib.unified_diff(original.splitlines(), mutant.splitlines(), lineterm="", n=0))


def _function_text(code: str, name: str) -> str | None:
    lines = code.splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"\s*(async\s+)?def {re.escape(name)}\(", line):
            indent = len(line) - len(line.lstrip())
            body = [line]
            for nxt in lines[i + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent and not nxt.lstrip().startswith(")"):
                    break
                body.append(nxt)
            return "\n".join(body)
    return None


def report(groups: list[Group], seconds: dict[str, float]) -> int:
    equivalents = load_equivalents()
    unexplained: list[dict[str, object]] = []
    totals = {"mutants": 0, "caught": 0, "equivalent": 0, "accelerator": 0, "survived": 0, "not run": 0}
    print(f"{'group':12} {'mutants':>7} {'caught':>7} {'equiv.':>7} {'gpu':>4} {'surv.':>6} {'score':>7} {'time':>8}")
    for group in groups:
        rows = group_results(group)
        if not rows:
            print(f"{group.name:12} (not run)")
            continue
        caught = sum(1 for r in rows if r["status"] in CAUGHT.values())
        equiv = gpu = survived = not_run = 0
        for r in rows:
            if r["status"] in CAUGHT.values():
                continue
            if r["status"] == "not run":
                not_run += 1
                continue
            e = is_listed(str(r["function"]), str(r["old"]), str(r["new"]), equivalents)
            if e is not None and e["kind"] == "accelerator":
                gpu += 1
            elif e is not None:
                equiv += 1
            else:
                survived += 1
                unexplained.append(r)
        judged = len(rows) - equiv - gpu - not_run
        score = f"{100 * caught / judged:.1f}%" if judged else "-"
        took = f"{seconds[group.name] / 60:.1f} min" if group.name in seconds else ""
        print(f"{group.name:12} {len(rows):7} {caught:7} {equiv:7} {gpu:4} {survived:6} {score:>7} {took:>8}"
              + (f"  ({not_run} not run)" if not_run else ""))
        for key, value in (("mutants", len(rows)), ("caught", caught), ("equivalent", equiv), ("accelerator", gpu),
                           ("survived", survived), ("not run", not_run)):
            totals[key] += value
    judged = totals["mutants"] - totals["equivalent"] - totals["accelerator"] - totals["not run"]
    if judged:
        print(f"{'all':12} {totals['mutants']:7} {totals['caught']:7} {totals['equivalent']:7} "
              f"{totals['accelerator']:4} {totals['survived']:6} {100 * totals['caught'] / judged:6.1f}%")
    WORK.mkdir(exist_ok=True)
    with open(WORK / "survivors.txt", "w", encoding="utf-8") as f:
        for r in unexplained:
            f.write(f"[[equivalent]]  # {r['name']} ({r['status']})\nfunction = {json.dumps(r['function'])}\n"
                    f"old = {json.dumps(r['old'])}\nnew = {json.dumps(r['new'])}\nwhy = \"\"\n\n")
    if unexplained:
        print(f"{len(unexplained)} survivor(s) neither killed nor listed in {EQUIVALENTS.relative_to(ROOT)}; "
              f"their changes: {(WORK / 'survivors.txt').relative_to(ROOT)}")
    return 1 if unexplained else 0


def try_mutants(group: Group, patterns: list[str], pytest_args: list[str], timeout: float = 300) -> int:
    """Run this checkout's tests (``pytest_args``, default the group's) against each unexplained
    survivor of the group's last run whose mangled or readable name holds one of ``patterns`` (all
    of them when none is given): the quick check of a new test before the group is run again."""
    src = WORK / group.name / "mutants" / "src"
    if not src.exists():
        raise SystemExit(f"{group.name} has not run yet: python scripts/mutation_test.py {group.name}")
    equivalents = load_equivalents()
    rows = [r for r in group_results(group)
            if r["status"] in SURVIVED.values()
            and is_listed(str(r["function"]), str(r["old"]), str(r["new"]), equivalents) is None
            and (not patterns or any(p in str(r["name"]) or p in str(r["function"]) for p in patterns))]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    tests = pytest_args or list(group.tests)
    killed = 0
    for r in rows:
        name = str(r["name"])
        env["MUTANT_UNDER_TEST"] = name
        try:
            result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                                     "-o", f"pythonpath={src}", *tests], cwd=ROOT, env=env, capture_output=True,
                                    timeout=timeout)
            caught = result.returncode not in (0, 5)  # 5: no test selected
        except subprocess.TimeoutExpired:  # mutmut counts a timeout as caught too
            caught = True
        killed += caught
        print(f"{'killed  ' if caught else 'SURVIVED'} {name}: {_norm(str(r['new']))[:150]!r}", flush=True)
    print(f"{killed} of {len(rows)} killed")
    return 0 if killed == len(rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("groups", nargs="*", help="groups to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the groups, their modules and tests")
    parser.add_argument("--report", action="store_true", help="only report the last runs' results")
    parser.add_argument("--fresh", action="store_true", help="forget a group's previous results")
    parser.add_argument("--children", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--try", dest="try_group", metavar="GROUP",
                        help="run this checkout's tests (after --, default the group's) against the last run's "
                             "unexplained survivors whose name holds one of the given words")
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = parser.parse_args(argv)
    if args.try_group:
        found = [g for g in GROUPS if g.name == args.try_group]
        if not found:
            parser.error(f"unknown group {args.try_group!r}; available: {', '.join(g.name for g in GROUPS)}")
        return try_mutants(found[0], args.groups, pytest_args)
    unknown = set(args.groups) - {g.name for g in GROUPS}
    if unknown:
        parser.error(f"unknown group(s) {sorted(unknown)}; available: {', '.join(g.name for g in GROUPS)}")
    chosen = [g for g in GROUPS if not args.groups or g.name in args.groups]
    if args.list:
        for g in chosen:
            print(f"{g.name}: {', '.join(g.modules)}\n    tests: {', '.join(g.tests)}")
        return 0
    seconds: dict[str, float] = {}
    if not args.report:
        try:
            from importlib.metadata import version

            found = version("mutmut")
        except Exception:
            raise SystemExit(f"mutmut is not installed: pip install mutmut=={MUTMUT_VERSION}") from None
        if found != MUTMUT_VERSION:
            print(f"note: mutmut {found} installed; the figures in docs/benchmarks.md were taken with {MUTMUT_VERSION}")
        for g in chosen:
            seconds[g.name] = run_group(g, args.children, args.fresh)
            print(f"{g.name}: mutmut ran in {seconds[g.name] / 60:.1f} min", flush=True)
    return report(chosen, seconds)


if __name__ == "__main__":
    sys.exit(main())
