"""Built-in language-model task: a small decoder-only transformer trained on next-token prediction.

Data is a UTF-8 text file, or generated text when ``data`` is omitted. The modules have readable
names (``blocks.{i}.attn.qkv``, ``blocks.{i}.mlp.fc1``, ``head``, ...) so that debugging tools point at
something meaningful. Initial weights depend only on ``settings.seed`` and the architecture.
See docs/training.md.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stabletrain.config import TrainSettings
from stabletrain.data.paths import TEXT_DATA_HINT, data_path_problems
from stabletrain.data.text import (
    BYTE_VOCAB_SIZE,
    TextDataset,
    char_vocabulary,
    encode_bytes,
    encode_chars,
    generate_text,
    num_windows,
)
from stabletrain.tasks.base import Task

__all__ = ["MODEL_NAMES", "TransformerLM", "build", "build_model", "check"]

#: Values of ``settings.model`` this task accepts (None means the default, "transformer").
MODEL_NAMES = ("transformer",)

#: Length of the built-in generated text, in characters (= byte tokens; it is ASCII).
GENERATED_TEXT_CHARS = 200_000

_DATA_HINT = TEXT_DATA_HINT


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with every op written out.

    ``F.scaled_dot_product_attention`` would fuse scores, mask, softmax and the weighted sum
    into one op; spelled out, op-level debugging tools see (and can blame) each step.
    """

    def __init__(self, dim: int, n_heads: int, context_length: int, dropout: float, qk_norm: bool = False):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim ({dim}) must be a multiple of n_heads ({n_heads})")
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        # qk-layernorm (Dehghani et al. 2023): each head's q and k normalised over head_dim, so
        # that q.k / sqrt(head_dim) stays bounded by the gains however large the qkv weights grow.
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else None
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else None
        self.attn_drop = nn.Dropout(dropout)
        self.proj = nn.Linear(dim, dim)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.ones(context_length, context_length, dtype=torch.bool).triu(diagonal=1)
        # Not persistent: derived from context_length, so it stays out of checkpoints.
        self.causal_mask: torch.Tensor
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        # The most negative finite value rather than -inf: softmax gives the same zeros, and
        # tools that flag non-finite activations do not fire on the mask itself.
        scores = scores.masked_fill(self.causal_mask[:T, :T], torch.finfo(scores.dtype).min)
        weights = self.attn_drop(scores.softmax(dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(out))


class MLP(nn.Module):
    """Position-wise feed-forward network: fc1 -> GELU -> fc2 -> dropout."""

    def __init__(self, dim: int, dropout: float, expansion: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(dim, expansion * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(expansion * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, dim: int, n_heads: int, context_length: int, dropout: float, qk_norm: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads, context_length, dropout, qk_norm)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """A small GPT-style decoder-only transformer with learnt position embeddings.

    Args:
        vocab_size: Number of token ids.
        n_layers: Transformer blocks.
        n_heads: Attention heads per block; must divide ``dim``.
        dim: Embedding width.
        context_length: Longest sequence the position embedding covers.
        dropout: Dropout after the embeddings, on attention weights and on residual branches.
        qk_norm: LayerNorm of each head's queries and keys before their dot product.
        z_loss: Weight of PaLM's z-loss, ``z_loss * mean(logsumexp(logits)**2)``, added to the loss.

    Example::

        model = TransformerLM(vocab_size=256, n_layers=2, n_heads=4, dim=64, context_length=32)
        batch = {"input_ids": torch.randint(256, (8, 32)), "labels": torch.randint(256, (8, 32))}
        loss = model.training_step(batch)
    """

    def __init__(
        self,
        vocab_size: int,
        n_layers: int,
        n_heads: int,
        dim: int,
        context_length: int,
        dropout: float = 0.0,
        qk_norm: bool = False,
        z_loss: float = 0.0,
    ):
        super().__init__()
        if z_loss < 0:
            raise ValueError(f"z_loss must be >= 0, got {z_loss} (0 turns it off; PaLM used 1e-4)")
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.z_loss = z_loss
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(context_length, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, n_heads, context_length, dropout, qk_norm) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        # GPT-2 scheme: N(0, 0.02) everywhere, residual output projections shrunk by
        # 1/sqrt(2 * n_layers) so the residual stream's variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            assert isinstance(block, Block)
            for proj in (block.attn.proj, block.mlp.fc2):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits of shape ``(batch, time, vocab_size)`` for ``(batch, time)`` ids."""
        T = input_ids.shape[1]
        if T > self.context_length:
            raise ValueError(f"sequence length {T} exceeds context_length {self.context_length}")
        pos = torch.arange(T, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy of ``{"input_ids": (B, T), "labels": (B, T)}``, plus
        ``z_loss * mean(logsumexp(logits)**2)`` over the same positions when ``z_loss`` > 0."""
        logits = self(batch["input_ids"])
        # The loss in fp32 whatever the precision: a bf16/fp16 log-softmax over the
        # vocabulary loses most of its digits, an instability of its own.
        flat = logits.flatten(0, 1).float()
        loss = F.cross_entropy(flat, batch["labels"].flatten())
        if self.z_loss:
            # PaLM's z-loss pulls the log-partition toward 0, so the logits cannot drift together.
            loss = loss + self.z_loss * torch.logsumexp(flat, dim=-1).square().mean()
        return loss


# --------------------------------------------------------------------------------------
# Settings checks
# --------------------------------------------------------------------------------------


def _data_path(data: Any) -> Path | None:
    return Path(data) if isinstance(data, (str, os.PathLike)) else None


def check(settings: TrainSettings) -> list[str]:
    """Every problem with the language-model settings, one line each; [] when all is well.

    Checks the model name, that ``model_args.dim`` is a multiple of ``model_args.n_heads``,
    and that ``data`` is a readable file holding at least one window of
    ``context_length + 1`` tokens under the chosen tokenizer.
    """
    args = settings.model_args
    problems = []
    if settings.model is not None and settings.model not in MODEL_NAMES:
        valid = ", ".join(repr(n) for n in MODEL_NAMES)
        problems.append(
            f"model: unknown language model {settings.model!r} (valid: {valid}, or omit it; "
            "image models are 'cnn' and 'torchvision/<name>' with task='image_classification')"
        )
    if args.dim % args.n_heads:
        lower = args.dim - args.dim % args.n_heads
        upper = lower + args.n_heads
        nearest = f"{lower} or {upper}" if lower > 0 else str(upper)
        problems.append(
            f"model_args.dim: {args.dim} is not a multiple of model_args.n_heads={args.n_heads} "
            f"(use e.g. dim={nearest}, or an n_heads that divides {args.dim})"
        )
    needed = args.context_length + 1
    if settings.data is None:
        if GENERATED_TEXT_CHARS < needed:
            problems.append(
                f"model_args.context_length: {args.context_length} is too long for the built-in text "
                f"({GENERATED_TEXT_CHARS} tokens, one sample needs {needed}); give a longer text file as data"
            )
        return problems
    path = _data_path(settings.data)
    if path is None:
        problems.append(
            f"data: the language model task reads a text file path, got a {type(settings.data).__name__} "
            "(to train on your own Dataset, pass model=<nn.Module with training_step> as well)"
        )
        return problems
    missing = data_path_problems("language_model", path)
    problems.extend(missing or _check_text_file(path, args.tokenizer, needed))
    return problems


def _count_tokens(path: Path, tokenizer: str) -> int:
    """Tokens of the text file under ``tokenizer`` (bytes, or UTF-8 characters), without
    encoding them. Raises OSError or UnicodeDecodeError."""
    if tokenizer == "byte":
        return path.stat().st_size
    return len(path.read_bytes().decode("utf-8"))


def _check_text_file(path: Path, tokenizer: str, needed: int) -> list[str]:
    try:
        num_tokens = _count_tokens(path, tokenizer)
    except OSError as exc:
        return [f"data: cannot read {path}: {exc} ({_DATA_HINT})"]
    except UnicodeDecodeError as exc:
        return [
            f"data: {path} is not valid UTF-8 (byte {exc.start}: {exc.reason}); the char tokenizer "
            "needs UTF-8 text (model_args.tokenizer='byte' accepts any bytes)"
        ]
    if tokenizer != "byte" and not num_tokens:
        return [f"data: {path} is empty; the char tokenizer needs a non-empty UTF-8 text file"]
    if num_tokens < needed:
        unit = "bytes" if tokenizer == "byte" else "characters"
        return [
            f"data: {path} is too short: {num_tokens} tokens ({unit}, model_args.tokenizer={tokenizer!r}), "
            f"one sample needs model_args.context_length + 1 = {needed}; "
            "give a longer file or lower model_args.context_length"
        ]
    return []


def num_samples(settings: TrainSettings) -> int:
    """Training windows the settings' data gives (``len`` of the dataset :func:`build` makes),
    without building it. Call :func:`check` first: the data must be readable.
    """
    args = settings.model_args
    if settings.data is None:
        text = generate_text(GENERATED_TEXT_CHARS)
        num_tokens = len(text.encode("utf-8")) if args.tokenizer == "byte" else len(text)
    else:
        num_tokens = _count_tokens(Path(settings.data), args.tokenizer)
    return num_windows(num_tokens, args.context_length)


# --------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------


def _load_tokens(settings: TrainSettings) -> tuple[torch.Tensor, dict[str, Any]]:
    """Token stream and model_meta for the settings' data and tokenizer."""
    tokenizer = settings.model_args.tokenizer
    if settings.data is None:
        raw: str | bytes = generate_text(GENERATED_TEXT_CHARS)
    else:
        path = _data_path(settings.data)
        if path is None:
            raise ValueError(f"data: expected a text file path, got {type(settings.data).__name__}")
        raw = path.read_bytes()
    if tokenizer == "byte":
        return encode_bytes(raw), {"tokenizer": "byte", "vocab_size": BYTE_VOCAB_SIZE}
    text = raw if isinstance(raw, str) else raw.decode("utf-8")
    vocab = char_vocabulary(text)
    return encode_chars(text, vocab), {"tokenizer": "char", "vocab_size": len(vocab), "vocab": vocab}


def build(settings: TrainSettings) -> Task:
    """The language-model task: model, window dataset and ``model_meta``.

    ``model_meta`` holds ``tokenizer``, ``vocab_size`` and, for the char tokenizer, ``vocab``
    (the vocabulary string; token ``i`` is ``vocab[i]``). Call :func:`check` first for
    readable errors.

    Example::

        task = build(TrainSettings(out="out/x"))
        batch = torch.utils.data.default_collate([task.dataset[0], task.dataset[1]])
        loss = task.model.training_step(batch)
    """
    tokens, meta = _load_tokens(settings)
    dataset = TextDataset(tokens, settings.model_args.context_length)
    return Task(
        name="language_model", model=build_model(settings, meta), dataset=dataset, model_meta=meta, in_memory=True
    )


def build_model(settings: TrainSettings, model_meta: dict[str, Any]) -> nn.Module:
    """The same freshly initialised model as :func:`build` makes, without reading the data.

    Args:
        settings: The run's settings (architecture from ``model_args``, weights from ``seed``).
        model_meta: ``Task.model_meta`` of the run, for the vocabulary size.

    Raises:
        ValueError: ``model_meta`` is from a run with a different tokenizer.
    """
    args = settings.model_args
    meta_tokenizer = model_meta.get("tokenizer", args.tokenizer)
    if meta_tokenizer != args.tokenizer:
        raise ValueError(
            f"model_meta was made with tokenizer={meta_tokenizer!r} but model_args.tokenizer={args.tokenizer!r}"
        )
    if args.tokenizer == "char" and "vocab_size" not in model_meta:
        raise ValueError("model_meta lacks vocab_size, which the char tokenizer needs (use the run's Task.model_meta)")
    vocab_size = int(model_meta.get("vocab_size", BYTE_VOCAB_SIZE))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        return TransformerLM(
            vocab_size=vocab_size,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            dim=args.dim,
            context_length=args.context_length,
            dropout=args.dropout,
            qk_norm=args.qk_norm,
            z_loss=args.z_loss,
        )
