"""An op with a non-finite output, as the tracer inspects it: its non-finite inputs (:class:`BadInput`) and
the findings made for it (:class:`BadOp`), named after the module that ran it. See ``docs/diagnose.md``.
"""

from __future__ import annotations

import traceback
from typing import Any, Optional, Protocol, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from stabletrain.debug.op_trace.findings import INPUT_SOURCES, NAN, NEGINF, OpFinding, tensor_stat
from stabletrain.debug.op_trace.ops import infinite_constant, is_additive_mask, nonfinite_kinds
from stabletrain.debug.op_trace.source import anomaly_source, user_source

#: Owner of autograd nodes created outside every module's forward.
OUTSIDE = ("", "")


class TracerState(Protocol):
    """What a :class:`BadOp` reads of the :class:`~stabletrain.debug.op_trace.tracer.OpTracer` inspecting it."""

    model: nn.Module
    op_count: int
    #: The key under which autograd nodes carry the module that created them.
    node_key: str
    #: The modules whose forward is running, outermost first: ``(name, type name)``.
    module_stack: list[tuple[str, str]]

    def batch_rows(self, t: torch.Tensor, kind: Optional[str] = None) -> Optional[list[int]]: ...


class BadInput:
    """A non-finite tensor argument of the op being inspected."""

    __slots__ = ("now", "was", "kinds", "broadcast")

    def __init__(self, now: torch.Tensor, was: torch.Tensor):
        self.now = now  # the argument itself (its storage holds the origins)
        self.was = was  # its values before the op ran (differs for in-place ops)
        self.kinds = nonfinite_kinds(was)
        self.broadcast: Optional[torch.Tensor] = None


class BadOp:
    """What one op with a non-finite output is: shared by the findings made for it."""

    def __init__(self, tracer: TracerState, func: Any, args: Any, kwargs: Any, before: Any):
        self.tracer = tracer
        self.func = func
        self.op = str(func)
        b_args, b_kwargs = before if before is not None else (args, kwargs)
        self.flat_now = tree_flatten((args, kwargs))[0]
        self.flat_was = tree_flatten((b_args, b_kwargs))[0]
        self.in_backward = torch._C._current_graph_task_id() != -1
        self.op_index = tracer.op_count - 1
        self._common: Optional[dict[str, Any]] = None

    def common(self) -> dict[str, Any]:
        """Fields every finding of this op shares (computed once, only when one is made)."""
        if self._common is None:
            t = self.tracer
            root_type = type(t.model).__name__
            if self.in_backward:
                node = torch._C._current_autograd_node()
                # Node.metadata is a dict (the stubs say a method).
                owner = cast(dict, node.metadata).get(t.node_key) if node is not None else None
                outside = owner is None or owner == OUTSIDE
                module, type_name = ("", root_type) if outside else cast(tuple[str, str], owner)
                source = anomaly_source(node)
                forward_op = node.name() if node is not None else None
            else:
                outside = not t.module_stack
                module, type_name = t.module_stack[-1] if t.module_stack else ("", root_type)
                source = user_source(traceback.extract_stack())
                forward_op = None
            floats = [a for a in self.flat_was
                      if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())]
            self._common = dict(
                op=self.op, phase="backward" if self.in_backward else "forward", module=module, module_type=type_name,
                inputs=[tensor_stat(a, i) for i, a in enumerate(floats)], source=source, forward_op=forward_op,
                op_index=self.op_index, outside_forward=outside,
            )
        return self._common

    def finding(self, bad: torch.Tensor, kind: str, origin: str, cause: Optional[OpFinding] = None,
                input_name: Optional[str] = None, rows_of: Optional[torch.Tensor] = None) -> OpFinding:
        passed_on = origin in INPUT_SOURCES
        written = origin == "op" and kind != NAN and infinite_constant(self.flat_was)
        if origin in ("data", "buffer", "untracked"):
            # A tensor of only 0 and -inf is an additive mask; other Infs in it are damage.
            deliberate = rows_of is not None and kind == NEGINF and is_additive_mask(rows_of)
        else:
            deliberate = written
        return OpFinding(
            **self.common(), dtype=str(bad.dtype).replace("torch.", ""), output=tensor_stat(bad),
            inputs_nonfinite=passed_on, kind=kind, origin=origin, input_name=input_name, cause=cause,
            written=written, deliberate=deliberate and kind != NAN,
            # Where the op made them: all its non-finite rows, or the positions given.
            rows=self.tracer.batch_rows(rows_of, kind) if rows_of is not None else self.tracer.batch_rows(bad),
        )
