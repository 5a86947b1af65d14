"""The checks of a run's settings that need neither torch nor Lightning.

``stabletrain train`` runs :func:`check_without_torch` before it imports torch, so that a mistyped
setting, a wrong type, a missing data path or a non-empty ``out`` folder is reported at once;
``train()`` then runs every check before anything is written. See docs/training.md.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from stabletrain.config import TrainSettings, load_settings, partial_settings
from stabletrain.data.paths import data_path_problems
from stabletrain.errors import ConfigError
from stabletrain.runfiles.checkpoint import checkpoint_dir, fallback_advice, unreadable_reason
from stabletrain.runfiles.commands import train_command
from stabletrain.runfiles.lock import LOCK_NAME

__all__ = ["check_without_torch", "out_dir_problems"]

#: Environment variables through which launchers (Lightning's, torchrun, SLURM, MPI) give a process its rank.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def check_without_torch(settings: dict[str, Any]) -> TrainSettings:
    """Validate ``settings`` with every check that needs no torch; the settings, or one
    :class:`ConfigError` listing every problem found.

    pydantic's checks (unknown keys, types, ranges), then on the values it accepts: the data
    path exists and is a file (language model) or a folder (images), and the ``out`` folder
    can take the run (see :func:`out_dir_problems`).
    """
    try:
        parsed = load_settings(settings)
    except ConfigError as exc:
        partial, rejected = partial_settings(settings)
        more = [] if partial is None else _problems_despite(partial, rejected)
        raise ConfigError(exc.problems + more) from None
    problems = _problems_despite(parsed, [])
    if problems:
        raise ConfigError(problems)
    return parsed


def _problems_despite(settings: TrainSettings, rejected: list[str]) -> list[str]:
    def reads(*keys: str) -> bool:
        return any(r == k or r.startswith(k + ".") or k.startswith(r + ".") for r in rejected for k in keys)

    problems = []
    if not reads("task", "model", "data") and isinstance(settings.data, (str, os.PathLike)):
        problems.extend(data_path_problems(_task_name(settings), Path(settings.data)))
    if not reads("out", "overwrite", "resume_interrupted", "resume_from") and not _launched_as_later_rank():
        problems.extend(out_dir_problems(settings))
    return problems


def _task_name(settings: TrainSettings) -> str:
    """The built-in task of the settings, as ``stabletrain.tasks.resolve_task_name`` decides it
    for model names; "custom" for a Python object."""
    model = settings.model
    if model is not None and not isinstance(model, str):
        return "custom"
    if settings.task is not None:
        return settings.task
    if isinstance(model, str) and (model == "cnn" or model.startswith("torchvision/")):
        return "image_classification"
    return "language_model"


def _launched_as_later_rank() -> bool:
    """Whether a launcher started this process as a rank other than the first: the first
    process owns ``out`` and checks it; the others find it already in use by the run."""
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) != 0:
            return True
    return False


def out_dir_problems(settings: TrainSettings) -> list[str]:
    """Whether the ``out`` folder can take the run: empty or absent for a new run (or
    ``overwrite``); for ``resume_interrupted`` a whole ``last.ckpt``, for ``resume_from`` a whole
    file. An unreadable checkpoint's problem names the one to continue from instead
    (:func:`stabletrain.runfiles.checkpoint.fallback_advice`), with the command."""
    s = settings
    out = Path(s.out)
    last = checkpoint_dir(out) / "last.ckpt"
    if s.resume_interrupted and s.resume_from is not None:
        return [
            f"resume_from: given together with resume_interrupted=true; use one: resume_from={s.resume_from} "
            f"continues from that file, resume_interrupted=true from {last}"
        ]
    if s.resume_from is not None:
        source = Path(s.resume_from)
        if not source.is_file() and not (source.is_dir() and source.suffix == ".ckpt"):  # a file, or a sharded folder
            return [f"resume_from: no checkpoint file at {source}; {_checkpoints_there(out)}"]
        return _unreadable("resume_from", source, s)
    if s.resume_interrupted:
        if not last.exists():
            return [f"resume_interrupted: no checkpoint to resume from at {last}: {_no_last_ckpt(out)}"]
        return _unreadable("resume_interrupted", last, s)
    if out.exists() and not out.is_dir():
        return [f"out: {out} exists and is not a folder"]
    if out.is_dir() and any(p.name != LOCK_NAME for p in out.iterdir()) and not s.overwrite:
        return [
            f"out: {out} is not empty; pass overwrite=true to replace its outputs, "
            "resume_interrupted=true to continue its run, or choose another folder"
        ]
    return []


def _no_last_ckpt(out: Path) -> str:
    """Why a run folder has no ``last.ckpt``, from what the folder holds, and what to do."""
    if not out.exists():
        return (f"{out} does not exist, so there is no run to continue; drop resume_interrupted=true to start "
                "one there, or pass the out folder of the run to continue")
    if not out.is_dir():
        return f"{out} is a file, not a run folder; pass the out folder of the run to continue"
    if not any(p.name != LOCK_NAME for p in out.iterdir()):
        return (f"{out} is empty, so there is no run to continue; drop resume_interrupted=true to start one "
                "there, or pass the out folder of the run to continue")
    return ("the run stopped before its first checkpoint; start again with overwrite=true instead of "
            "resume_interrupted=true")


def _checkpoints_there(out: Path) -> str:
    """The checkpoints of the run in ``out`` to pass instead (newest first), or that it has none."""
    folder = checkpoint_dir(out)
    found = sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True) if folder.is_dir() else []
    if not found:
        return f"pass the .ckpt file of a run; {out} has none ({folder} holds no .ckpt file)"
    shown = ", ".join(str(p) for p in found[:3]) + (f" (+{len(found) - 3} more)" if len(found) > 3 else "")
    return f"pass a .ckpt file; the run in {out} has {shown}"


def _unreadable(setting: str, path: Path, settings: TrainSettings) -> list[str]:
    reason = unreadable_reason(path)  # no torch: the size and the zip index
    if reason is None:
        return []
    # Naming the checkpoint to use instead reads the others' recorded health, which needs torch;
    # only this error pays for loading it.
    advice = fallback_advice(path, command=functools.partial(train_command, settings))
    return [f"{setting}: cannot read {path}: {reason}. {advice}"]
