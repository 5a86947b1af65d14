"""The trainer's state and checkpoints: the state to save, the checks before resuming, and a
resumed run's history continued (see docs/checkpoints.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from stabletrain import __version__
from stabletrain.errors import ConfigError
from stabletrain.runfiles.checkpoint import SHARDED, checkpoint_dir, list_checkpoints, resume_conflicts
from stabletrain.utils.rng import get_rng_state
from stabletrain.utils.text import shell_path


def checkpoint_state(trainer: Any, on_cpu: bool = False, layout: Optional[str] = None) -> dict[str, Any]:
    """The resumable state of ``trainer`` (a Trainer) between steps; ``step`` is the next step to run.

    Collective when distributed (the RNG states of all ranks are gathered). ``on_cpu``:
    a copy on the CPU instead of references to the live tensors. ``layout``: ``"sharded"`` for
    each rank's own shards (DTensors, optimizer state keyed by name: what a sharded checkpoint
    writes, nothing gathered), ``"full"`` for the full state on rank 0; by default the trainer's
    ``checkpoint_layout``."""
    rng = get_rng_state()
    if trainer.world_size > 1:
        import torch.distributed as dist

        gathered: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(gathered, rng)
        rng_all = gathered
    else:
        rng_all = [rng]
    layout = layout or getattr(trainer, "checkpoint_layout", "full")
    if trainer.sharded and layout == SHARDED:  # each rank's shards, no gather (docs/distributed.md)
        from stabletrain.distributed.dcp import sharded_state

        parts = sharded_state(trainer.model, trainer.optimizer)
        model, optimizer = parts["model"], parts["optimizer"]
    elif trainer.sharded:  # FSDP2: the full state on rank 0's CPU, {} elsewhere (docs/distributed.md)
        from stabletrain.distributed.checkpoint_state import gather_checkpoint_parts

        model, optimizer = gather_checkpoint_parts(trainer.model, trainer.optimizer)
    else:
        model, optimizer = trainer.model.state_dict(), trainer.optimizer.state_dict()
    guard = getattr(getattr(trainer, "safety", None), "guard", None)
    state = {
        "step": trainer.step,
        "model": model,
        "optimizer": optimizer,
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else {},
        # The guard's counts of fp16 skipped steps: logged as ``skipped_steps``, they go on from here.
        "guard": guard.state_dict() if guard is not None else {},
        "rng": rng_all,
        "data": {"microbatches_consumed": trainer.microbatches_consumed},
        "settings": json.dumps(trainer.resolved_settings()),
        "model_meta": json.dumps(trainer.task.model_meta),
        "callbacks": {},
        "stabletrain_version": __version__,
        "torch_version": str(torch.__version__),
    }
    if trainer.sharded and layout == SHARDED:
        state["layout"] = SHARDED
        state["world_size"] = trainer.world_size
    if on_cpu:
        from torch.utils._pytree import tree_map

        state = tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x, state)
    return state


def check_resume(trainer: Any, state: dict[str, Any], source: Path) -> None:
    """ConfigError listing why ``state`` (loaded from ``source``) cannot continue this run."""
    settings = trainer.settings
    saved = json.loads(state["settings"])
    # A sharded checkpoint loads at any world size (DCP reshards; see resharding_note).
    allow = ("world_size",) if state.get("layout") == SHARDED else ()
    problems = resume_conflicts(saved, trainer.resolved_settings(), allow=allow)
    which = "resume_from" if settings.resume_from is not None else "resume_interrupted"
    if settings.steps <= int(state["step"]):
        problems.append(
            f"steps: the checkpoint already holds {int(state['step'])} steps; "
            f"set steps above that to train on (got {settings.steps})"
        )
    from stabletrain.safety.checkpoint_health import nonfinite_entries

    bad = nonfinite_entries(state)
    if bad:
        others = [c for c in list_checkpoints(checkpoint_dir(trainer.out))
                  if c.healthy and c.path.resolve() != source.resolve()]
        best = others[-1] if others else None
        fix = (f"resume_from={shell_path(best.path)} (step {best.step}, healthy)" if best
               else "overwrite=true (no healthy checkpoint)")
        problems.append(f"{which}: {source} holds NaN/Inf ({', '.join(bad[:4])}); continue from {fix} instead")
    if problems:
        raise ConfigError(problems)


def continue_history(trainer: Any, state: dict[str, Any], source: Path) -> None:
    """Continue the run's history (health, trends) and say where it resumed from."""
    from stabletrain.runfiles.checkpoint import health_now
    from stabletrain.runfiles.history import read_run

    health = state.get("health") if isinstance(state.get("health"), dict) else None
    quarantined = honour_quarantine(trainer)  # first: an unreadable file stops the resume before any row
    metrics = trainer.out / "metrics.jsonl"
    if metrics.is_file():
        history = read_run(metrics)
        # Steps the self-healing skipped are forgotten after their row, as the run did when it recovered.
        skipped = {e["step"] for e in history.events if e.get("event") == "recovery" and e.get("action") == "skip_step"}
        for row in history.rows:
            if row["step"] < trainer.step:
                trainer.safety.health.observe(row["step"], row)
                if row["step"] in skipped:
                    trainer.safety.health.forget(row["step"])
        note = history.skipped_note(metrics)
        if note is not None:
            trainer.console.info(note)
    if health:  # after the rows: its open spike episode already counts them
        trainer.safety.health.resume(health)
    # As the run's other messages judge it: a mechanism named after it was written may have begun before it.
    healthy, why = health_now(trainer.out, trainer.step, health)
    note = "" if health is None else f" ({'healthy' if healthy else 'not healthy'}: {why})"
    trainer.console.info(f"Resumed from step {trainer.step}: {source}{note}")
    trainer.log_event({"event": "resume", "step": trainer.step, "checkpoint": str(source)})
    if quarantined:
        trainer.console.info(quarantined)


