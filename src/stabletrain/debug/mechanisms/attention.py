"""Attention statistics: the max pre-softmax logit and the mean entropy, from attention logits.

Two sources, both seen by :mod:`~stabletrain.debug.mechanisms.probes`:

* a softmax over the last dimension inside an attention module (eager attention, which
  materialises the logits): :func:`softmax_stats` reads the softmax's input;
* ``F.scaled_dot_product_attention``, which never materialises them: :func:`sdpa_stats`
  computes ``q @ k^T * scale`` (plus the mask or the causal pattern) once more, on logged steps.

Which module is an attention module is :func:`is_attention_module`. An entry is *masked* when
the mask excludes it (a boolean mask's False, the causal pattern) or when its logit is -inf or
at most half the most negative finite value of the logits' dtype (an additive mask of
``finfo.min``, as the built-in LM and Hugging Face's eager attention use); masked entries are
left out of the max, and a query whose keys are all masked is left out of the entropy mean.
Everything stays on the device; the logits are processed in chunks of queries so that the
statistics never hold more than about :data:`CHUNK_ELEMENTS` float32 values per temporary, and a
call with more than :data:`CALL_BUDGET` logits is measured on evenly spaced queries (then
samples): its max is then the max over those, its entropy their mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

#: Logit entries per chunk (16 MiB as float32); a few temporaries of this size live at once.
CHUNK_ELEMENTS = 1 << 22
#: Logits the statistics of one attention call cover at most (16.8M, e.g. 8 samples x 32 heads x
#: 256 queries x 256 keys): beyond, evenly spaced queries of every sample and head are measured
#: (then every n-th sample), so that a long context costs a bounded amount.
CALL_BUDGET = 1 << 24


def is_attention_module(module: nn.Module) -> bool:
    """The rule for "an attention module": ``nn.MultiheadAttention``, or a class whose name
    contains ``attention`` or ``attn`` (any case): ``GPT2Attention``, ``LlamaAttention``,
    ``BertSelfAttention``, ``CausalSelfAttention``, timm's ``Attention``, ``SelfAttn``."""
    if isinstance(module, nn.MultiheadAttention):
        return True
    name = type(module).__name__.lower()
    return "attention" in name or "attn" in name


@dataclass
class AttentionStats:
    """Running statistics of one module (float32 device scalars).

    Attributes:
        logit_max: Largest unmasked logit seen.
        entropy_sum: Sum of the per-query entropies (nats) of the queries counted.
        rows: Number of queries counted (batch x heads x queries with an unmasked key).
    """

    logit_max: Tensor
    entropy_sum: Tensor
    rows: Tensor

    def merge(self, other: "AttentionStats") -> "AttentionStats":
        other_max = other.logit_max.to(self.logit_max.device)
        # torch.maximum propagates NaN: a NaN logit anywhere stays visible.
        return AttentionStats(
            torch.maximum(self.logit_max, other_max),
            self.entropy_sum + other.entropy_sum.to(self.entropy_sum.device),
            self.rows + other.rows.to(self.rows.device),
        )

    def entropy_mean(self) -> Tensor:
        """Mean entropy per query (NaN when no query was counted)."""
        return self.entropy_sum / self.rows


def masked_below(dtype: torch.dtype) -> float:
    """Logits at or below this are masked: half the most negative finite value of ``dtype``."""
    return torch.finfo(dtype).min / 2 if dtype.is_floating_point else -math.inf


def scores_stats(scores: Tensor, threshold: float) -> AttentionStats:
    """Statistics of one block of float32 logits ``(..., queries, keys)`` whose masked entries
    hold -inf or a value at or below ``threshold`` (see :func:`masked_below`).

    A query counts when one of its keys is unmasked: then its largest logit is an unmasked one
    (a masked value lies far below any other), and so no mask needs to be built.
    """
    row_max = scores.amax(dim=-1)
    counted = ~(row_max <= threshold)  # a NaN logit is no mask: its query counts, and shows
    # softmax rather than exp(log_softmax): exp of the huge negative logs of masked entries is
    # several times slower on a CPU. Masked keys get p = 0 exactly; the clamp keeps 0 * log p at 0
    # where log p is -inf.
    logp = torch.log_softmax(scores, dim=-1).clamp_min_(torch.finfo(scores.dtype).min)
    plogp = torch.softmax(scores, dim=-1).mul_(logp)
    entropy = -plogp.sum(dim=-1)
    return AttentionStats(
        torch.where(counted, row_max, -math.inf).amax(),
        torch.where(counted, entropy, 0.0).sum(),
        counted.sum().float(),
    )


