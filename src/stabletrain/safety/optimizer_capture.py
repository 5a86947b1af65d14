"""Capture the optimizer step the guard stopped at: re-run to it and save its state and gradients.

When an update makes finite parameters non-finite (and ``debug_args.nancapture.enabled=true``), the
trainer re-runs to the failing step from the newest checkpoint and captures the optimizer's state
and gradients right before the step (``reason = "optimizer_step"``);
:func:`stabletrain.debug.optimizer_step.diagnose_optimizer_step` replays it offline. See docs/blowups.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from stabletrain.debug.optimizer_damage import optimizer_name
from stabletrain.debug.optimizer_step import REASON_OPTIMIZER_STEP
from stabletrain.distributed.norms import local_tensor
from stabletrain.safety.guard import GuardFailure
from stabletrain.utils.text import shell_path

__all__ = ["capture_optimizer_step"]


class _Reached(Exception):
    """The re-run reached the failing step's optimizer step (control flow only)."""


def _cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_cpu(v) for v in obj]
    return obj


class _Collector:
    """Trainer callbacks for the re-run: collect step ``k`` and snapshot around its optimizer step."""

    def __init__(self, trainer: Any, k: int, monitor: Any):
        self.trainer, self.k, self.monitor = trainer, k, monitor
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}

    def on_step_start(self, trainer: Any, *, step: int) -> None:
        if step == self.k:
            self.monitor.begin_step(step)

    def on_microbatch(self, trainer: Any, *, step: int, micro_step: int, batch: Any, indices: Any) -> None:
        if step == self.k:
            self.monitor.collect_batch(batch, indices)

    def on_after_microbatch(self, trainer: Any, *, step: int, micro_step: int, loss: Tensor) -> None:
        if step == self.k:
            self.monitor.collect_loss(loss)

    def on_after_backward(self, trainer: Any, *, step: int, grad_norm: Any) -> None:
        if step == self.k:
            self.before["grad_norm"] = float(grad_norm.total)

    def on_before_optimizer_step(self, trainer: Any, *, step: int) -> None:
        if step != self.k:
            return
        model, optimizer = trainer.model, trainer.optimizer
        self.before["params"] = {n: _cpu(p) for n, p in model.named_parameters()}
        grads = {n: _cpu(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        state_dict = _cpu(optimizer.state_dict())
        if trainer.sharded:  # FSDP2: this rank's shards, with their places; replay puts every rank's together
            self.before.update(_as_shards(grads, state_dict, trainer.rank, trainer.world_size))
        else:
            self.before["grads"], self.before["state_dict"] = grads, state_dict

    def on_after_optimizer_step(self, trainer: Any, *, step: int) -> None:
        if step != self.k:
            return
        model, optimizer = trainer.model, trainer.optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        local = {n: local_tensor(p.detach()) for n, p in model.named_parameters()}  # FSDP2: this rank's shard
        self.after["params"] = {n: int((~torch.isfinite(t)).sum()) for n, t in local.items()
                                if not bool(torch.isfinite(t).all())}
        self.after["state"] = [f"{names.get(id(p), '?')}: {key}" for p, st in optimizer.state.items()
                               for key, v in st.items() if isinstance(v, Tensor) and v.is_floating_point()
                               and not bool(torch.isfinite(local_tensor(v)).all())]
        raise _Reached


def _as_shards(grads: dict[str, Any], state_dict: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """A sharded run's gradients and optimizer state as this rank's shards (``local_shards``): the
    state's tensors keyed ``"<position>/<entry>"``, the rest of ``state_dict`` kept without them."""
    from stabletrain.distributed.shards import local_shards

    tensors = {f"{i}/{key}": v for i, st in state_dict["state"].items() for key, v in st.items()
               if isinstance(v, Tensor)}
    rest = {"state": {i: {k: v for k, v in st.items() if not isinstance(v, Tensor)}
                      for i, st in state_dict["state"].items()},
            "param_groups": state_dict["param_groups"]}
    return {"grads": {}, "state_dict": rest, "grads_shards": local_shards(grads.items(), rank, world_size),
            "state_shards": local_shards(tensors.items(), rank, world_size)}


def _source(trainer: Any, k: int) -> tuple[Optional[dict[str, Any]], str]:
    """The newest state at or before step ``k`` to re-run from, and where it came from. A sharded
    checkpoint's folder under FSDP2 is read without its tensors: :func:`_restore` loads each rank's part."""
    from stabletrain.runfiles.checkpoint import checkpoint_dir, is_sharded_checkpoint, list_checkpoints, load_checkpoint

    usable = [c for c in list_checkpoints(checkpoint_dir(trainer.out)) if c.step <= k]
    if usable:
        path = usable[-1].path
        shards = trainer.sharded and is_sharded_checkpoint(path)
        return load_checkpoint(path, tensors=not shards), str(path)
    start = trainer.safety.start_state
    if start is not None:
        return start, "the start of the run"
    return None, ""


def _restore(trainer: Any, state: dict[str, Any], source: str) -> None:
    """Put ``state`` (from :func:`_source`) into the model and optimizer; under FSDP2 collective,
    whichever form it has: a sharded checkpoint's folder (each rank reads its part), the full state
    of a full file, or the shards of the start kept in memory (``layout`` sharded)."""
    model, optimizer = trainer.model, trainer.optimizer
    if not trainer.sharded:
        model.load_state_dict(state["model"])
        trainer._load_optimizer_state(state["optimizer"])
        return
    if "model" not in state:  # a sharded checkpoint's meta.pt: the shards are in its folder
        from stabletrain.distributed.dcp import load_shards

        load_shards(model, optimizer, Path(source))
    elif state.get("layout") == "sharded":
        from stabletrain.distributed.dcp import set_sharded_state

        set_sharded_state(model, optimizer, state)
    else:
        from stabletrain.distributed.checkpoint_state import load_optimizer_checkpoint
        from stabletrain.distributed.shards import load_full_state

        load_full_state(model, model_state=state["model"])
        load_optimizer_checkpoint(model, optimizer, state["optimizer"])


def capture_optimizer_step(trainer: Any, failure: GuardFailure) -> Optional[Path]:
    """Re-run to ``failure.step`` and capture its optimizer step (see the module docstring).

    Returns the capture file, or None when no state from before that step is available (a
    resumed run whose checkpoints from before the step were rotated away).
    """
    from stabletrain.debug.nan_capture import NaNCaptureMonitor
    from stabletrain.events import CallbackList
    from stabletrain.utils.rng import set_rng_state

    k = failure.step
    state, source = _source(trainer, k)
    if state is None:
        return None
    model, optimizer = trainer.model, trainer.optimizer
    _restore(trainer, state, source)
    if trainer.scaler is not None and state.get("scaler"):
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.step = int(state["step"])
    trainer.microbatches_consumed = int(state["data"]["microbatches_consumed"])
    trainer.build_loader()
    set_rng_state(state["rng"][trainer.rank])

    folder = trainer.out / "debug" / "nan_capture"
    settings = trainer.resolved_settings()
    monitor = NaNCaptureMonitor(
        model, folder, rank=trainer.rank, world_size=trainer.world_size, scaler=trainer.scaler,
        precision=trainer.precision, gradient_accumulation_steps=trainer.settings.gradient_accumulation_steps,
        settings=settings, model_meta=dict(trainer.task.model_meta), any_rank=lambda flag: False,
        replay_command=f"stabletrain diagnose {shell_path(folder / f'rank{trainer.rank}')}",
    )
    collector = _Collector(trainer, k, monitor)
    callbacks, trainer.callbacks = trainer.callbacks, CallbackList([collector])
    trainer.safety.replaying = True
    try:
        while trainer.step <= k:
            trainer.train_step()
            trainer.step += 1
    except _Reached:
        pass
    finally:
        trainer.callbacks = callbacks
        trainer.safety.replaying = False
    param_names = [n for n, _ in model.named_parameters()]
    by_id = {id(p): n for n, p in model.named_parameters()}
    order = [by_id.get(id(p), "?") for g in optimizer.param_groups for p in g["params"]]
    extra: dict[str, Any] = {"optimizer_step": {
        "optimizer": optimizer_name(optimizer),
        "param_names": order,
        "state_dict": collector.before.get("state_dict", {}),
        "grads": collector.before.get("grads", {}),
        **{k: collector.before[k] for k in ("grads_shards", "state_shards") if k in collector.before},
        "gradient_norm": collector.before.get("grad_norm", math.nan),
        "gradient_clip_val": float(trainer.settings.gradient_clip_val),
        "after": {"nonfinite_params": collector.after.get("params", {}),
                  "nonfinite_state": collector.after.get("state", [])},
        "reproduced_in_rerun": bool(collector.after.get("params") or collector.after.get("state")),
        "source": {"path": source, "step": int(state["step"])},
        "failure": {"param_names": failure.param_names, "state_entries": failure.state_entries,
                    "explanation": failure.explanation},
    }}
    path = monitor.write_capture(REASON_OPTIMIZER_STEP, nan_param_names=list(collector.after.get("params", {})),
                                 params=collector.before.get("params"), extra=extra)
    monitor.close()
    del param_names
    return path
