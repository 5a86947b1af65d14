"""Two "nodes" of one process each on this machine: torchrun with a static or a c10d rendezvous,
and SLURM's srun simulated by its environment variables. Fabric picks up the launcher's ranks,
FSDP2 shards over both nodes, and a fault on node 1 stops node 0 at the same step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from fsdp_common import WORKER, build_lm, free_port, node_command
from fsdp_worker import FAULT_STEP

from stabletrain.distributed import reassemble

pytestmark = pytest.mark.slow


def _launch(how: str, node: int, port: int, out) -> subprocess.Popen:
    from conftest import cli_env

    env = cli_env()
    env["OMP_NUM_THREADS"] = "1"
    if how == "slurm":
        # What srun sets for `srun --nodes 2 --ntasks-per-node 1` (MASTER_* come from the batch script).
        env.update(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="2", SLURM_PROCID=str(node),
                   SLURM_LOCALID="0", SLURM_NODEID=str(node), SLURM_JOB_NAME="train", SLURM_JOB_ID="4242",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, str(WORKER), "nodes", str(out)]
    else:
        cmd = node_command(node, port, WORKER, ["nodes", str(out)], rdzv=how)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# torchrun with a static rendezvous runs the trainer itself in test_fsdp_nodes.py.
@pytest.mark.parametrize("how", ["c10d", "slurm"])
def test_two_nodes_rank_and_stop_together(tmp_path, how):
    port = free_port()
    procs = [_launch(how, node, port, tmp_path) for node in (0, 1)]
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-4000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected_env = "SLURMEnvironment" if how == "slurm" else "TorchElasticEnvironment"
    for rank, s in enumerate(seen):
        assert s["environment"] == expected_env
        assert (s["global_rank"], s["world_size"], s["local_rank"], s["mesh"]) == (rank, 2, 0, [2, 1])
        # One process per node: the node is the rank (the c10d rendezvous may number the nodes in
        # the order they joined, but consistently).
        assert s["node_rank"] == rank
        assert s["stopped_at"] == FAULT_STEP and s["nonfinite"] == ["head.weight"]
    assert seen[0]["norms"] == seen[1]["norms"], "one global norm, bitwise the same on both nodes"
    assert all(torch.isfinite(torch.tensor(seen[0]["norms"][:FAULT_STEP])))
    # Each node wrote its shard under its global rank; together they are the whole model.
    full = reassemble([torch.load(tmp_path / f"shard_rank{r}.pt", weights_only=True) for r in range(2)])
    assert list(full) == [n for n, _ in build_lm(0).named_parameters()]
