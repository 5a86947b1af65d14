"""No mechanism on healthy runs: the default language model and the default image classifier, each with several
seeds, trained as `stabletrain train` trains them (500 steps), and the mechanisms their live alerts named (the
``{"event": "mechanism"}`` rows of metrics.jsonl), with how close each signal came to its rule's threshold.

    python benchmarks/mechanism_false_alarms.py [--seeds 0,1,2] [--steps 500] [--out DIR]

About 1 min per run on 2 idle CPU cores (6 runs by default). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import stabletrain
from stabletrain.config import MechanismArgs
from stabletrain.runfiles.history import read_run


def one_run(out: Path, task: str, seed: int, steps: int) -> dict[str, Any]:
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        stabletrain.train(out=out, task=task, seed=seed, steps=steps, loggers={"tensorboard": {"enabled": False}})
    history = read_run(out / "metrics.jsonl")
    rows = history.rows

    def extreme(key: str, fn: Any) -> float:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return fn(values) if values else math.nan

    lr_ratio = [r["signals/update_rms/decay"] * r["signals/weight_rms/decay"] / r["lr"] for r in rows
                if all(isinstance(r.get(k), (int, float)) for k in ("signals/update_rms/decay",
                                                                      "signals/weight_rms/decay", "lr")) and r["lr"]]
    return {
        "task": task, "seed": seed, "final_loss": rows[-1]["loss"],
        "named": [e["id"] for e in history.events if e.get("event") == "mechanism"],
        "attn_logit_max": extreme("signals/attn_logit_max", max),
        "attn_entropy_min": extreme("signals/attn_entropy_min", min),
        "logit_mean": extreme("signals/output_logit_mean", lambda v: max(abs(x) for x in v)),
        "eps_fraction": extreme("signals/adam_eps_fraction", max),
        "update_over_lr": min(lr_ratio) if lr_ratio else math.nan,
        "update_rms": extreme("signals/update_rms/decay", max),
        "seconds": time.perf_counter() - start,
    }


def table(results: list[dict[str, Any]]) -> str:
    a = MechanismArgs()
    lines = ["| task | seed | final loss | mechanisms named | max attention logit | min attention entropy | "
             "max abs mean logit | max eps fraction | min update RMS / lr | max update_rms/decay |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.3g}"

    for x in results:
        lines.append(f"| {x['task']} | {x['seed']} | {x['final_loss']:.3f} | {', '.join(x['named']) or 'none'} | "
                     f"{f(x['attn_logit_max'])} | {f(x['attn_entropy_min'])} | {f(x['logit_mean'])} | "
                     f"{f(x['eps_fraction'])} | {f(x['update_over_lr'])} | {f(x['update_rms'])} |")
    lines.append(f"| rule's threshold | | | | >= {a.attn_logit_limit:g} | <= {a.attn_entropy_floor:g} | "
                 f">= {a.logit_mean_limit:g} | >= {a.eps_fraction:g} | <= {a.eps_update_ratio:g} | "
                 f">= {a.runaway_update:g} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--tasks", default="language_model,image_classification")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    args = parser.parse_args()
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        for task in args.tasks.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                results.append(one_run(root / f"{task}_seed{seed}", task, seed, args.steps))
    named = sum(len(x["named"]) for x in results)
    print(f"{len(results)} runs in {time.perf_counter() - start:.0f} s: {named} mechanism(s) named")
    print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
