"""The model source line of an op: the innermost frame outside torch and stabletrain's debugging tools, in
forward from the call stack, in backward from the traceback anomaly mode stored on the autograd node.
See ``docs/diagnose.md``.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Optional

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
# stabletrain's debugging tools (replay, diagnose) call the user's code; their frames are never the answer.
_DEBUG_DIR = os.path.dirname(os.path.dirname(_THIS_FILE)) + os.sep  # .../stabletrain/debug/
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(_THIS_FILE)))) + os.sep  # .../src/


def user_source(stack: list[traceback.FrameSummary]) -> Optional[str]:
    """The innermost frame outside torch and this module: the model code that called the op."""
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if path.startswith(_DEBUG_DIR) or path.startswith(_TORCH_DIR) or "/lightning_fabric/" in path:
            continue
        if frame.filename.startswith("<"):
            continue
        line = (frame.line or "").strip()
        return f"{_short_path(path)}:{frame.lineno}: {line}"
    return None


def _short_path(path: str) -> str:
    """``path`` relative to the working directory when below it (shorter in reports), a
    built-in model's file as ``stabletrain/...``, else absolute."""
    if path.startswith(_PACKAGE_PARENT):
        return path[len(_PACKAGE_PARENT):]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def anomaly_source(node: Any) -> Optional[str]:
    """The forward traceback anomaly mode stored on an autograd node, reduced to the user's line."""
    text = getattr(node, "metadata", {}).get("traceback_") if node is not None else None
    if not text:
        return None
    frames = []
    for entry in text if isinstance(text, list) else [text]:
        for line in str(entry).splitlines():
            line = line.strip()
            if line.startswith('File "'):
                try:
                    path, rest = line[6:].split('", line ', 1)
                    lineno = int(rest.split(",")[0])
                except ValueError:
                    continue
                frames.append(traceback.FrameSummary(path, lineno, "", lookup_line=True))
    return user_source(frames)
