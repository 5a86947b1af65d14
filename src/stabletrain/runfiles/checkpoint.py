"""Checkpoints: atomic writes, safe loading (``weights_only=True``), exact resume.

``out/checkpoints/last.ckpt`` and ``step_NNNNNN.ckpt`` hold model, optimizer, loss scaler, step,
every rank's RNG states and the data position; a non-finite state is never written, and rotation
keeps the newest healthy one (:mod:`stabletrain.safety.checkpoint_health`). See docs/checkpoints.md.

A checkpoint is one file (``checkpoint_format=full``) or, under FSDP2 with
``checkpoint_format=sharded``, a folder of the same name holding every rank's shards
(torch.distributed.checkpoint) and ``meta.pt``: everything but the model and optimizer tensors,
health included, so that rotation and "newest healthy" never read the shards. A folder is
written under a hidden temporary name and renamed once complete (:func:`commit_sharded`);
every reader here takes both forms (:func:`is_checkpoint`).
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

#: In a sharded checkpoint folder: the non-tensor state and health (written last: the folder's
#: completion marker) and DCP's index of the shards.
META_NAME = "meta.pt"
DCP_INDEX = ".metadata"
#: ``layout`` of a sharded checkpoint's state (a full file has none).
SHARDED = "sharded"


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
    _protect_healthy(folder, state.get("health") or {})
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


def check_free_space(state: dict[str, Any], folder: Path, periodic: bool, nbytes: Optional[int] = None,
                     copies: Optional[int] = None) -> None:
    """Raise :class:`NotEnoughSpaceError` when the checkpoint of ``state`` will not fit in
    ``folder``: its size is taken as the larger of its tensors' bytes (``nbytes`` when given: a
    sharded checkpoint's, summed over the ranks) and the last checkpoint's size, with a margin;
    nothing is written, so the previous checkpoint stays intact. ``copies``: how many times it is
    written (default 2 for a periodic file, ``step_N.ckpt`` and ``last.ckpt``; a sharded folder's
    ``last.ckpt`` is hard links, 1)."""
    from stabletrain.utils.io import free_bytes, tensor_bytes

    free = free_bytes(folder)
    if free is None:
        return
    size = max(tensor_bytes(state) if nbytes is None else nbytes, checkpoint_size(folder / "last.ckpt"))
    needed = int(size * 1.05) + 2**16
    needed *= copies if copies is not None else (2 if periodic else 1)
    if free < needed:
        name = periodic_name(int(state["step"])) if periodic else "last.ckpt"
        raise NotEnoughSpaceError(folder / name, needed, free)


# --------------------------------------------------------------------------------------
# Sharded checkpoints: a folder per checkpoint (rank 0's file operations; the shards are
# written by every rank through stabletrain.distributed.dcp)
# --------------------------------------------------------------------------------------


def sharded_target(out: Path, step: int, periodic: bool) -> tuple[Path, Path]:
    """``(temporary folder, final folder)`` of a sharded checkpoint: every rank computes the same."""
    folder = checkpoint_dir(out)
    name = periodic_name(step) if periodic else "last.ckpt"
    return folder / f".{name}.tmp", folder / name


def begin_sharded(meta: dict[str, Any], out: Path, periodic: bool, nbytes: int) -> Path:
    """Rank 0, before the shards are written: check the free space for ``nbytes`` (every rank's
    shards together) and create the empty temporary folder the ranks write into.

    Raises:
        NotEnoughSpaceError, OSError: Nothing was started; the previous checkpoints are intact.
    """
    folder = checkpoint_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    check_free_space(meta, folder, periodic, nbytes=nbytes, copies=1)
    tmp, _ = sharded_target(out, int(meta["step"]), periodic)
    _remove(tmp)
    tmp.mkdir()
    return tmp


def commit_sharded(meta: dict[str, Any], out: Path, periodic: bool, keep: int) -> Path:
    """Rank 0, once every rank's shards and DCP's index are in the temporary folder: write
    ``meta.pt`` (the non-tensor state and health; last, so a folder without it is incomplete),
    rename the folder into place, link it as ``last.ckpt`` when periodic, rotate. Returns ``last.ckpt``."""
    from stabletrain.utils.io import atomic_torch_save

    tmp, target = sharded_target(out, int(meta["step"]), periodic)
    folder = checkpoint_dir(out)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "layout": SHARDED,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        **meta,
        # Each file's size: a copy that did not finish is found without reading the shards.
        "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()},
    }
    atomic_torch_save(meta, tmp / META_NAME)
    _fsync_dir(tmp)
    _protect_healthy(folder, meta.get("health") or {})
    _replace(tmp, target)
    _fsync_dir(folder)
    last = folder / "last.ckpt"
    if periodic:
        _atomic_copy(target, last)
        _prune(folder, keep)
    return last


def _fsync_dir(folder: Path) -> None:
    import os

    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_sharded_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta.pt`` of a sharded checkpoint folder: everything but the model and optimizer
    tensors (``weights_only``). Raises CheckpointError when it is missing or unreadable."""
    import torch

    path = Path(path)
    reason = unreadable_reason(path)
    if reason is not None:
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}. {fallback_advice(path)}")
    try:
        meta = torch.load(path / META_NAME, map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = _exception_text(exc)
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}. {fallback_advice(path)}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a stabletrain checkpoint")
    return meta


