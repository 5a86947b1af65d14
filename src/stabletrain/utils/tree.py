"""Nested batches: tensors inside dicts, lists and tuples, walked, selected, copied and moved.

The maps are Lightning Fabric's (``apply_to_collection``, ``move_data_to_device``: dicts,
lists, tuples, named tuples and dataclasses keep their type). Two walks are our own, because
they need the path to each tensor, which Fabric's maps do not give:

* :func:`named_tensors` names each tensor by where it sits (``batch['x'][0]``);
* :func:`to_storable` converts a batch for a file that ``torch.load(weights_only=True)``
  reads back, and names the place of anything it cannot store.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
from lightning_fabric.utilities.apply_func import move_data_to_device
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from stabletrain.utils.text import json_float

__all__ = [
    "named_tensors",
    "tensors",
    "leading_size",
    "select_rows",
    "to_device",
    "detached_copy",
    "cpu_copy",
    "to_storable",
    "json_ready",
    "bitwise_equal",
]


def named_tensors(obj: Any, prefix: str = "batch", max_depth: Optional[int] = None) -> Iterator[tuple[str, Tensor]]:
    """``(label, tensor)`` for every tensor nested in ``obj``'s dicts, lists and tuples, in order.

    Labels extend ``prefix`` the way the value is reached: ``batch['x']``, ``batch[1][0]``.

    Args:
        obj: A tensor, or containers of them (other values are skipped).
        prefix: The label of ``obj`` itself.
        max_depth: Containers nested deeper than this are not entered (None: no limit). Hooks
            that run on every module call set it, so that a deeply nested output costs little.

    Example::

        list(named_tensors({"x": x, "y": [y0, y1]}))
        # [("batch['x']", x), ("batch['y'][0]", y0), ("batch['y'][1]", y1)]
    """
    yield from _named(obj, prefix, 0, max_depth)


def _named(obj: Any, prefix: str, depth: int, max_depth: Optional[int]) -> Iterator[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        yield prefix, obj
    elif max_depth is not None and depth > max_depth:
        return
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from _named(item, f"{prefix}[{key!r}]", depth + 1, max_depth)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _named(item, f"{prefix}[{i}]", depth + 1, max_depth)


def tensors(obj: Any) -> Iterator[Tensor]:
    """Every tensor nested in ``obj``, in order (see :func:`named_tensors`)."""
    return (t for _, t in named_tensors(obj))


def leading_size(obj: Any) -> Optional[int]:
    """The first dimension of the first tensor in ``obj`` that has one (a batch's sample count), or None."""
    return next((int(t.shape[0]) for t in tensors(obj) if t.ndim), None)


def select_rows(obj: Any, rows: Sequence[int], n: int) -> Any:
    """``obj`` with only the samples ``rows`` (0-based) of every tensor whose first dimension is ``n``
    (the batch size); other tensors and values stay as they are."""
    index = torch.as_tensor(list(rows), dtype=torch.long)

    def select(t: Tensor) -> Tensor:
        return t[index.to(t.device)] if t.ndim and t.shape[0] == n else t

    return apply_to_collection(obj, Tensor, select)


def to_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor on ``device`` (Fabric's ``move_data_to_device``)."""
    return move_data_to_device(obj, device)


def detached_copy(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a detached copy on the same device (no host transfer)."""
    return apply_to_collection(obj, Tensor, lambda t: t.detach().clone())


def cpu_copy(t: Tensor) -> Tensor:
    """A detached CPU copy of ``t`` that owns its memory: never a view that would drag its whole
    storage into a file."""
    return t.detach().to("cpu", copy=True)


def to_storable(obj: Any, where: str = "batch") -> Any:
    """A copy of ``obj`` that ``torch.load(weights_only=True)`` can read back: CPU tensors,
    numbers, strings, None, and lists, tuples and dicts of them.

    Named tuples become plain tuples and NumPy arrays become tensors (their classes would
    have to be unpickled).

    Raises:
        TypeError: ``obj`` holds something else (a custom class); the message names where.
    """
    if isinstance(obj, Tensor):
        return cpu_copy(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, (str, int))]
        if bad:
            raise TypeError(f"{where}: dict keys must be str or int to be stored safely, got {type(bad[0]).__name__}")
        return {k: to_storable(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [to_storable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise TypeError(
        f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored in a capture safely "
        "(only tensors, numbers, strings, None, lists, tuples and dicts); "
        "the capture is written without this microbatch"
    )


def json_ready(obj: Any) -> Any:
    """``obj`` with every float made JSON-safe (:func:`~stabletrain.utils.text.json_float`)."""
    return apply_to_collection(obj, float, json_float)


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Same dtype, shape and bits; two all-NaN tensors count as equal (NaN payloads may differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if bool(torch.isnan(a).all()) and bool(torch.isnan(b).all()):
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
