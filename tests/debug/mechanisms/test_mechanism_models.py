"""The signals on code nobody here wrote: Hugging Face GPT-2, Llama and BERT in sdpa and eager
attention, and ``nn.MultiheadAttention`` with and without ``need_weights``. Each value is
checked against a float64 computation on the same weights and batch."""

from __future__ import annotations

import math

import pytest
import real_models as rm
import torch
import torch.nn.functional as F
from torch import nn

from stabletrain import MechanismMonitor

pytest.importorskip("transformers")

CAUSAL = {"gpt2": True, "llama": True, "bert": False}
LAYER = {"gpt2": "transformer.h.{}.attn", "llama": "model.layers.{}.self_attn",
         "bert": "bert.encoder.layer.{}.attention.self"}


def entropy_and_max(scores: torch.Tensor, valid: torch.Tensor) -> tuple[float, float]:
    """float64: max over valid entries; mean entropy of the softmax over each query's valid keys."""
    x = scores.double().masked_fill(~valid, -math.inf)
    p = torch.softmax(x, dim=-1)
    plogp = torch.where(valid, p * torch.log(p), torch.zeros((), dtype=torch.float64))
    return x.max().item(), (-plogp.sum(-1)).mean().item()


def float64_attention(model: nn.Module, kind: str, batch: dict) -> list[tuple[float, float]]:
    """(max logit, mean entropy) per layer: the scores the float64 eager model hands its
    softmax, with the masks rebuilt from the batch (causal and/or key padding)."""
    ref = rm._hf(kind, "eager")
    ref.load_state_dict(model.state_dict())
    ref.double()
    seen: list[torch.Tensor] = []
    original = F.softmax

    def recording(x, *args, **kwargs):
        if x.ndim == 4:
            seen.append(x.detach().clone())
        return original(x, *args, **kwargs)

    F.softmax = recording  # HF's eager attention calls nn.functional.softmax
    try:
        with torch.no_grad():
            ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        F.softmax = original
    keys_kept = batch["attention_mask"].bool()[:, None, None, :]
    t = batch["input_ids"].shape[1]
    valid = keys_kept & (torch.ones(t, t, dtype=torch.bool).tril() if CAUSAL[kind] else True)
    # Padded queries of the causal models still see their earlier keys; none has zero valid keys.
    assert valid.any(-1).all()
    return [entropy_and_max(scores, valid.expand_as(scores)) for scores in seen]


def float64_logits(model: nn.Module, kind: str, batch: dict) -> tuple[float, float]:
    ref = rm._hf(kind, "eager")
    ref.load_state_dict(model.state_dict())
    ref.double()
    with torch.no_grad():
        logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if kind == "bert":
        rows = logits
    else:  # causal LM loss: position t predicts label t+1; -100 (padding) and the last position left out
        labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        rows = logits.reshape(-1, logits.shape[-1])[labels.reshape(-1) != -100]
    return torch.logsumexp(rows, dim=-1).mean().item(), rows.abs().max().item()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_hugging_face_attention_and_output_logits_against_float64(kind, attn):
    model = rm._hf(kind, attn)
    batch = rm._tokens("none", "classes" if kind == "bert" else "tokens")
    with torch.no_grad():  # larger weights than the init, so the values are not all near 0
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight", "query.weight", "key.weight")):
                p.mul_(8)
    expected_attention = float64_attention(model, kind, batch)
    expected_logits = float64_logits(model, kind, batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with MechanismMonitor(model, optimizer, report=lambda n: pytest.fail(n.text)) as monitor:
        monitor.begin_step(log=True)
        loss = rm.lm_step(model, batch)
        loss.backward()
        optimizer.step()
        monitor.after_step()
        values = monitor.values()
    assert len(expected_attention) == 2
    for layer, (best, entropy) in enumerate(expected_attention):
        name = LAYER[kind].format(layer)
        assert values[f"signals/attn_logit_max/{name}"] == pytest.approx(best, rel=1e-4), name
        assert values[f"signals/attn_entropy/{name}"] == pytest.approx(entropy, rel=1e-4), name
    assert values["signals/attn_logit_max"] == pytest.approx(max(b for b, _ in expected_attention), rel=1e-4)
    assert values["signals/attn_entropy_min"] == pytest.approx(min(e for _, e in expected_attention), rel=1e-4)
    assert values["signals/output_logsumexp"] == pytest.approx(expected_logits[0], rel=1e-5)
    assert values["signals/output_logit_absmax"] == pytest.approx(expected_logits[1], rel=1e-5)
    assert max(b for b, _ in expected_attention) > 1.0  # the scaled weights give logits well away from 0


class Pool(nn.Module):
    """Attention pooling by ``nn.MultiheadAttention`` over padded sequences, then a classifier."""

    def __init__(self, need_weights: bool):
        super().__init__()
        torch.manual_seed(0)
        self.need_weights = need_weights
        self.query = nn.Parameter(torch.randn(1, 3, 16))
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x, pad):
        q = self.query.expand(len(x), -1, -1)
        out, _ = self.mha(q, x, x, key_padding_mask=pad, need_weights=self.need_weights)
        return self.head(out.mean(1))


def mha_float64(pool: Pool, x: torch.Tensor, pad: torch.Tensor) -> tuple[float, float]:
    mha = pool.mha
    w, b = mha.in_proj_weight.double(), mha.in_proj_bias.double()
    q = pool.query.double().expand(len(x), -1, -1) @ w[:16].T + b[:16]
    k = x.double() @ w[16:32].T + b[16:32]

    def heads(t):
        return t.reshape(t.shape[0], t.shape[1], 4, 4).transpose(1, 2)

    scores = heads(q) @ heads(k).transpose(-2, -1) / 2.0  # head_dim 4
    valid = ~pad[:, None, None, :].expand_as(scores)
    return entropy_and_max(scores, valid)


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_against_float64(need_weights):
    pool = Pool(need_weights)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 16, generator=g) * 3
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[0, 4:] = True
    pad[2, 1:] = True
    x[0, 5] = 1e3  # a padded position with a huge key: masked, so not the max
    best, entropy = mha_float64(pool, x, pad)
    with MechanismMonitor(pool, report=lambda n: None) as monitor:
        monitor.begin_step(log=True)
        loss = F.cross_entropy(pool(x, pad), torch.tensor([0, 1, 2, 3]))
        loss.backward()
        monitor.after_step()
        values = monitor.values()
    assert values["signals/attn_logit_max/mha"] == pytest.approx(best, rel=1e-5)
    assert values["signals/attn_entropy/mha"] == pytest.approx(entropy, rel=1e-5)
    assert [n.keys for n in monitor.notices] == [
        "signals/weight_rms/*, signals/update_rms/*, signals/update_rms_max, signals/update_rms_argmax, "
        "signals/adam_eps_fraction"]
