"""In-memory snapshots for rolling a plain PyTorch loop back past a bad step.

:class:`RollbackSnapshots` keeps one CPU copy of the model, optimizer and RNG states, taken every
``every`` steps (:meth:`~RollbackSnapshots.maybe_take`); :meth:`~RollbackSnapshots.restore` puts it back
and returns its step. The trainer's ``on_instability.policy=rollback`` is in :mod:`stabletrain.safety.healing`.
See docs/self_healing.md.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from torch import Tensor, nn

from stabletrain.utils.rng import get_rng_state, set_rng_state

__all__ = ["RollbackSnapshots"]


class RollbackSnapshots:
    """One in-memory snapshot of model, optimizer and RNG states, renewed every ``every`` steps.

    Args:
        model: The module trained.
        optimizer: Its optimizer.
        every: Take a snapshot at steps 0, ``every``, ``2 * every``, ...
        extra: Objects with ``state_dict``/``load_state_dict`` restored too (e.g. an
            ``InstabilityGuard``, a GradScaler, an lr scheduler).
    """

    def __init__(self, model: nn.Module, optimizer: Any, every: int = 50, extra: tuple[Any, ...] = ()):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.model, self.optimizer, self.every, self.extra = model, optimizer, int(every), tuple(extra)
        self.step: Optional[int] = None
        self._state: Optional[dict[str, Any]] = None

    def maybe_take(self, step: int) -> bool:
        """Take a snapshot if ``step`` is a multiple of ``every`` (and not already taken)."""
        if step % self.every or self.step == step:
            return False
        self.take(step)
        return True

    def take(self, step: int) -> None:
        """Snapshot now, as the state at the start of ``step``."""
        self._state = _to_cpu({
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "extra": [e.state_dict() for e in self.extra],
        })
        self._state["rng"] = get_rng_state()
        self.step = int(step)

    def restore(self) -> int:
        """Put the snapshot back; returns the step it was taken at (the next step to run)."""
        if self._state is None or self.step is None:
            raise RuntimeError("RollbackSnapshots.restore: no snapshot yet; call maybe_take(step) at each step start")
        self.model.load_state_dict(self._state["model"])
        self.optimizer.load_state_dict(copy.deepcopy(self._state["optimizer"]))
        for e, s in zip(self.extra, self._state["extra"]):
            e.load_state_dict(copy.deepcopy(s))
        set_rng_state(self._state["rng"])
        return self.step

    @property
    def nbytes(self) -> int:
        """Bytes of tensors the snapshot holds."""
        return _nbytes(self._state)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0
