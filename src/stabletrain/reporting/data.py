"""A run's logged series, one row per step, read from ``metrics.jsonl`` and ``settings.json`` (:class:`RunData`).
See ``docs/report.md``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from stabletrain.errors import StabletrainError
from stabletrain.runfiles.history import read_run, run_folder_problem


class RunData:
    """The series of one run, one row per step: after a resume the later rows win (see
    :mod:`stabletrain.runfiles.history`)."""

    def __init__(self, out: Path):
        self.out = out
        path = out / "metrics.jsonl"
        problem = run_folder_problem(out)
        if problem is not None:
            raise StabletrainError(problem)
        history = read_run(path)
        self.events = history.events
        self.resumes = history.resumes
        self.rollbacks = history.rollbacks
        #: What a resume replaced: a blow-up before it is part of the run's story.
        self.abandoned_events = history.abandoned_events
        self.abandoned_rows = history.abandoned_rows
        self.rows = history.rows
        if not self.rows:
            raise StabletrainError(f"{path} holds no logged steps yet")
        settings_path = out / "settings.json"
        self.settings: dict[str, Any] = json.loads(settings_path.read_text()) if settings_path.exists() else {}
        self.steps = np.array([r["step"] for r in self.rows], dtype=np.int64)

    def series(self, key: str) -> np.ndarray:
        return np.array([_as_float(r.get(key)) for r in self.rows], dtype=np.float64)

    def layer_keys(self) -> list[str]:
        keys: dict[str, None] = {}
        for row in self.rows:
            for k in row:
                if k.startswith("gradient_norm/"):
                    keys.setdefault(k, None)
        return list(keys)


def _as_float(v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return math.nan
