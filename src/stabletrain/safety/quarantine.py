"""Samples found bad by the self-healing, kept out of training: ``out/<run>/quarantine.json``.

When a step's loss or gradient goes non-finite under ``on_instability`` and its capture is
written, :func:`isolate_samples` looks for the samples that cause it, with evidence:

1. the captured batches: a sample whose input holds NaN/Inf (``how: "input"``);
2. otherwise the step is replayed from the capture and narrowed down by replaying subsets of
   its culprit microbatch (the search ``stabletrain diagnose`` runs; ``how: "replay"``).

Only samples isolated this way are quarantined; a failure that no sample explains (a learning
rate too high, damaged weights) quarantines nothing. :class:`Quarantine` keeps the entries,
writes them to the run folder, and the loader skips their indices from then on, in later epochs
and after a resume (see :mod:`stabletrain.data.loader`). ``stabletrain report`` lists them.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Iterable, Optional

from torch import nn

__all__ = ["QUARANTINE_FILE", "Quarantine", "isolate_samples", "read_quarantine"]

QUARANTINE_FILE = "quarantine.json"
_VERSION = 1


def read_quarantine(out: str | Path) -> list[dict[str, Any]]:
    """The quarantined samples of the run in ``out`` (one entry per sample), [] when none."""
    path = Path(out) / QUARANTINE_FILE
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    return list(data.get("samples", []))


class Quarantine:
    """The quarantined samples of a run, by dataset index, with the evidence that put each there."""

    def __init__(self, out: str | Path):
        self.path = Path(out) / QUARANTINE_FILE
        self.entries: dict[int, dict[str, Any]] = {}

    def indices(self) -> frozenset[int]:
        return frozenset(self.entries)

    def add(self, entries: Iterable[dict[str, Any]]) -> list[int]:
        """Add entries (``{"index": i, ...}``); returns the indices that were new."""
        new = []
        for e in entries:
            i = int(e["index"])
            if i not in self.entries:
                self.entries[i] = dict(e)
                new.append(i)
        return new

    def save(self) -> None:
        """Write ``quarantine.json`` atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        body = {"version": _VERSION, "samples": [self.entries[i] for i in sorted(self.entries)]}
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        tmp.replace(self.path)

    def load(self) -> None:
        """Add the entries of the run folder's file (the quarantine outlives the checkpoints)."""
        self.add(read_quarantine(self.path.parent))

    def state_dict(self) -> list[dict[str, Any]]:
        return [dict(self.entries[i]) for i in sorted(self.entries)]

    def load_state_dict(self, entries: list[dict[str, Any]]) -> None:
        self.add(entries)


def isolate_samples(capture: str | Path, model: Optional[nn.Module] = None, max_replays: int = 24
                    ) -> list[dict[str, Any]]:
    """The samples of a captured non-finite step that cause it, each with its evidence.

    Args:
        capture: A capture folder (``.../rank0``) or its ``nan_capture.pt``.
        model: Your model (a copy is used) when the capture's model is not a built-in one.
        max_replays: Most subset replays spent narrowing the culprit microbatch down.

    Returns:
        ``[{"index", "how", "evidence", ...}]``: ``how`` is ``"input"`` (its input holds
        non-finite values: ``field``, the first of them, and ``count``, over all; ``evidence``
        names each field with its count) or ``"replay"`` (replayed alone, its loss or
        gradient is non-finite while the rest of its microbatch is finite: ``loss_alone``);
        [] when no sample explains the failure.
    """
    from stabletrain.debug.diagnose.locate import nonfinite_inputs
    from stabletrain.debug.diagnose.search import isolate
    from stabletrain.debug.replay import forward_backward, load_nan_capture
    from stabletrain.debug.replay.precision import normalize_precision

    cap = load_nan_capture(capture, model=copy.deepcopy(model) if model is not None else None)
    found: dict[int, dict[str, Any]] = {}
    for hit in nonfinite_inputs(cap):
        if hit.get("index") is None:
            continue
        i = int(hit["index"])
        entry = found.setdefault(i, {"index": i, "how": "input", "field": hit["field"], "count": 0, "evidence": ""})
        entry["count"] += int(hit["count"])
        # Each field named with its own count: a sample with NaN in its input and its target says so.
        said = f"{hit['field']} holds {int(hit['count'])} non-finite value(s)"
        entry["evidence"] = f"{entry['evidence']}, {said}" if entry["evidence"] else said
    if found:
        return [found[i] for i in sorted(found)]
    precision, device = normalize_precision(cap.precision), cap.default_device()
    full = forward_backward(cap, precision=precision, device=device)
    if all(math.isfinite(float(v)) for v in full.loss_values) and not full.nonfinite_param_names:
        return []  # the replay is finite: nothing to pin on a sample
    data = isolate(cap, full, cap.get_model(), precision, device, max_replays, [], [])
    if data.status != "isolated" or not data.index_sets or not data.microbatches:
        return []
    key = data.microbatches[0]
    rows = data.row_sets or []
    for index_set, row_set in zip(data.index_sets, rows):
        for i, r in zip(index_set, row_set):
            if i is None:
                continue
            alone = forward_backward(cap, rows={key: [r]}, precision=precision, device=device, backward=False)
            loss = float(alone.loss_values[0])
            what = f"loss is {loss}" if not math.isfinite(loss) else "gradient is non-finite"
            found[int(i)] = {
                "index": int(i), "how": "replay", "loss_alone": loss if math.isfinite(loss) else str(loss),
                "evidence": f"replayed alone its {what}; the rest of its microbatch replays finite "
                            f"({data.replays} subset replays)",
            }
    return [found[i] for i in sorted(found)]
