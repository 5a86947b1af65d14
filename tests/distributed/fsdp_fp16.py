"""fp16 under FSDP2 on 2 CPU processes (Fabric's MixedPrecision plugin, ``torch.amp.GradScaler("cpu")``), or
the same run unsharded in one process: an Inf planted in one gradient element at PLANT_STEP, under FSDP2 in
rank 1's shard only. The scaler must skip that step on every rank.

    python fsdp_fp16.py OUT sharded|unsharded     (or run(out, sharded) in this process)

Writes ``OUT/result_rank{r}.json``: how each rank's run ended.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

PLANT_STEP = 3
MODEL_ARGS = {"n_layers": 2, "dim": 32, "n_heads": 2, "context_length": 32, "lr": 1e-3, "warmup_steps": 0,
              "tokenizer": "char", "dropout": 0.0}


class PlantInf:
    """After the last backward of PLANT_STEP (before the scaler unscales): Inf into one element of head.weight's
    gradient, in rank 1's shard when sharded."""

    def on_after_microbatch(self, trainer, *, step, micro_step, loss):
        if step != PLANT_STEP or trainer.rank != trainer.world_size - 1:
            return
        grad = trainer.model.head.weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        with torch.no_grad():
            local[-1, 0] = math.inf


def run(out: str, sharded: bool) -> dict:
    """Train; how this rank's run ended."""
    from lightning_fabric import Fabric

    from stabletrain.config import load_settings
    from stabletrain.distributed import FSDP2Strategy
    from stabletrain.training.loop import Trainer
    from stabletrain.training.setup import fp16_plugin

    fabric = Fabric(accelerator="cpu", devices=2 if sharded else 1, strategy=FSDP2Strategy() if sharded else "auto",
                    plugins=[fp16_plugin("cpu", 2.0**10)])
    settings = load_settings(dict(out=out, steps=6, batch_size=8, num_workers=0, log_every_num_steps=1,
                                  checkpoint_every_num_steps=3, model_args=MODEL_ARGS, trend_alerts={"enabled": False},
                                  debug_args={"nancapture": {"enabled": True}}, callbacks=[PlantInf()],
                                  **({"strategy": "fsdp"} if sharded else {})))
    result: dict = {}
    try:
        Trainer(settings, fabric=fabric).fit()
        result["ended"] = "done"
    except Exception as exc:  # noqa: BLE001 (the test reads how each rank ended)
        result.update(ended=type(exc).__name__, message=str(exc))
    return result


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    result = run(out, sharded=mode == "sharded")
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", "0"))
    Path(out, f"result_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
