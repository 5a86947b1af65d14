"""``stabletrain.train(strategy="fsdp")`` of the built-in language model, as a script that the tests
start (Fabric's launcher re-runs it for rank 1; torchrun starts it once per "node").

    python fsdp_train.py OUT train              # 2 processes, 6 steps, checkpoints at 3 and 6
    python fsdp_train.py OUT resume FROM        # the same run continued from checkpoint FROM
    python fsdp_train.py OUT fault [NODES]      # nancapture on; a NaN planted by rank 1 at FAULT_STEP
    python fsdp_train.py OUT guard [NODES]      # the same NaN, nancapture off: the guard stops the run
    python fsdp_train.py OUT noguard            # the same NaN, the guard off too: the checkpoint is refused

Each rank writes ``OUT/result_rank{r}.json``: how its run ended.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import stabletrain

FAULT_STEP = 2
#: The built-in LM kept small: the tests compare it against a float64 reference in one process.
#: Character tokens: rank 1's half of the embedding rows (the later characters) occurs in every batch.
MODEL_ARGS = {"n_layers": 2, "dim": 32, "n_heads": 2, "context_length": 32, "lr": 1e-3, "warmup_steps": 0,
              "tokenizer": "char", "dropout": 0.0}


class PlantNaN:
    """On rank 1, at FAULT_STEP: NaN into one row of ITS shard of the token embedding, the row of a
    token of its own first microbatch (so its forward meets it); the other rank plants nothing."""

    def __init__(self) -> None:
        self.planted: dict[str, int] = {}

    def on_microbatch(self, trainer, *, step, micro_step, batch, indices):
        if trainer.rank != 1 or step != FAULT_STEP or micro_step != 0:
            return
        weight = trainer.model.tok_emb.weight
        local = weight.to_local()
        rows = weight.shape[0]
        first = rows - local.shape[0]  # rank 1 of 2 holds the last rows (dim-0 chunks)
        mine = [int(t) for t in batch["input_ids"].flatten() if int(t) >= first]
        token = mine[0]
        with torch.no_grad():
            local[token - first, 0] = float("nan")
        self.planted = {"token": token, "row_in_shard": token - first, "first_row": first}


def settings(out: str, mode: str, extra: list[str]) -> dict:
    common = dict(
        out=out, strategy="fsdp", accelerator="cpu", steps=6, batch_size=8, num_workers=0,
        log_every_num_steps=1, checkpoint_every_num_steps=3, gradient_norm_per_layer=True,
        model_args=MODEL_ARGS, trend_alerts={"enabled": False},
    )
    planted = mode in ("fault", "guard", "noguard")
    nodes = int(extra[0]) if planted and extra else 1
    common.update(devices=2 // nodes, num_nodes=nodes)
    if mode == "resume":
        common["resume_from"] = extra[0]
    if mode == "fault":
        common["debug_args"] = {"nancapture": {"enabled": True}}
    if mode == "noguard":
        common["guard"] = {"enabled": False}
    return common


def main() -> None:
    out, mode, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    plant = PlantNaN()
    result: dict = {}
    try:
        planted = mode in ("fault", "guard", "noguard")
        stabletrain.train(**settings(out, mode, extra), callbacks=[plant] if planted else [])
        result["ended"] = "done"
    except Exception as exc:  # noqa: BLE001 (the test reads how each rank ended)
        result.update(ended=type(exc).__name__, message=str(exc), step=getattr(exc, "step", None),
                      capture=str(getattr(exc, "capture_path", "")))
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    result.update(rank=rank, planted=plant.planted)
    Path(out, f"result_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
