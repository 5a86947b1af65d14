"""The replay command shown in ``NaNDetectedError``: ``stabletrain replay PATH [--model file.py:Class]``
when a command can rebuild the model, else a Python template with ``# FILL IN`` lines.
See ``docs/nancapture.md``."""

from __future__ import annotations

import inspect
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Optional, cast

from torch import Tensor, nn

from stabletrain.utils.text import abs_path, shell_path


def default_step_fn(model: nn.Module, batch: Any, *step_args: Any) -> Tensor:
    """The loss of one microbatch when no ``step_fn`` is given: ``model.training_step(batch)``
    (and the microbatch's captured ``step_args``, if any)."""
    return model.training_step(batch, *step_args)  # type: ignore[operator]


#: Step functions and model builders under this package are found by replay from the names a
#: capture stores (stabletrain.integrations); nothing outside it is imported from a capture.
INTEGRATIONS_PACKAGE = "stabletrain.integrations."


def qualified_name(obj: Any) -> str:
    """``module.QualName`` of a class or function (what a capture stores of the model and step function)."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _import_spec(obj: Any, needs_no_args: bool) -> Optional[tuple[str, bool, str]]:
    """(file path or module name, whether it is a file, name) for :func:`importable_ref`, or None."""
    if _not_importable_reason(obj, needs_no_args) is not None:
        return None
    module = sys.modules[obj.__module__]
    source = getattr(module, "__file__", None)
    if source and source.endswith(".py"):
        return abs_path(source), True, obj.__qualname__
    return obj.__module__, False, obj.__qualname__


def _not_importable_reason(obj: Any, needs_no_args: bool) -> Optional[str]:
    """Why ``stabletrain replay --model/--step-fn`` cannot import (and build) ``obj``; None if it can."""
    qualname = getattr(obj, "__qualname__", "")
    module_name = getattr(obj, "__module__", None)
    what = qualname or type(obj).__qualname__
    if not qualname or module_name is None:
        return f"{what} has no importable name"
    if "<locals>" in qualname:
        return f"{what} is defined inside a function"
    if "<" in qualname:
        return f"{what} is not defined by a def or class statement"
    if "." in qualname:
        return f"{what} is nested in {qualname.rsplit('.', 1)[0]}, not defined at the top level of a file"
    module = sys.modules.get(module_name)
    if module is None or getattr(module, qualname, None) is not obj:
        return f"{what} is not found under its name in its module {module_name}"
    source = getattr(module, "__file__", None)
    if not (source and source.endswith(".py")) and module_name == "__main__":
        return f"{what} is defined in an interactive session, not in a file"
    if needs_no_args:
        try:
            sig = inspect.signature(cast(Callable[..., Any], obj))
        except (TypeError, ValueError):
            return f"the signature of {what} cannot be read"
        required = [
            p.name for p in sig.parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:
            return f"its constructor needs arguments: {', '.join(required)}"
    return None


def importable_ref(obj: Any, needs_no_args: bool) -> Optional[str]:
    """``file.py:Name`` (or ``package.module:Name``) that ``stabletrain replay --model`` can
    import, when ``obj`` is defined at the top level of a source file; else None. A file
    path is quoted for the shell.

    Args:
        obj: A class or function.
        needs_no_args: For a model class: also require a constructor without required arguments.
    """
    spec = _import_spec(obj, needs_no_args)
    if spec is None:
        return None
    target, is_file, name = spec
    return f"{shlex.quote(target) if is_file else target}:{name}"


def _custom_step_fn(step_fn: Any) -> bool:
    """A step function the replay command must name; replay finds the integrations' own by itself."""
    if step_fn is None or step_fn is default_step_fn:
        return False
    return not f"{getattr(step_fn, '__module__', '')}.".startswith(INTEGRATIONS_PACKAGE)


