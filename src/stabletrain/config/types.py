"""The building blocks of the settings: number types, the base model, Fabric's names.

See docs/training.md for the settings themselves.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict

PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")
Precision = Literal["auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"]
#: Precisions a replay can run in (Lightning Fabric's names): every one but "auto". Defined here,
#: without torch, for ``stabletrain replay --precision``'s choices.
REPLAY_PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def _refuse_booleans(what: str) -> BeforeValidator:
    def check(value: Any) -> Any:
        # pydantic reads true as 1 and false as 0: batch_size=true would train with batch size 1.
        if isinstance(value, bool):
            raise ValueError(f"expected {what}, not true/false")
        return value

    return BeforeValidator(check)


#: A whole number; true/false are refused. A float that is exactly whole (2.0, or 1e4 on the
#: command line, where JSON reads it as a float) is taken as that number; 2.5 is refused.
Int = Annotated[int, _refuse_booleans("a whole number")]
#: A number; true/false are refused.
Float = Annotated[float, _refuse_booleans("a number")]


class SettingsGroup(BaseModel):
    """Base for every settings group: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )


#: Names every Lightning Fabric 2.x accepts, so that these settings are checked without importing
#: Fabric (and torch, seconds on a cold start); any other name is looked up in Fabric's registries.
COMMON_FABRIC_NAMES: dict[str, frozenset[str]] = {
    "accelerator": frozenset(("auto", "cpu", "cuda", "gpu", "mps", "tpu")),
    "strategy": frozenset(
        ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true", "dp", "fsdp",
         "fsdp2", "deepspeed")
    ),
}


def is_fsdp1_variant(name: str) -> bool:
    """Fabric's FSDP1 strategies other than ``fsdp`` (which means FSDP2 in stabletrain)."""
    return name.startswith("fsdp") and name not in ("fsdp", "fsdp2")


def fabric_choices(setting: Literal["accelerator", "strategy"]) -> list[str]:
    """The names Lightning Fabric accepts for ``accelerator`` or ``strategy``, ``auto`` first.

    Example::

        fabric_choices("accelerator")  # ['auto', 'cpu', 'cuda', 'gpu', 'mps', 'tpu']
    """
    # Imported here: only a non-default value needs Fabric's registries.
    if setting == "accelerator":
        from lightning_fabric.accelerators import ACCELERATOR_REGISTRY

        names = [*ACCELERATOR_REGISTRY.available_accelerators(), "gpu"]
    else:
        from lightning_fabric.strategies import STRATEGY_REGISTRY

        # fsdp2 is stabletrain's name (FSDP2 through Fabric's ModelParallelStrategy); Fabric's FSDP1
        # variants are refused by the strategy check.
        names = [n for n in STRATEGY_REGISTRY.available_strategies() if not is_fsdp1_variant(n)] + ["fsdp2"]
    return ["auto", *sorted(set(names) - {"auto"})]


def one_of(value: str, choices: list[str], what: str) -> str:
    if value in choices:
        return value
    close = difflib.get_close_matches(value, choices, n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"not {what}{hint} Valid choices: {', '.join(choices)}")




def type_name(ann: Any) -> str:
    """A readable type: ``float``, ``one of cosine|linear|constant``, ``int or null``."""
    if get_origin(ann) is Annotated:
        return type_name(get_args(ann)[0])
    origin = get_origin(ann)
    args = get_args(ann)
    if ann is Any:
        return "str"
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin is Union:
        parts = [type_name(a) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return text + " or null" if type(None) in args else text
    if origin in (list, tuple):
        inner = sorted({type_name(a) for a in args if a is not Ellipsis})
        return f"{origin.__name__}[{', '.join(inner)}]" + (f" of {len(args)}" if origin is tuple else "")
    if origin is dict:
        return "dict"
    if ann is Path:
        return "path"
    return getattr(ann, "__name__", str(ann))

