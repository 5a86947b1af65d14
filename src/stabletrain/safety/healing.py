"""Self-healing in the trainer: ``on_instability.policy`` ``skip_step`` or ``rollback``.

:class:`Healer` is the trainer callback that the :class:`~stabletrain.safety.net.SafetyNet` calls each
step: :meth:`~Healer.check` before the optimizer step, :meth:`~Healer.after_step` to undo a bad
update, :meth:`~Healer.end_of_step` to turn the verdicts into recoveries (capture, event row,
console line, and under ``rollback`` the restore of the newest in-memory snapshot).
See docs/self_healing.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from stabletrain.debug.nan_capture import NaNCaptureMonitor, default_replay_command
from stabletrain.errors import StabletrainError
from stabletrain.safety.instability_guard import InstabilityGuard, Recovery
from stabletrain.safety.quarantine import Quarantine, isolate_samples
from stabletrain.utils.rng import set_rng_state
from stabletrain.utils.text import shell_path

__all__ = ["Healer", "RecoveryLimitError", "snapshot_bytes"]

#: Capture reasons that replay and diagnose know, by trigger.
_REASONS = {"nonfinite_loss": "nonfinite_loss", "nonfinite_grad": "nonfinite_gradients"}
#: Triggers caught before the optimizer step with the weights undamaged by it: the samples are searched.
_NONFINITE = ("nonfinite_loss", "nonfinite_grad")


class RecoveryLimitError(StabletrainError):
    """More than ``on_instability.max_recoveries`` bad steps: training stopped.

    Attributes:
        step: The bad step that went over the limit.
        recoveries: The recoveries made before it.
        capture_path: The capture of that step, when written.
    """

    def __init__(self, message: str, step: int, recoveries: int, capture_path: Optional[Path] = None):
        super().__init__(message)
        self.step, self.recoveries, self.capture_path = step, recoveries, capture_path

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.step, self.recoveries, self.capture_path))


def snapshot_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state; of an FSDP2 DTensor, this rank's shard."""
    if isinstance(state, Tensor):
        from stabletrain.distributed.norms import local_tensor

        local = local_tensor(state)
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(snapshot_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(snapshot_bytes(v) for v in state)
    return 0


def _spike_diagnoses_line(trigger: str, found: list[tuple[int, Path]]) -> str:
    """One console line for the diagnoses of the spike recoveries of one trigger: (step, capture folder)."""
    (step, folder), more = found[0], len(found) > 1
    steps = f"recoveries at steps {', '.join(str(s) for s, _ in found)}" if more else f"recovery at step {step}"
    return (f"Diagnosis of the {steps} ({trigger}): {'their' if more else 'its'} values were finite and the "
            "diagnosis looks for NaN/Inf, so it has no verdict on a spike; the replay shows "
            f"{f'step {step}' if more else 'the step'}'s loss: stabletrain replay {shell_path(folder)}")


class Healer:
    """The trainer's self-healing (``on_instability``); see the module docstring."""

    is_healer = True

    def __init__(self, trainer: Any):
        self.trainer = trainer
        args = trainer.settings.on_instability
        self.args = args
        self.policy = args.policy
        reduce = None
        if trainer.world_size > 1:
            def reduce(t: Tensor) -> Tensor:
                return trainer.fabric.all_reduce(t.clone(), reduce_op="mean")
        self.guard = InstabilityGuard(
            trainer.optimizer, window=args.window, zscore=args.zscore, warmup=args.warmup,
            max_ratio=args.max_ratio, min_std=args.min_std, all_reduce=reduce, action=self.policy,
            scaler=trainer.scaler,
        )
        #: Recoveries made so far (host rows, as logged); checkpointed.
        self.recoveries: list[dict[str, Any]] = []
        self.snapshot: Optional[dict[str, Any]] = None
        #: Sample indices of each step since the snapshot (rollback skips them).
        self._since: dict[int, list[Any]] = {}
        self._indices: list[Any] = []
        self.monitor: Optional[NaNCaptureMonitor] = None
        self._group: Any = None
        #: Samples isolated as the cause of a non-finite step: the loader skips them (quarantine.json).
        self.quarantine = Quarantine(trainer.out)

    # ------------------------------------------------------------------ callback events

    def on_train_start(self, trainer: Any) -> None:
        if self.quarantine.entries:  # resumed: the checkpoint's and the run folder's quarantine
            self._apply_quarantine()
        self.monitor = NaNCaptureMonitor(
            trainer.model, trainer.out / "debug" / "recoveries", rank=trainer.rank, world_size=trainer.world_size,
            scaler=trainer.scaler, precision=trainer.precision,
            gradient_accumulation_steps=trainer.settings.gradient_accumulation_steps,
            settings=trainer.resolved_settings(), model_meta=dict(trainer.task.model_meta),
            any_rank=lambda flag: False, replay_command="stabletrain replay",
        )
        if trainer.world_size > 1 and trainer.fabric.device.type == "cuda":
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        if self.policy == "rollback":
            self._take_snapshot()

    def on_step_start(self, trainer: Any, *, step: int) -> None:
        self._indices = []
        if self.monitor is not None:
            self.monitor.begin_step(step)

    def on_microbatch(self, trainer: Any, *, step: int, micro_step: int, batch: Any, indices: Any) -> None:
        self._indices.append(indices)
        if self.monitor is not None:
            self.monitor.collect_batch(batch, indices)

    def on_after_microbatch(self, trainer: Any, *, step: int, micro_step: int, loss: Tensor) -> None:
        if self.monitor is not None:
            self.monitor.collect_loss(loss)

    def on_checkpoint_save(self, trainer: Any, *, step: int, state: dict[str, Any]) -> None:
        state.setdefault("callbacks", {})["on_instability"] = {
            **self.guard.state_dict(), "recoveries": [dict(r) for r in self.recoveries],
            "quarantine": self.quarantine.state_dict(),
        }
        if self.policy == "rollback" and (self.snapshot is None or self.snapshot["step"] != step):
            if trainer.sharded and state.get("layout") != "sharded":  # a full checkpoint: rank 0 holds it all
                self._take_snapshot()
            else:  # a resume from this checkpoint starts from this snapshot
                self._set_snapshot(_cpu_copy(state))

    def on_checkpoint_load(self, trainer: Any, *, state: dict[str, Any]) -> None:
        saved = (state.get("callbacks") or {}).get("on_instability")
        if saved:
            self.guard.load_state_dict(saved)
            self.recoveries = [dict(r) for r in saved.get("recoveries", [])]
            self.quarantine.load_state_dict(saved.get("quarantine", []))
        # Found after that checkpoint was written, the samples are as bad on resume: skip them too.
        self.quarantine.load()

    def on_train_end(self, trainer: Any) -> None:
        self._handle(self.guard.poll(wait=True))
        if self.monitor is not None:
            self.monitor.close()
        if self.args.diagnose:
            self._diagnose_captures()

    def _diagnose_captures(self, limit: int = 5, last: bool = False) -> dict[int, str]:
        """Diagnose the first captures now that training is over (it never holds a step back);
        ``diagnosis.json`` lands next to each capture, where the report reads the verdict.
        ``last``: the newest capture too (a stop at the recovery limit). Returns recovery number -> verdict."""

        from stabletrain.debug.diagnose import diagnose

        t = self.trainer
        verdicts: dict[int, str] = {}
        if not t.is_rank_zero:
            return verdicts
        rows = [r for r in self.recoveries if r.get("capture")]
        chosen = rows[:limit] + (rows[-1:] if last and rows[-1:] and rows[-1] not in rows[:limit] else [])
        spikes: dict[str, list[tuple[int, Path]]] = {}  # trigger -> (step, capture folder): one line each
        for row in chosen:
            folder = Path(row["capture"]).parent if t.world_size == 1 else Path(row["capture"]).parent.parent
            custom = t.resolved_settings().get("task") == "custom"
            try:
                result = diagnose(folder, model=_replay_model(t) if custom else None)
            except Exception as exc:  # a diagnosis that cannot run must not fail a finished run
                t.console.info(f"Could not diagnose the capture of step {row['step']}: {type(exc).__name__}: {exc}")
                continue
            verdicts[int(row["recovery"])] = str(result.verdict)
            if row.get("trigger") in _NONFINITE:
                t.console.info(f"Diagnosis of the recovery at step {row['step']}: {result.verdict}")
            else:  # diagnose looks for NaN/Inf: of a spike with finite values it can only say it replays finite
                spikes.setdefault(str(row.get("trigger")), []).append((int(row["step"]), folder))
        for trigger, found in spikes.items():
            t.console.info(_spike_diagnoses_line(trigger, found))
        return verdicts

    def on_exception(self, trainer: Any, *, exception: BaseException) -> None:
        if self.monitor is not None:
            self.monitor.close()

    # ------------------------------------------------------------------ SafetyNet's calls

    def check(self, step: int, losses: list[Tensor], grad_norm: Tensor) -> Tensor:
        """Judge the step on the device; the device bool "this update is skipped"."""
        if self.policy == "rollback":
            self._since[step] = self._indices
        return self.guard.check(step, losses, grad_norm, samples=self._indices)

    def after_step(self) -> None:
        self.guard.after_step()

    def end_of_step(self) -> None:
        """Turn the verdicts the host has into recoveries; take the periodic snapshot."""
        t = self.trainer
        n = self.guard.ready_count()
        if self._group is not None:  # a GPU under DDP: the ranks agree on how many (host tensors)
            import torch.distributed as dist

            agreed = torch.tensor([n], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self._group)
            n = int(agreed[0])
        self._handle(self.guard.take(n))
        if self.policy == "rollback" and t.step % self.args.rollback_steps == 0:
            # Not inside an open spike: the older snapshot stays the one to return to.
            if (self.snapshot is None or self.snapshot["step"] != t.step) and not t.safety.health.spike_open:
                self._take_snapshot()

    # ------------------------------------------------------------------ recoveries

    def _handle(self, found: list[Recovery]) -> None:
        for rec in found:
            self._recover(rec)

    def _recover(self, rec: Recovery) -> None:
        t = self.trainer
        capture = self._capture(rec)
        if t.sharded and t.world_size > 1:
            t.fabric.barrier()  # a sharded capture is every rank's files: all written before any is read
        culprits = self._isolate(rec, capture)
        over = len(self.recoveries) >= self.args.max_recoveries
        row = rec.to_row()
        if t.world_size > 1:
            row["samples"] = row["skipped_samples"] = self._gather(rec.samples)
        row["capture"] = None if capture is None else str(capture)
        row["recovery"] = len(self.recoveries) + 1
        row["culprits"] = [e["index"] for e in culprits]
        row["quarantined"] = self._quarantine(rec, culprits, row["capture"])
        if over:
            row["action"] = "stop"
        elif self.policy == "rollback" and culprits and rec.trigger in _NONFINITE:
            # Caught before the optimizer step and explained by its samples: the weights are
            # undamaged, so there is nothing to roll back; the update is skipped and the samples kept out.
            row["action"] = "skip_step"
        elif self.policy == "rollback":
            row.update(self._rollback(rec))
        self.recoveries.append(row)
        t.safety.health.note_recovery(rec.step, rec.trigger)
        t.log_event(row)
        where = f"; capture: {capture}" if capture is not None else ""
        if over:
            from stabletrain.safety.recovery_stop import recovery_limit_message

            # The diagnosis promised "once training has finished": it has, here too.
            verdicts = self._diagnose_captures(last=True) if self.args.diagnose else {}
            text = recovery_limit_message(self, rec, row, capture, verdicts)
            # Not printed here: the CLI prints the error, and train.log gets it (Trainer._report_exception).
            raise RecoveryLimitError(text, rec.step, len(self.recoveries) - 1, capture)
        samples = _few(row["samples"], first=self._bad_data_samples(rec), then=row["culprits"])
        t.console.info(f"Recovered step {rec.step}: {rec.description}; {self._what(row)}; "
                       f"{_culprit_text(culprits, row)}samples {samples}{where}")

    def _what(self, row: dict[str, Any]) -> str:
        """The action taken, and what differs when the same step number comes back after a rollback."""
        if row["action"] == "skip_step":
            what = "update skipped"
            if self.policy == "rollback":
                what += " (not rolled back: the weights are undamaged and the culprit samples are known)"
        else:
            same = [r for r in self.recoveries[:-1] if r.get("rolled_back_to") == row["rolled_back_to"]]
            again = (f" for the {_ordinal(len(same) + 1)} time (the state of that snapshot keeps leading to bad "
                     "steps)") if same else ""
            what = (f"rolled back to step {row['rolled_back_to']}{again}, "
                    f"{len(row.get('skipped_steps', []))} step(s) of data skipped")
        if any(r["step"] == row["step"] for r in self.recoveries[:-1]):
            what += (f"; recovery {row['recovery']} of at most {self.args.max_recoveries}: step {row['step']} again, "
                     "on other batches (the data since the snapshot is not re-run)")
        return what

    def _isolate(self, rec: Recovery, capture: Optional[Path]) -> list[dict[str, Any]]:
        """The samples that cause a non-finite step, with evidence (every rank's); [] when none is isolated."""
        t = self.trainer
        found: list[dict[str, Any]] = []
        # A sharded capture is every rank's microbatches put together: one rank searches them all.
        searches = not t.sharded or t.rank == 0
        if capture is not None and rec.trigger in _NONFINITE and searches:
            custom = t.resolved_settings().get("task") == "custom"
            try:
                found = isolate_samples(capture.parent, model=(_replay_model(t) if t.sharded else t.model)
                                        if custom else None)
            except Exception as exc:  # the search must never fail the run it protects
                t.console.info(f"Could not search the samples of step {rec.step}: {type(exc).__name__}: {exc}")
        if t.world_size > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * t.world_size
            dist.all_gather_object(gathered, found)
            found = [e for part in gathered for e in part]
        return found

    def _quarantine(self, rec: Recovery, culprits: list[dict[str, Any]], capture: Optional[str]) -> list[int]:
        """Quarantine the isolated samples (quarantine.json); the loader skips them from the next step on."""
        t = self.trainer
        new = self.quarantine.add(
            {**e, "step": rec.step, "trigger": rec.trigger, "step_loss": row_value(rec.loss),
             "step_gradient_norm": row_value(rec.gradient_norm), "capture": capture} for e in culprits)
        if new:
            if t.is_rank_zero:
                self.quarantine.save()
            self._apply_quarantine()
        return new

    def _apply_quarantine(self) -> None:
        t = self.trainer
        t.quarantined = self.quarantine.indices()
        t.build_loader()  # from the same data position, without the quarantined samples

    def _bad_data_samples(self, rec: Recovery) -> list[int]:
        """The samples of the step whose data holds a NaN or an Inf, when its batches are still held."""
        m = self.monitor
        if m is None or m.step != rec.step:
            return []
        found = m.nonfinite_samples()
        return self._gather(found) if self.trainer.world_size > 1 else found

    def _gather(self, samples: list[int]) -> list[int]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.trainer.world_size
        dist.all_gather_object(gathered, list(samples))
        return [int(i) for part in gathered for i in part]

    def _capture(self, rec: Recovery) -> Optional[Path]:
        """Capture the triggering step when its batches are still held (the verdict was read
        in the same step: always on the CPU). The update was skipped, so the model's weights
        are the ones the step started from."""
        m = self.monitor
        if m is None or m.step != rec.step:
            return None
        t = self.trainer
        # One folder per recovery: a step number that comes back (after a rollback) gets its own.
        again = sum(1 for r in self.recoveries if r["step"] == rec.step)
        folder = t.out / "debug" / "recoveries" / (f"step{rec.step}" + (f"_r{again + 1}" if again else ""))
        m.out_dir = folder
        m.replay_command = default_replay_command(
            folder / f"rank{t.rank}" if t.world_size == 1 else folder, model=t.model,
            builtin=t.resolved_settings().get("task") != "custom")
        reason = _REASONS.get(rec.trigger, rec.trigger)
        extra = {"recovery": {"trigger": rec.trigger, "zscore": rec.zscore, "ratio": rec.ratio,
                              "loss": rec.loss, "gradient_norm": rec.gradient_norm, "action": self.policy}}
        return m.write_capture(reason, extra=extra)

    # ------------------------------------------------------------------ rollback

    def _take_snapshot(self) -> None:
        # Under FSDP2 each rank keeps a CPU copy of its own shards: 1/world size of the model and optimizer.
        state = self.trainer.checkpoint_state(on_cpu=True, layout="sharded" if self.trainer.sharded else None)
        state["callbacks"]["on_instability"] = self.guard.state_dict()
        self._set_snapshot(state)

    def _set_snapshot(self, state: dict[str, Any]) -> None:
        self.snapshot = state
        self._since = {s: ix for s, ix in self._since.items() if s >= int(state["step"])}

    def _rollback(self, rec: Recovery) -> dict[str, Any]:
        """Restore the snapshot; the data position stays, so the batches since it are skipped."""
        t = self.trainer
        snap = self.snapshot
        assert snap is not None, "rollback without a snapshot"
        steps = sorted(s for s in self._since if s >= snap["step"])
        samples: list[int] = []
        for s in steps:
            samples.extend(_flat(self._since[s]))
        if t.world_size > 1:
            samples = self._gather(samples)
        if snap.get("layout") == "sharded":  # FSDP2: each rank puts back its own shards
            from stabletrain.distributed.dcp import set_sharded_state

            set_sharded_state(t.model, t.optimizer, snap)
        else:
            t.model.load_state_dict(snap["model"])
            saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in t.optimizer.param_groups]
            t.optimizer.load_state_dict(snap["optimizer"])
            for group, kept in zip(t.optimizer.param_groups, saved_groups):
                group.update(kept)
        if t.scaler is not None and snap.get("scaler"):
            t.scaler.load_state_dict(snap["scaler"])
        set_rng_state(snap["rng"][t.rank])
        # The detector judges the re-run against the window it had then, not against values
        # from the abandoned steps (a rollback to the start would otherwise see a "spike").
        self.guard.load_state_dict(snap["callbacks"]["on_instability"])
        t.step = int(snap["step"])
        self._since = {}
        # The rows of the abandoned steps are superseded, as after a resume (stabletrain.runfiles.history).
        t.log_event({"event": "resume", "step": t.step, "reason": f"rollback after step {rec.step}"})
        return {"rolled_back_to": t.step, "skipped_steps": steps, "skipped_samples": samples}


