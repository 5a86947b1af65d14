"""Checkpoints: atomic writes, safe loading (``weights_only=True``), exact resume.

``out/checkpoints/last.ckpt`` and ``step_NNNNNN.ckpt`` hold model, optimizer, loss scaler, step,
every rank's RNG states and the data position; a non-finite state is never written, and rotation
keeps the newest healthy one (:mod:`stabletrain.safety.checkpoint_health`). See docs/checkpoints.md.
"""

from __future__ import annotations

import datetime
import errno
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from stabletrain.errors import StabletrainError
from stabletrain.runfiles.history import mechanism_spans
from stabletrain.utils.text import shell_path

# torch is imported where a checkpoint is written or read, so that the command line can check
# a run's checkpoints (unreadable_reason) before it loads torch.

FORMAT = "stabletrain.runfiles.checkpoint"
VERSION = 1

#: Settings that cannot change when resuming: they define the model, the data or their order.
FROZEN_ON_RESUME = (
    "task",
    "model",
    "data",
    "batch_size",
    "gradient_accumulation_steps",
    "seed",
    "model_args.n_layers",
    "model_args.n_heads",
    "model_args.dim",
    "model_args.context_length",
    "model_args.tokenizer",
    "model_args.qk_norm",
    "model_args.cnn_width",
    "model_args.optimizer",
    "world_size",
)

#: Frozen settings added after checkpoints were first written: the value a checkpoint whose
#: settings lack one was trained with.
FROZEN_SINCE_ADDED = {"model_args.qk_norm": False}

_PERIODIC = re.compile(r"^step_(\d+)\.ckpt$")


class CheckpointError(StabletrainError):
    """A checkpoint is missing, unreadable or does not fit the current settings."""


def checkpoint_dir(out: Path) -> Path:
    return Path(out) / "checkpoints"


def periodic_name(steps_done: int) -> str:
    return f"step_{steps_done:06d}.ckpt"


def save_checkpoint(state: dict[str, Any], out: Path, periodic: bool, keep: int) -> Path:
    """Write ``last.ckpt`` (and ``step_N.ckpt`` when ``periodic``) atomically; prune old periodic files."""
    from stabletrain.utils.io import atomic_torch_save

    folder = checkpoint_dir(out)
    state = {
        "format": FORMAT,
        "version": VERSION,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        **state,
    }
    last = folder / "last.ckpt"
    check_free_space(state, folder, periodic)
    health = state.get("health") or {}
    if health.get("healthy") is False:
        _keep_newest_healthy(folder)
    elif isinstance(health.get("pending_since"), int):  # a mechanism may be named that began at that step
        _keep_newest_healthy(folder, before_step=health["pending_since"])
    if periodic:
        target = folder / periodic_name(int(state["step"]))
        atomic_torch_save(state, target)
        _atomic_copy(target, last)
        _prune(folder, keep)
    else:
        atomic_torch_save(state, last)
    return last


class NotEnoughSpaceError(OSError):
    """Raised before a checkpoint is written when it would not fit (``errno`` ENOSPC).

    Attributes:
        needed: Bytes the write needs (the checkpoint, twice for a periodic one: ``step_N.ckpt``
            and its copy as ``last.ckpt``).
        free: Bytes free on that filesystem.
    """

    def __init__(self, path: Path, needed: int, free: int):
        super().__init__(errno.ENOSPC, f"not enough free space for the checkpoint ({needed / 2**20:,.1f} MiB "
                                       f"needed, {free / 2**20:,.1f} MiB free)", str(path))
        self.needed, self.free = needed, free


def check_free_space(state: dict[str, Any], folder: Path, periodic: bool) -> None:
    """Raise :class:`NotEnoughSpaceError` when the checkpoint of ``state`` will not fit in
    ``folder``: its size is taken as the larger of its tensors' bytes and the last checkpoint's
    size, with a margin; nothing is written, so the previous checkpoint stays intact."""
    from stabletrain.utils.io import free_bytes, tensor_bytes

    free = free_bytes(folder)
    if free is None:
        return
    last = folder / "last.ckpt"
    size = max(tensor_bytes(state), last.stat().st_size if last.is_file() else 0)
    needed = int(size * 1.05) + 2**16
    if periodic:
        needed *= 2
    if free < needed:
        name = periodic_name(int(state["step"])) if periodic else "last.ckpt"
        raise NotEnoughSpaceError(folder / name, needed, free)


