"""Where: the culprit subset replayed under op tracing, the first harmful non-finite op it finds, and where a
non-finite input of that op came from (the data, the weights, a buffer, the batch's conversion). The captured
batches are scanned for the values that explain such an input. See ``docs/diagnose.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from stabletrain.debug.diagnose.types import DataReport, RowSelection, WeightsReport
from stabletrain.debug.nan_capture import default_step_fn
from stabletrain.debug.op_trace import OpFinding, OpTracer
from stabletrain.debug.replay import MicrobatchKey, NaNCapture, forward_backward
from stabletrain.utils.tree import named_tensors


def locate(cap: NaNCapture, model: nn.Module, data: DataReport, precision: str,
           device: torch.device) -> tuple[Optional[OpFinding], dict[str, Any]]:
    """Trace the culprit subset of ``data`` (its first culprit or example rows, when it names rows
    of one microbatch); returns the finding and what was traced (``{"microbatches", "rows",
    "dataset_indices"}``)."""
    keys = data.microbatches
    sample_rows = data.rows or (data.examples[0] if data.examples else [])
    rows: Optional[RowSelection] = {keys[0]: sample_rows} if sample_rows and len(keys) == 1 else None
    finding = trace(cap, model, keys, rows, precision, device)
    index_sets = data.index_sets if data.row_sets else data.example_indices
    traced_on = {
        "microbatches": keys,
        "rows": sample_rows if rows else None,
        "dataset_indices": index_sets[0] if rows and index_sets else None,
    }
    return finding, traced_on


def trace(
    cap: NaNCapture,
    model: nn.Module,
    keys: list[MicrobatchKey],
    rows: Optional[RowSelection],
    precision: str,
    device: torch.device,
) -> Optional[OpFinding]:
    """The first harmful non-finite op of the subset, its rows given as rows of the microbatch."""
    base = cap.step_fn or default_step_fn
    # The forward pass alone first: most failures start there, and it costs neither the
    # backward pass nor anomaly mode (which records a traceback per autograd node).
    for backward in (False, True):
        tracer = OpTracer(model, check_backward=backward, armed=False)

        def traced_step(m: nn.Module, batch: Any, *step_args: Any, tracer: OpTracer = tracer) -> Tensor:
            # Armed once the captured state is loaded and the batch is on the device: restoring
            # non-finite weights is not the failing op; what the model does with them is.
            tracer.arm()
            tracer.watch_batch(batch)
            loss = base(m, batch, *step_args)
            tracer.check_loss(loss)  # a non-finite loss is the harm: its origin is the finding
            return loss

        forward_backward(cap, microbatches=keys, rows=rows, precision=precision, device=device, context=tracer,
                         step_fn=traced_step, backward=backward)
        if tracer.finding is not None:
            # Rows of the traced subset -> rows of the microbatch (unknown over several microbatches).
            subset = rows[keys[0]] if rows and len(keys) == 1 else None
            return _microbatch_rows(tracer.finding, subset, len(keys) == 1)
    return None


def _microbatch_rows(f: OpFinding, subset: Optional[Sequence[int]], one_microbatch: bool) -> OpFinding:
    def convert(r: Optional[list[int]]) -> Optional[list[int]]:
        if r is None or not one_microbatch:
            return None
        return r if subset is None else [subset[i] for i in r if i < len(subset)]

    cause = dataclasses.replace(f.cause, rows=convert(f.cause.rows)) if f.cause is not None else None
    return dataclasses.replace(f, rows=convert(f.rows), cause=cause)


def origin(finding: Optional[OpFinding], data: DataReport, weights: WeightsReport, precision: str,
           traced_on: Optional[dict[str, Any]] = None) -> Optional[str]:
    """Where a non-finite input of the finding's op came from: "data", "weights", "buffers",
    "precision_conversion"; None when its inputs were finite (the op made the value) or unknown."""
    if finding is None or not finding.inputs_nonfinite:
        return None
    # The tracer knows which tensor held it; the data scan tells bad data from a conversion.
    if finding.origin == "weight" and weights.nonfinite:
        return "weights"
    if finding.origin == "buffer" and weights.nonfinite_buffers:
        return "buffers"
    rows = set(data.rows or ((traced_on or {}).get("rows") or []))
    keys = set(data.microbatches)
    for bad in data.nonfinite_inputs:
        if (bad["rank"], bad["micro_step"]) in keys and (bad["row"] is None or bad["row"] in rows):
            return "data"
    if weights.nonfinite:
        return "weights"
    if weights.nonfinite_buffers:
        return "buffers"
    if precision in ("16-true", "bf16-true"):
        return "precision_conversion"
    return None


# ---------------------------------------------------------------- what the captured batches hold


def nonfinite_inputs(cap: NaNCapture) -> list[dict[str, Any]]:
    """Non-finite values already in the captured batches, per sample and tensor; a sample's
    additive mask (only 0 and -inf) holds them on purpose and is left out."""

    def bad(t: Tensor) -> Tensor:
        flags = ~torch.isfinite(t)
        if t.is_complex() or not bool(flags.any()):
            return flags
        masks = (t == 0) | torch.isneginf(t)
        if t.ndim:
            masks = masks.reshape(len(t), -1).all(1).reshape([len(t)] + [1] * (t.ndim - 1))
        else:
            masks = masks.all()
        return flags & ~masks

    return _flag_inputs(cap, bad)


def out_of_range_inputs(cap: NaNCapture, precision: str) -> list[dict[str, Any]]:
    """Finite values of the captured batches that 16-true or bf16-true, which convert the
    batch to their dtype, turn into Inf; per sample and tensor, with the sample's abs max."""
    dtype = {"16-true": torch.float16, "bf16-true": torch.bfloat16}.get(precision)
    if dtype is None:
        return []
    limit = torch.finfo(dtype).max

    def beyond(t: Tensor) -> Tensor:
        if t.is_complex() or torch.finfo(t.dtype).max <= limit:
            return torch.zeros_like(t, dtype=torch.bool)
        return torch.isfinite(t) & ~torch.isfinite(t.to(dtype))

    return _flag_inputs(cap, beyond, with_abs_max=True)


