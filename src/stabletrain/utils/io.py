"""Atomic file writes: a crash mid-write never leaves a half-written file behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional

import torch


class _Writes:
    """A binary file for ``torch.save`` that keeps the ``OSError`` of a failed write: torch turns
    it into a ``RuntimeError`` (``[enforce fail at inline_container.cc] unexpected pos``) that
    says nothing about a full disk."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.error: Optional[OSError] = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def _as_write_error(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path``, the file the caller wanted written (not its temporary file)."""
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


@contextmanager
def _atomic_target(path: Path, *, make_parent: bool = True) -> Iterator[tuple[int, Path]]:
    """A temporary file beside ``path`` to write (its open descriptor and its path), renamed over
    ``path`` when the block ends without an error.

    On an error the temporary file is removed, whatever ``path`` held before is intact, and an
    ``OSError`` is raised again naming ``path`` (not the temporary file), its errno kept.
    """
    try:
        if make_parent:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _as_write_error(exc, path) from None
    try:
        yield fd, Path(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno is not None:
            raise _as_write_error(exc, path) from None
        raise


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to a temporary file in the same folder, fsync, then rename over ``path``.

    Raises:
        OSError: The file could not be written (``errno`` ENOSPC on a full disk, EROFS, ENOENT
            when the folder vanished); ``filename`` is ``path``. The temporary file is removed
            and whatever ``path`` held before is intact.
    """
    path = Path(path)
    with _atomic_target(path) as (fd, _):
        with os.fdopen(fd, "wb") as f:
            writes = _Writes(f)
            try:
                torch.save(obj, writes)  # type: ignore[arg-type]  # a file-like with write and flush
            except BaseException:
                if writes.error is not None:  # torch's RuntimeError hides the disk's OSError
                    raise writes.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
    return path


def free_bytes(folder: str | Path) -> Optional[int]:
    """Free bytes on the filesystem of ``folder`` (its nearest existing parent); None when unknown."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested dict/list/tuple: what ``torch.save`` writes, less a little."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def atomic_write_text(text: str, path: str | Path) -> Path:
    """Write ``text`` to ``path`` atomically (temporary file, then rename); errors as
    :func:`atomic_torch_save`'s."""
    path = Path(path)
    with _atomic_target(path) as (fd, _):
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return path


def atomic_copy(src: str | Path, dst: str | Path) -> Path:
    """Copy ``src`` over ``dst`` atomically (temporary file, then rename); errors as
    :func:`atomic_torch_save`'s, naming ``dst``. The folder of ``dst`` must exist."""
    dst = Path(dst)
    with _atomic_target(dst, make_parent=False) as (fd, tmp):
        os.close(fd)
        shutil.copyfile(src, tmp)
    return dst