def remove_temporaries(out: Path) -> list[Path]:
    """Remove the temporary files (``.NAME.xxxx.tmp``) that a killed run left in ``out`` and its
    checkpoint folder; call only while holding the run lock. Returns those removed."""
    removed = []
    for folder in (Path(out), checkpoint_dir(out)):
        if folder.is_dir():
            for path in folder.glob(".*.tmp"):
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def _keep_newest_healthy(folder: Path, before_step: Optional[int] = None) -> None:
    """Before an unhealthy (or pending) state overwrites last.ckpt: if last.ckpt holds the only copy of
    the newest healthy checkpoint (holding at most ``before_step`` steps; its step_N.ckpt was rotated
    away), give it its periodic name."""
    best = newest_healthy(folder, before_step=before_step)
    if best is not None and best.path.name == "last.ckpt":
        _atomic_copy(best.path, folder / periodic_name(best.step))


def _atomic_copy(src: Path, dst: Path) -> None:
    from stabletrain.utils.io import atomic_copy

    atomic_copy(src, dst)


def _prune(folder: Path, keep: int) -> None:
    """Keep the newest ``keep`` periodic files; while the newest checkpoint is not healthy,
    also the newest healthy one (the place to resume from after the instability); while a mechanism
    rule is pending (the newest checkpoint's ``health["pending_since"]``), also the newest healthy one
    from before the step it would begin at."""
    periodic = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _PERIODIC.match(p.name)))
    doomed = [path for _, path in periodic[: max(0, len(periodic) - keep)]]
    if not doomed:
        return
    infos = list_checkpoints(folder)
    protect = set()
    healthy = [c for c in infos if c.healthy and c.path.name != "last.ckpt"]
    if infos and infos[-1].healthy is False and healthy:
        protect.add(healthy[-1].path)
    pending = (infos[-1].health or {}).get("pending_since") if infos else None
    if isinstance(pending, int):  # a mechanism may be named that began at `pending`: keep one from before it
        before = [c for c in healthy if c.step <= pending]
        if before:
            protect.add(before[-1].path)
    for path in doomed:
        if path not in protect:
            path.unlink(missing_ok=True)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint safely (no code runs); raise CheckpointError with the reason otherwise.

    When the file is missing or cannot be read, the error names the checkpoint beside it to
    continue from (:func:`fallback_advice`).
    """
    import torch

    path = Path(path)
    if path.is_dir():  # a run folder (its checkpoints/, even when last.ckpt is missing there) or a checkpoint folder
        path = (checkpoint_dir(path) if checkpoint_dir(path).is_dir() else path) / "last.ckpt"
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}. {fallback_advice(path)}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # empty, truncated, corrupt, or holding pickled objects
        reason = unreadable_reason(path) or _exception_text(exc)
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}. {fallback_advice(path)}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a stabletrain checkpoint")
    if int(state.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{path} was written by a newer stabletrain (checkpoint format {state['version']}, "
            f"this version reads up to {VERSION}); upgrade stabletrain"
        )
    return state


def unreadable_reason(path: str | Path) -> Optional[str]:
    """Why the file at ``path`` cannot be a whole checkpoint, found without torch and without
    unpickling (the size and the zip directory that ``torch.save`` writes last); None when it
    looks whole. Reading it can still fail on what is inside."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        return f"cannot open it ({exc.strerror or exc})"
    if size == 0:
        return "the file is empty (0 bytes)"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return f"the file is cut short or is not a checkpoint ({size:,} bytes without the index torch.save writes last)"
    if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
        return f"the file is a zip archive but not a torch checkpoint (no data.pkl among {len(names)} entries)"
    return None


def fallback_checkpoint(failed: str | Path) -> Optional[CheckpointInfo]:
    """The checkpoint to continue from when ``failed`` cannot be read: among the others in its
    folder that read, the newest recorded healthy, else the newest whose health was not
    recorded (older stabletrain); None when every other one is unreadable or not healthy."""
    failed = Path(failed)
    others = [c for c in list_checkpoints(failed.parent) if c.path.resolve() != failed.resolve()]
    healthy = [c for c in others if c.healthy]
    unknown = [c for c in others if c.healthy is None]
    pick = healthy or unknown
    return pick[-1] if pick else None


def _setting(**start: Any) -> str:
    """The start settings as ``key=value`` words: paths absolute and quoted, booleans as true/false."""
    def word(v: Any) -> str:
        return shell_path(v) if isinstance(v, Path) else json.dumps(v)

    return " ".join(f"{k}={word(v)}" for k, v in start.items())


