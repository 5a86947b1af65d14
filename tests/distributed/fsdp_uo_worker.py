"""Run by tests/distributed/test_fsdp_uo.py under torchrun: underflow_overflow on the built-in LM
sharded with FSDP2 through Lightning Fabric on CPU processes (gloo).

    torchrun --nproc_per_node 2 fsdp_uo_worker.py OUT

Four runs, each with a fresh model and monitor, each in its own folder under OUT:

* ``trace``: steps 0 and 1 traced through the trainer's callback (every frame in the log);
* ``weight``: an Inf written into rank 1's shard of ``blocks.1.mlp.fc1.weight`` before step 2;
* ``activation``: rank 1's ``blocks.0.mlp.fc2`` returns an Inf at step 1 (rank 0 is healthy);
* ``shard_grad``: a plain loop with ``check_all_ranks``; an Inf in rank 1's shard of the
  gradient of ``head.weight`` at step 1, written before the monitor's hook reads it.

Every rank writes ``OUT/<run>/rank{global_rank}.json`` (what it saw and raised); the monitor
writes ``OUT/<run>/debug/underflow_overflow_rank{global_rank}.log``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from fsdp_common import ACCUM, Step, build_lm, global_batch, microbatches
from lightning_fabric import Fabric

from stabletrain.config import UnderflowOverflowArgs
from stabletrain.debug.underflow_overflow import (
    UnderflowOverflowCallback,
    UnderflowOverflowError,
    UnderflowOverflowMonitor,
)
from stabletrain.distributed import fabric_strategy
from stabletrain.utils.dist import max_over_ranks

STEPS = 3
TRACED = [0, 1]
WEIGHT_FAULT_STEP, ACTIVATION_FAULT_STEP, GRAD_FAULT_STEP = 2, 1, 1
FAULTY_RANK = 1
LR = 0.1


class Loop:
    """What the callback uses of stabletrain's Trainer, around a Fabric running FSDP2: the same
    order of events as ``Trainer.train_step`` (the trainer is not wired for FSDP yet)."""

    def __init__(self, fabric: Fabric, out: Path, args: UnderflowOverflowArgs):
        self.fabric = fabric
        self.out = out
        self.rank, self.world_size = fabric.global_rank, fabric.world_size
        self.model = build_lm(0)
        self.fabric_module = fabric.setup_module(Step(self.model))
        self.optimizer = fabric.setup_optimizers(torch.optim.SGD(self.model.parameters(), lr=LR))
        self.settings = SimpleNamespace(gradient_accumulation_steps=ACCUM)
        self.scaler = None
        self.step = 0
        self.console = SimpleNamespace(info=lambda msg: None)
        self.events: list[dict] = []
        self.stop_reason: Optional[str] = None
        self.callback = UnderflowOverflowCallback(args)

    def max_over_ranks(self, value: Any) -> float:
        return max_over_ranks(value, self.fabric)

    def log_event(self, event: dict) -> None:
        self.events.append(event)

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def fit(self, before_step: Callable[[int], None] = lambda step: None) -> dict:
        """Train STEPS steps; what this rank saw and raised."""
        cb = self.callback
        cb.on_train_start(self)
        seen: dict[str, Any] = {"rank": self.rank, "steps_done": [], "error": None}
        try:
            for step in range(STEPS):
                self.step = step
                before_step(step)
                cb.on_step_start(self, step=step)
                for i, mb in enumerate(microbatches(global_batch(step), self.rank, self.world_size, ACCUM)):
                    cb.on_microbatch(self, step=step, micro_step=i, batch=mb, indices=None)
                    with self.fabric.no_backward_sync(self.fabric_module, enabled=i < ACCUM - 1):
                        loss = self.fabric_module(mb)
                        cb.on_before_backward(self, step=step, micro_step=i, loss=loss)
                        self.fabric.backward(loss / ACCUM)
                cb.on_after_backward(self, step=step, grad_norm=None)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                cb.on_after_optimizer_step(self, step=step)
                seen["steps_done"].append(step)
        except UnderflowOverflowError as exc:
            seen["error"] = error_record(exc)
            cb.on_exception(self, exception=exc)
        else:
            cb.on_train_end(self)
        seen["events"] = self.events
        return seen


def error_record(exc: UnderflowOverflowError) -> dict:
    record = {k: getattr(exc, k) for k in ("step", "rank", "detected_by", "phase", "module", "tensor", "value")}
    record.update(log_path=str(exc.log_path), message=str(exc))
    return record


def trace_run(fabric: Fabric, out: Path) -> dict:
    loop = Loop(fabric, out, UnderflowOverflowArgs(enabled=True, trace_batch_nums=TRACED))
    seen = loop.fit()
    seen["module_names"] = [n for n, _ in loop.model.named_modules()]
    seen["param_names"] = [n for n, _ in loop.model.named_parameters()]
    seen["param_types"] = sorted({type(p).__name__ for p in loop.model.parameters()})
    seen["sharded"] = loop.callback._watching().sharded
    return seen


def weight_run(fabric: Fabric, out: Path) -> dict:
    loop = Loop(fabric, out, UnderflowOverflowArgs(enabled=True))
    weight = loop.model.blocks[1].mlp.fc1.weight

    def plant(step: int) -> None:
        if step == WEIGHT_FAULT_STEP and fabric.global_rank == FAULTY_RANK:
            with torch.no_grad():
                weight.to_local()[0, 0] = float("inf")  # rank 1's shard only

    return loop.fit(plant)


def activation_run(fabric: Fabric, out: Path) -> dict:
    loop = Loop(fabric, out, UnderflowOverflowArgs(enabled=True))
    state = {"step": -1}

    def inf_output(module: torch.nn.Module, args: Any, output: torch.Tensor) -> Optional[torch.Tensor]:
        if state["step"] == ACTIVATION_FAULT_STEP and fabric.global_rank == FAULTY_RANK:
            output = output.clone()
            output[0, 0, 0] = float("inf")
            return output
        return None

    # Registered before the monitor's hooks (on_train_start), so the monitor sees the Inf.
    loop.model.blocks[0].mlp.fc2.register_forward_hook(inf_output)
    return loop.fit(lambda step: state.update(step=step))


def shard_grad_run(fabric: Fabric, out: Path) -> dict:
    """A plain loop: the monitor with auto_check=False and one collective decision per phase."""
    rank = fabric.global_rank
    lm = build_lm(0)
    module = fabric.setup_module(Step(lm))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(lm.parameters(), lr=LR))
    state = {"step": -1}

    def inf_grad(p: torch.Tensor) -> None:
        if state["step"] == GRAD_FAULT_STEP and rank == FAULTY_RANK:
            p.grad.to_local()[0, 0] = float("inf")

    lm.head.weight.register_post_accumulate_grad_hook(inf_grad)  # before the monitor's hook
    seen: dict[str, Any] = {"rank": rank, "steps_done": [], "error": None}
    with UnderflowOverflowMonitor(lm, out_dir=out / "debug", rank=rank, auto_check=False) as monitor:
        seen["sharded"] = monitor.sharded
        try:
            for step in range(STEPS):
                state["step"] = step
                monitor.set_step(step)
                for i, mb in enumerate(microbatches(global_batch(step), rank, fabric.world_size, ACCUM)):
                    monitor.micro_step = i
                    with fabric.no_backward_sync(module, enabled=i < ACCUM - 1):
                        loss = module(mb)
                        monitor.record_loss(loss)
                        monitor.check_all_ranks(fabric)
                        fabric.backward(loss / ACCUM)
                monitor.check_all_ranks(fabric)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                seen["steps_done"].append(step)
        except UnderflowOverflowError as exc:
            seen["error"] = error_record(exc)
    return seen


def sharded_too_late(fabric: Fabric) -> str:
    """A monitor created before fabric.setup_module: refused at the first set_step."""
    lm = build_lm(0)
    monitor = UnderflowOverflowMonitor(lm, out_dir="/nonexistent", rank=fabric.global_rank, auto_check=False)
    fabric.setup_module(Step(lm))
    try:
        monitor.set_step(0)
    except ValueError as exc:
        return str(exc)
    finally:
        monitor.close()
    return ""


RUNS = {"trace": trace_run, "weight": weight_run, "activation": activation_run, "shard_grad": shard_grad_run}

if __name__ == "__main__":
    out = Path(sys.argv[1])
    fabric = Fabric(accelerator="cpu", devices=2, strategy=fabric_strategy("fsdp"))
    fabric.launch()
    for name, run in RUNS.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        seen = run(fabric, folder)
        if name == "trace":
            seen["too_late"] = sharded_too_late(fabric)
        (folder / f"rank{fabric.global_rank}.json").write_text(json.dumps(seen))
        fabric.barrier()
