"""Provenance: where each NaN and Inf came from, kept per tensor storage and per kind of value (NaN, +Inf,
-Inf), decided op by op (element by element for elementwise ops). The rules are in
:mod:`stabletrain.debug.op_trace.tracer`; see ``docs/diagnose.md``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from stabletrain.debug.op_trace.bad_op import BadInput, BadOp
from stabletrain.debug.op_trace.findings import NAN, NEGINF, POSINF, OpFinding, pick_origin
from stabletrain.debug.op_trace.ops import is_elementwise, kind_mask, nonfinite_kinds, storage_ptr


class Provenance:
    """The origins of the non-finite values seen so far, and the tensors no traced op makes."""

    def __init__(self) -> None:
        # Origins per storage, for each kind of value; a weak reference tells a storage that
        # was freed (and whose memory may hold a new tensor) from a live one.
        self.records: dict[int, tuple[Any, dict[str, OpFinding]]] = {}
        # Tensors no traced op makes: weights, buffers and the data, by storage.
        self.known: dict[int, tuple[Any, str, str]] = {}

    def know(self, t: torch.Tensor, source: str, name: str) -> None:
        """Name ``t`` (a weight, a buffer, the data) for NaN/Inf found in it: no traced op made it."""
        ptr = storage_ptr(t)
        if ptr is not None and ptr not in self.known:
            self.known[ptr] = (StorageWeakRef(t.untyped_storage()), source, name)

    def clear(self) -> None:
        """Forget the origins (the storages may be reused once tracing ends)."""
        self.records.clear()

    def origins(self, t: torch.Tensor) -> dict[str, OpFinding]:
        """The origins recorded for ``t``'s storage, per kind (empty when none, or the storage was freed)."""
        ptr = storage_ptr(t)
        entry = self.records.get(ptr) if ptr is not None else None
        if entry is None or entry[0].expired():
            return {}
        return entry[1]

    def record(self, t: torch.Tensor, origins: dict[str, OpFinding]) -> None:
        """Keep ``origins`` for ``t``'s storage (added to what it holds already)."""
        ptr = storage_ptr(t)
        if ptr is None or not origins:
            return
        entry = self.records.get(ptr)
        if entry is None or entry[0].expired():
            if len(self.records) > 4096:  # forget freed storages now and then
                self.records = {k: v for k, v in self.records.items() if not v[0].expired()}
            entry = self.records[ptr] = (StorageWeakRef(t.untyped_storage()), {})
        entry[1].update(origins)

    def input_origin(self, op: BadOp, inp: BadInput, kind: str, bad: torch.Tensor) -> OpFinding:
        """The origin of the ``kind`` values of input ``inp``; for a tensor that no traced op
        made, a finding at this op (the first to use it), kept for later uses too."""
        found = self.origins(inp.now).get(kind)
        if found is not None:
            return found
        ptr = storage_ptr(inp.now)
        known = self.known.get(ptr) if ptr is not None else None
        if known is not None and known[0].expired():
            known = None
        source, name = (known[1], known[2]) if known is not None else ("untracked", None)
        found = op.finding(bad, kind, source, input_name=name, rows_of=inp.was)
        self.record(inp.now, {kind: found})
        return found

    def output_origins(self, op: BadOp, out: torch.Tensor, inputs: list[BadInput]) -> dict[str, OpFinding]:
        """The origin of each kind of non-finite value in ``out``, an output of ``op``."""
        kinds = nonfinite_kinds(out)
        if not inputs:
            return {k: op.finding(out, k, "op") for k in kinds}
        if is_elementwise(op.func) and self._broadcast(inputs, out):
            return self._elementwise_origins(op, out, kinds, inputs)
        found: dict[str, OpFinding] = {}
        for k in kinds:
            if k == NAN:
                nan_in = [i for i in inputs if NAN in i.kinds]
                inf_in = [i for i in inputs if POSINF in i.kinds or NEGINF in i.kinds]
                if nan_in:
                    found[k] = self.input_origin(op, nan_in[0], NAN, out)
                elif inf_in:
                    causes = [self.input_origin(op, i, s, out)
                              for i in inf_in for s in (POSINF, NEGINF) if s in i.kinds]
                    found[k] = op.finding(out, NAN, "inf", cause=pick_origin(causes))
                else:
                    found[k] = op.finding(out, NAN, "op")
            else:
                # Same sign first; the other sign passed through a negation; else born here.
                other = NEGINF if k == POSINF else POSINF
                src = next((i for i in inputs if k in i.kinds), None)
                src = src or next((i for i in inputs if other in i.kinds), None)
                if src is not None:
                    found[k] = self.input_origin(op, src, k if k in src.kinds else other, out)
                else:
                    found[k] = op.finding(out, k, "op")
        return found

    @staticmethod
    def _broadcast(inputs: list[BadInput], out: torch.Tensor) -> bool:
        for inp in inputs:
            try:
                inp.broadcast = torch.broadcast_to(inp.was, out.shape)
            except RuntimeError:
                return False
        return True

    def _elementwise_origins(
        self, op: BadOp, out: torch.Tensor, kinds: list[str], inputs: list[BadInput]
    ) -> dict[str, OpFinding]:
        """Origins decided element by element: a bad output element comes from a bad input
        element at the same position, or is born here."""
        masks = [{k: kind_mask(i.broadcast, k) for k in i.kinds} for i in inputs]  # type: ignore[arg-type]
        any_bad = torch.zeros(out.shape, dtype=torch.bool, device=out.device)
        for m in masks:
            for v in m.values():
                any_bad |= v
        found: dict[str, OpFinding] = {}
        for k in kinds:
            at = kind_mask(out, k)
            born = at & ~any_bad
            if k == NAN:
                src = next((i for i, m in zip(inputs, masks) if NAN in m and bool((at & m[NAN]).any())), None)
                if src is not None:  # an older NaN passed on
                    found[k] = self.input_origin(op, src, NAN, out)
                    continue
                causes = [self.input_origin(op, i, s, out) for i, m in zip(inputs, masks)
                          for s in (POSINF, NEGINF) if s in m and bool((at & m[s]).any())]
                if causes and not bool(born.any()):
                    found[k] = op.finding(out, NAN, "inf", cause=pick_origin(causes), rows_of=at & ~born)
                else:
                    found[k] = op.finding(out, NAN, "op", rows_of=born)
                continue
            if bool(born.any()):  # a new Inf (an overflow) is named before Infs passed on with it
                found[k] = op.finding(out, k, "op", rows_of=born)
                continue
            other = NEGINF if k == POSINF else POSINF
            src, sign = None, k
            for s in (k, other):
                src = next((i for i, m in zip(inputs, masks) if s in m and bool((at & m[s]).any())), None)
                if src is not None:
                    sign = s
                    break
            found[k] = self.input_origin(op, src, sign, out) if src is not None else op.finding(out, k, "op")
        return found
