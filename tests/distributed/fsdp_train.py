"""``stabletrain.train(strategy="fsdp")`` of the built-in language model, as a script that the tests
start (Fabric's launcher re-runs it for rank 1; torchrun starts it once per "node").

    python fsdp_train.py OUT train              # 2 processes, 6 steps, full-file checkpoints at 3 and 6
    python fsdp_train.py OUT resume FROM        # the same run continued from checkpoint FROM
    python fsdp_train.py OUT sharded            # 8 steps, sharded checkpoints written asynchronously at 3
                                                # and 6, nancapture on, a NaN planted by rank 1 at SHARDED_FAULT
    python fsdp_train.py OUT sharded_resume FROM     # 8 steps from sharded checkpoint FROM on 2 processes
    python fsdp_train.py OUT sharded_resume1 FROM    # ... on 1 process: OUT/loaded.pt holds what it loaded
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
#: The sharded run's fault: after its checkpoints at 3 and 6 (the second written asynchronously while steps 6
#: and 7 run), so that the stop message names it.
SHARDED_FAULT = 7
#: The built-in LM kept small: the tests compare it against a float64 reference in one process.
#: Character tokens: rank 1's half of the embedding rows (the later characters) occurs in every batch.
MODEL_ARGS = {"n_layers": 2, "dim": 32, "n_heads": 2, "context_length": 32, "lr": 1e-3, "warmup_steps": 0,
              "tokenizer": "char", "dropout": 0.0}


class PlantNaN:
    """On rank 1, at FAULT_STEP: NaN into one row of ITS shard of the token embedding, the row of a
    token of its own first microbatch (so its forward meets it); the other rank plants nothing."""

    def __init__(self, at: int = FAULT_STEP) -> None:
        self.planted: dict[str, int] = {}
        self.at = at

    def on_microbatch(self, trainer, *, step, micro_step, batch, indices):
        if trainer.rank != 1 or step != self.at or micro_step != 0:
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


class RecordLoaded:
    """At the start of training (after the resume), the one rank saves the weights and optimizer moments it
    holds (world size 1: the local tensors are the full ones) to OUT/loaded.pt."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer):
        if trainer.world_size != 1:
            return
        model = {n: p.detach().to_local().clone() for n, p in trainer.model.named_parameters()}
        # By position, as torch's optimizer.state_dict() numbers the parameters.
        params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        moments = [{k: (v.to_local() if hasattr(v, "to_local") else v).clone()
                    for k, v in trainer.optimizer.state[p].items()} for p in params]
        torch.save({"model": model, "optimizer": moments}, Path(self.out, "loaded.pt"))


def settings(out: str, mode: str, extra: list[str]) -> dict:
    common = dict(
        out=out, strategy="fsdp", accelerator="cpu", steps=6, batch_size=8, num_workers=0,
        log_every_num_steps=1, checkpoint_every_num_steps=3, gradient_norm_per_layer=True,
        model_args=MODEL_ARGS, trend_alerts={"enabled": False},
    )
    planted = mode in ("fault", "guard", "noguard")
    nodes = int(extra[0]) if planted and extra else 1
    common.update(devices=2 // nodes, num_nodes=nodes)
    if mode in ("train", "resume"):
        common["checkpoint_format"] = "full"
    if mode.startswith("sharded"):
        common.update(steps=8, max_checkpoints_to_keep=3)
    if mode == "sharded":
        common.update(checkpoint_async=True, debug_args={"nancapture": {"enabled": True}})
    if mode.startswith("sharded_resume"):
        common["resume_from"] = extra[0]
        common["devices"] = 1 if mode == "sharded_resume1" else 2
    if mode == "resume":
        common["resume_from"] = extra[0]
    if mode == "fault":
        common["debug_args"] = {"nancapture": {"enabled": True}}
    if mode == "noguard":
        common["guard"] = {"enabled": False}
    return common


def main() -> None:
    out, mode, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    plant = PlantNaN(SHARDED_FAULT if mode == "sharded" else FAULT_STEP)
    result: dict = {}
    try:
        planted = mode in ("fault", "guard", "noguard", "sharded")
        callbacks = [plant] if planted else [RecordLoaded(out)] if mode == "sharded_resume1" else []
        stabletrain.train(**settings(out, mode, extra), callbacks=callbacks)
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
