"""Pasteable commands for messages: continue a run, resume from a checkpoint, start again.

A command is built from the run's own ``stabletrain train`` arguments when the CLI started
it, else from its settings when every setting is expressible on the command line (built-in
task, no Python objects). Paths (``out``, ``data``, ``resume_from``) are made absolute and
every argument is quoted for a POSIX shell, so the command works when pasted in any folder.
Runs that cannot be expressed on the command line (your own model or dataset objects) get
the Python call with the settings to add.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Optional

from stabletrain.config import TrainSettings
from stabletrain.utils.text import abs_path

#: Settings a continuation replaces: how a run starts, not what it trains.
_START_KEYS = ("out", "resume_interrupted", "resume_from", "overwrite")
_invocation: Optional[list[str]] = None


def set_cli_invocation(args: Optional[list[str]]) -> None:
    """Called by ``stabletrain train`` with its ``key=value`` arguments."""
    global _invocation
    _invocation = None if args is None else list(args)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    out[prefix[:-1]] = data
    return out


def _cli_pairs(settings: TrainSettings) -> Optional[list[tuple[str, Any]]]:
    """The settings that differ from the defaults as (dotted key, value); None when one of
    them is a Python object the command line cannot express."""
    if settings.callbacks or not (settings.model is None or isinstance(settings.model, str)):
        return None
    if not (settings.data is None or isinstance(settings.data, (str, Path))):
        return None
    current = _flatten(settings.to_json_dict())
    default = _flatten(TrainSettings(out=settings.out).to_json_dict())
    return [(k, v) for k, v in current.items() if k not in _START_KEYS and k != "callbacks" and default.get(k) != v]


def _value(key: str, value: Any) -> str:
    if key == "data" and isinstance(value, str) and Path(value).exists():
        value = abs_path(value)
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return json.dumps(value)


def train_command(settings: TrainSettings, **start: Any) -> str:
    """``stabletrain train ...`` continuing ``settings``' run with the start settings ``start``
    (``resume_interrupted=True``, ``resume_from=path``, ``overwrite=True``) and any extra
    ``key=value`` given as ``extra={"debug_args.nancapture.enabled": True}``. ``from_invocation=False``
    builds it from ``settings`` even in a process that ``stabletrain train`` started (a command for another
    run, e.g. one read from its settings.json).

    Example::

        train_command(settings, resume_from="out/run/checkpoints/step_000040.ckpt")
        # "stabletrain train out=/abs/out/run ... resume_from=/abs/out/run/checkpoints/step_000040.ckpt"
    """
    extra: dict[str, Any] = dict(start.pop("extra", {}) or {})
    from_invocation = bool(start.pop("from_invocation", True))
    start_items = []
    for key, value in start.items():
        if key in ("resume_from",) and value is not None:
            value = abs_path(value)
        start_items.append((key, value))
    if _invocation is not None and from_invocation:
        pairs = []
        for arg in _invocation:
            key, _, raw = arg.partition("=")
            if key not in _START_KEYS and key not in extra:
                pairs.append((key, raw if key != "data" else _value("data", raw)))
    else:
        found = _cli_pairs(settings)
        if found is None:
            return _python_call(settings, start_items, extra)
        pairs = [(k, _value(k, v)) for k, v in found if k not in extra]
    out = abs_path(settings.out)
    items = [("out", out), *pairs, *((k, _value(k, v)) for k, v in [*start_items, *extra.items()])]
    return "stabletrain train " + " ".join(shlex.quote(f"{k}={v}") for k, v in items)


def _python_call(settings: TrainSettings, start_items: list[tuple[str, Any]], extra: dict[str, Any]) -> str:
    args = [f"out={abs_path(settings.out)!r}", "... your other settings ..."]
    args += [f"{k}={v!r}" for k, v in start_items]
    nested = ", ".join(f"{k}={v!r}" for k, v in extra.items())
    text = "stabletrain.train(" + ", ".join(args) + ")"
    return text + (f" with {nested}" if nested else "")