def no_replay_command_reason(model: Any, step_fn: Any = None) -> Optional[str]:
    """Why :func:`default_replay_command` gives a Python template instead of a shell
    command for your model (and step function); None when it gives a command."""
    if model is None:
        return "no model was given"
    why = _not_importable_reason(type(model), needs_no_args=True)
    if why is None and _custom_step_fn(step_fn):
        why = _not_importable_reason(step_fn, needs_no_args=False)
    return why


def default_replay_command(
    path: str | Path, *, model: Any = None, step_fn: Any = None, builtin: bool = False
) -> str:
    """How to replay the capture at ``path`` (a rank folder or the folder of ranks).

    Built-in models are rebuilt from the stored settings: ``stabletrain replay PATH``. For
    your own model the command names its class as ``file.py:Class`` (``--model``, and
    ``--step-fn`` for a step function) when the class is defined at the top level of a
    file and needs no constructor arguments. Paths are quoted for the shell, so the command
    works when pasted whatever characters they hold.

    Otherwise no command can rebuild the model, and the result is a Python template (several
    lines, not a shell command): the lines to complete follow a ``# FILL IN`` comment and
    hold ``...`` (:func:`no_replay_command_reason` says why there is no command).

    Example::

        default_replay_command("out/run/debug/nan_capture/rank0", model=MyModel())
        # 'stabletrain replay out/run/debug/nan_capture/rank0 --model train.py:MyModel'
    """
    target = shell_path(path)
    if builtin:
        return f"stabletrain replay {target}"
    custom_step = _custom_step_fn(step_fn)
    if no_replay_command_reason(model, step_fn) is None:
        model_ref = importable_ref(type(model), needs_no_args=True)
        step_ref = importable_ref(step_fn, needs_no_args=False) if custom_step else None
        return f"stabletrain replay {target} --model {model_ref}" + (f" --step-fn {step_ref}" if step_ref else "")
    return _replay_template(path, model, step_fn if custom_step else None)


def is_replay_template(text: str) -> bool:
    """Whether ``text`` (from :func:`default_replay_command`) is a Python template, not a command."""
    return text.startswith(_TEMPLATE_HEAD)


_TEMPLATE_HEAD = "import stabletrain\n"


def _replay_template(path: str | Path, model: Any, step_fn: Any) -> str:
    """Python that replays the capture once the ``# FILL IN`` lines are completed."""
    lines = ["import stabletrain"]
    cls = type(model) if model is not None else None
    model_spec = _import_spec(cls, needs_no_args=False) if cls is not None else None
    step_spec = _import_spec(step_fn, needs_no_args=False) if step_fn is not None else None
    if model_spec is not None or step_spec is not None:
        lines.append(
            "from stabletrain.debug.replay import load_object  # imports a file without running its __main__ block"
        )
    if model_spec is not None:
        target, _, name = model_spec
        lines.append(f"{name} = load_object({f'{target}:{name}'!r})")
        why = _not_importable_reason(cls, needs_no_args=True)
        if why is None:
            lines.append(f"model = {name}()")
        else:
            # The placeholder alone on its line: run unfilled, load_nan_capture says what to do.
            lines.append(f"# FILL IN: construct {name} as in training ({why}), e.g. model = {name}(...):")
            lines.append("model = ...")
    else:
        what = qualified_name(cls) if cls is not None else "your model class"
        lines.append(f"# FILL IN: build the model as in training (an instance of {what}):")
        lines.append("model = ...")
    call = "model=model"
    if step_fn is not None:
        if step_spec is not None:
            target, _, name = step_spec
            lines.append(f"step_fn = load_object({f'{target}:{name}'!r})")
        else:
            lines.append(
                f"# FILL IN: the step function your loop computed the loss with ({qualified_name(step_fn)}):"
            )
            lines.append("step_fn = ...")
        call += ", step_fn=step_fn"
    lines.append(f"print(stabletrain.load_nan_capture({abs_path(path)!r}, {call}).replay())")
    return "\n".join(lines)
