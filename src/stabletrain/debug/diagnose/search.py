"""Which data: the microbatches, then the samples, that are enough to trigger the failure, found by replaying
subsets (delta debugging) within a budget of replays. See ``docs/diagnose.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
from torch import Tensor, nn

from stabletrain.debug.diagnose.types import DataReport, RowSelection
from stabletrain.debug.nan_capture import NaNCaptureError
from stabletrain.debug.replay import ForwardBackwardResult, MicrobatchKey, NaNCapture, forward_backward
from stabletrain.utils.text import fmt_list

T = TypeVar("T")

#: Disjoint culprit sets searched for at most: a second bad sample is found, and a model that
#: fails on any data shows itself by its complement still failing after three.
MAX_CULPRIT_SETS = 3


def ddmin(items: list[T], fails: Callable[[list[T]], bool]) -> list[T]:
    """A 1-minimal subset of ``items`` (which fails) that still fails (Zeller's delta debugging).

    With one culprit this is a bisection: about 2 log2(len(items)) checks.
    """
    items = list(items)
    n = 2
    while len(items) >= 2:
        chunks = split(items, n)
        reduced = False
        for chunk in chunks:
            if fails(chunk):
                items, n, reduced = chunk, 2, True
                break
        if not reduced and n > 2:  # with 2 chunks each complement is the other chunk, already tried
            for chunk in chunks:
                rest = [x for x in items if x not in chunk]
                if fails(rest):
                    items, n, reduced = rest, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items


def split(items: list[T], n: int) -> list[list[T]]:
    """``items`` in ``n`` consecutive chunks of nearly equal size (the first ones one longer); no empty chunk."""
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        if end > start:
            out.append(items[start:end])
        start = end
    return out


class ReplayBudget:
    """The subset replays the search may run. A replay asked for past the limit is not run:
    it counts as not failing and marks the budget ``refused``, so that the search can discard
    what it decided without replays."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.refused = False

    def take(self) -> bool:
        """Use one replay; False (and ``refused``) when none is left."""
        if self.used >= self.limit:
            self.refused = True
            return False
        self.used += 1
        return True


class SubsetReplays:
    """Replays subsets of the captured step within a :class:`ReplayBudget`. A subset that cannot
    be run (BatchNorm refusing a batch of one sample) counts as not failing; ``errors`` says why."""

    def __init__(self, cap: NaNCapture, precision: str, device: torch.device, limit: int):
        self.cap, self.precision, self.device = cap, precision, device
        self.budget = ReplayBudget(limit)
        self.errors: list[str] = []

    def fails(self, mbs: Sequence[MicrobatchKey], rows: Optional[RowSelection] = None,
              forward_only: bool = False) -> bool:
        if not self.budget.take():
            return False
        try:
            res = forward_backward(self.cap, microbatches=list(mbs), rows=rows, precision=self.precision,
                                   device=self.device, backward=not forward_only)
        except NaNCaptureError:
            raise
        except Exception as exc:  # e.g. BatchNorm refusing a batch of one sample
            self.errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return False
        return res.reproduces(self.cap.reason)

    def errors_caveat(self) -> list[str]:
        if not self.errors:
            return []
        return [
            f"{len(self.errors)} subset(s) could not be run and counted as not failing ({self.errors[0]}); "
            "layers that need several samples (BatchNorm) refuse very small subsets"
        ]


@dataclass
class RowSearch:
    """What the search over the rows of the culprit microbatch decided.

    Attributes:
        sets: Disjoint sets of rows that each fail on their own.
        remaining: The rows in none of them.
        rest_fails: The remaining rows fail too (the model fails on any data).
        probes: Single rows of the remaining ones that were found to fail alone.
    """

    sets: list[list[int]]
    remaining: list[int]
    rest_fails: bool = False
    probes: list[int] = field(default_factory=list)


def search_rows(n: int, check: Callable[[list[int]], bool], budget: ReplayBudget) -> RowSearch:
    """Up to :data:`MAX_CULPRIT_SETS` disjoint sets of the ``n`` rows that each fail on their own.
    Whatever was decided after the budget ran out is discarded."""
    if n == 1:
        return RowSearch([[0]], [])
    sets: list[list[int]] = []
    remaining = list(range(n))
    rest_fails = False
    for round_ in range(MAX_CULPRIT_SETS):
        found = ddmin(remaining, check)
        if budget.refused:
            break
        sets.append(found)
        remaining = [r for r in remaining if r not in found]
        if not remaining:
            break
        rest = check(remaining)
        if budget.refused:
            break
        rest_fails = rest
        if not rest_fails:
            break
        if round_ == 0 and len(found) == 1 and len(remaining) >= 3:
            # The rest fails too. Before searching it, probe three single samples spread
            # over it: when they all fail alone, any sample does (cheaper than two searches).
            picks = [remaining[0], remaining[len(remaining) // 2], remaining[-1]]
            alone = all(check([r]) for r in picks)
            if budget.refused:
                break
            if alone:
                return RowSearch(sets, remaining, rest_fails, picks)
    return RowSearch(sets, remaining, rest_fails)


def isolate(
    cap: NaNCapture,
    full: ForwardBackwardResult,
    model: nn.Module,
    precision: str,
    device: torch.device,
    max_replays: int,
    nonfinite_inputs: list[dict[str, Any]],
    out_of_range_inputs: list[dict[str, Any]],
) -> DataReport:
    """The culprit microbatches and samples of a reproducible failure, by replaying subsets of it.

    ``full`` is a replay of the whole step (its losses say which microbatches fail in the forward
    pass); ``model`` is the replayed model (its batch-dependent layers make a caveat); the input
    scans are reported as they are.
    """
    keys = list(full.microbatches)
    loss_bad = [k for k, v in zip(keys, full.loss_values, strict=True) if not math.isfinite(v)]
    check = "forward" if loss_bad else "forward+backward"
    subsets = SubsetReplays(cap, precision, device, max_replays)
    failing = _failing_microbatches(keys, loss_bad, subsets)
    if not failing:
        # The accumulated gradient of several microbatches goes out of range, not any one sample's.
        combo = ddmin(keys, subsets.fails)
        if subsets.budget.refused:
            combo = keys
        return DataReport(
            status="combination", check=check, failing_microbatches=failing, microbatches=combo,
            note=f"no microbatch fails on its own; together, microbatches {keys_text(combo)} do: their accumulated "
            "gradient goes out of range, not any one sample's",
            nonfinite_inputs=nonfinite_inputs, out_of_range_inputs=out_of_range_inputs,
            replays=subsets.budget.used,
        )

    culprit = failing[0]
    rank, micro = culprit
    part = cap.rank_capture(rank)
    n = part.microbatch_size(micro)
    forward_only = culprit in loss_bad
    rows = search_rows(n, lambda r: subsets.fails([culprit], {culprit: list(r)}, forward_only), subsets.budget)
    caveats = [f"stopped after {max_replays} subset replays (max_subset_replays)"] if subsets.budget.refused else []
    caveats += subsets.errors_caveat()
    sets = rows.sets or [list(range(n))]
    ix = part.indices[micro]
    where = f"microbatch {micro}" + (f" of rank {rank}" if len(cap.ranks) > 1 else "")
    every = not rows.remaining and n > 1 and all(len(s) == 1 for s in sets) and len(sets) == n
    common: dict[str, Any] = dict(
        check=check, failing_microbatches=failing, microbatches=[culprit], microbatch_size=n,
        nonfinite_inputs=nonfinite_inputs, out_of_range_inputs=out_of_range_inputs, replays=subsets.budget.used,
    )
    if rows.rest_fails or every:
        # No culprit: what failed on its own are examples (one is traced), not samples to blame.
        examples = sets + [[r] for r in rows.probes]
        note = _any_data_note(where, sets, rows, every) + _also_failing(failing, keys, culprit, culprit_found=False)
        return DataReport(
            status="not_data_specific", note=note, examples=examples, example_indices=_dataset_indices(ix, examples),
            caveats=caveats, approximate=_approximate(caveats), **common,
        )
    index_sets = _dataset_indices(ix, sets)
    note = _culprit_note(where, n, sets, index_sets) + _also_failing(failing, keys, culprit, culprit_found=True)
    caveats = isolation_caveats(model, n, caveats)
    return DataReport(
        status="isolated", note=note, row_sets=sets, index_sets=index_sets, caveats=caveats,
        approximate=_approximate(caveats), **common,
    )


def not_searched(nonfinite_inputs: list[dict[str, Any]], out_of_range_inputs: list[dict[str, Any]]) -> DataReport:
    """The data report of a failure that is not reproducible: no subset can be searched."""
    return DataReport(
        status="not_searched", nonfinite_inputs=nonfinite_inputs, out_of_range_inputs=out_of_range_inputs,
        note="not searched: a failure that does not come back cannot be narrowed down by replaying subsets",
    )


def _failing_microbatches(keys: list[MicrobatchKey], loss_bad: list[MicrobatchKey],
                          subsets: SubsetReplays) -> list[MicrobatchKey]:
    """The microbatches that fail on their own. A loss is computed per microbatch, so the full
    replay already says which ones produce a non-finite loss; gradient-only failures need a
    replay per microbatch."""
    if loss_bad:
        return loss_bad
    if len(keys) == 1:
        return keys
    failing = [k for k in keys if subsets.fails([k])]
    return [] if subsets.budget.refused else failing


def _dataset_indices(ix: Optional[Tensor], sets: list[list[int]]) -> Optional[list[list[int]]]:
    """The dataset indices of sets of rows, when the capture holds the microbatch's indices ``ix``."""
    return [[int(ix[r]) for r in s] for s in sets] if isinstance(ix, Tensor) else None


def _approximate(caveats: list[str]) -> bool:
    return any("batch-dependent" in c for c in caveats)


def _any_data_note(where: str, sets: list[list[int]], rows: RowSearch, every: bool) -> str:
    if every:
        return f"every sample of {where} fails on its own: the failure does not depend on particular data"
    if rows.probes:
        return (
            f"row {sets[0][0]} of {where} fails on its own, and so do rows {', '.join(map(str, rows.probes))} "
            f"picked from the other {len(rows.remaining)} samples: the failure does not depend on particular data"
        )
    return (
        f"{len(sets)} disjoint sets of samples of {where} each fail on their own and the remaining "
        f"{len(rows.remaining)} samples fail too: the failure does not depend on particular data"
    )


def _culprit_note(where: str, n: int, sets: list[list[int]], index_sets: Optional[list[list[int]]]) -> str:
    together = any(len(s) > 1 for s in sets)
    if len(sets) == 1:
        verb = "trigger the failure together (not one alone)" if together else "triggers the failure"
    else:
        verb = "each trigger the failure on their own" if not together else "trigger the failure (in groups)"
    names = samples_text(sets, index_sets)
    return f"{names} of {where} ({n} samples) {verb}; the other samples of the microbatch do not"


def _also_failing(failing: list[MicrobatchKey], keys: list[MicrobatchKey], culprit: MicrobatchKey,
                  culprit_found: bool) -> str:
    """The other microbatches that fail alone, appended to the note."""
    if not culprit_found:
        return f" ({len(failing)} of {len(keys)} microbatches fail alone)" if len(failing) > 1 else ""
    others = [k for k in failing if k != culprit]
    return f"; microbatches {keys_text(others)} also fail alone (not searched further)" if others else ""


def isolation_caveats(model: nn.Module, microbatch_size: int, caveats: list[str]) -> list[str]:
    """``caveats`` with what makes samples replayed on their own differ from the full microbatch."""
    caveats = list(caveats)
    if microbatch_size <= 1:
        return caveats
    norms = [name or "<root>" for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms:
        caveats.insert(0,
            f"the model has batch-dependent layers (BatchNorm in training mode: {fmt_list(norms, 3)}): a subset of "
            "samples is normalised with its own batch statistics, so samples replayed on their own do not see exactly "
            "what they saw in the full microbatch; the isolation of single samples is approximate"
        )
    drops = [name for name, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    if drops:
        caveats.append(
            "dropout masks are drawn for the subset's shape from the captured random state, so they differ from the "
            "full microbatch's"
        )
    return caveats


def samples_text(sets: list[list[int]], index_sets: Optional[list[list[int]]]) -> str:
    """The samples of ``sets`` by dataset index when known, else by row: "the sample at dataset index 7"."""
    if index_sets:
        flat = [i for s in index_sets for i in s]
        if len(flat) == 1:
            return f"the sample at dataset index {flat[0]}"
        return f"the samples at dataset indices {fmt_list(flat, 8)}"
    flat = [r for s in sets for r in s]
    return f"row {flat[0]}" if len(flat) == 1 else f"rows {fmt_list(flat, 8)}"


def keys_text(keys: Sequence[MicrobatchKey]) -> str:
    """Microbatches by number, with their rank when they come from several: "0, 1 (rank 1)"."""
    ranks = {r for r, _ in keys}
    if len(ranks) <= 1:
        return ", ".join(str(m) for _, m in keys)
    return ", ".join(f"{m} (rank {r})" for r, m in keys)
