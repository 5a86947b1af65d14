"""What the integrations' guard costs with several processes: its verdict agreed over ranks.

Two processes (torchrun, gloo, CPU) train the benchmark language model (``common.py``) in the
Accelerate loop of ``integrations_overhead.py`` under DDP, with ``StepMonitor`` in both variants
(nancapture, mechanisms and trend alerts off: the guard is all that differs), interleaved step
by step on two copies of the model:

* ``guard=False``;
* ``guard=True``: after each optimizer step the check of the optimizer state, agreed over ranks
  by an asynchronous all-reduce read at the next step's end (with nancapture on it rides on
  nancapture's read instead and adds no collective).

It prints, from rank 0, the median step time of each and their ratio, and the time spent in
``end_step`` per step (the check, the agreement's start and the last one's read). Host syncs
added per step are counted on rank 0 (``CountSyncs``).

    python benchmarks/integrations_ddp_guard.py [--steps 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_model_and_batches, machine  # noqa: E402

OFF = {"nancapture": {"enabled": False}, "mechanisms": {"enabled": False}}


def worker(steps: int, threads: int) -> None:
    from accelerate import Accelerator

    from stabletrain.integrations.accelerate import StepMonitor
    from stabletrain.utils.sync import CountSyncs

    torch.set_num_threads(threads)
    accelerator = Accelerator(cpu=True)
    base, batches = bench_model_and_batches(8, seed=accelerator.process_index)
    out = tempfile.TemporaryDirectory()
    own = {True: 0.0, False: 0.0}

    def make(guard: bool):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = accelerator.prepare(model, optimizer)
        monitor = StepMonitor(accelerator, model, out_dir=out.name, debug_args=OFF, trend_alerts={"enabled": False},
                              guard=guard)
        data, counter = itertools.cycle(batches), itertools.count()

        def step() -> None:
            i = next(counter)
            batch = next(data)
            monitor.begin_step(i)
            monitor.collect_batch(batch)
            loss = accelerator.unwrap_model(model).training_step(batch)
            monitor.collect_loss(loss)
            accelerator.backward(loss)
            monitor.check(optimizer)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            monitor.end_step()
            own[guard] += time.perf_counter() - t0

        return step, monitor

    variants = {False: make(False), True: make(True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    syncs = {}
    for i in range(steps + 2):
        for guard in ((False, True) if i % 2 == 0 else (True, False)):
            step, _ = variants[guard]
            with CountSyncs() as counter:
                t0 = time.perf_counter()
                step()
                elapsed = time.perf_counter() - t0
            if i >= 2:  # warm-up
                times[guard].append(elapsed)
                syncs[guard] = syncs.get(guard, 0) + counter.count
    for _, monitor in variants.values():
        monitor.close()
    if accelerator.is_main_process:
        off, on = median(times[False]), median(times[True])
        print(f"{machine()}; 2 processes (gloo), {threads} torch thread(s) each, {steps} interleaved steps per variant")
        print(f"step time: guard off {off * 1e3:.1f} ms, guard on (agreed over ranks) {on * 1e3:.1f} ms: "
              f"{on / off:.3f}x")
        per_step = {g: own[g] / (steps + 2) * 1e3 for g in own}
        print(f"end_step per step: {per_step[False]:.3f} ms off, {per_step[True]:.3f} ms on")
        print(f"host syncs added per step on rank 0: {(syncs[True] - syncs[False]) / steps:+.2f}")
    accelerator.wait_for_everyone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(args.steps, args.threads)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           __file__, "--steps", str(args.steps), "--threads", str(args.threads)]
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
