"""Settings from dicts: validated at once, every problem in one readable ConfigError (see docs/training.md)."""

from __future__ import annotations

import difflib
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from stabletrain.config.train import TrainSettings
from stabletrain.config.types import type_name
from stabletrain.errors import ConfigError

#: Keys that settings.json and checkpoints add to the settings; not settings themselves.
RESOLVED_ONLY_KEYS = ("world_size", "model_meta")


def settings_from_resolved(resolved: dict[str, Any], **overrides: Any) -> TrainSettings:
    """Rebuild :class:`TrainSettings` from a run's resolved settings (settings.json, a checkpoint).

    Python objects that were only described (a custom model or dataset, callbacks) cannot be
    restored; they come back as None/[] unless given in ``overrides``.
    """
    data = {k: v for k, v in resolved.items() if k not in RESOLVED_ONLY_KEYS}
    for key in ("model", "data"):
        if isinstance(data.get(key), str) and data[key].startswith("<"):
            data[key] = None
    data["callbacks"] = []
    data.update(overrides)
    return load_settings(data)





def load_settings(settings: dict[str, Any]) -> TrainSettings:
    """Validate a settings dict; raise one ConfigError listing every problem."""
    try:
        return TrainSettings(**settings)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, TrainSettings)) from None


def partial_settings(settings: dict[str, Any]) -> tuple[Optional[TrainSettings], list[str]]:
    """The settings without the values pydantic rejects, and the dotted keys of those values.

    Each rejected value is left out, so its setting falls back to its default, and the rest
    is validated again. The checks that do not read a rejected setting can then still run,
    so that one error lists every mistake. Returns ``(None, keys)`` when the rest still does
    not validate (e.g. ``out`` is missing).

    Example::

        partial_settings({"out": "o", "steps": 0, "model_args": {"lr": 0.1, "lrr": 1}})
        # (TrainSettings(out='o', steps=500, model_args=ModelArgs(lr=0.1, ...), ...), ['steps', 'model_args.lrr'])
    """
    data = _copy_dicts(settings)
    rejected: list[str] = []
    while True:
        try:
            return TrainSettings(**data), rejected
        except ValidationError as exc:
            dropped = [key for err in exc.errors() if (key := _drop(data, err["loc"])) is not None]
            if not dropped:
                return None, rejected
            rejected.extend(dropped)


def _copy_dicts(data: Any) -> Any:
    """A copy of the nested dicts, sharing their other values (models, datasets, callbacks)."""
    return {k: _copy_dicts(v) for k, v in data.items()} if isinstance(data, dict) else data


def _drop(data: dict[str, Any], loc: tuple[Any, ...]) -> Optional[str]:
    """Delete the deepest key of ``loc`` present in the nested dicts; its dotted path, or None."""
    node: Any = data
    path: list[str] = []
    parent: dict[str, Any] = data
    for part in loc:
        if not (isinstance(node, dict) and part in node):
            break  # e.g. a union member's name, or an index into a list
        parent, node = node, node[part]
        path.append(str(part))
    if not path:
        return None
    del parent[path[-1]]
    return ".".join(path)


def _format_validation_error(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    problems = []
    # A value that fits no member of a union (devices=true) fails once per member; one line per setting.
    by_setting: dict[tuple[str, ...], list[Any]] = {}
    for err in exc.errors():
        key = tuple(p for p in _setting_loc(root, err["loc"]) if not isinstance(p, int))
        by_setting.setdefault(key, []).append(err)
    for names, errs in by_setting.items():
        err = next((e for e in errs if e["type"] == "value_error"), errs[0])  # our own checks say most
        loc = [str(p) for p in (_setting_loc(root, err["loc"]) if len(errs) == 1 else names)]
        where = ".".join(loc) or "settings"
        if err["type"] == "extra_forbidden":
            parent = _model_at(root, err["loc"][:-1])
            hint = ""
            if parent is not None:
                close = difflib.get_close_matches(loc[-1], list(parent.model_fields), n=1, cutoff=0.5)
                if close:
                    prefix = ".".join(loc[:-1] + [close[0]])
                    hint = f" Did you mean '{prefix}'?"
                else:
                    valid = ", ".join(parent.model_fields)
                    hint = f" Valid keys here: {valid}."
            problems.append(f"{where}: unknown setting.{hint}")
            continue
        if err["type"] == "missing":
            problems.append(f"{where}: required setting is missing.")
            continue
        msg = err["msg"]
        if len(errs) > 1 and err["type"] != "value_error":
            annotation = _annotation_at(root, names)
            if annotation is not None:
                msg = f"Input should be {type_name(annotation)}"
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        problems.append(f"{where}: {msg} (got {err.get('input')!r})")
    return problems


def _setting_loc(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """``loc`` without pydantic's names of union members (``function-before[...]``, ``str``):
    the setting's names, with list positions (ints) and unknown keys kept."""
    model: Any = root
    parts: list[Any] = []
    for part in loc:
        if isinstance(model, type) and issubclass(model, BaseModel):
            parts.append(str(part))
            field = model.model_fields.get(str(part))
            model = field.annotation if field is not None else None
        elif isinstance(part, int):
            parts.append(part)
    return tuple(parts)


def _annotation_at(root: type[BaseModel], loc: tuple[str, ...]) -> Any:
    model: Any = root
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        model = model.model_fields[part].annotation
    return model


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> Optional[type[BaseModel]]:
    """The settings model class found by following ``loc`` from ``root``."""
    model: Any = root
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        model = field.annotation
    if isinstance(model, type) and issubclass(model, BaseModel):
        return model
    return None

