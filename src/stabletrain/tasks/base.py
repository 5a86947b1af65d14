"""The contract between the trainer and a model.

Any ``torch.nn.Module`` that defines ``training_step(batch) -> loss`` can be trained by stabletrain,
and every debugging tool works on it. Optional: ``configure_optimizer(model_args)`` (else AdamW or
SGD from ``model_args``) and ``training_metrics() -> dict[str, Tensor]`` (scalar device tensors
logged with the loss; must not read device values itself). See docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import Dataset


@runtime_checkable
class TrainModel(Protocol):
    """An ``nn.Module`` with ``training_step(batch) -> scalar loss tensor``."""

    def training_step(self, batch: Any) -> torch.Tensor: ...


@dataclass
class Task:
    """What a task hands to the trainer.

    Attributes:
        name: "language_model", "image_classification" or "custom".
        model: The model to train; it satisfies :class:`TrainModel`.
        dataset: A map-style dataset; ``dataset[i]`` is one sample that
            ``torch.utils.data.default_collate`` can batch (tensors, or dicts/tuples of them).
        model_meta: JSON-compatible facts learnt from the data that, together with the
            settings, rebuild the same architecture without the data (e.g. the vocabulary).
        in_memory: True when the dataset is already in memory (worker processes do not help).
        warnings: What the user should know about the data before training, one sentence each
            (e.g. the unreadable images left out); the trainer prints them.
        model_name: How the run's header names the model (e.g. ``torchvision/resnet18``); empty
            for the model's class name.
    """

    name: str
    model: torch.nn.Module
    dataset: Dataset
    model_meta: dict[str, Any] = field(default_factory=dict)
    in_memory: bool = True
    warnings: list[str] = field(default_factory=list)
    model_name: str = ""
