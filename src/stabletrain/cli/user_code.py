"""``--model`` and ``--step-fn``: your own model class and step function, named as ``file.py:Name``."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional


def add_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--model FILE.py:NAME`` and ``--step-fn FILE.py:NAME`` to ``parser``."""
    parser.add_argument(
        "--model",
        metavar="FILE.py:NAME",
        help="your own model: a class (or function) that builds it without arguments, as file.py:Name or module:Name",
    )
    parser.add_argument(
        "--step-fn", metavar="FILE.py:NAME", help="step_fn(model, batch) -> loss, if the model has no training_step"
    )


def load(ns: argparse.Namespace) -> tuple[Optional[Any], Optional[Callable[..., Any]]]:
    """``(model, step_fn)`` from the parsed ``--model`` and ``--step-fn`` (None where not given).

    Raises:
        NaNCaptureError: A name that cannot be loaded, or a ``--model`` that builds no ``nn.Module``.
    """
    if not ns.model and not ns.step_fn:
        return None, None
    from torch import nn

    from stabletrain.debug.nan_capture import NaNCaptureError
    from stabletrain.debug.replay import load_object

    model = None
    if ns.model:
        factory = load_object(ns.model)
        model = factory() if callable(factory) and not isinstance(factory, nn.Module) else factory
        if not isinstance(model, nn.Module):
            raise NaNCaptureError(f"--model {ns.model}: built a {type(model).__name__}, not a torch.nn.Module")
    step_fn = load_object(ns.step_fn) if ns.step_fn else None
    return model, step_fn
