"""Sharded (DCP) against full-file checkpoints under FSDP2 on 2 CPU processes: rank 0's peak host memory
during a save, and what a save costs the training steps, synchronous and asynchronous.

    python benchmarks/sharded_checkpoints.py [--dim 512] [--layers 8] [--repeats 3]

Runs the stabletrain code paths the trainer runs: the full file (``gather_checkpoint_parts`` then
``save_checkpoint``: every rank takes part in the gather, rank 0 holds the whole state and writes it) and
the sharded folder (``sharded_state`` then ``write_shards``: each rank writes its own shards; ``begin_sharded`` /
``commit_sharded`` around it on rank 0). Memory: rank 0's peak resident set during the save above the one
before it (Linux: ``/proc/self/clear_refs`` resets the peak, ``VmHWM`` reads it). Time: the seconds a save
holds the loop, and the time of 4 training steps after it started, against 4 steps without a save,
interleaved repeats in one run. Fabric re-runs this script for rank 1.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def peak_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))  # type: ignore[union-attr]


def rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))  # type: ignore[union-attr]


def reset_peak() -> None:
    """Give freed heap memory back to the system (glibc keeps it otherwise, and a save could reuse it
    unseen), then reset the peak."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")


class _Bench:
    """The sharded model on this rank, its optimizer, one batch, and the two kinds of save."""

    def __init__(self, args: argparse.Namespace):
        from lightning_fabric import Fabric
        from torch import nn

        from stabletrain.distributed import fabric_strategy
        from stabletrain.tasks.language_model import TransformerLM

        torch.set_num_threads(1)
        self.fabric = fabric = Fabric(accelerator="cpu", devices=2, strategy=fabric_strategy("fsdp"))
        fabric.launch()
        self.rank = fabric.global_rank
        folder = args.out or (tempfile.mkdtemp(prefix="sharded_bench_") if self.rank == 0 else "")
        self.folder = Path(fabric.broadcast(folder))
        self.keep_folder = bool(args.out)
        torch.manual_seed(0)
        self.lm = TransformerLM(vocab_size=256, n_layers=args.layers, n_heads=8, dim=args.dim, context_length=64,
                                dropout=0.0)

        class Step(nn.Module):
            def __init__(self, model: nn.Module):
                super().__init__()
                self.model = model

            def forward(self, batch):  # type: ignore[no-untyped-def]
                return self.model.training_step(batch)

        self.module = fabric.setup_module(Step(self.lm))
        self.optimizer = torch.optim.AdamW(self.lm.parameters(), lr=1e-4)
        fabric.setup_optimizers(self.optimizer)
        ids = torch.randint(256, (4, 65), generator=torch.Generator().manual_seed(self.rank))
        self.batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        self.group = torch.distributed.new_group(backend="gloo")  # the background writes' own
        self.step()  # the optimizer state exists from here on

    def step(self) -> None:
        self.fabric.backward(self.module(self.batch))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save_full(self, step_no: int) -> None:
        from stabletrain.distributed.checkpoint_state import gather_checkpoint_parts
        from stabletrain.runfiles.checkpoint import save_checkpoint

        model, optim = gather_checkpoint_parts(self.lm, self.optimizer)
        if self.rank == 0:
            save_checkpoint({"step": step_no, "model": model, "optimizer": optim}, self.folder / "full",
                            periodic=False, keep=1)
        self.fabric.barrier()

    def save_sharded(self, step_no: int, asynchronous: bool = False):  # type: ignore[no-untyped-def]
        from stabletrain.distributed.dcp import sharded_state, write_shards
        from stabletrain.runfiles.checkpoint import begin_sharded, sharded_target

        out = self.folder / "sharded"
        state = sharded_state(self.lm, self.optimizer)
        if self.rank == 0:
            begin_sharded(self.meta(step_no), out, False, nbytes=0)
        self.fabric.barrier()
        tmp, _ = sharded_target(out, step_no, False)
        future = write_shards(state, tmp, asynchronous=asynchronous, process_group=self.group if asynchronous else None)
        if future is None:
            self.commit(step_no)
        return future

    def save_async_and_wait(self, step_no: int) -> None:
        self.save_sharded(step_no, asynchronous=True).result()
        self.commit(step_no)

    def commit(self, step_no: int) -> None:
        from stabletrain.runfiles.checkpoint import commit_sharded

        if self.rank == 0:
            commit_sharded(self.meta(step_no), self.folder / "sharded", False, keep=1)

    @staticmethod
    def meta(step_no: int) -> dict:
        return {"step": step_no, "health": {"healthy": True}}

    def snapshot(self, step_no: int) -> None:
        """What ``on_instability.policy=rollback`` keeps under FSDP2: a CPU copy of this rank's shards."""
        from torch.utils._pytree import tree_map

        from stabletrain.distributed.dcp import sharded_state

        self.kept = tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x,
                             sharded_state(self.lm, self.optimizer))

    def peak_above_before(self, save) -> float:  # type: ignore[no-untyped-def]
        """MiB: rank 0's peak resident memory during ``save(1)`` above its level just before."""
        self.fabric.barrier()
        reset_peak()
        before = rss_kib()
        save(1)
        return (peak_kib() - before) / 1024

    def timed(self, kind: str) -> tuple[float, float]:
        """Seconds the save held the loop, and of the save plus 4 steps after it (commit included)."""
        self.fabric.barrier()
        start = time.perf_counter()
        future = None
        if kind == "sync save":
            self.save_sharded(2)
        elif kind == "async save":
            future = self.save_sharded(2, asynchronous=True)
        blocked = time.perf_counter() - start
        for _ in range(4):
            self.step()
        if future is not None:
            future.result()
            self.commit(2)
        self.fabric.barrier()
        return blocked, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bench = _Bench(args)
    memory: dict[str, list[float]] = {"sharded": [], "sharded asynchronous": [], "full": [], "rollback snapshot": []}
    blocks: dict[str, list[float]] = {"sync save": [], "async save": []}
    totals: dict[str, list[float]] = {"no save": [], "sync save": [], "async save": []}
    for _ in range(args.repeats):  # interleaved: each repeat measures every kind once
        memory["sharded"].append(bench.peak_above_before(bench.save_sharded))
        memory["sharded asynchronous"].append(bench.peak_above_before(bench.save_async_and_wait))
        memory["full"].append(bench.peak_above_before(bench.save_full))
        bench.kept = None
        memory["rollback snapshot"].append(bench.peak_above_before(bench.snapshot))
        for kind in totals:
            blocked, total = bench.timed(kind)
            totals[kind].append(total)
            if kind in blocks:
                blocks[kind].append(blocked)
    if bench.rank == 0:
        report(bench, args, memory, blocks, totals)
        if not bench.keep_folder:
            shutil.rmtree(bench.folder, ignore_errors=True)
    bench.fabric.barrier()


