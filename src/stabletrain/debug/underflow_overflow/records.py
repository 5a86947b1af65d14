"""What the monitor's hooks keep of a step: module calls, watched gradients, and one row of
statistics per tensor, grouped in events. Statistics stay device tensors until
:func:`host_values` reads them back for a report. See ``docs/underflow_overflow.md``.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Optional

import torch
from torch import Tensor

from stabletrain.utils.tree import named_tensors

from .stats import nan_min, to_host

__all__ = [
    "MAX_DEPTH",
    "Call",
    "Role",
    "GradSite",
    "StatsRow",
    "Event",
    "Values",
    "tensors_of",
    "host_values",
    "module_label",
]

#: Containers nested deeper than this in a module's inputs or outputs are not looked into.
MAX_DEPTH = 4

#: ``(event index, row index) -> (abs min, abs max)`` read back to the host.
Values = dict[tuple[int, int], tuple[float, float]]


class Call:
    """One call of a module's forward."""

    __slots__ = ("path", "cls", "parent", "depth", "mid", "batch")

    def __init__(self, path: str, cls: str, parent: Optional[Call], mid: int):
        self.path = path
        self.cls = cls
        self.parent = parent
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.mid = mid  # id() of the module
        #: The outermost call's batch size (first dimension of its first input), for sample rows.
        self.batch: Optional[int] = parent.batch if parent is not None else None


class Role(NamedTuple):
    """A part a tensor played in the forward: ``call``'s ``"input"`` or ``"output"`` ``label``."""

    call: Call
    kind: str
    label: str


class GradSite:
    """A tensor whose gradient is watched, with every role it played in the forward."""

    __slots__ = ("ref", "version", "roles", "shape", "dtype")

    def __init__(self, ref: Any, version: int, shape: tuple, dtype: torch.dtype):
        self.ref = ref
        self.version = version
        self.roles: list[Role] = []
        self.shape = shape
        self.dtype = dtype


class StatsRow(NamedTuple):
    """What one hook records of one tensor: a row of the log."""

    label: str  # weight name, input[0], output['logits'], grad of ..., loss
    role: str  # weight | input | output | loss | grad
    amin: Tensor  # abs min, a device scalar
    amax: Tensor  # abs max, a device scalar
    shape: tuple
    dtype: torch.dtype
    ref: Any  # a weak reference to the tensor (None for weights), to find the samples later
    key: Optional[tuple[int, int]]  # (id, version) of the tensor: who else took it (None for gradients)
    data_flag: Optional[Tensor] = None  # the model's own inputs: a device bool, non-finite and not a mask


class Event:
    """What one hook saw: a module's inputs, its outputs, the loss, or one gradient."""

    __slots__ = ("phase", "step", "micro", "kind", "call", "lines", "site")

    def __init__(
        self,
        phase: str,
        step: int,
        micro: int,
        kind: str,
        call: Optional[Call],
        lines: list[StatsRow],
        site: Optional[GradSite] = None,
    ):
        self.phase = phase
        self.step = step
        self.micro = micro
        self.kind = kind  # enter | exit | loss | grad | param
        self.call = call  # None for a gradient of a tensor (kind "grad"): its module is the site's
        self.lines = lines
        self.site = site

    def upto(self, j: int) -> Event:
        """This event with its rows up to and including row ``j``."""
        return Event(self.phase, self.step, self.micro, self.kind, self.call, self.lines[: j + 1], self.site)


def tensors_of(obj: Any, prefix: str) -> Iterator[tuple[str, Tensor]]:
    """(label, tensor) of a module's inputs or outputs; a lone output tensor is ``output[0]``."""
    if isinstance(obj, Tensor) and prefix == "output":
        return iter([("output[0]", obj)])
    return named_tensors(obj, prefix, max_depth=MAX_DEPTH)


def host_values(events: list[Event]) -> Values:
    """The abs min and max of every row of ``events``, read back in one transfer per device."""
    keys: list[tuple[int, int]] = []
    tensors: list[Tensor] = []
    for i, ev in enumerate(events):
        for j, line in enumerate(ev.lines):
            keys.append((i, j))
            tensors.extend((line.amin, line.amax))
    flat = to_host(tensors)
    return {k: nan_min(flat[2 * n], flat[2 * n + 1]) for n, k in enumerate(keys)}


def module_label(path: str, cls: Optional[str]) -> str:
    """``module blocks.0.attn (CausalSelfAttention)``, or ``the model itself (GPT)`` for ``""``."""
    if path == "":
        return f"the model itself ({cls})"
    return f"module {path} ({cls})"
