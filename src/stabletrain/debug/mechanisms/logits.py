"""Output-logit statistics: the log-partition (mean logsumexp over classes), the mean logit and max |logit|.

The logits are what the loss receives: the input of ``F.cross_entropy`` (class dimension 1, or
0 for one unbatched row) or of ``log_softmax`` (its ``dim``), seen by
:mod:`~stabletrain.debug.mechanisms.probes`. For ``cross_entropy`` with class-index targets, the
rows whose target is ``ignore_index`` (padding) are left out: they do not enter the loss.
``nll_loss`` is not read: it receives log-probabilities, whose logsumexp is 0 by construction
(the logits are read at the ``log_softmax`` before it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

#: Logits per chunk: logsumexp makes one temporary of its input's size; bigger chunks than the
#: attention's because a language model's vocabulary makes rows long (128K logits) and many.
CHUNK_ELEMENTS = 1 << 26


@dataclass
class LogitStats:
    """Running statistics of the output logits (float32 device scalars)."""

    lse_sum: Tensor
    rows: Tensor
    absmax: Tensor
    #: Sum over the rows of each row's mean logit (over its classes): the common level the softmax ignores.
    mean_sum: Tensor

    def merge(self, other: "LogitStats") -> "LogitStats":
        device = self.lse_sum.device
        return LogitStats(
            self.lse_sum + other.lse_sum.to(device),
            self.rows + other.rows.to(device),
            torch.maximum(self.absmax, other.absmax.to(device)),
            self.mean_sum + other.mean_sum.to(device),
        )

    def lse_mean(self) -> Tensor:
        """Mean logsumexp per row (NaN when no row was counted)."""
        return self.lse_sum / self.rows

    def logit_mean(self) -> Tensor:
        """Mean logit over the classes and the rows (NaN when no row was counted)."""
        return self.mean_sum / self.rows


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


Found = tuple[Tensor, int, Optional[Tensor]]


def cross_entropy_logits(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[Found]:
    """``(logits, class_dim, rows_kept)`` of an ``F.cross_entropy`` call; None when its input is
    not a floating tensor. ``rows_kept`` (bool, the input's shape without the class dimension)
    is None when every row counts."""
    logits = _arg(args, kwargs, 0, "input")
    target = _arg(args, kwargs, 1, "target")
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.numel() == 0:
        return None
    class_dim = 1 if logits.ndim >= 2 else 0
    kept = None
    if isinstance(target, Tensor) and not target.is_floating_point():
        ignore = _arg(args, kwargs, 4, "ignore_index", -100)
        kept = target != ignore
    return logits, class_dim, kept


def log_softmax_logits(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[Found]:
    """``(logits, dim, None)`` of a ``log_softmax`` call; None without an explicit ``dim``."""
    logits = _arg(args, kwargs, 0, "input")
    dim = _arg(args, kwargs, 1, "dim")
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or dim is None or logits.numel() == 0:
        return None
    return logits, int(dim) % max(1, logits.ndim), None


def logit_stats(logits: Tensor, class_dim: int, kept: Optional[Tensor]) -> LogitStats:
    """Sum of the rows' logsumexp, the rows counted, the largest |logit| of those rows and the sum of
    their mean logits.

    Rows are processed in chunks of about :data:`CHUNK_ELEMENTS` logits (logsumexp
    materialises a temporary the size of its input).
    """
    rows = logits.movedim(class_dim, -1).reshape(-1, logits.shape[class_dim]) if logits.ndim else logits.reshape(1, 1)
    keep = None if kept is None else kept.reshape(-1)
    step = max(1, CHUNK_ELEMENTS // max(1, rows.shape[1]))
    lse_sum = torch.zeros((), dtype=torch.float32, device=logits.device)
    absmax = torch.zeros((), dtype=torch.float32, device=logits.device)
    mean_sum = torch.zeros((), dtype=torch.float32, device=logits.device)
    for start in range(0, rows.shape[0], step):
        block = rows[start : start + step]
        lse = torch.logsumexp(block, dim=-1).float()
        low, high = torch.aminmax(block, dim=-1)
        row_absmax = torch.maximum(low.abs(), high.abs()).float()
        row_mean = block.mean(dim=-1, dtype=torch.float32)
        if keep is not None:
            k = keep[start : start + step]
            lse = torch.where(k, lse, 0.0)
            row_absmax = torch.where(k, row_absmax, 0.0)
            row_mean = torch.where(k, row_mean, 0.0)
        lse_sum = lse_sum + lse.sum()
        mean_sum = mean_sum + row_mean.sum()
        absmax = torch.maximum(absmax, row_absmax.amax())
    count = keep.sum().float() if keep is not None else torch.full((), rows.shape[0], dtype=torch.float32,
                                                                     device=logits.device)
    return LogitStats(lse_sum, count, absmax, mean_sum)
