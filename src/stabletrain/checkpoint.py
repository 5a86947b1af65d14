"""Checkpoints: atomic writes, safe loading, exact resume.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts only, so it loads with
``torch.load(weights_only=True)`` and never runs code. It holds everything needed to
continue bitwise-exactly on the CPU: model, optimizer, loss scaler, step, the RNG states of
every rank and the data position.

Files under ``out/checkpoints/``:

* ``last.ckpt``: the newest state, rewritten at every checkpoint and at the end of training;
* ``step_000100.ckpt``: the state after 100 optimizer steps (training resumes at step 100);
  the newest ``max_checkpoints_to_keep`` of these are kept.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Optional

from stabletrain.errors import StabletrainError

# torch is imported where a checkpoint is written or read, so that the command line can check
# a run's checkpoints (unreadable_reason) before it loads torch.

FORMAT = "stabletrain.checkpoint"
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
    "model_args.cnn_width",
    "model_args.optimizer",
    "world_size",
)

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
    if periodic:
        target = folder / periodic_name(int(state["step"]))
        atomic_torch_save(state, target)
        _atomic_copy(target, last)
        _prune(folder, keep)
    else:
        atomic_torch_save(state, last)
    return last


def _atomic_copy(src: Path, dst: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _prune(folder: Path, keep: int) -> None:
    periodic = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _PERIODIC.match(p.name)))
    for _, path in periodic[: max(0, len(periodic) - keep)]:
        path.unlink(missing_ok=True)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint safely (no code runs); raise CheckpointError with the reason otherwise.

    When the file cannot be read, the error names the newest readable checkpoint beside it and
    how to continue from that one.
    """
    import torch

    path = Path(path)
    if path.is_dir():
        path = checkpoint_dir(path) / "last.ckpt" if (checkpoint_dir(path) / "last.ckpt").exists() else path / "last.ckpt"
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, corrupt, or holding pickled objects
        reason = unreadable_reason(path) or _exception_text(exc)
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}. {_fallback_advice(path)}") from None
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


def readable_checkpoints(folder: str | Path, exclude: Optional[Path] = None) -> list[tuple[Optional[int], Path]]:
    """``(step, path)`` of the checkpoints in ``folder`` that look whole (:func:`unreadable_reason`),
    newest first: ``last.ckpt`` (its step is unknown without reading it: None), then ``step_N.ckpt``
    by descending N. ``exclude`` is left out (the file that failed)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    periodic = sorted(((int(m.group(1)), p) for p in folder.iterdir() if (m := _PERIODIC.match(p.name))), reverse=True)
    candidates: list[tuple[Optional[int], Path]] = [(None, folder / "last.ckpt"), *periodic]
    exclude = Path(exclude).resolve() if exclude is not None else None
    return [
        (step, p) for step, p in candidates
        if p.is_file() and p.resolve() != exclude and unreadable_reason(p) is None
    ]


def _fallback_advice(failed: Path) -> str:
    """Where to continue from when ``failed`` cannot be read: the newest checkpoint beside it that loads."""
    import torch

    for step, path in readable_checkpoints(failed.parent, exclude=failed):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            continue
        if isinstance(state, dict) and state.get("format") == FORMAT:
            step = int(state.get("step", step or 0))
            return (
                f"The newest readable checkpoint is {path} (step {step}); continue from it with "
                f"resume_from={shlex.quote(str(path.resolve()))}"
            )
    return f"No other readable checkpoint in {failed.parent}; start again with overwrite=true"


def _exception_text(exc: BaseException) -> str:
    """``Type: first line of the message``; the type alone when the message is empty (EOFError)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def resume_conflicts(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Frozen settings that differ between the checkpoint's run and this one, one line each."""
    problems = []
    for key in FROZEN_ON_RESUME:
        a, b = _get(saved, key), _get(current, key)
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