def _flag_inputs(cap: NaNCapture, test: Callable[[Tensor], Tensor], with_abs_max: bool = False) -> list[dict[str, Any]]:
    """Where ``test(tensor) -> bool mask`` holds in the captured batches, per sample and tensor."""
    found = []
    for part in cap.ranks:
        for micro, batch in enumerate(part.microbatches):
            if batch is None:
                continue
            n = part.microbatch_size(micro)
            for name, t in named_tensors(batch):
                if not (t.is_floating_point() or t.is_complex()) or not t.numel():
                    continue
                bad = test(t)
                if bool(bad.any()):
                    where = {"rank": part.rank, "micro_step": micro}
                    found += _flagged(where, name, t, bad, n, part.indices[micro], with_abs_max)
    return found


def _flagged(where: dict[str, Any], name: str, t: Tensor, bad: Tensor, n: int, ix: Optional[Tensor],
             with_abs_max: bool) -> list[dict[str, Any]]:
    """One entry per sample of a microbatch of ``n`` whose rows of ``t`` hold flagged values ``bad``
    (one for the whole tensor when it has no batch dimension)."""
    if not (t.ndim and t.shape[0] == n):
        entry = {**where, "row": None, "index": None, "field": name, "count": int(bad.sum())}
        return [{**entry, "abs_max": float(t[bad].abs().max())} if with_abs_max else entry]
    counts = bad.reshape(n, -1).sum(1)
    found = []
    for row in torch.nonzero(counts).flatten().tolist():
        entry = {**where, "row": row, "index": int(ix[row]) if isinstance(ix, Tensor) else None, "field": name,
                 "count": int(counts[row])}
        found.append({**entry, "abs_max": float(t[row].abs().max())} if with_abs_max else entry)
    return found
