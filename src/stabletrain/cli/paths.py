"""The path given to ``stabletrain replay`` and ``diagnose``, checked before torch is loaded.

Loading torch takes seconds; a mistyped path, a file that is no capture, or a run folder in
which no capture was ever written is answered at once. Only what is certainly wrong is refused
here: the loader (:func:`stabletrain.debug.nan_capture.capture_files`) decides the rest.
"""

from __future__ import annotations

import os
from pathlib import Path

from stabletrain.errors import NaNCaptureError

__all__ = ["check_capture_path", "is_run_without_capture"]

#: The name of every capture file (``stabletrain.debug.nan_capture.FILE_NAME``, which needs torch).
CAPTURE_FILE = "nan_capture.pt"

#: How deep below the given folder a capture is looked for: a run folder's
#: ``debug/recoveries/step12/rank0/nan_capture.pt`` is 5 levels down.
_MAX_DEPTH = 5

#: Every file ``torch.save`` writes is a zip archive (captures are written with it).
_ZIP_MAGIC = b"PK\x03\x04"


def check_capture_path(path: str | Path, command: str) -> None:
    """Raise :class:`NaNCaptureError` when ``path`` cannot hold a NaN capture.

    Args:
        path: What the user gave ``stabletrain replay`` or ``diagnose``.
        command: ``"replay"`` or ``"diagnose"``, for the example in the message.
    """
    p = Path(path)
    if p.is_file():
        if p.name != CAPTURE_FILE and not _is_zip(p):  # a damaged capture: the loader says how
            raise NaNCaptureError(
                f"{p} is not a stabletrain NaN capture (a capture is a file torch.save wrote, and this one is "
                f"not); give the capture's folder, e.g. stabletrain {command} out/boom/debug/nan_capture/rank0, "
                "or the run folder",
                p,
            )
        return
    if not p.exists():
        raise NaNCaptureError(f"no such file or folder: {p}", p)
    if p.is_dir() and not _holds_capture(p):
        raise NaNCaptureError(
            f"no NaN capture in {p}: no {CAPTURE_FILE} in it or in its subfolders (expected {p / CAPTURE_FILE}, "
            f"{p}/rank<N>/{CAPTURE_FILE}, or a run folder with debug/nan_capture/ or debug/recoveries/); "
            "captures are written when debug_args.nancapture.enabled=true and a step fails, and at the "
            "recoveries of on_instability.policy",
            p,
        )


def is_run_without_capture(path: str | Path) -> bool:
    """A training run's folder (it holds metrics.jsonl) in which no capture was written: ``diagnose`` reads
    its logged signals instead (docs/mechanisms.md)."""
    p = Path(path)
    return p.is_dir() and (p / "metrics.jsonl").is_file() and not _holds_capture(p)


def _is_zip(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == _ZIP_MAGIC
    except OSError:
        return True  # unreadable here: let the loader say why


def _holds_capture(folder: Path) -> bool:
    top = len(folder.parts)
    for dirpath, dirnames, filenames in os.walk(folder):
        if CAPTURE_FILE in filenames:
            return True
        if len(Path(dirpath).parts) - top >= _MAX_DEPTH - 1:
            dirnames.clear()
    return False