def remove_temporaries(out: Path) -> list[Path]:
    """Remove the temporary files and folders (``.NAME.xxxx.tmp``, a sharded checkpoint's
    ``.NAME.tmp``) that a killed run left in ``out`` and its checkpoint folder, and finish a
    replacement of a checkpoint folder that a kill interrupted (:func:`_replace`); call only
    while holding the run lock. Returns those removed."""
    import shutil

    removed = []
    for folder in (Path(out), checkpoint_dir(out)):
        if not folder.is_dir():
            continue
        for old in folder.glob(".*" + _OLD):
            target = folder / old.name[1:-len(_OLD)]
            if not target.exists() and (old.is_file() or is_sharded_checkpoint(old)):
                old.rename(target)  # killed between the two renames: the old checkpoint is still the one
            else:
                _remove(old)
                removed.append(old)
        for path in folder.glob(".*.tmp"):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


#: Suffix of a checkpoint folder being replaced (see :func:`_replace`).
_OLD = ".old"


def _replace(src: Path, dst: Path) -> None:
    """Rename ``src`` (a complete file or folder) to ``dst``, replacing what ``dst`` holds. A
    folder cannot be renamed over another, so the old one first becomes ``.NAME.old``; a kill
    between the two renames leaves it there, and :func:`remove_temporaries` puts it back."""
    import os

    if src.is_file() and not dst.is_dir():
        os.replace(src, dst)
        return
    old = dst.parent / f".{dst.name}{_OLD}"
    if dst.exists():
        _remove(old)
        os.rename(dst, old)
    os.rename(src, dst)
    _remove(old)


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Is ``path`` a complete sharded checkpoint folder (DCP's index and ``meta.pt``, written last)?"""
    path = Path(path)
    return path.is_dir() and (path / META_NAME).is_file() and (path / DCP_INDEX).is_file()


def is_checkpoint(path: str | Path) -> bool:
    """A checkpoint file, or a complete sharded checkpoint folder."""
    path = Path(path)
    return path.is_file() or is_sharded_checkpoint(path)


def checkpoint_size(path: str | Path) -> int:
    """Bytes on disk of a checkpoint file or folder (0 when absent)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return 0


def _protect_healthy(folder: Path, health: dict[str, Any]) -> None:
    """Before a checkpoint with ``health`` replaces last.ckpt: keep the newest healthy one (from before
    a pending mechanism's step) under its periodic name (:func:`_keep_newest_healthy`)."""
    if health.get("healthy") is False:
        _keep_newest_healthy(folder)
    elif isinstance(health.get("pending_since"), int):  # a mechanism may be named that began at that step
        _keep_newest_healthy(folder, before_step=health["pending_since"])


def _keep_newest_healthy(folder: Path, before_step: Optional[int] = None) -> None:
    """Before an unhealthy (or pending) state overwrites last.ckpt: if last.ckpt holds the only copy of
    the newest healthy checkpoint (holding at most ``before_step`` steps; its step_N.ckpt was rotated
    away), give it its periodic name."""
    best = newest_healthy(folder, before_step=before_step)
    if best is not None and best.path.name == "last.ckpt":
        _atomic_copy(best.path, folder / periodic_name(best.step))


def _atomic_copy(src: Path, dst: Path) -> None:
    """Copy a checkpoint over ``dst``: a file's bytes; a sharded folder by hard links (its files
    are never written again, so a link costs no space), into a temporary folder renamed over ``dst``."""
    from stabletrain.utils.io import atomic_copy

    if not src.is_dir():
        if dst.is_dir():
            tmp = dst.parent / f".{dst.name}.copy.tmp"
            atomic_copy(src, tmp)
            _replace(tmp, dst)
            return
        atomic_copy(src, dst)
        return
    link_tree(src, dst.parent / f".{dst.name}.link.tmp")
    _replace(dst.parent / f".{dst.name}.link.tmp", dst)


def link_tree(src: Path, dst: Path) -> Path:
    """``dst`` as a new folder of hard links to ``src``'s files (copies where the filesystem
    cannot link); ``meta.pt`` linked last, so that ``dst`` is complete only once it is there."""
    import os
    import shutil

    _remove(dst)
    dst.mkdir(parents=True)
    files = sorted((p for p in src.iterdir() if p.is_file()), key=lambda p: p.name == META_NAME)
    for path in files:
        try:
            os.link(path, dst / path.name)
        except OSError:
            shutil.copyfile(path, dst / path.name)
    return dst


def _prune(folder: Path, keep: int) -> None:
    """Keep the newest ``keep`` periodic files; while the newest checkpoint is not healthy,
    also the newest healthy one (the place to resume from after the instability); while a mechanism
    rule is pending (the newest checkpoint's ``health["pending_since"]``), also the newest healthy one
    from before the step it would begin at."""
    periodic = sorted((int(m.group(1)), p) for p in folder.iterdir()
                      if (m := _PERIODIC.match(p.name)) and is_checkpoint(p))
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
            _remove(path)


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names: itself (a file or a sharded checkpoint folder), or for a
    run folder its ``checkpoints/last.ckpt``."""
    path = Path(path)
    if path.is_dir() and not _looks_sharded(path):
        # A run folder: its checkpoints/last.ckpt, even when missing there (the error names it).
        path = (checkpoint_dir(path) if checkpoint_dir(path).is_dir() else path) / "last.ckpt"
    return path


def _looks_sharded(path: Path) -> bool:
    """A folder meant as a sharded checkpoint (complete or not): named ``*.ckpt``, or holding
    ``meta.pt`` or DCP's index."""
    return path.suffix == ".ckpt" or (path / META_NAME).exists() or (path / DCP_INDEX).exists()


def load_checkpoint(path: str | Path, tensors: bool = True, optimizer: bool = True) -> dict[str, Any]:
    """Load a checkpoint safely (no code runs); raise CheckpointError with the reason otherwise.

    A sharded checkpoint folder is read in this one process, without a process group: its
    shards are put back together into the full model and optimizer state (the whole state in
    host memory once: 12 bytes per parameter for float32 AdamW), in the form a full file
    holds, so that every reader works unchanged (:func:`stabletrain.distributed.dcp.load_full`).
    ``tensors=False`` reads ``meta.pt`` only (``model`` and ``optimizer`` then absent);
    ``optimizer=False`` leaves the optimizer state of a sharded checkpoint unread.

    When the file is missing or cannot be read, the error names the checkpoint beside it to
    continue from (:func:`fallback_advice`).
    """
    import torch

    path = resolve_checkpoint(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}. {fallback_advice(path)}")
    if path.is_dir():
        meta = read_sharded_meta(path)
        _check_version(path, meta)
        if not tensors:
            return meta
        from stabletrain.distributed.dcp import load_full

        try:
            return {**meta, **load_full(path, optimizer=optimizer)}
        except Exception as exc:  # a shard file damaged or missing
            raise CheckpointError(f"cannot read checkpoint {path}: {_exception_text(exc)}. "
                                  f"{fallback_advice(path)}") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # empty, truncated, corrupt, or holding pickled objects
        reason = unreadable_reason(path) or _exception_text(exc)
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}. {fallback_advice(path)}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a stabletrain checkpoint")
    _check_version(path, state)
    return state


def _check_version(path: Path, state: dict[str, Any]) -> None:
    if int(state.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{path} was written by a newer stabletrain (checkpoint format {state['version']}, "
            f"this version reads up to {VERSION}); upgrade stabletrain"
        )


def unreadable_reason(path: str | Path) -> Optional[str]:
    """Why the file at ``path`` cannot be a whole checkpoint, found without torch and without
    unpickling (the size and the zip directory that ``torch.save`` writes last); None when it
    looks whole. Reading it can still fail on what is inside."""
    path = Path(path)
    if path.is_dir():
        return _unreadable_folder(path)
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
    # torch.save puts every entry in one top folder (``<stem>/data.pkl``); torch.load refuses a
    # data.pkl outside one.
    if not any(n.endswith("/data.pkl") for n in names):
        return (f"the file is a zip archive but not a torch checkpoint (no FOLDER/data.pkl, which torch.save writes, "
                f"among its {len(names)} entries)")
    return None


def _unreadable_folder(path: Path) -> Optional[str]:
    """Why a folder cannot be a whole sharded checkpoint: ``meta.pt`` (written last) missing or
    cut short, DCP's index or a shard file missing, or a file shorter than recorded."""
    meta = path / META_NAME
    if not meta.exists():
        return (f"the folder holds no {META_NAME}, which a sharded checkpoint gets last: its write did not "
                "finish, or it is not a checkpoint")
    reason = unreadable_reason(meta)
    if reason is not None:
        return f"{META_NAME}: {reason}"
    if not (path / DCP_INDEX).is_file():
        return f"the folder holds no {DCP_INDEX} (torch.distributed.checkpoint's index of the shards)"
    recorded = _recorded_files(meta)
    for name, size in recorded.items():
        f = path / name
        if not f.is_file():
            return f"the shard file {name} is missing"
        if f.stat().st_size != size:
            return f"the shard file {name} holds {f.stat().st_size:,} bytes, {size:,} were written"
    return None


def _recorded_files(meta: Path) -> dict[str, int]:
    """``meta.pt``'s ``files`` entry without torch: the zip's data.pkl holds it as plain pickled
    data (names and sizes); {} when it cannot be read that way."""
    import pickle

    try:
        with zipfile.ZipFile(meta) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            raw = archive.read(name)
    except (zipfile.BadZipFile, OSError, StopIteration):
        return {}

    class _NoClasses(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:  # tensors' rebuilders etc.: not needed here
            return lambda *a, **k: None

        def persistent_load(self, pid: Any) -> Any:
            return None

    try:
        data = _NoClasses(__import__("io").BytesIO(raw)).load()
    except Exception:
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return {str(k): int(v) for k, v in files.items()} if isinstance(files, dict) else {}


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


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _exception_text(exc: BaseException) -> str:
    """``Type: first line of the message`` without its final full stop (the caller's sentence goes
    on) or terminal colour codes; the type alone when the message is empty (EOFError). torch's
    weights-only refusal is a page of advice: its line that names the object is kept instead."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    unpickler = [line for line in lines if line.startswith("WeightsUnpickler error: ")]
    if unpickler:  # "Unsupported global: GLOBAL mod.Name was not an allowed global by default. Please use ..."
        why = unpickler[0][len("WeightsUnpickler error: "):].split(". ")[0]
        lines = [f"Weights only load failed: {why}"]
    first = lines[0].rstrip(".") if lines else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def resume_conflicts(saved: dict[str, Any], current: dict[str, Any], allow: tuple[str, ...] = ()) -> list[str]:
    """Frozen settings that differ between the checkpoint's run and this one, one line each;
    those in ``allow`` may differ (``world_size`` for a sharded checkpoint, which DCP reshards)."""
    problems = []
    for key in FROZEN_ON_RESUME:
        if key in allow:
            continue
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
    file = path / META_NAME if path.is_dir() else path
    st = file.stat()
    key = (str(file.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _CACHE:
        import torch

        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
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
        if not is_checkpoint(path):
            continue
        try:
            step, health = read_checkpoint_health(path)
        except Exception:  # truncated, foreign or unreadable: not a place to resume from
            continue
        if step in seen:
            continue
        healthy, why = health_now(folder.parent, step, health)
        seen[step] = CheckpointInfo(path, step, healthy, why, health)
    return [seen[s] for s in sorted(seen)]


def health_now(run: str | Path, step: int, health: Optional[dict[str, Any]]) -> tuple[Optional[bool], str]:
    """A checkpoint's health as known now: ``(healthy, why)`` as recorded when it was written (None
    when it has no record), except that one recorded healthy is not once the run's metrics.jsonl names
    a mechanism that began before its ``step`` (named later: :func:`~stabletrain.runfiles.history.mechanism_spans`)."""
    healthy = None if health is None else bool(health.get("healthy"))
    why = str((health or {}).get("why", ""))
    if healthy:
        span = next((m for m in mechanism_spans(run) if m.covers(step)), None)
        if span is not None:
            return False, span.why()
    return healthy, why


def newest_healthy(folder: str | Path, before_step: Optional[int] = None) -> Optional[CheckpointInfo]:
    """The newest checkpoint recorded healthy (optionally holding at most ``before_step``
    steps), or None."""
    healthy = [c for c in list_checkpoints(folder)
               if c.healthy and (before_step is None or c.step <= before_step)]
    return healthy[-1] if healthy else None


def none_healthy_before(folder: str | Path, step: int) -> str:
    """Why no checkpoint of a run is a place to restart from before ``step``, as a phrase: none
    was written by then (``step_000020.ckpt`` holds steps 0-19: it is from before step 20), or
    those written are not healthy."""
    if any(c.step <= step for c in list_checkpoints(folder)):
        return f"no checkpoint from before step {step} is healthy"
    return f"no checkpoint was written before step {step}"