def fallback_advice(failed: str | Path, command: Optional[Callable[..., str]] = None) -> str:
    """A sentence: where to continue from when ``failed`` (missing or unreadable) cannot be
    used, by the rule of :func:`fallback_checkpoint`, or to start again.

    Args:
        failed: The checkpoint file that could not be read.
        command: Builds what to run from start settings, called as ``command(resume_from=path)``
            or ``command(overwrite=True)`` (e.g. :func:`stabletrain.runfiles.commands.train_command` with
            the run's settings bound); by default the settings themselves
            (``resume_from=/abs/path``).

    Example::

        fallback_advice(Path("out/run/checkpoints/last.ckpt"))
        # "The newest healthy checkpoint is out/run/checkpoints/step_000200.ckpt (step 200); continue
        #  from it: resume_from=/abs/out/run/checkpoints/step_000200.ckpt"
    """
    failed = Path(failed)
    build = command or _setting
    best = fallback_checkpoint(failed)
    if best is not None:
        which, where = ("healthy", f"{best.path} (step {best.step})") if best.healthy else (
            "readable", f"{best.path}, {best.reason()}")
        return f"The newest {which} checkpoint is {where}; continue from it: {build(resume_from=best.path)}"
    others = [c for c in list_checkpoints(failed.parent) if c.path.resolve() != failed.resolve()]
    if others:  # all recorded unhealthy
        found = f"is healthy (the newest, {others[-1].path}, is {others[-1].reason()})"
    else:
        found = "can be read"
    return f"No other checkpoint in {failed.parent} {found}; start again: {build(overwrite=True)}"


def _exception_text(exc: BaseException) -> str:
    """``Type: first line of the message``; the type alone when the message is empty (EOFError)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def resume_conflicts(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Frozen settings that differ between the checkpoint's run and this one, one line each."""
    problems = []
    for key in FROZEN_ON_RESUME:
        a, b = _get(saved, key), _get(current, key)
        if a is None:
            a = FROZEN_SINCE_ADDED.get(key)
        if a != b:
            problems.append(
                f"{key}: the checkpoint was trained with {json.dumps(a)}, now {json.dumps(b)}; "
                "this setting cannot change on resume (start a new run in another out folder instead)"
            )
    return problems


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)  # type: ignore[assignment]
    return d


# --------------------------------------------------------------------------------------
# Recorded health, read back: one rule for every message (see stabletrain.safety.checkpoint_health)
# --------------------------------------------------------------------------------------


@dataclass
class CheckpointInfo:
    """A checkpoint file of a run and its recorded health (``healthy`` None: written by an
    older stabletrain, health unknown)."""

    path: Path
    step: int
    healthy: Optional[bool]
    why: str
    health: Optional[dict[str, Any]] = None

    def reason(self) -> str:
        """``step 200 (healthy: ...)``, for messages."""
        if self.healthy is None:
            return f"step {self.step} (health not recorded: written by an older stabletrain)"
        return f"step {self.step} ({'healthy' if self.healthy else 'not healthy'}: {self.why})"


_CACHE: dict[tuple[str, int, int], tuple[int, Optional[dict[str, Any]]]] = {}


def read_checkpoint_health(path: str | Path) -> tuple[int, Optional[dict[str, Any]]]:
    """``(step, health)`` of a checkpoint file without reading its tensors (memory-mapped).

    Raises:
        OSError, RuntimeError, ValueError: The file cannot be read as a checkpoint.
    """
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _CACHE:
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError(f"{path} is not a stabletrain checkpoint")
        health = state.get("health")
        _CACHE[key] = (int(state["step"]), dict(health) if isinstance(health, dict) else None)
    return _CACHE[key]


def list_checkpoints(folder: str | Path) -> list[CheckpointInfo]:
    """The run's checkpoints oldest first, one per step: ``step_*.ckpt`` files, and
    ``last.ckpt`` where no periodic file holds its step (a periodic file is preferred: the
    next run overwrites last.ckpt). Unreadable files are skipped. A checkpoint recorded healthy
    but written after a mechanism began (named later, in the run's metrics.jsonl:
    :func:`~stabletrain.runfiles.history.mechanism_spans`) is listed as not healthy."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    files = sorted(p for p in folder.iterdir() if _PERIODIC.match(p.name)) + [folder / "last.ckpt"]
    seen: dict[int, CheckpointInfo] = {}
    for path in files:
        if not path.is_file():
            continue
        try:
            step, health = read_checkpoint_health(path)
        except Exception:  # truncated, foreign or unreadable: not a place to resume from
            continue
        if step in seen:
            continue
        healthy = None if health is None else bool(health.get("healthy"))
        why = str((health or {}).get("why", ""))
        if healthy:  # recorded healthy when written; a mechanism named later may have begun before it
            span = next((m for m in mechanism_spans(folder.parent) if m.covers(step)), None)
            if span is not None:
                healthy, why = False, span.why()
        seen[step] = CheckpointInfo(path, step, healthy, why, health)
    return [seen[s] for s in sorted(seen)]


def newest_healthy(folder: str | Path, before_step: Optional[int] = None) -> Optional[CheckpointInfo]:
    """The newest checkpoint recorded healthy (optionally holding at most ``before_step``
    steps), or None."""
    healthy = [c for c in list_checkpoints(folder)
               if c.healthy and (before_step is None or c.step <= before_step)]
    return healthy[-1] if healthy else None
