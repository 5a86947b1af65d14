"""``stabletrain replay PATH``: rerun a captured failing step offline (:meth:`stabletrain.NaNCapture.replay`).

    stabletrain replay out/boom/debug/nan_capture/rank0          # one rank
    stabletrain replay out/boom/debug/nan_capture --json         # all ranks, for machines
"""

from __future__ import annotations

import argparse
import json

from stabletrain.cli import user_code
from stabletrain.cli.paths import check_capture_path
from stabletrain.config.types import REPLAY_PRECISIONS

HELP = "rerun a captured NaN step offline: stabletrain replay PATH [--json]"


def run(argv: list[str]) -> int:
    """``stabletrain replay PATH [--json] [--precision P] [--device D] [--model SPEC] [--step-fn SPEC]``."""
    parser = argparse.ArgumentParser(
        prog="stabletrain replay",
        description="Rerun a captured failing step offline (forward and backward, no optimizer step) and say "
        "whether it reproduces. PATH is a rank folder, its nan_capture.pt, or the folder of all ranks.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  stabletrain replay out/boom/debug/nan_capture/rank0\n"
            "  stabletrain replay out/boom/debug/nan_capture --json            # every rank of a DDP run\n"
            "  stabletrain replay out/boom/debug/nan_capture/rank0 --precision 64-true\n"
            "  stabletrain replay out/mine/debug/nan_capture/rank0 --model train.py:MyModel   # your own model\n"
        ),
    )
    parser.add_argument("path", help="rank folder, nan_capture.pt, or the folder of all ranks")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--precision", choices=REPLAY_PRECISIONS, help="replay in this precision (default: as captured)"
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the captured device type when available)")
    user_code.add_options(parser)
    ns = parser.parse_args(argv)
    check_capture_path(ns.path, "replay")  # before torch: a wrong path is answered at once
    from stabletrain.debug.replay import load_nan_capture

    model, step_fn = user_code.load(ns)
    cap = load_nan_capture(ns.path, model=model, step_fn=step_fn)
    result = cap.replay(precision=ns.precision, device=ns.device)
    print(json.dumps(result.to_dict(), indent=2) if ns.json else result.to_text())
    return 0
