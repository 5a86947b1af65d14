"""The :class:`Diagnosis`: the evidence and the prose written from it, as Markdown and as JSON.

It sits above ``render`` (which renders it) rather than in ``types``, so that no import goes in a circle.
See ``docs/diagnose.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from stabletrain.debug.diagnose import render
from stabletrain.debug.diagnose.types import Evidence, key_dict
from stabletrain.utils.tree import json_ready


@dataclass(kw_only=True)
class Diagnosis(Evidence):
    """What :func:`~stabletrain.debug.diagnose.diagnose` found. ``str(diagnosis)`` is the human-readable account.

    Every field of :class:`~stabletrain.debug.diagnose.types.Evidence` (the capture, the replays and the
    cause class, the finding, the data, the weights), and:

    Attributes:
        cause_explanation: The cause class in plain language, with the evidence (including
            whether float64 keeps the step finite).
        summary: What happened, in one or two sentences.
        probable_cause: The most likely cause, in plain language.
        next_actions: Concrete next steps with setting names and values.
        files: The diagnosis.md and diagnosis.json written.
    """

    cause_explanation: str
    summary: str
    probable_cause: str
    next_actions: list[str]
    files: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, ev: Evidence, *, cause_explanation: str, summary: str, probable_cause: str, next_actions: list[str],
           files: list[str]) -> Diagnosis:
        """The diagnosis of ``ev`` with its prose."""
        facts = {f.name: getattr(ev, f.name) for f in fields(Evidence)}
        return cls(**facts, cause_explanation=cause_explanation, summary=summary, probable_cause=probable_cause,
                   next_actions=next_actions, files=files)

    @property
    def verdict(self) -> str:
        """One line: the cause class and the probable cause."""
        return f"{self.cause_title}: {self.probable_cause}"

    def to_dict(self) -> dict[str, Any]:
        """The same fields as the report, JSON-ready (non-finite numbers as "nan", "inf", "-inf")."""
        finding = None
        if self.finding is not None:
            finding = json_ready(self.finding.to_dict())
            finding["where"] = self.finding.where
        return {
            "path": self.path,
            "step": self.step,
            "ranks": self.ranks,
            "world_size": self.world_size,
            "precision": self.precision,
            "loss_scale": self.loss_scale,
            "reason": self.reason,
            "model_class": self.model_class,
            "device": self.device,
            "verdict": self.verdict,
            "summary": self.summary,
            "cause": self.cause,
            "cause_title": self.cause_title,
            "cause_explanation": self.cause_explanation,
            "probable_cause": self.probable_cause,
            "deterministic": self.deterministic,
            "matches_capture": self.matches_capture,
            "reproduces_in": self.reproduces_in,
            "replays": [r.to_dict() for r in self.replays],
            "where": finding,
            "traced_on": None if self.traced_on is None else {
                **self.traced_on, "microbatches": [key_dict(k) for k in self.traced_on["microbatches"]]},
            "origin": self.origin,
            "data": self.data.to_dict(),
            "weights": self.weights.to_dict(),
            "next_actions": self.next_actions,
            "history": json_ready(self.history),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "files": self.files,
        }

    def __str__(self) -> str:
        return self.to_markdown()

    def to_markdown(self) -> str:
        """The human-readable account (Markdown), as written to ``diagnosis.md``."""
        return render.markdown(self, summary=self.summary, probable_cause=self.probable_cause,
                               cause_explanation=self.cause_explanation, next_actions=self.next_actions)
