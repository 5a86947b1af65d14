"""Final loss against the peak learning rate, qk_norm off and on: the shape of the LR-sensitivity
figure of Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training
instabilities"), on CPU, in a few minutes.

Each point is one run of ``stabletrain.train`` on the built-in language model, small enough for a
CPU (1 block of width 32, 2 heads, 16 tokens, batch 8; about 30K parameters), AdamW without weight
decay or dropout, 5 warmup steps then cosine to 0.1 x lr, seed 0, one torch thread. Only ``model_args.lr`` and
``model_args.qk_norm`` change between runs. The final loss is the mean of the last 3 logged losses
(steps 180, 190, 199; each one batch). The largest attention logit over the run
(``signals/attn_logit_max``) says which runs had attention-logit growth.

    python benchmarks/lr_sensitivity.py [--out out/lr_sensitivity] [--steps 200] [--lrs 1e-3,3e-3,...]

Prints a markdown table; writes ``<out>/lr_sensitivity.png`` (matplotlib) and
``<out>/lr_sensitivity.json`` (the numbers). docs/gen_examples.py copies the figure to
docs/img/lr_sensitivity.png (``--only lr-sensitivity``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import stabletrain
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.training.reproductions import TINY

LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
#: The reproductions' tiny model (stabletrain.training.reproductions.TINY): the same settings as the tests.
MODEL_ARGS: dict[str, Any] = dict(TINY["model_args"])


def one_run(out: Path, lr: float, qk_norm: bool, steps: int) -> dict[str, Any]:
    """Train once; the final loss and the largest attention logit, read back from metrics.jsonl."""
    settings = {
        "steps": steps,
        "batch_size": TINY["batch_size"],
        "log_every_num_steps": 10,
        "model_args": {**MODEL_ARGS, "lr": lr, "qk_norm": qk_norm},
        "loggers": {"tensorboard": {"enabled": False}},
        "checkpoint_every_num_steps": 10 * steps,
    }
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            stabletrain.train(out=out, **settings)
        except stabletrain.StabletrainError as exc:  # a run the guard stops is a point too (NaN)
            print(f"lr {lr:g} qk_norm {qk_norm}: {type(exc).__name__}", file=sys.__stderr__)
    rows, _ = read_metrics(out / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    final = sum(losses[-3:]) / len(losses[-3:])
    attn = [r["signals/attn_logit_max"] for r in rows if "signals/attn_logit_max" in r]
    return {
        "lr": lr,
        "qk_norm": qk_norm,
        "final_loss": final if math.isfinite(final) else None,
        "attn_logit_max": max(attn) if attn else None,
        "seconds": round(time.perf_counter() - start, 1),
    }


def table(results: list[dict[str, Any]]) -> str:
    def fmt(v: Any, spec: str) -> str:
        return "NaN" if v is None else format(v, spec)

    by = {(r["lr"], r["qk_norm"]): r for r in results}
    lines = [
        "| peak lr | final loss, qk_norm off | final loss, qk_norm on | max attention logit, off | on |",
        "|---|---|---|---|---|",
    ]
    for lr in sorted({r["lr"] for r in results}):
        off, on = by[(lr, False)], by[(lr, True)]
        lines.append(
            f"| {lr:g} | {fmt(off['final_loss'], '.3f')} | {fmt(on['final_loss'], '.3f')} "
            f"| {fmt(off['attn_logit_max'], '.3g')} | {fmt(on['attn_logit_max'], '.3g')} |"
        )
    best = {q: min((r["final_loss"] for r in results if r["qk_norm"] is q and r["final_loss"] is not None),
                   default=float("nan")) for q in (False, True)}
    lines.append("")
    lines.append(f"best final loss: {best[False]:.3f} (qk_norm off), {best[True]:.3f} (qk_norm on)")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    for qk_norm, style in ((False, "o-"), (True, "s-")):
        points = [(r["lr"], r["final_loss"]) for r in results
                  if r["qk_norm"] is qk_norm and r["final_loss"] is not None]
        ax.plot(*zip(*points), style, label=f"qk_norm {'on' if qk_norm else 'off'}")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate (AdamW)")
    ax.set_ylabel("final loss")
    ax.set_title("LR sensitivity, built-in language model (30K parameters)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/lr_sensitivity"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LRS), help="comma-separated peak lrs")
    args = parser.parse_args()
    lrs = [float(x) for x in args.lrs.split(",")]
    # One torch thread: fastest for a model this small, and the same numbers on any machine's
    # thread count (the order of float sums depends on it).
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for lr in lrs:
            for qk_norm in (False, True):
                results.append(one_run(Path(tmp) / f"lr{lr:g}_qk{int(qk_norm)}", lr, qk_norm, args.steps))
    print(f"{len(results)} runs of {args.steps} steps in {time.perf_counter() - start:.0f} s\n")
    print(table(results))
    (args.out / "lr_sensitivity.json").write_text(json.dumps(results, indent=1) + "\n")
    try:
        plot(results, args.out / "lr_sensitivity.png")
    except ImportError:
        print('figure skipped: matplotlib is not installed (pip install "stabletrain[plots]")')
        return
    print(f"figure: {args.out / 'lr_sensitivity.png'}")


if __name__ == "__main__":
    main()
