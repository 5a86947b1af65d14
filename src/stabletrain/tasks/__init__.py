"""Built-in tasks and the user-model protocol.

``build_task(settings)`` turns settings into a :class:`Task` (model + dataset);
``build_model(settings, model_meta)`` rebuilds just the model, e.g. to replay a capture.
"""

from __future__ import annotations

from typing import Any

import torch

from stabletrain.config import IMAGE_MODEL_ARGS, LANGUAGE_MODEL_ARGS, TrainSettings
from stabletrain.tasks.base import Task, TrainModel

__all__ = ["Task", "TrainModel", "build_task", "build_model", "check_task", "num_samples", "resolve_task_name"]


def resolve_task_name(settings: TrainSettings) -> str:
    """'custom' for a user's nn.Module, else the built-in task named or implied by ``model``."""
    if isinstance(settings.model, torch.nn.Module):
        return "custom"
    if settings.task is not None:
        return settings.task
    if isinstance(settings.model, str) and (settings.model == "cnn" or settings.model.startswith("torchvision/")):
        return "image_classification"
    return "language_model"


def _module(name: str) -> Any:
    if name == "language_model":
        from stabletrain.tasks import language_model

        return language_model
    from stabletrain.tasks import image_classification

    return image_classification


def names_user_code(model: str) -> bool:
    """Whether the model name given is a reference to code (``own.py:MLP``, ``pkg.models:Net``,
    ``own.py``), which no built-in model name is."""
    return ":" in model or model.endswith(".py")


def own_model_problem(model: str) -> str:
    """What to do instead of naming your own model's code in ``model``."""
    cls = model.rpartition(":")[2] or "MyModel"
    if cls.endswith(".py"):
        cls = "MyModel"
    return (
        f"model: {model!r} names your own code, but model= takes a built-in model's name ('transformer', the "
        f"default; 'cnn'; 'torchvision/<name>') or an nn.Module instance; train your own model from Python: "
        f"stabletrain.train(out=..., model={cls}(), data=<your map-style Dataset>), the model having a "
        "training_step(batch) -> loss method (docs/training.md, Your own model)"
    )


def check_task(settings: TrainSettings) -> list[str]:
    """Every problem with the task-related settings, as one line each; [] when all is well."""
    name = resolve_task_name(settings)
    explicit = settings.model_args.model_fields_set
    problems = []
    foreign = {
        "language_model": IMAGE_MODEL_ARGS,
        "image_classification": LANGUAGE_MODEL_ARGS,
        "custom": LANGUAGE_MODEL_ARGS + IMAGE_MODEL_ARGS,
    }[name]
    for key in foreign:
        if key in explicit:
            given = getattr(settings.model_args, key)
            problems.append(f"model_args.{key}: not used by the {name} task (got {given!r})")
    if name != "image_classification" and "bad_images" in settings.data_args.model_fields_set:
        problems.append(
            f"data_args.bad_images: only image folders are checked for unreadable files, not used by the {name} "
            f"task (got {settings.data_args.bad_images!r})"
        )
    if name == "custom":
        model = settings.model
        if not callable(getattr(model, "training_step", None)):
            problems.append(
                f"model: {type(model).__name__} has no training_step(batch) -> loss method; "
                "see stabletrain.tasks.base.TrainModel"
            )
        if settings.data is None or isinstance(settings.data, str):
            problems.append(
                f"data: a custom model needs a map-style torch Dataset passed from Python (got {settings.data!r})"
            )
        elif not (hasattr(settings.data, "__getitem__") and hasattr(settings.data, "__len__")):
            problems.append("data: expected a map-style Dataset with __getitem__ and __len__ "
                            f"(got {type(settings.data).__name__})")
        elif len(settings.data) == 0:
            problems.append("data: the dataset is empty (len 0)")
        return problems
    if settings.model is not None and not isinstance(settings.model, str):
        problems.append(f"model: expected a model name or an nn.Module (got {type(settings.model).__name__})")
        return problems
    if isinstance(settings.model, str) and names_user_code(settings.model):
        problems.append(own_model_problem(settings.model))
        return problems
    problems.extend(_module(name).check(settings))
    return problems


def num_samples(settings: TrainSettings) -> int:
    """Samples in the dataset :func:`build_task` would make, without building the model.

    Call it only when :func:`check_task` found no problem (the data must be readable).
    """
    name = resolve_task_name(settings)
    if name == "custom":
        return len(settings.data)
    return int(_module(name).num_samples(settings))


def build_task(settings: TrainSettings) -> Task:
    """Model and dataset for the settings; call :func:`check_task` first for readable errors."""
    name = resolve_task_name(settings)
    if name == "custom":
        return Task(name="custom", model=settings.model, dataset=settings.data, model_meta={}, in_memory=False)
    return _module(name).build(settings)


def build_model(settings: TrainSettings, model_meta: dict[str, Any]) -> torch.nn.Module:
    """A freshly initialised built-in model, as :func:`build_task` would make it."""
    name = resolve_task_name(settings)
    if name == "custom":
        raise ValueError("a custom model cannot be rebuilt from settings; pass the model instance instead")
    return _module(name).build_model(settings, model_meta)
