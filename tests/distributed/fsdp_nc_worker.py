"""Run by tests/distributed/test_fsdp_capture.py under torchrun: nancapture in a plain FSDP2 loop.

    torchrun --nproc_per_node 2 fsdp_nc_worker.py OUT

Lightning Fabric with FSDP2 on CPU processes (gloo) trains the built-in LM with a NaNCaptureMonitor. Before
step FAULT_STEP, rank 1 puts a NaN into row FAULT_TOKEN of the token embedding, a row of its own shard; only
rank 1's first microbatch of that step holds the token, so only its loss is NaN, while the averaged gradient
is NaN on every rank. Every rank writes ``OUT/nan_capture/rank{r}/nan_capture.pt`` and ``OUT/rank{r}.json``
(what it saw), rank 0 also ``OUT/full_at_fault.pt``, the full model gathered at the start of that step.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
from fsdp_common import ACCUM, VOCAB, Step, build_lm, global_batch, microbatches
from lightning_fabric import Fabric

from stabletrain.debug.grad_norm import clip_grad_norm_with_total, compute_grad_norm
from stabletrain.debug.nan_capture import (
    NaNCaptureMonitor,
    NaNDetectedError,
    largest_abs_grads,
    nonfinite_grad_names,
)
from stabletrain.distributed import fabric_strategy, gather_full_state

FAULT_STEP, FAULT_RANK = 2, 1
#: In rank 1's rows of the embedding (33..64 of 65) and, at step 2, only in rank 1's microbatch 0.
FAULT_TOKEN = 45
STEPS = 4
#: Per rank: a gradient element put into its shard after the failure, finite but past float32's norm.
OVERFLOW = {0: ("blocks.0.mlp.fc1.weight", 2e19), 1: ("head.weight", 3e19)}


def main(out: Path) -> None:
    world = int(os.environ["WORLD_SIZE"])
    fabric = Fabric(accelerator="cpu", devices=world, strategy=fabric_strategy("fsdp"))
    fabric.launch()
    rank = fabric.global_rank
    lm = build_lm(0)
    module = fabric.setup_module(Step(lm))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(lm.parameters(), lr=0.1))
    monitor = NaNCaptureMonitor(lm, out_dir=out / "nan_capture", gradient_accumulation_steps=ACCUM)
    seen: dict = {"rank": rank, "world_size": world, "raised": None, "losses": []}
    seen["local_numel"] = sum(p.to_local().numel() for p in lm.parameters())
    seen["global_numel"] = sum(p.numel() for p in lm.parameters())
    for step in range(STEPS):
        if step == FAULT_STEP:
            if rank == FAULT_RANK:
                first_row = math.ceil(VOCAB / world) * rank  # FSDP2 shards dim 0 as torch.chunk does
                with torch.no_grad():
                    lm.tok_emb.weight.to_local()[FAULT_TOKEN - first_row].fill_(float("nan"))
            full, _ = gather_full_state(lm)  # collective; the model the failing step starts from
            if rank == 0:
                torch.save(full, out / "full_at_fault.pt")
        monitor.begin_step(step)
        for i, mb in enumerate(microbatches(global_batch(step), rank, world, ACCUM)):
            monitor.collect_batch(mb)
            with fabric.no_backward_sync(module, enabled=i < ACCUM - 1):
                loss = module(mb)
                monitor.collect_loss(loss)
                fabric.backward(loss / ACCUM)
            seen["losses"].append([step, i, float(loss.detach())])
        gn = compute_grad_norm(lm.named_parameters())
        try:
            monitor.check_and_capture(gn)
        except NaNDetectedError as err:
            seen["raised"] = {"step": err.step, "rank": err.rank, "reason": err.reason,
                              "names": err.nan_param_names, "path": str(err.capture_path), "message": str(err)}
            seen["global_nonfinite_names"] = gn.nonfinite_names()
            seen["overflow"] = overflow_reads(lm, rank)
            break
        clip_grad_norm_with_total(gn.params, 1.0, gn.total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    monitor.close()
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    # Leave together, then skip the interpreter's teardown: on a loaded machine a rank's C++ destructors at
    # exit aborted it ("terminate called without an active exception", no Python frame) about 1 run in 10,
    # after every file above was written, even with the process group destroyed first.
    fabric.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def overflow_reads(lm, rank: int) -> dict:
    """What the failure path reads of finite gradients too large for a float32 norm, one huge element in
    each rank's shard of a different parameter: the elementwise names (none) and the largest elements,
    global on every rank although each rank holds only one of them."""
    with torch.no_grad():
        for p in lm.parameters():
            p.grad.to_local().zero_()
        name, value = OVERFLOW[rank]
        dict(lm.named_parameters())[name].grad.to_local()[0, 0] = value
    return {"names": nonfinite_grad_names(lm.named_parameters()),
            "largest": largest_abs_grads(lm.named_parameters(), k=3),
            "norm_finite": bool(torch.isfinite(compute_grad_norm(lm.named_parameters()).total))}


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    main(target)