def report(bench: _Bench, args: argparse.Namespace, memory: dict, blocks: dict, totals: dict) -> None:
    from stabletrain.distributed.dcp import local_tensors, sharded_state

    n_params = sum(p.numel() for p in bench.lm.parameters())
    full_bytes = n_params * 12
    mine = sum(t.numel() * t.element_size() for t in local_tensors(sharded_state(bench.lm, bench.optimizer)))
    print(f"model: {n_params:,} parameters; float32 AdamW state {full_bytes / 2**20:,.1f} MiB in all, rank 0's "
          f"shards {mine / 2**20:,.1f} MiB (2 CPU processes, loaded 2-core machine, {args.repeats} repeats)")
    for kind, values in memory.items():
        what = f"a {kind} save" if kind != "rollback snapshot" else "a rollback snapshot (a CPU copy of its shards)"
        print(f"rank 0 peak host memory during {what}, above its level before it: median "
              f"{statistics.median(values):7.1f} MiB  ({', '.join(f'{v:.1f}' for v in values)})")
    from stabletrain.safety.healing import snapshot_bytes

    print(f"the rollback snapshot holds {snapshot_bytes(bench.kept) / 2**20:.1f} MiB on rank 0 (snapshot_bytes)")
    base = statistics.median(totals["no save"])
    for kind in blocks:
        total = statistics.median(totals[kind])
        print(f"a sharded {kind:<10} + 4 steps: {total:6.2f} s vs 4 steps alone {base:.2f} s (+{total - base:.2f} s); "
              f"the save held the loop {statistics.median(blocks[kind]):.2f} s")
    sizes = {p.name: p.stat().st_size for p in (bench.folder / "sharded" / "checkpoints" / "last.ckpt").iterdir()}
    full = (bench.folder / "full" / "checkpoints" / "last.ckpt").stat().st_size
    print(f"sharded last.ckpt/: {', '.join(f'{k} {v / 2**20:.1f} MiB' for k, v in sorted(sizes.items()))}; "
          f"full last.ckpt: {full / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
