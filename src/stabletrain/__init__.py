"""stabletrain: PyTorch training that finds and fixes training instabilities.

Public API, imported lazily (``import stabletrain`` is cheap and has no side effects): ``train``,
``compute_grad_norm``, ``load_nan_capture``, ``UnderflowOverflowMonitor``, ``diagnose``, ``report``,
``TrendDetector``, ``MechanismMonitor``, ``verify_remedies``, ``StepGuard``, ``InstabilityGuard`` (see
``__all__``). See docs/index.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "train": "stabletrain.training.loop",
    "Trainer": "stabletrain.training.loop",
    "TrainResult": "stabletrain.training.loop",
    "TrainSettings": "stabletrain.config",
    "Callback": "stabletrain.events",
    "TrainModel": "stabletrain.tasks.base",
    "compute_grad_norm": "stabletrain.debug.grad_norm",
    "clip_grad_norm_with_total": "stabletrain.debug.grad_norm",
    "GradNorm": "stabletrain.debug.grad_norm",
    "UnderflowOverflowMonitor": "stabletrain.debug.underflow_overflow",
    "UnderflowOverflowError": "stabletrain.debug.underflow_overflow",
    "layer_grad_norms": "stabletrain.debug.grad_norm",
    "TrendDetector": "stabletrain.debug.trends",
    "TrendAlerts": "stabletrain.debug.trends",
    "detect_trends": "stabletrain.debug.trends",
    "MechanismMonitor": "stabletrain.debug.mechanisms",
    "MechanismSignals": "stabletrain.debug.mechanisms",
    "report": "stabletrain.reporting",
    "Report": "stabletrain.reporting",
    "verify_remedies": "stabletrain.reporting.remedies",
    "RemedyReport": "stabletrain.debug.remedies",
    "Candidate": "stabletrain.debug.remedies",
    "candidates_for": "stabletrain.debug.remedies",
    "StabletrainError": "stabletrain.errors",
    "ConfigError": "stabletrain.errors",
    "CheckpointError": "stabletrain.runfiles.checkpoint",
    "NaNCaptureMonitor": "stabletrain.debug.nan_capture",
    "NaNDetectedError": "stabletrain.debug.nan_capture",
    "NaNCaptureError": "stabletrain.debug.nan_capture",
    "load_nan_capture": "stabletrain.debug.replay",
    "NaNCapture": "stabletrain.debug.replay",
    "ReplayResult": "stabletrain.debug.replay",
    "diagnose": "stabletrain.debug.diagnose",
    "Diagnosis": "stabletrain.debug.diagnose",
    "StepGuard": "stabletrain.safety.guard",
    "NonFiniteStepError": "stabletrain.safety.guard",
    "InstabilityGuard": "stabletrain.safety.instability_guard",
    "SpikeDetector": "stabletrain.safety.spike_detector",
    "RollbackSnapshots": "stabletrain.safety.rollback_snapshot",
    "RecoveryLimitError": "stabletrain.safety.healing",
    "NonFiniteCheckpointError": "stabletrain.safety.net",
    "TrainingInterrupted": "stabletrain.safety.interrupts",
    "WriteFailedError": "stabletrain.safety.write_failures",
    "RunLockedError": "stabletrain.runfiles.lock",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stabletrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
