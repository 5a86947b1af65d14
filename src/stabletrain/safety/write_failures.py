"""A write that fails (a full disk, a read-only or vanished folder) ends the run with one message.

Every file stabletrain writes under ``out/`` (checkpoints, captures, metrics.jsonl, train.log,
TensorBoard, reports) can fail with an ``OSError``. Checkpoints and captures are written to a
temporary file and renamed, so a failed write leaves what was there before intact; a
checkpoint is not even started when the free space is less than it needs
(:func:`stabletrain.runfiles.checkpoint.check_free_space`). The trainer turns such an error
into :class:`WriteFailedError`: what could not be written and why, what is still intact, and
the command to continue once the cause is fixed. Under DDP/FSDP every rank stops together.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any, Optional

from stabletrain.errors import StabletrainError

#: errno values of writes that fail for a reason outside the program: the user can fix them.
WRITE_ERRNOS = {
    errno.ENOSPC: "no space left on device (ENOSPC)",
    errno.EDQUOT: "the disk quota is exceeded (EDQUOT)",
    errno.EROFS: "the filesystem is read-only (EROFS)",
    errno.EACCES: "permission denied (EACCES)",
    errno.EPERM: "operation not permitted (EPERM)",
    errno.ENOENT: "its folder no longer exists (ENOENT)",
    errno.EIO: "an input/output error (EIO)",
}

_FIX = {
    errno.ENOSPC: "Free space on that filesystem (df -h {folder} shows it)",
    errno.EDQUOT: "Free space within your quota",
    errno.EROFS: "Make {folder} writable again (or remount it read-write)",
    errno.EACCES: "Give this user write access to {folder}",
    errno.EPERM: "Give this user write access to {folder}",
    errno.ENOENT: "Something removed the run's folder while it trained; restore it or start again",
    errno.EIO: "Check the disk (dmesg) before writing to it again",
}


class WriteFailedError(StabletrainError):
    """A file of the run could not be written; training stopped.

    Attributes:
        path: The file that could not be written (None when unknown).
        errno: The ``errno`` of the failure (``errno.ENOSPC`` for a full disk).
        step: Steps completed when training stopped.
        checkpoint: The newest checkpoint still intact to continue from (None when there is none).
        command: The command that continues the run once the cause is fixed.
        other_rank: True on the ranks that stopped because another rank's write failed: the
            command line prints only the failing rank's message.
    """

    def __init__(self, message: str, path: Optional[Path], errno: Optional[int], step: int,
                 checkpoint: Optional[Path], command: str, other_rank: bool = False):
        super().__init__(message)
        self.path, self.errno, self.step, self.checkpoint, self.command = path, errno, step, checkpoint, command
        self.other_rank = other_rank

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.path, self.errno, self.step, self.checkpoint, self.command,
                             self.other_rank))


def is_write_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is an ``OSError`` of a write that the user can fix (:data:`WRITE_ERRNOS`)."""
    return isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS


def write_failed_error(trainer: Any, exc: Optional[OSError]) -> WriteFailedError:
    """The error ending ``trainer``'s run after the failed write ``exc`` (None: on another rank)."""
    from stabletrain.safety.stop_messages import resume_advice

    advice, best, command = resume_advice(trainer, None)
    if exc is None:
        return WriteFailedError(
            f"Another rank could not write a file of the run (its message says which); training stopped after "
            f"{trainer.step} steps on every rank. {advice}", None, None, trainer.step,
            None if best is None else best.path, command, other_rank=True)
    path = Path(exc.filename) if exc.filename else None
    folder = path.parent if path is not None else Path(trainer.out)
    why = WRITE_ERRNOS.get(exc.errno or 0, exc.strerror or str(exc))
    if exc.errno == errno.ENOSPC and exc.strerror and "free space" in exc.strerror:
        why = exc.strerror  # the check before a checkpoint: nothing was written
    fix = _FIX.get(exc.errno or 0, "Fix the cause").format(folder=folder)
    what = str(path) if path is not None else "a file of the run"
    message = (
        f"Could not write {what}: {why}. Training stopped after {trainer.step} steps. "
        f"Nothing already written was lost: checkpoints and captures are written whole or not at all "
        f"(a temporary file, removed on failure, then a rename). {fix}, then continue. {advice}"
    )
    return WriteFailedError(message, path, exc.errno, trainer.step, None if best is None else best.path, command)


def write_failure_text(exc: OSError) -> str:
    """One sentence for a failed write outside a training run (``stabletrain report``, ...):
    what could not be written, why, and what to do."""
    what = exc.filename or "a file"
    folder = Path(exc.filename).parent if exc.filename else Path(".")
    why = WRITE_ERRNOS.get(exc.errno or 0, exc.strerror or str(exc))
    fix = _FIX.get(exc.errno or 0, "Fix the cause").format(folder=folder)
    return f"could not write {what}: {why}. {fix}, then run the command again."
