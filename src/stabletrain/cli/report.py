"""``stabletrain report OUT [--no-plots]``: trends and plots of a run (:func:`stabletrain.report`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from stabletrain.cli import remedies
from stabletrain.errors import StabletrainError
from stabletrain.runfiles.history import run_folder_problem

HELP = "trends and plots of a run: stabletrain report out/my_run"


def run(argv: list[str]) -> int:
    """Parse the arguments and write ``OUT/report/``."""
    parser = argparse.ArgumentParser(
        prog="stabletrain report",
        description=(
            "Read OUT/metrics.jsonl, find exploding/vanishing/spiking/plateau/non-finite episodes "
            "and write OUT/report/: summary.md, gradient_norm.png, loss.png and, when per-layer "
            "norms were logged, gradient_norm_layers.png."
        ),
    )
    parser.add_argument("out", help="a training run's output folder, e.g. out/my_run")
    parser.add_argument("--no-plots", action="store_true", help="write the summary only")
    remedies.add_options(parser, model=True)
    ns = parser.parse_args(argv)
    remedies.check_budget(ns, parser)
    problem = run_folder_problem(ns.out)  # before torch: a wrong path is answered at once
    if problem is not None:
        raise StabletrainError(problem)
    if ns.verify:
        return remedies.run_report(ns)
    from stabletrain.reporting import report

    report(ns.out, plots=not ns.no_plots)
    _say_skipped(Path(ns.out) / "metrics.jsonl")
    return 0


def _say_skipped(metrics: Path) -> None:
    """Name the lines of metrics.jsonl the report could not read (a torn last line)."""
    from stabletrain.runfiles.history import read_run

    note = read_run(metrics).skipped_note(metrics) if metrics.is_file() else None
    if note is not None:
        print(note)
