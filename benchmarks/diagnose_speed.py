"""How long ``stabletrain.diagnose`` takes on a capture of the benchmark model; goal < 60 s
on 2 CPU cores.

The captures are made the way a user gets them: the trainer trains the benchmark model
(built-in transformer LM, 4 layers, dim 256, context 128, batch 16, dropout 0.1; see
``benchmarks/common.py``) with ``debug_args.nancapture`` on until a step fails. Two faults:

* ``embedding``: at step 1 the embedding row of a token that only one sample of the batch
  contains turns NaN (as if an earlier update had broken it). The diagnosis must find that
  sample among 16, the non-finite weights, and the embedding lookup.
* ``lr``: SGD at lr 1000 diverges within a few steps; every sample fails, which is the
  most expensive search (the complement keeps failing).

Then ``diagnose()`` is timed (model rebuilt from the stored settings, nothing cached) and
its phases are printed: load, weights, replays (captured precision twice, float64),
bisect (subset replays), trace (op tracing of the culprit subset), checkpoints.

    python benchmarks/diagnose_speed.py [--faults embedding lr] [--threads 2] [--repeats 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_SETTINGS, machine  # noqa: E402

import stabletrain  # noqa: E402
from stabletrain import NaNDetectedError  # noqa: E402


class PoisonRareToken:
    """At ``step``, turn NaN the embedding row of a token found in exactly one sample."""

    def __init__(self, step: int):
        self.step = step
        self.victim: tuple[int, int] | None = None  # (dataset index, token)

    def on_microbatch(self, trainer, *, step, micro_step, batch, indices):
        if step != self.step or self.victim is not None:
            return
        ids = batch["input_ids"]
        rows_with = torch.stack([(ids == t).any(1) for t in range(trainer.model.vocab_size)]).sum(1)
        token = int(torch.nonzero(rows_with == 1)[0])
        row = int(torch.nonzero((ids == token).any(1))[0])
        with torch.no_grad():
            trainer.model.tok_emb.weight[token] = float("nan")
        self.victim = (int(indices[row]), token)


def make_capture(fault: str, out: Path) -> tuple[Path, str]:
    settings = {**BENCH_SETTINGS, "out": out, "steps": 50, "log_every_num_steps": 1,
                "debug_args": {"nancapture": {"enabled": True}}}
    if fault == "embedding":
        poison = PoisonRareToken(step=1)
        settings["callbacks"] = [poison]
    elif fault == "lr":
        settings["model_args"] = {**settings["model_args"], "optimizer": "sgd", "lr": 1000.0, "warmup_steps": 0,
                                  "lr_schedule": "constant"}
    else:
        raise ValueError(f"unknown fault {fault!r}; valid: embedding, lr")
    try:
        stabletrain.train(**settings)
    except NaNDetectedError as err:
        note = f"failed at step {err.step} ({err.reason})"
        if fault == "embedding":
            note += f"; poisoned token {poison.victim[1]} only in dataset sample {poison.victim[0]}"
        return err.capture_path.parent, note
    raise RuntimeError(f"fault {fault!r}: training did not fail")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", nargs="+", default=["embedding", "lr"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the goal is for 2 CPU cores)")
    parser.add_argument("--repeats", type=int, default=1, help="diagnoses per capture (the median is shown)")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        for fault in ns.faults:
            path, note = make_capture(fault, Path(tmp) / fault)
            runs = []
            for _ in range(ns.repeats):
                start = time.perf_counter()
                d = stabletrain.diagnose(path, write=False)
                runs.append((time.perf_counter() - start, d))
            runs.sort(key=lambda r: r[0])
            total, d = runs[len(runs) // 2]
            phases = ", ".join(f"{k} {v:.2f}s" for k, v in d.timings.items())
            print(f"\nfault {fault}: {note}")
            print(f"  verdict: {d.verdict}")
            if d.finding is not None:
                print(f"  first non-finite op: {d.finding.op} in {d.finding.where}, {d.finding.phase}")
            print(f"  data: {d.data.note} ({d.data.replays} subset replays)")
            print(f"  diagnose(): {total:.2f} s (goal < 60 s) = {phases}")
            print("  full replays: " + ", ".join(f"{r.label} {r.seconds:.2f}s" for r in d.replays))


if __name__ == "__main__":
    main()
