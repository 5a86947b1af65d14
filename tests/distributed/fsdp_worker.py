"""Run by tests/distributed under torchrun: FSDP2 through Lightning Fabric on CPU processes (gloo).

    torchrun --nproc_per_node 2 fsdp_worker.py norms OUT      # one step: norms, clipping, shards
    torchrun --nnodes 2 --nproc_per_node 1 ... fsdp_worker.py nodes OUT

Each mode writes what the tests assert on under OUT: rank 0 a ``*.pt`` of full tensors (loadable
with weights_only=True), every rank a ``rank{global_rank}*.json`` of what it saw.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_common import ACCUM, Step, build_lm, global_batch, microbatches
from lightning_fabric import Fabric

from stabletrain.debug.grad_norm import clip_grad_norm_with_total, compute_grad_norm, layer_grad_norms
from stabletrain.distributed import fabric_strategy, fsdp_units, gather_full_state, local_shards
from stabletrain.utils.sync import CountSyncs

CLIP = 0.05
FAULT_STEP = 2
#: (name, shape, sharded dim) of DTensors whose shards the tests reassemble.
ODD_SHAPES = [("one_row", (1, 3), 0), ("five", (5,), 0), ("cols", (2, 7), 1), ("empty", (0, 4), 0)]


def fabric_for(num_nodes: int = 1) -> Fabric:
    import os

    world = int(os.environ.get("WORLD_SIZE") or os.environ["SLURM_NTASKS"])  # torchrun, or srun
    fabric = Fabric(
        accelerator="cpu", devices=world // num_nodes, num_nodes=num_nodes, strategy=fabric_strategy("fsdp")
    )
    fabric.launch()
    return fabric


def train_step(fabric: Fabric, module, lm, optimizer, step: int) -> tuple[torch.Tensor, object]:
    """One optimizer step of the trainer's shape: accumulate, global norm, clip, step."""
    losses = []
    for i, mb in enumerate(microbatches(global_batch(step), fabric.global_rank, fabric.world_size, ACCUM)):
        with fabric.no_backward_sync(module, enabled=i < ACCUM - 1):
            loss = module(mb)
            fabric.backward(loss / ACCUM)
        losses.append(loss.detach())
    gn = compute_grad_norm(lm.named_parameters())
    clip_grad_norm_with_total(gn.params, 1.0, gn.total)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean")
    return loss, gn


def norms(out: Path) -> None:
    fabric = fabric_for()
    rank = fabric.global_rank
    lm = build_lm(0)
    units = fsdp_units(Step(lm))
    module = fabric.setup_module(Step(lm))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(lm.parameters(), lr=0.1))
    seen = {
        "rank": rank,
        "world_size": fabric.world_size,
        "units": units,
        "classes": {n: type(m).__name__ for n, m in lm.named_modules() if n in ("", "blocks.0", "head")},
        "param_names": [n for n, _ in lm.named_parameters()],
        "param_types": sorted({type(p).__name__ for p in lm.parameters()}),
    }
    init_state, _ = gather_full_state(lm)
    torch.save(local_shards(lm.named_parameters()), out / f"shard_rank{rank}.pt")

    for i, mb in enumerate(microbatches(global_batch(0), rank, fabric.world_size, ACCUM)):
        with fabric.no_backward_sync(module, enabled=i < ACCUM - 1):
            fabric.backward(module(mb) / ACCUM)
    grads = [p.grad for p in lm.parameters()]
    seen["grad_types"] = sorted({type(g).__name__ for g in grads})

    reductions = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        reductions.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    with CountSyncs() as syncs:
        gn = compute_grad_norm(lm.named_parameters())
        layer_names, layer_norms = layer_grad_norms(gn)
    dist.all_reduce = all_reduce
    seen["syncs"], seen["all_reduces"] = syncs.count, len(reductions)
    seen["total"] = float(gn.total)
    seen["layer"] = dict(zip(layer_names, layer_norms.tolist()))
    local = torch._foreach_norm([g.to_local() for g in grads])
    seen["local_only_total"] = float(torch.linalg.vector_norm(torch.stack(local)))
    seen["torch_get_total_norm"] = float(torch.nn.utils.get_total_norm(grads).full_tensor())
    # A plain (replicated) parameter among the sharded ones: counted once, not summed over ranks.
    extra = torch.nn.Parameter(torch.zeros(2))
    extra.grad = torch.tensor([3.0, 4.0])
    mixed = compute_grad_norm([("extra", extra), *lm.named_parameters()])
    seen["mixed_total"], seen["mixed_extra"] = float(mixed.total), float(mixed.per_param[0])
    seen["mixed_layer"] = float(mixed.per_param[-1])

    clip_grad_norm_with_total(gn.params, CLIP, gn.total)
    clipped = {n: p.grad.full_tensor() for n, p in lm.named_parameters()}
    optimizer.step()
    stepped_state, _ = gather_full_state(lm)
    torch.save(local_shards(lm.named_parameters()), out / f"shard_after_rank{rank}.pt")

    # A NaN in one element of rank 1's shard: every rank's global norm sees it and names it.
    weight = lm.blocks[1].mlp.fc1.weight
    if rank == 1:
        weight.grad.to_local()[0, 0] = float("nan")
    gn = compute_grad_norm(lm.named_parameters())
    seen["nan_total_finite"] = bool(torch.isfinite(gn.total))
    seen["nan_names"] = gn.nonfinite_names()

    # Shapes FSDP's parameters rarely have: one row (rank 1's shard is empty), odd lengths, dim 1.
    from torch.distributed.tensor import Shard, distribute_tensor

    odd = {}
    for name, shape, dim in ODD_SHAPES:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        odd[name] = distribute_tensor(full, fabric.strategy.device_mesh["data_parallel"], [Shard(dim)])
    torch.save(local_shards(odd.items()), out / f"odd_rank{rank}.pt")

    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        torch.save({"init": init_state, "clipped": clipped, "stepped": stepped_state}, out / "full.pt")


def nodes(out: Path) -> None:
    """2 nodes x 1 process: ranks from the launcher, a fault on node 1 stops both at the same step."""
    fabric = fabric_for(num_nodes=2)
    seen = {
        "environment": type(fabric._connector.cluster_environment).__name__,
        "global_rank": fabric.global_rank,
        "node_rank": fabric.node_rank,
        "local_rank": fabric.local_rank,
        "world_size": fabric.world_size,
        "mesh": list(fabric.strategy.device_mesh.shape),
    }
    lm = build_lm(0)
    module = fabric.setup_module(Step(lm))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(lm.parameters(), lr=0.1))
    seen["norms"], seen["stopped_at"] = [], None
    for step in range(4):
        for i, mb in enumerate(microbatches(global_batch(step), fabric.global_rank, fabric.world_size, ACCUM)):
            with fabric.no_backward_sync(module, enabled=i < ACCUM - 1):
                fabric.backward(module(mb) / ACCUM)
        if step == FAULT_STEP and fabric.node_rank == 1:
            lm.head.weight.grad.to_local()[0, 0] = float("inf")
        gn = compute_grad_norm(lm.named_parameters())
        total = float(gn.total)  # the same value on every rank: the decision needs no collective
        seen["norms"].append(total)
        if not torch.isfinite(torch.tensor(total)):
            seen["stopped_at"], seen["nonfinite"] = step, gn.nonfinite_names()
            break
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.save(local_shards(lm.named_parameters()), out / f"shard_rank{fabric.global_rank}.pt")
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if mode == "norms":
        norms(out)
    elif mode == "nodes":
        nodes(out)
    else:
        raise SystemExit(f"unknown mode {mode!r}: norms or nodes")
