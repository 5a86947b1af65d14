"""Hand-built records for the unit tests of underflow_overflow: calls, rows and events as the
monitor's hooks would keep them, without a model."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from stabletrain.debug.underflow_overflow.records import Call, Event, GradSite, Role, StatsRow

NAN, INF = float("nan"), float("inf")


def calls() -> dict[str, Call]:
    """The model (``Net``), its children ``a`` (``Lin``) and ``b`` (``Soft``), and ``a.inner``."""
    root = Call("", "Net", None, 0)
    root.batch = 5
    a = Call("a", "Lin", root, 1)
    return {"": root, "a": a, "b": Call("b", "Soft", root, 2), "a.inner": Call("a.inner", "Act", a, 3)}


def row(
    label: str, role: str, amin: float, amax: float, key: Optional[str] = None, *,
    tensor: Optional[torch.Tensor] = None, data: Optional[bool] = None, shape: tuple = (5, 4),
) -> StatsRow:
    """A row; ``key`` names the tensor (rows with the same key are the same tensor), ``tensor``
    is one the row keeps a weak reference to, ``data`` the data flag of the model's own input."""
    ref, ident = None, None
    if tensor is not None:
        ref, ident, shape = weakref.ref(tensor), (id(tensor), tensor._version), tuple(tensor.shape)
    elif key is not None:
        ident = (hash(key), 0)
    flag = None if data is None else torch.tensor(data)
    return StatsRow(label, role, torch.tensor(amin), torch.tensor(amax), shape, torch.float32, ref, ident, flag)


def fwd(kind: str, call: Call, *lines: StatsRow, step: int = 0, micro: int = 0) -> Event:
    return Event("forward", step, micro, kind, call, list(lines))


def grad(site_roles: list[Role], amin: float, amax: float, step: int = 0) -> Event:
    site = GradSite(None, 0, (5, 4), torch.float32)
    site.roles.extend(site_roles)
    return Event("backward", step, 0, "grad", None, [row("grad", "grad", amin, amax)], site)
