"""``--verify`` of ``stabletrain diagnose`` and ``stabletrain report``: the candidate remedies re-run from the
newest healthy checkpoint and ranked (:func:`stabletrain.verify_remedies`); the first next action printed is
the best verified remedy, and the suggestions that were not verified say so. See docs/remedies.md.

    stabletrain diagnose out/boom/debug/nan_capture/rank0 --verify
    stabletrain diagnose out/boom --verify --budget-steps 400
    stabletrain report out/my_run --verify --budget-seconds 600
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from stabletrain.errors import StabletrainError

#: How far above a capture its run folder may lie (``out/debug/recoveries/step12/rank0``: 4 levels).
_MAX_UP = 5


def add_options(parser: argparse.ArgumentParser, model: bool = False) -> None:
    """Add ``--verify`` and its options to ``parser`` (``model``: also ``--model``, which diagnose has already)."""
    group = parser.add_argument_group("verify remedies (--verify)")
    group.add_argument("--verify", action="store_true",
                       help="re-run candidate remedies (lr x0.3 and x0.1, warmup, clipping, eps, beta2, precision, "
                            "qk_norm, z_loss) from the newest healthy checkpoint and rank them by measured outcome; "
                            "writes OUT/debug/remedies/")
    group.add_argument("--budget-steps", type=int, metavar="N", help="at most N optimizer steps in all re-runs")
    group.add_argument("--budget-seconds", type=float, metavar="S", help="at most S seconds of re-runs")
    group.add_argument("--start", metavar="CKPT",
                       help="the checkpoint to start from (default: the newest healthy one before the trouble); "
                            "0 for a fresh start")
    if model:
        group.add_argument("--model", metavar="FILE.py:NAME",
                           help="your own model, for a run of one: a class (or function) that builds it")
    group.add_argument("--data", metavar="FILE.py:NAME",
                       help="your own dataset, for a run of one: the dataset, or a function that returns it")


def check_budget(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse verify-only options without ``--verify``, and budgets that are not positive."""
    used = [flag for flag, value in (("--budget-steps", ns.budget_steps), ("--budget-seconds", ns.budget_seconds),
                                     ("--start", ns.start), ("--data", ns.data)) if value is not None]
    if used and not ns.verify:
        parser.error(f"{', '.join(used)} only with --verify")
    if ns.budget_steps is not None and ns.budget_steps < 1:
        parser.error(f"--budget-steps: a number of steps >= 1, got {ns.budget_steps}")
    if ns.budget_seconds is not None and ns.budget_seconds <= 0:
        parser.error(f"--budget-seconds: a number of seconds > 0, got {ns.budget_seconds:g}")


def _start(value: Optional[str]) -> Any:
    if value is None:
        return None
    return 0 if value.strip() == "0" else Path(value)


def _objects(ns: argparse.Namespace) -> tuple[Any, Any]:
    """``(model, data)`` from ``--model`` and ``--data`` (None where not given)."""
    from stabletrain.debug.remedies import RemedyError
    from stabletrain.utils.imports import load_object

    model = load_object(ns.model, error=RemedyError) if getattr(ns, "model", None) else None
    data = load_object(ns.data, error=RemedyError) if ns.data else None
    return model, data


def run_folder_of(path: Path) -> Optional[Path]:
    """The run folder (settings.json and metrics.jsonl) holding ``path`` (a capture), or ``path`` itself."""
    here = path.resolve() if path.is_dir() else path.resolve().parent
    for folder in [here, *here.parents][:_MAX_UP + 1]:
        if (folder / "settings.json").is_file() and (folder / "metrics.jsonl").is_file():
            return folder
    return None


def _verify(run: Path, ns: argparse.Namespace, mechanisms: Optional[list[str]] = None) -> Any:
    from stabletrain.reporting.remedies import verify_remedies

    model, data = _objects(ns)
    # With --json, stdout is the JSON alone: the progress lines go to stderr.
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if getattr(ns, "json", False) else print
    return verify_remedies(run, start=_start(ns.start), mechanisms=mechanisms, budget_steps=ns.budget_steps,
                           budget_seconds=ns.budget_seconds, model=model, data=data, progress=progress)


