"""The cost of watching every module for non-finite values, side by side in one run.

Three copies of the benchmark model (built-in transformer LM, see ``common.py``) train on
the same batches with AdamW, interleaved round by round so that machine noise hits all
alike:

* no monitor;
* stabletrain's ``UnderflowOverflowMonitor`` (forward and backward, in a plain loop);
* Hugging Face transformers' ``DebugUnderflowOverflow`` (forward only; ``pip install
  ".[bench]"``), the tool this design comes from;
* LightlyTrain's ``UnderflowOverflowMonitor`` (forward only: its vendored copy of the same class,
  driven by step number), when its wheel or install is given (``--lightly-train``; ``peers.py``
  says how to get it without its dependencies).

More copies run stabletrain's monitor forward only (as the peers are) and with its statistics
kernel replaced, to show where the time goes and where the floor is:

* ``hooks only``: every hook runs, every row is recorded, but no tensor is read (the kernel
  returns a constant): the Python cost of watching every module;
* ``one read per tensor``: the kernel is a plain ``sum`` of each tensor it would measure: one
  read of every activation, gradient and weight, the least any exact statistic of them costs.

It prints the step time of each over the plain loop's, and the host synchronisations
(``aten._local_scalar_dense``) each adds per training step. Goal for stabletrain: at most
1.05x step time and 2 added synchronisations. On a loaded machine use ``--clock cpu
--threads 1`` (CPU time of one thread, far less disturbed by other processes than wall time).

``--kernel`` instead times the statistics kernel alone on CPU tensors of 8 MiB to 128 MiB, each
written just before it is measured (as a module's output is): over the whole tensor, in 1 MiB
chunks (what the monitor does past 2 MiB), and one plain read, interleaved.

    python benchmarks/underflow_overflow_overhead.py [--rounds 12] [--repeats 1] [--threads N] [--clock wall|cpu]
                                                     [--device cpu|cuda] [--lightly-train WHEEL_OR_DIR]
    python benchmarks/underflow_overflow_overhead.py --kernel [--rounds 21] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from common import bench_model_and_batches, device_sync, interleaved, machine, median
from peers import lightly_train_debug_module

from stabletrain import UnderflowOverflowMonitor
from stabletrain.debug.underflow_overflow import stats
from stabletrain.utils.sync import CountSyncs

_ZERO = torch.zeros(())


def _hooks_only(t: torch.Tensor, scratch: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _ZERO, _ZERO


def _one_read(t: torch.Tensor, scratch: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sum(t)
    return s, s


class Loop:
    """One model, its optimizer and a cycle of batches: ``step()`` is one training step."""

    def __init__(self, model: torch.nn.Module, batches: list[Any], before_step: Callable[[int], None] = lambda s: None,
                 kernel: Any = None):
        self.model, self.batches, self.before_step, self.kernel = model, batches, before_step, kernel
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.n = 0

    def step(self) -> None:
        real = stats.raw_stats
        if self.kernel is not None:
            stats.raw_stats = self.kernel
        try:
            self.before_step(self.n)
            loss = self.model.training_step(self.batches[self.n % len(self.batches)])
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            stats.raw_stats = real
        self.n += 1


def syncs_per_step(loop: Loop) -> int:
    with CountSyncs() as counter:
        loop.step()
    return counter.count


def kernel_sizes(rounds: int) -> None:
    """The statistics kernel alone, whole tensor against 1 MiB chunks, by tensor size (CPU)."""
    from statistics import median

    from stabletrain.debug.underflow_overflow import stats

    def whole(t: torch.Tensor, scratch: dict) -> Any:
        chunk, stats.CHUNK = stats.CHUNK, 1 << 62  # never chunked
        try:
            return stats.raw_stats(t, scratch)
        finally:
            stats.CHUNK = chunk

    print(f"statistics kernel, {torch.get_num_threads()} threads, wall clock, median of {rounds} interleaved rounds "
          "(each tensor written just before)")
    for numel in (1 << 21, 1 << 23, 1 << 25):
        t, src = torch.empty(numel), torch.randn(numel)
        scratch_a: dict = {}
        scratch_b: dict = {}
        kinds: dict[str, Callable[[], Any]] = {
            "write": lambda: None, "one read": lambda t=t: torch.sum(t),
            "whole": lambda t=t, s=scratch_a: whole(t, s), "chunks": lambda t=t, s=scratch_b: stats.raw_stats(t, s)}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(rounds):
            for name, f in kinds.items():
                t0 = time.perf_counter()
                for _ in range(5):
                    torch.add(src, 1.0, out=t)
                    f()
                times[name].append((time.perf_counter() - t0) / 5)
        base = median(times["write"])
        us = {k: (median(v) - base) * 1e6 for k, v in times.items() if k != "write"}
        print(f"  {numel * 4 / 2**20:5.0f} MiB: one read {us['one read']:7.0f} us, whole tensor {us['whole']:7.0f} us, "
              f"1 MiB chunks {us['chunks']:7.0f} us ({us['chunks'] / us['whole']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--lightly-train", default=None, metavar="WHEEL_OR_DIR",
                        help="LightlyTrain's wheel or install folder (default: an installed lightly_train, if any)")
    parser.add_argument("--kernel", action="store_true", help="time the statistics kernel alone by tensor size")
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.kernel:
        return kernel_sizes(ns.rounds)

    model, batches = bench_model_and_batches(num_batches=4, device=ns.device)
    loops: dict[str, Loop] = {"no monitor": Loop(model, batches)}

    ours_model = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as tmp:
        monitor = UnderflowOverflowMonitor(ours_model, out_dir=tmp)
        loops["stabletrain UnderflowOverflowMonitor"] = Loop(ours_model, batches, monitor.set_step)
        floors = []
        for name, kernel in (("  hooks only (no read)", _hooks_only), ("  one read per tensor (floor)", _one_read)):
            m = copy.deepcopy(model)
            floors.append(UnderflowOverflowMonitor(m, out_dir=tmp, rank=len(floors) + 1))
            loops[name] = Loop(m, batches, floors[-1].set_step, kernel=kernel)
        fw_model = copy.deepcopy(model)
        floors.append(UnderflowOverflowMonitor(fw_model, out_dir=tmp, rank=len(floors) + 1, include_backward=False))
        loops["  forward only (include_backward=False)"] = Loop(fw_model, batches, floors[-1].set_step)
        try:
            from transformers.debug_utils import DebugUnderflowOverflow
        except ImportError:
            print("transformers is not installed (pip install -e '.[bench]'): skipping DebugUnderflowOverflow")
        else:
            hf_model = copy.deepcopy(model)
            DebugUnderflowOverflow(hf_model)
            loops["transformers DebugUnderflowOverflow"] = Loop(hf_model, batches)
        lt_module, lt_label = lightly_train_debug_module(ns.lightly_train)
        lt_log = None
        if lt_module is None:
            print(f"skipping LightlyTrain's monitor: {lt_label}")
        else:
            # As LightlyTrain's UnderflowOverflowMonitor drives it (peers.py).
            lt_log = open(Path(tmp) / "lightly_train_underflow_overflow_rank0.log", "a")
            lt_model = copy.deepcopy(model)
            lt = lt_module.DebugUnderflowOverflow(lt_model, max_frames_to_save=21, trace_batch_nums=[],
                                                  abort_after_batch_num=None, log_file=lt_log,
                                                  batch_number_mode="manual")
            loops[f"{lt_label} UnderflowOverflowMonitor"] = Loop(lt_model, batches, lt.set_batch_number)

        syncs = {name: syncs_per_step(loop) for name, loop in loops.items()}
        clock = time.process_time if ns.clock == "cpu" else time.perf_counter
        times = interleaved({name: loop.step for name, loop in loops.items()}, repeats=ns.repeats, rounds=ns.rounds,
                            sync=device_sync(ns.device), clock=clock)
        monitor.close()
        for f in floors:
            f.close()
        if lt_log is not None:
            lt_log.close()

    base = times["no monitor"]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"machine: {machine()}, device {ns.device}, {ns.clock} clock")
    print("model: built-in transformer LM, 4 layers, dim 256, batch 16, context 128 "
          f"({n_params / 1e6:.1f}M parameters); "
          f"AdamW step; {ns.rounds} rounds x {ns.repeats} steps, interleaved")
    print(f"{'':46}{'ms/step':>10}{'ratio (median, quartiles)':>28}{'added syncs/step':>18}")
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        q = sorted(ratios)
        spread = f"{median(ratios):.3f}x ({q[len(q) // 4]:.3f}-{q[(3 * len(q)) // 4]:.3f})"
        print(f"{name:46}{median(ts) * 1e3:>10.0f}{spread:>28}{syncs[name] - syncs['no monitor']:>18}")


if __name__ == "__main__":
    main()
