"""op_trace: op-level tracing with provenance, where a harmful NaN or Inf is born, in forward or backward.

:func:`trace_first_nonfinite` and :class:`OpTracer`; ``stabletrain diagnose`` uses them on a captured step.
See ``docs/diagnose.md``; how provenance is decided is in :mod:`stabletrain.debug.op_trace.tracer`.

One job per file: ``findings`` (what is reported), ``ops`` (what an aten op does to its tensors), ``source``
(the model source line of an op), ``bad_op`` (an op with a non-finite output), ``provenance`` (where each
NaN/Inf came from, per storage), ``tracer`` (the tracer: hooks, dispatch, what is reported).
"""

from stabletrain.debug.op_trace.findings import (
    KINDS,
    NAN,
    NEGINF,
    POSINF,
    OpFinding,
    TensorStat,
    replace_index,
    tensor_stat,
)
from stabletrain.debug.op_trace.ops import is_additive_mask
from stabletrain.debug.op_trace.tracer import OpTracer, trace_first_nonfinite

__all__ = [
    "OpFinding",
    "OpTracer",
    "TensorStat",
    "is_additive_mask",
    "tensor_stat",
    "trace_first_nonfinite",
    # importable before the split, kept so
    "KINDS",
    "NAN",
    "POSINF",
    "NEGINF",
    "replace_index",
]
