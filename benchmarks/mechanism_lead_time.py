"""How early the mechanism alerts come: on each reproduction of docs/mechanisms.md, the step of the first
alert against the step the loss was lost, at the reproduction's own logging cadence and at every step.

"Lost" (``stabletrain.training.reproductions.loss_lost_step``): for a run whose loss blows up, the first
logged step whose loss is twice the lowest before it (or non-finite); for one that stalls, the first logged
step from which its loss, smoothed over 3 logged points, stays more than 5% above the same run at a good
setting (same data order) at every later step. Also: the published mitigation's run, and whether any
mechanism is named in it.

    python benchmarks/mechanism_lead_time.py [--out DIR]

Each run is the tiny model of the reproductions (about 30K parameters), in-process, one torch thread; the
whole benchmark takes about a minute on 2 CPU cores. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from stabletrain.training import reproductions as r

#: name -> (the run, the run at a good setting, the published mitigation's run), each called with
#: (folder, **overrides).
CASES: dict[str, tuple[Callable[..., r.Rows], Callable[..., r.Rows], Callable[..., r.Rows], str]] = {
    "attention-logit growth": (r.run_attention_growth, lambda out, **kw: r.run_attention_growth(out, lr=0.01, **kw),
                               lambda out, **kw: r.run_attention_growth(out, qk_norm=True, **kw),
                               "model_args.qk_norm=true"),
    "the Adam epsilon regime": (r.run_adam_eps, lambda out, **kw: r.run_adam_eps(out, eps=1e-8, **kw),
                                lambda out, **kw: r.run_adam_eps(out, eps=1e-8, **kw), "model_args.eps=1e-8"),
    "runaway updates (SGD, lr 1)": (r.run_sgd_blowup, lambda out, **kw: r.run_sgd_blowup(out, lr=0.1, **kw),
                                    lambda out, **kw: r.run_sgd_blowup(out, lr=0.1, **kw), "model_args.lr=0.1"),
}


def measure(out: Path) -> list[dict[str, Any]]:
    results = []
    for name, (run, good, mitigation, fix) in CASES.items():
        own: list[dict[str, Any]] = []
        for cadence in (None, 1):
            kw = {} if cadence is None else {"log_every_num_steps": cadence}
            rows, reference = run(out, **kw), good(out, **kw)
            if own and _cadence(rows) == _cadence(own):
                continue  # the reproduction already logs every step
            own = own or rows
            events = r.mechanism_events(rows)
            first = events[0] if events else None
            lost = r.loss_lost_step(rows, reference)
            every = _cadence(rows)
            results.append({
                "mechanism": name, "every": every, "named": None if first is None else first["id"],
                "start": None if first is None else first["start_step"],
                "alert": None if first is None else first["step"], "lost": lost,
                "lead": None if first is None or lost is None else lost - first["step"],
            })
        fixed = mitigation(out)
        results[-1]["fix"] = fix
        results[-1]["fix_named"] = [e["id"] for e in r.mechanism_events(fixed)]
        results[-1]["fix_loss"] = r.final_loss(fixed)
        results[-1]["loss"] = r.final_loss(own)
    return results


def _cadence(rows: list[dict]) -> int:
    steps = [row["step"] for row in rows[:3]]
    return steps[1] - steps[0] if len(steps) > 1 else 1


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| mechanism | logged every | named | began at | alert at | loss lost at | lead (steps) |",
             "|---|---|---|---|---|---|---|"]
    for x in results:
        lines.append(f"| {x['mechanism']} | {x['every']} | {x['named'] or 'none'} | {x['start']} | {x['alert']} | "
                     f"{x['lost']} | {x['lead']} |")
    lines += ["", "| mechanism | published fix | mechanisms named with it | final loss without / with it |",
              "|---|---|---|---|"]
    for x in results:
        if "fix" in x:
            without = f"{x['loss']:.3f}" if x["loss"] == x["loss"] else "NaN (the guard stopped it)"
            lines.append(f"| {x['mechanism']} | `{x['fix']}` | {', '.join(x['fix_named']) or 'none'} | "
                         f"{without} / {x['fix_loss']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(args.out or Path(tmp))
    print(f"{len(results) * 2 + len(CASES)} runs in {time.perf_counter() - start:.0f} s")
    print()
    print(table(results))


if __name__ == "__main__":
    main()