def _rows_per_chunk(lead: int, keys: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, lead * keys))


def _merge(acc: Optional[AttentionStats], new: AttentionStats) -> AttentionStats:
    return new if acc is None else acc.merge(new)


def subset_strides(batch: int, lead: int, queries: int, keys: int) -> tuple[int, int]:
    """``(sample stride, query stride)`` that keep one call's ``lead x queries x keys`` logits
    within :data:`CALL_BUDGET`: evenly spaced queries first, then every n-th sample."""
    total = lead * queries * keys
    if total <= CALL_BUDGET:
        return 1, 1
    q_stride = min(queries, math.ceil(total / CALL_BUDGET))
    rest = lead * math.ceil(queries / q_stride) * keys
    return (min(batch, math.ceil(rest / CALL_BUDGET)) if rest > CALL_BUDGET else 1), q_stride


def _every(t: Tensor, stride: int, ndim: int) -> Tensor:
    """Every ``stride``-th sample of ``t`` when its first dimension is the batch of an ``ndim`` input."""
    return t[::stride] if stride > 1 and t.ndim == ndim and t.shape[0] > 1 else t


def softmax_stats(scores: Tensor) -> AttentionStats:
    """Statistics of the logits a softmax over the last dimension receives (eager attention)."""
    if scores.ndim < 2:
        scores = scores.reshape(1, -1)
    threshold = masked_below(scores.dtype)
    queries, keys = scores.shape[-2], scores.shape[-1]
    lead = scores.numel() // max(1, queries * keys)
    b_stride, q_stride = subset_strides(scores.shape[0] if scores.ndim > 2 else 1, lead, queries, keys)
    scores = _every(scores, b_stride, scores.ndim)[..., ::q_stride, :]
    queries, lead = scores.shape[-2], scores.numel() // max(1, scores.shape[-2] * keys)
    step = _rows_per_chunk(lead, keys)
    acc: Optional[AttentionStats] = None
    for start in range(0, queries, step):
        acc = _merge(acc, scores_stats(scores[..., start : start + step, :].float(), threshold))
    assert acc is not None, "a softmax over zero queries"
    return acc


def sdpa_stats(
    query: Tensor,
    key: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> AttentionStats:
    """Statistics of the logits ``F.scaled_dot_product_attention(query, key, ...)`` computes.

    The logits are ``query @ key^T * scale`` (``scale`` defaults to ``1/sqrt(head_dim)``), plus
    a float ``attn_mask``; a boolean ``attn_mask`` keeps the entries where it is True and
    ``is_causal`` keeps key ``j <= i`` for query ``i`` (the top-left aligned triangle SDPA uses).
    The product is computed in the inputs' dtype (bfloat16 and float32 as they are; float16 in
    float32, where the raw product could overflow), then in float32.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
    queries, keys = query.shape[-2], key.shape[-2]
    lead = max(math.prod(query.shape[:-2]), math.prod(key.shape[:-2]))
    ndim = max(query.ndim, key.ndim)
    b_stride, q_stride = subset_strides(query.shape[0] if ndim > 2 else 1, lead, queries, keys)
    dtype = torch.float32 if query.dtype == torch.float16 else query.dtype
    q = _every(query, b_stride, ndim)[..., ::q_stride, :].to(dtype)
    kt = _every(key, b_stride, ndim).to(dtype).transpose(-2, -1)
    if attn_mask is not None:
        attn_mask = _every(attn_mask, b_stride, ndim)
        if attn_mask.ndim >= 2 and attn_mask.shape[-2] != 1:
            attn_mask = attn_mask[..., ::q_stride, :]
    positions = torch.arange(0, queries, q_stride, device=q.device)  # the queries measured
    threshold = masked_below(query.dtype)
    step = _rows_per_chunk(max(math.prod(q.shape[:-2]), math.prod(kt.shape[:-2])), keys)
    acc: Optional[AttentionStats] = None
    for start in range(0, q.shape[-2], step):
        stop = min(q.shape[-2], start + step)
        scores = (q[..., start:stop, :] @ kt).float() * scale
        if attn_mask is not None:
            mask = attn_mask if attn_mask.ndim < 2 or attn_mask.shape[-2] == 1 else attn_mask[..., start:stop, :]
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, -math.inf)
            else:
                scores = scores + mask.float()
        if is_causal:
            rows = positions[start:stop, None]
            scores = scores.masked_fill(rows < torch.arange(keys, device=scores.device)[None, :], -math.inf)
        acc = _merge(acc, scores_stats(scores, threshold))
    assert acc is not None, "attention over zero queries"
    return acc
