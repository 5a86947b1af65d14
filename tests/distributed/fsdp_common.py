"""What the FSDP worker processes and the single-process references share: the model, the data,
the step, and a torchrun launcher with a timeout."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from stabletrain.tasks.language_model import TransformerLM

WORKER = Path(__file__).with_name("fsdp_worker.py")
# 65 rows in the embedding and head: uneven shards (33 + 32 rows on 2 ranks).
VOCAB, CONTEXT = 65, 16
GLOBAL_BATCH, ACCUM = 8, 2


def build_lm(seed: int = 0, dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> TransformerLM:
    """The built-in LM (2 blocks, dim 32); the same weights in every process for a given seed."""
    torch.manual_seed(seed)
    return TransformerLM(vocab_size=VOCAB, n_layers=2, n_heads=2, dim=32, context_length=CONTEXT,
                         dropout=dropout).to(dtype)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s GLOBAL_BATCH sequences; rank r of W trains on rows r*B/W .. (r+1)*B/W."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(VOCAB, (GLOBAL_BATCH, CONTEXT + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def rows(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in batch.items()}


def microbatches(batch: dict[str, torch.Tensor], rank: int, world: int, accum: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s share of a global batch, split into ``accum`` equal microbatches."""
    per_rank = GLOBAL_BATCH // world
    per_micro = per_rank // accum
    first = rank * per_rank
    return [rows(batch, first + i * per_micro, first + (i + 1) * per_micro) for i in range(accum)]


class Step(nn.Module):
    """The trainer's shape: the module that FSDP shards at the root runs the whole training step."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: Any) -> torch.Tensor:
        return self.model.training_step(batch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(node: int, port: int, script: Path, args: Sequence[str], rdzv: str = "static") -> list[str]:
    """``torchrun`` for node ``node`` of 2 "nodes" of one process each on this machine, with a
    static (``--node-rank`` honoured) or a c10d rendezvous on localhost:``port``."""
    where = (["--master-addr=127.0.0.1", f"--master-port={port}"] if rdzv == "static"
             else ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test"])
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node-rank={node}",
            *where, str(script), *args]


def torchrun(
    args: Sequence[str], nproc: int = 2, timeout: float = 240, extra: Sequence[str] = ()
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node NPROC fsdp_worker.py ARGS`` on localhost; fails the test on a hang."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra]
    if not extra:
        cmd += ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    cmd += [str(WORKER), *args]
    from conftest import cli_env  # here: the worker processes import this file without tests/ on sys.path

    env = cli_env()
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