def honour_quarantine(trainer: Any) -> Optional[str]:
    """On a resume, whatever the policy: the samples in the run folder's ``quarantine.json`` (found
    bad by the self-healing) stay out of the loader. Returns the console line saying which, None
    when there are none."""
    from stabletrain.safety.quarantine import QUARANTINE_FILE, read_quarantine

    path = trainer.out / QUARANTINE_FILE
    try:
        entries = read_quarantine(trainer.out)
        indices = sorted({int(e["index"]) for e in entries})
    except (ValueError, KeyError, TypeError) as exc:  # a hand-edited file: not a list of {"index": ...}
        raise ConfigError([f"{path}: cannot read the quarantined samples ({type(exc).__name__}: {exc}); repair "
                           "the file, or delete it to train on those samples again"]) from None
    if not indices:
        return None
    trainer.quarantined = frozenset(indices) | trainer.quarantined
    trainer.build_loader()  # at the restored data position, without them
    by_index = {int(e["index"]): e for e in entries}
    shown = ", ".join(f"{i} (step {by_index[i].get('step', '?')}: {by_index[i].get('evidence', 'no evidence saved')})"
                      for i in indices[:4]) + (f", ... ({len(indices) - 4} more)" if len(indices) > 4 else "")
    return (f"Quarantine: {len(indices)} sample(s) found bad earlier in this run stay out of training "
            f"(listed in {path}): {shown}")


def resharding_note(trainer: Any, state: dict[str, Any]) -> Optional[str]:
    """What a resume at another world size than the checkpoint's keeps exactly, and what not;
    None at the same world size."""
    saved = int(json.loads(state["settings"]).get("world_size", trainer.world_size))
    if saved == trainer.world_size:
        return None
    rng = ("each rank continues its own RNG stream" if trainer.world_size <= saved else
           f"ranks {saved}..{trainer.world_size - 1} start from the seed, not from a saved RNG stream")
    return (f"Resumed at world size {trainer.world_size} from a checkpoint written at world size {saved}: the weights "
            "and optimizer state are loaded exactly (DCP reshards them) and every step takes the same samples as it "
            f"would have (the data order is global), but the steps are not bitwise those of {saved} processes: the "
            f"gradients are summed in another order, and {rng}.")


def rng_state_for(trainer: Any, state: dict[str, Any]) -> Optional[Any]:
    """This rank's saved RNG state, or None when the checkpoint has none for it (it was written at
    a smaller world size)."""
    states = state["rng"]
    return states[trainer.rank] if trainer.rank < len(states) else None
