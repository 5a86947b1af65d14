"""Tiny Hugging Face models with random weights (no download) and data with planted faults.

Token 63 is the fault: its input-embedding row holds +-1e30 (finite weights), and only the
samples that contain it reach it. The first LayerNorm that sees such a hidden state squares
1e30 past float32's range: its variance is inf and its output NaN, for those samples only.
"""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

BAD_TOKEN = 63


def _plant(embedding: torch.nn.Embedding) -> None:
    with torch.no_grad():
        row = torch.tensor([1e30, -1e30]).repeat(embedding.weight.shape[1] // 2)
        embedding.weight[BAD_TOKEN] = row


def gpt2_config() -> GPT2Config:
    # Untied head: the huge row is reached only by samples holding the token, not by every logit.
    return GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=0)


def causal_lm(planted: bool = True) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config())
    if planted:
        _plant(model.transformer.wte)
    return model


def bert_config() -> BertConfig:
    return BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=16, num_labels=3, pad_token_id=0)


def classifier(planted: bool = True) -> BertForSequenceClassification:
    torch.manual_seed(0)
    model = BertForSequenceClassification(bert_config())
    if planted:
        _plant(model.bert.embeddings.word_embeddings)
    return model


class TokenData(torch.utils.data.Dataset):
    """``n`` random sequences of tokens 1..62; sample ``bad`` also holds token 63 at position 5.
    ``task="lm"``: labels are the inputs; ``"cls"``: one class label per sequence."""

    def __init__(self, n: int = 64, bad: int | None = None, task: str = "lm"):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, BAD_TOKEN, (n, 16), generator=g)
        self.classes = torch.randint(0, 3, (n,), generator=g)
        if bad is not None:
            self.ids[bad, 5] = BAD_TOKEN
        self.task = task

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i] if self.task == "lm" else self.classes[i]
        return {"input_ids": self.ids[i], "labels": labels}


def build_causal_lm():
    """For ``stabletrain replay --model hf_models.py:build_causal_lm``: from the config alone."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(gpt2_config())