def _replay_model(trainer: Any) -> Any:
    """A model a capture can be replayed into in this process: a deep copy of the trainer's, or under
    FSDP2 (whose DTensor parameters cannot run outside the mesh) the unsharded one the trainer kept
    the structure of (:meth:`~stabletrain.training.loop.Trainer.unsharded_model`)."""
    import copy

    if getattr(trainer, "sharded", False):
        return trainer.unsharded_model()
    return copy.deepcopy(trainer.model)


def _cpu_copy(state: dict[str, Any]) -> dict[str, Any]:
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, Tensor) else x, state)


def _flat(indices: list[Any]) -> list[int]:
    out: list[int] = []
    for ix in indices:
        out.extend(int(i) for i in (ix.reshape(-1).tolist() if isinstance(ix, Tensor) else ix))
    return out


def row_value(x: float) -> Any:
    """A float as a JSON row holds it ("nan" and "inf" as strings)."""
    import math

    return x if math.isfinite(x) else str(x)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _culprit_text(culprits: list[dict[str, Any]], row: dict[str, Any]) -> str:
    if not culprits:
        return ""
    named = "; ".join(f"{e['index']}: {e['evidence']}" for e in culprits[:4])
    new = row.get("quarantined") or []
    return f"culprit sample(s) {named}; {'quarantined' if new else 'already quarantined'}; "


def _few(items: list[int], limit: int = 16, first: Sequence[int] = (), then: Sequence[int] = ()) -> str:
    """Up to ``limit`` samples; those in ``first`` (whose data holds NaN/Inf) named first, and
    marked, then those in ``then`` (the isolated culprits), so that a long list never hides them."""
    present = set(items)
    bad = list(dict.fromkeys(i for i in first if i in present))
    marked = set(bad)
    culprits = [i for i in dict.fromkeys(then) if i in present and i not in marked]
    order = bad + culprits + [i for i in items if i not in marked and i not in set(culprits)]
    shown = [f"{i} (NaN/Inf in its data)" if i in marked else str(i) for i in order[:max(limit, len(bad))]]
    rest = len(order) - len(shown)
    return f"[{', '.join(shown)}{f', ... ({rest} more)' if rest > 0 else ''}]"
