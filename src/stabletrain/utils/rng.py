"""Random-number-generator state in a form that ``torch.load(weights_only=True)`` accepts.

Checkpoints and NaN captures both store RNG state. Python's and NumPy's states are tuples
holding arrays, which the safe loader refuses, so they are converted to tensors, ints and
lists here and back again.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch

RawRngState = tuple[torch.Tensor, Any, Any, Optional[list[torch.Tensor]]]


def raw_rng_state() -> RawRngState:
    """The RNG states as the RNGs return them: cheap to take every microbatch; convert with
    :func:`storable_rng_state` only when they are written."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), np.random.get_state(legacy=True), random.getstate(), cuda


def storable_rng_state(raw: RawRngState) -> dict[str, Any]:
    """:func:`raw_rng_state` as tensors, ints and lists (``torch.load(weights_only=True)`` reads it)."""
    torch_state, np_state, py_state, cuda = raw
    name, keys, pos, has_gauss, cached_gaussian = np_state
    version, internal, gauss = py_state
    state: dict[str, Any] = {
        "torch": torch_state.clone(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": int(version), "internal": list(internal), "gauss": gauss},
    }
    if cuda is not None:
        state["cuda"] = [c.clone() for c in cuda]
    return state


def get_rng_state() -> dict[str, Any]:
    """The state of every RNG a training step may draw from (torch CPU, CUDA, NumPy, Python)."""
    return storable_rng_state(raw_rng_state())


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["name"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), NumPy and Python's random module."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
