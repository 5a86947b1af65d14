"""The last verification of a run, as the run's later messages quote it: ``remedies.json`` read back
while the run's ``metrics.jsonl`` is byte for byte what was verified (a resume or more steps make the
verification stale, and it is then not quoted)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from stabletrain.debug.remedies.plan import SCRATCH

__all__ = ["METRICS_DIGEST", "UNVERIFIED", "VerifiedRecord", "current_record", "label_suggestion", "metrics_digest"]

#: The key of ``remedies.json`` holding the SHA-256 of the run's metrics.jsonl when it was written.
METRICS_DIGEST = "metrics_sha256"

#: What diagnose and the report add to a suggestion before a verification (the words it replaces).
UNVERIFIED = "not verified on this run: --verify tries it"


def label_suggestion(action: str, measured: Sequence[tuple[str, str, bool]]) -> str:
    """A suggestion of diagnose or the report, after a verification whose candidates are ``measured``
    (``(name, result, is the verified remedy)``): ``Tried: ...`` with the numbers of the candidates it
    names, else ``Not verified: ...``. A line that suggests no setting (``key=value``: a command that
    replays a capture, a finding such as "precision is already 32-true") keeps its words."""
    if action.startswith("Replay the step yourself") or not re.search(r"[\w.]=\S", action):
        return action
    tried = [m for m in measured if _names(action, m[0])]
    if not tried:
        return f"Not verified: {action.replace(UNVERIFIED, 'not tried by --verify')}"
    numbers = "; ".join(f"{name}: {result}" + (" (the verified remedy above)" if best else "")
                        for name, result, best in tried)
    # Its own words "not verified: <why this value>" were true before the verification; the numbers follow.
    action = action.replace(UNVERIFIED, "tried by --verify").replace(", not verified: ", ": ")
    return f"Tried: {action} (measured here: {numbers})"


def _names(action: str, candidate: str) -> bool:
    """Whether ``action`` suggests the setting ``candidate`` (``key=value``): the same text, not as a part
    of another (``lr=0.3`` is not ``lr=0.03``, ``clip=1`` not ``other.clip=1``), or the same key with the
    same number (``gradient_clip_val=1.0`` is ``gradient_clip_val=1``)."""
    if re.search(r"(?<![\w.])" + re.escape(candidate) + r"(?![\w.])", action):
        return True
    key, _, value = candidate.partition("=")
    wanted = _number(value)
    if not key or wanted is None:
        return False
    return any(_number(v) == wanted for v in re.findall(r"(?<![\w.])" + re.escape(key) + r"=([-+\w.]+)", action))


def _number(text: str) -> Optional[float]:
    try:
        return float(text.rstrip("."))
    except ValueError:
        return None


def metrics_digest(run: Path) -> Optional[str]:
    """The SHA-256 of ``run/metrics.jsonl`` (None when it cannot be read)."""
    try:
        return hashlib.sha256((Path(run) / "metrics.jsonl").read_bytes()).hexdigest()
    except OSError:
        return None


@dataclass(frozen=True)
class VerifiedRecord:
    """A verification that is still current: where it is, its first next action (the verified remedy
    with its command, or why there is none) and what each candidate measured."""

    path: Path
    next_action: str
    measured: tuple[tuple[str, str, bool], ...]

    def next_actions(self, others: Sequence[str] = ()) -> list[str]:
        """As :meth:`RemedyReport.next_actions` printed them: the verified remedy first, then ``others`` labelled."""
        return [self.next_action, *(label_suggestion(a, self.measured) for a in others)]


def current_record(run: str | Path) -> Optional[VerifiedRecord]:
    """The run's last verification (``debug/remedies/remedies.json``) if ``metrics.jsonl`` has not changed
    since it was written; None without one, or when it is stale or unreadable."""
    folder = Path(run) / SCRATCH
    try:
        data = json.loads((folder / "remedies.json").read_text(encoding="utf-8"))
        digest = data[METRICS_DIGEST]
        measured = tuple((str(r["candidate"]["name"]), str(r["result"]), str(r["candidate"]["name"]) == data["best"])
                         for r in data["ranked"])
        next_action = str(data["next_action"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if digest is None or digest != metrics_digest(Path(run)):
        return None
    return VerifiedRecord(folder / "remedies.md", next_action, measured)
