"""The statistics behind the signals, against float64 computations written out here: attention
logits from SDPA's arguments (masks, causal, GQA, chunks), from a softmax's input, and the
output logits' log-partition."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import stabletrain.debug.mechanisms.attention as attention_module
from stabletrain.debug.mechanisms.attention import is_attention_module, sdpa_stats, softmax_stats
from stabletrain.debug.mechanisms.logits import cross_entropy_logits, logit_stats


def reference(scores: torch.Tensor, valid: torch.Tensor) -> tuple[float, float]:
    """Max over the valid entries, and the mean over queries with a valid key of the entropy of
    the softmax over the valid keys alone, in float64, query by query."""
    scores, valid = torch.broadcast_tensors(scores.double(), valid)
    best, entropies = -math.inf, []
    for row, keep in zip(scores.reshape(-1, scores.shape[-1]), valid.reshape(-1, valid.shape[-1])):
        if not keep.any():
            continue
        kept = row[keep]
        best = max(best, kept.max().item())
        p = torch.softmax(kept, dim=0)
        entropies.append(-(p * p.log()).sum().item())
    return best, sum(entropies) / len(entropies)


def _qk(b=2, h=3, lq=5, s=7, e=8, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, lq, e, generator=g) * scale, torch.randn(b, h, s, e, generator=g) * scale


def test_sdpa_logits_without_mask_are_q_k_scaled():
    q, k = _qk()
    stats = sdpa_stats(q, k)
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(8)
    best, entropy = reference(scores, torch.ones_like(scores, dtype=torch.bool))
    assert stats.logit_max.item() == pytest.approx(best, rel=1e-5)
    assert stats.entropy_mean().item() == pytest.approx(entropy, rel=1e-5)
    assert stats.rows.item() == 2 * 3 * 5


def test_sdpa_bool_mask_float_mask_and_causal_leave_masked_entries_out():
    q, k = _qk(lq=6, s=6)
    scores = q.double() @ k.double().transpose(-2, -1) * 0.25
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(2, 1, 6, 6, generator=g) > 0.4
    keep[1, 0, 2] = False  # one query with every key masked: no entropy for it
    # A planted huge logit in a masked place must not be the max.
    k_big = k.clone()
    q_big = q.clone()
    q_big[0, 0, 0] = k_big[0, 0, 1] * 100
    big_scores = q_big.double() @ k_big.double().transpose(-2, -1) * 0.25
    keep[:, :, 0, 1] = False
    best, entropy = reference(big_scores, keep)
    for mask in (keep, torch.zeros(keep.shape).masked_fill(~keep, -math.inf),
                 torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)):
        stats = sdpa_stats(q_big, k_big, attn_mask=mask, scale=0.25)
        assert stats.logit_max.item() == pytest.approx(best, rel=1e-5), mask.dtype
        assert stats.entropy_mean().item() == pytest.approx(entropy, rel=1e-5)
        assert stats.rows.item() == keep.expand(2, 3, 6, 6).any(-1).sum().item()
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    best, entropy = reference(scores, causal)
    stats = sdpa_stats(q, k, is_causal=True, scale=0.25)
    assert (stats.logit_max.item(), stats.entropy_mean().item()) == pytest.approx((best, entropy), rel=1e-5)


def test_sdpa_causal_is_top_left_aligned_for_more_keys_than_queries():
    q, k = _qk(lq=3, s=5)
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(8)
    best, entropy = reference(scores, torch.ones(3, 5, dtype=torch.bool).tril())
    stats = sdpa_stats(q, k, is_causal=True)
    assert (stats.logit_max.item(), stats.entropy_mean().item()) == pytest.approx((best, entropy), rel=1e-5)
    # What SDPA itself computes with is_causal: the same triangle (checked on the output).
    v = torch.randn(2, 3, 5, 4)
    mine = torch.softmax(scores.float().masked_fill(~torch.ones(3, 5, dtype=torch.bool).tril(), -math.inf), -1) @ v
    assert torch.allclose(F.scaled_dot_product_attention(q, k, v, is_causal=True), mine, atol=1e-5)


def test_sdpa_grouped_query_attention_repeats_key_heads():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    scores = q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-2, -1) / math.sqrt(8)
    best, entropy = reference(scores, torch.ones_like(scores, dtype=torch.bool))
    stats = sdpa_stats(q, k, enable_gqa=True)
    assert (stats.logit_max.item(), stats.entropy_mean().item()) == pytest.approx((best, entropy), rel=1e-5)


def test_chunks_give_the_same_values_as_one_block(monkeypatch):
    q, k = _qk(lq=9, s=9)
    keep = torch.rand(2, 3, 9, 9, generator=torch.Generator().manual_seed(2)) > 0.3
    whole = sdpa_stats(q, k, attn_mask=keep)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    whole_softmax = softmax_stats(scores.masked_fill(~keep, torch.finfo(torch.float32).min))
    monkeypatch.setattr(attention_module, "CHUNK_ELEMENTS", 7)  # one query row per chunk
    chunked = sdpa_stats(q, k, attn_mask=keep)
    chunked_softmax = softmax_stats(scores.masked_fill(~keep, torch.finfo(torch.float32).min))
    for a, b in ((whole, chunked), (whole_softmax, chunked_softmax), (whole, whole_softmax)):
        assert a.logit_max.item() == pytest.approx(b.logit_max.item(), rel=1e-6)
        assert a.entropy_mean().item() == pytest.approx(b.entropy_mean().item(), rel=1e-5)
        assert a.rows.item() == b.rows.item()


def test_softmax_input_with_finfo_min_mask_and_a_nan_logit():
    scores = torch.randn(2, 2, 4, 4)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    masked = scores.masked_fill(~causal, torch.finfo(torch.float32).min)
    best, entropy = reference(scores, causal)
    stats = softmax_stats(masked)
    assert (stats.logit_max.item(), stats.entropy_mean().item()) == pytest.approx((best, entropy), rel=1e-5)
    # A NaN logit is not a mask: it shows in the max.
    masked[1, 0, 2, 1] = math.nan
    assert math.isnan(softmax_stats(masked).logit_max.item())


def test_attention_module_rule():
    from torch import nn

    class CausalSelfAttention(nn.Module): ...

    class SelfAttn(nn.Module): ...

    class Gate(nn.Module): ...

    assert is_attention_module(nn.MultiheadAttention(4, 2))
    assert is_attention_module(CausalSelfAttention()) and is_attention_module(SelfAttn())
    assert not is_attention_module(Gate()) and not is_attention_module(nn.Softmax(-1))


def test_output_logits_leave_ignored_rows_out():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, generator=g) * 5
    logits[2, 3] = 1000.0  # a padded row: its huge logit must not count
    target = torch.tensor([1, 2, -100, 4, 5, -100])
    found = cross_entropy_logits((logits, target), {})
    assert found is not None
    stats = logit_stats(*found)
    keep = target != -100
    ref = torch.logsumexp(logits.double()[keep], dim=1)
    assert stats.lse_mean().item() == pytest.approx(ref.mean().item(), rel=1e-6)
    assert stats.absmax.item() == pytest.approx(logits.double()[keep].abs().max().item(), rel=1e-6)
    assert stats.logit_mean().item() == pytest.approx(logits.double()[keep].mean().item(), abs=1e-5)  # of |logits| ~5
    assert stats.rows.item() == 4


def test_output_logits_class_dim_one_of_a_segmentation_input():
    logits = torch.randn(2, 5, 3, 4) * 4  # (N, C, H, W)
    target = torch.randint(0, 5, (2, 3, 4))
    stats = logit_stats(*cross_entropy_logits((logits,), {"target": target}))
    ref = torch.logsumexp(logits.double(), dim=1)
    assert stats.lse_mean().item() == pytest.approx(ref.mean().item(), rel=1e-6)
    assert stats.logit_mean().item() == pytest.approx(logits.double().mean().item(), rel=1e-6, abs=1e-7)
    assert stats.rows.item() == 24


def test_a_call_beyond_the_budget_is_measured_on_evenly_spaced_queries_then_samples(monkeypatch):
    from stabletrain.debug.mechanisms.attention import subset_strides

    q, k = _qk(b=4, h=2, lq=12, s=12)
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(8)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    full = sdpa_stats(q, k, is_causal=True)
    for budget, strides in ((4 * 2 * 12 * 12, (1, 1)), (4 * 2 * 4 * 12, (1, 3)), (2 * 2 * 1 * 12, (2, 12))):
        monkeypatch.setattr(attention_module, "CALL_BUDGET", budget)
        assert subset_strides(4, 8, 12, 12) == strides
        b, s = strides
        best, entropy = reference(scores[::b, :, ::s], causal[::s])
        for stats in (sdpa_stats(q, k, is_causal=True),
                      softmax_stats((q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~causal, -math.inf))):
            assert stats.logit_max.item() == pytest.approx(best, rel=1e-5), strides
            assert stats.entropy_mean().item() == pytest.approx(entropy, rel=1e-5), strides
            assert stats.rows.item() == (4 // b) * 2 * len(range(0, 12, s))
    # Within the budget nothing is left out.
    monkeypatch.setattr(attention_module, "CALL_BUDGET", 1 << 24)
    assert full.rows.item() == 4 * 2 * 12