def run_diagnose(ns: argparse.Namespace) -> int:
    """``stabletrain diagnose PATH --verify``: a capture is diagnosed as without ``--verify``, then the remedies
    are verified from its run's newest healthy checkpoint; a run folder without a capture is verified only."""
    from stabletrain.cli.paths import check_capture_path
    from stabletrain.runfiles.history import run_folder_problem

    path = Path(ns.path)
    try:
        check_capture_path(path, "diagnose")
        has_capture = True
    except StabletrainError:
        if not path.is_dir() or run_folder_problem(path) is not None:
            raise
        has_capture = False
    if not has_capture:  # a run that never went non-finite: what its signals say, then the remedies
        from stabletrain.debug.diagnose.run_signals import diagnose_run

        account = diagnose_run(path, write=not ns.no_write, verified=False)  # this verification's, below
        _print_merged(ns, _verify(path, ns), account)
        return 0
    from stabletrain.cli import user_code
    from stabletrain.debug.diagnose import diagnose

    model, step_fn = user_code.load(ns)
    # This verification's next actions are put in below, not the last one's.
    result = diagnose(ns.path, model=model, step_fn=step_fn, device=ns.device, write=not ns.no_write, verified=False)
    run = run_folder_of(path)
    if run is None:
        raise StabletrainError(f"--verify: no run folder (settings.json and metrics.jsonl) holds {path}: the remedies "
                               "are re-run from the run's checkpoints with its settings; captures of other "
                               "frameworks' runs (Lightning, HF Trainer, Accelerate) cannot be verified here")
    _print_merged(ns, _verify(run, ns, mechanisms=_mechanisms_of(result)), result)
    return 0


def _print_merged(ns: argparse.Namespace, report: Any, diagnosis: Any) -> None:
    """The diagnosis (of a capture, an optimizer step or a run's signals) with the verified next actions in
    place of its own: the verified remedy first, then its own suggestions marked tried (with what was
    measured) or not. Its diagnosis.md and .json are written again so that they say the same."""
    from stabletrain.debug.diagnose.run import with_next_actions

    merged = with_next_actions(diagnosis, report.next_actions(diagnosis.next_actions))
    _print_json_or_text(ns, report, merged, None)


def _mechanisms_of(result: Any) -> list[str]:
    """The mechanisms a capture's diagnosis shows: those the run's signals named before the step, a non-finite
    step; float16 range for a precision-induced failure in float16; bad data when the data carried the NaN/Inf
    in."""
    # The mechanisms the run's signals named before the step (runaway updates, ...) answer first.
    mechanisms = [m.id for m in getattr(result, "mechanisms", None) or [] if not m.follows] + ["nonfinite"]
    if getattr(result, "cause", None) == "precision_induced" and str(getattr(result, "precision", "")).startswith("16"):
        mechanisms.insert(0, "fp16_range")
    if getattr(result, "origin", None) == "data":
        mechanisms.append("bad_data")
    return mechanisms


def _print_json_or_text(ns: argparse.Namespace, report: Any, diagnosis: Any, actions: Optional[list[str]]) -> None:
    if getattr(ns, "json", False):
        out = {"remedies": report.to_dict()}
        if diagnosis is not None:
            out["diagnosis"] = diagnosis.to_dict()
        print(json.dumps(out, indent=2))
        return
    if diagnosis is not None:
        print(diagnosis.to_markdown())
        print()
    print(report.to_markdown())
    if actions is not None:
        print()
        print("\n".join(_numbered(actions)))
    files = [*(getattr(diagnosis, "files", None) or []), *report.files]
    if files:
        print(f"\nWritten: {', '.join(map(str, files))}")


def _numbered(actions: list[str]) -> list[str]:
    return ["Next actions:", *(f"{i}. {a}" for i, a in enumerate(actions, 1))]


def run_report(ns: argparse.Namespace) -> int:
    """``stabletrain report OUT --verify``: the report (its summary without its next actions), the remedies
    verified and ranked, then the next actions: the verified remedy first, the report's own labelled not verified."""
    from stabletrain.reporting import report as build_report

    summary = build_report(ns.out, quiet=True, plots=not ns.no_plots, verified=False)  # this verification's, below
    text, actions = split_next(summary.text)
    print(text)
    print()
    remedies = _verify(Path(ns.out), ns)
    build_report(ns.out, quiet=True, plots=not ns.no_plots)  # summary.md again, quoting it
    print()
    print(remedies.to_markdown())
    print()
    print("\n".join(_numbered(remedies.next_actions(actions))))
    print(f"\nWritten: {', '.join(map(str, remedies.files))}")
    return 0


def split_next(text: str) -> tuple[str, list[str]]:
    """The report's printed summary without its ``next:`` block, and the actions of that block."""
    lines = text.splitlines()
    if "next:" not in lines:
        return text, []
    i = lines.index("next:")
    j = i + 1
    actions = []
    while j < len(lines) and lines[j].startswith("  - "):
        actions.append(lines[j][4:])
        j += 1
    return "\n".join(lines[:i] + lines[j:]), actions
