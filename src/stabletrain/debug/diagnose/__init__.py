"""diagnose: from a NaN capture to a verdict — which op, which module, which sample, and why.

``stabletrain.diagnose(path)``, ``cap.diagnose()`` and ``stabletrain diagnose PATH``; see ``docs/diagnose.md``.

One job per file: ``run`` (the orchestrator), ``classify`` (full replays, cause classes), ``search`` (the
culprit data), ``locate`` (the op trace and the origin of its inputs), ``weights`` (weights, checkpoints,
history), ``explain`` (the prose), ``actions`` (next actions), ``render`` (Markdown), ``types`` and ``result``
(the result objects).
"""

from stabletrain.debug.diagnose.result import Diagnosis
from stabletrain.debug.diagnose.run import diagnose
from stabletrain.debug.diagnose.types import (
    DETERMINISTIC_NUMERICAL,
    HUGE_WEIGHT,
    NOT_REPRODUCIBLE,
    PRECISION_INDUCED,
    DataReport,
    Evidence,
    ParamStat,
    ReplayOutcome,
    WeightsReport,
)

__all__ = [
    "diagnose",
    "Diagnosis",
    "Evidence",
    "ReplayOutcome",
    "DataReport",
    "WeightsReport",
    "ParamStat",
    "PRECISION_INDUCED",
    "DETERMINISTIC_NUMERICAL",
    "NOT_REPRODUCIBLE",
    "HUGE_WEIGHT",
]
