"""The integrations' settings (``debug_args``, ``trend_alerts``) from dicts or models, checked
as ``stabletrain train`` checks them (see docs/integrations/)."""

from __future__ import annotations

from typing import Any, Mapping, Union

from pydantic import BaseModel, ValidationError

from stabletrain.config import DebugArgs, TrendAlertArgs
from stabletrain.errors import ConfigError

Settings = Union[None, Mapping[str, Any], BaseModel]


def parse_settings(model: type[BaseModel], value: Settings, name: str) -> Any:
    """``value`` (None, a dict or the pydantic model itself) validated as ``model``.

    Raises:
        ConfigError: Every problem at once, with the dotted key, as ``stabletrain train`` does.
    """
    if value is None:
        return model()
    if isinstance(value, model):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError([f"{name}: expected a dict or {model.__name__}, got {type(value).__name__} ({value!r})"])
    try:
        return model(**value)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join([name, *(str(p) for p in err["loc"])])
            if err["type"] == "extra_forbidden":
                parent = model
                for part in err["loc"][:-1]:
                    ann = parent.model_fields[str(part)].annotation
                    parent = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else parent
                problems.append(f"{where}: unknown setting. Valid keys here: {', '.join(parent.model_fields)}")
            else:
                msg = err["msg"].removeprefix("Value error, ")
                problems.append(f"{where}: {msg} (got {err.get('input')!r})")
        raise ConfigError(problems) from None


def parse_tool_settings(debug_args: Settings, trend_alerts: Settings) -> tuple[DebugArgs, TrendAlertArgs]:
    """Both settings groups of the integrations, every problem of both in one ConfigError."""
    problems: list[str] = []
    parsed = []
    for model, value, name in ((DebugArgs, debug_args, "debug_args"), (TrendAlertArgs, trend_alerts, "trend_alerts")):
        try:
            parsed.append(parse_settings(model, value, name))
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    return parsed[0], parsed[1]
