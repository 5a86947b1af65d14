"""``stabletrain diagnose PATH``: which op, module and sample made a captured step fail, and why
(:func:`stabletrain.diagnose`).

    stabletrain diagnose out/boom/debug/nan_capture/rank0
    stabletrain diagnose out/mine/debug/nan_capture/rank0 --model train.py:MyModel --json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from stabletrain.cli import remedies, user_code
from stabletrain.cli.paths import check_capture_path, is_run_without_capture

HELP = "which op, module and sample made a captured step NaN, and why: stabletrain diagnose PATH [--json]"


def run(argv: list[str]) -> int:
    """``stabletrain diagnose PATH [--json] [--device D] [--model SPEC] [--step-fn SPEC] [--no-write]``."""
    parser = argparse.ArgumentParser(
        prog="stabletrain diagnose",
        description="From a NaN capture to a verdict: the op where the harmful NaN/Inf was born (module, phase, dtype, "
        "source line), "
        "the cause (precision-induced, deterministic numerical, not reproducible), the samples that trigger it, "
        "whether the weights were already bad, and what to change. Writes diagnosis.md and diagnosis.json next "
        "to the capture.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  stabletrain diagnose out/boom/debug/nan_capture/rank0\n"
            "  stabletrain diagnose out/boom/debug/nan_capture/rank0 --json\n"
            "  stabletrain diagnose out/mine/debug/nan_capture/rank0 --model train.py:MyModel   # your own model\n"
            "  stabletrain diagnose out/boom/debug/nan_capture/rank0 --verify   # and verify the remedies\n"
        ),
    )
    parser.add_argument("path", help="rank folder, nan_capture.pt, the folder of all ranks, or the run folder "
                                     "(with --verify: any run folder)")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the captured device type when available)")
    user_code.add_options(parser)
    parser.add_argument("--no-write", action="store_true", help="do not write diagnosis.md and diagnosis.json")
    remedies.add_options(parser)
    ns = parser.parse_args(argv)
    remedies.check_budget(ns, parser)
    if ns.verify:
        return remedies.run_diagnose(ns)
    if is_run_without_capture(ns.path):  # never went non-finite: what its signals say (no torch needed)
        return _run_diagnosis(ns)
    check_capture_path(ns.path, "diagnose")  # before torch: a wrong path is answered at once
    from stabletrain.debug.diagnose import diagnose
    from stabletrain.debug.nan_capture import NaNCaptureError

    model, step_fn = user_code.load(ns)
    _list_recoveries(ns.path)
    try:
        result = diagnose(ns.path, model=model, step_fn=step_fn, device=ns.device, write=not ns.no_write)
    except NaNCaptureError as exc:
        # The loader's hints name the replay command; the same options work here.
        raise NaNCaptureError(str(exc).replace("stabletrain replay ", "stabletrain diagnose "), exc.path) from None
    _print_result(result, ns.json)
    return 0


def _run_diagnosis(ns: argparse.Namespace) -> int:
    from stabletrain.debug.diagnose.run_signals import diagnose_run

    result = diagnose_run(ns.path, write=not ns.no_write)
    _print_result(result, ns.json)
    return 0


def _print_result(result: Any, as_json: bool) -> None:
    """A diagnosis (of a capture or of a run's signals) as JSON or Markdown, then the files written."""
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.to_markdown())
        if result.files:
            print(f"\nWritten: {', '.join(result.files)}")


def _list_recoveries(path: str) -> None:
    """A run folder without a nancapture stop but with self-healing captures: say which is diagnosed."""
    from pathlib import Path

    from stabletrain.debug.nan_capture import recovery_captures

    run = Path(path)
    if not run.is_dir() or (run / "debug" / "nan_capture").is_dir():
        return
    found = recovery_captures(run)
    if found:
        names = ", ".join(d.name for d in found)
        print(f"Recovery captures in {run / 'debug' / 'recoveries'} (oldest first): {names}. Diagnosing the newest, "
              f"{found[-1].name}; for another: stabletrain diagnose {found[0]}\n", file=sys.stderr)
