"""Settings from the command line: dotted ``key=value`` pairs, and the rows of ``train --help``.

See docs/training.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from stabletrain.config.train import TrainSettings
from stabletrain.config.types import type_name
from stabletrain.errors import ConfigError

#: Settings that only make sense from Python.
PYTHON_ONLY = ("callbacks",)


def parse_cli_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["model_args.lr=0.01", "out=out/x"]`` into a nested dict.

    Values are parsed as JSON where possible (numbers, true/false, null, lists, objects);
    anything else is kept as a string, so ``precision=bf16-mixed`` needs no quoting. A setting
    given twice is an error (the last value would silently win), and so is a group given whole
    and by key (``model_args={"lr": 1} model_args.lr=2``).
    """
    result: dict[str, Any] = {}
    problems = []
    given: list[tuple[tuple[str, ...], str, Any]] = []  # (key parts, argument, value) of the valid arguments
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep or not key:
            problems.append(f"{arg!r}: expected key=value, e.g. model_args.lr=0.01")
            continue
        parts = key.split(".")
        if any(not p for p in parts):
            problems.append(f"{arg!r}: malformed key {key!r}")
            continue
        given.append((tuple(parts), arg, _parse_value(raw)))
    repeats = _repeated_keys(given)
    problems.extend(repeats)
    if repeats:
        raise ConfigError(problems)
    for key_parts, _, value in given:
        node = result
        for i, p in enumerate(key_parts[:-1]):
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                problems.append(f"{'.'.join(key_parts)}: {'.'.join(key_parts[: i + 1])} was already given a value, "
                                "it cannot also have sub-keys")
                break
            node = child
        else:
            node[key_parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    return result


def _repeated_keys(given: list[tuple[tuple[str, ...], str, Any]]) -> list[str]:
    """One line per setting given more than once: the same key, or a group and keys inside it."""
    problems = []
    done: set[int] = set()
    for i, (parts, _, _) in enumerate(given):
        if i in done:
            continue
        # The shortest key that is a prefix of this one, or of which it is a prefix, heads the cluster.
        related = [j for j, (other, _, _) in enumerate(given) if _nested(parts, other)]
        head = min(related, key=lambda j: len(given[j][0]))
        cluster = [j for j, (other, _, _) in enumerate(given) if _nested(given[head][0], other)]
        done.update(cluster)
        if len(cluster) < 2:
            continue
        key = ".".join(given[head][0])
        args = [given[j][1] for j in cluster]
        listed = ", ".join(args)
        if all(given[j][0] == given[head][0] for j in cluster):
            problems.append(f"{key}: given {len(args)} times ({listed}); give each setting once")
        elif isinstance(given[head][2], dict):
            problems.append(f"{key}: given as a whole and by key ({listed}); give the group once, or only its keys")
        else:
            problems.append(f"{key}: was given a value and sub-keys ({listed}); a setting cannot also have sub-keys")
    return problems


def _nested(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _parse_value(raw: str) -> Any:
    lowered = raw.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def settings_help(model: type[BaseModel] = TrainSettings, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, description) for every setting, depth first."""
    rows = []
    for name, field in model.model_fields.items():
        if name in PYTHON_ONLY:
            continue
        dotted = prefix + name
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(settings_help(ann, dotted + "."))
            continue
        default = "required" if field.is_required() else _default_repr(field.get_default(call_default_factory=True))
        rows.append((dotted, type_name(ann), default, field.description or ""))
    return rows



def _default_repr(value: Any) -> str:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value, default=str)
