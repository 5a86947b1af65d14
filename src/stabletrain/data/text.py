"""Text data for the language-model task: generated text, tokenizers and a window dataset.

Two tokenizers are built in:

* **byte**: the UTF-8 bytes of the text; the vocabulary is always the 256 byte values, so a
  model can be rebuilt from the settings alone.
* **char**: one token per Unicode character; the vocabulary is the sorted set of characters
  that occur in the text. The vocabulary string must travel with the model (the task puts
  it in ``model_meta["vocab"]``) to rebuild the same embedding table without the file.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "BYTE_VOCAB_SIZE",
    "TextDataset",
    "char_vocabulary",
    "decode_bytes",
    "decode_chars",
    "encode_bytes",
    "encode_chars",
    "generate_text",
]

#: Vocabulary size of the byte-level tokenizer.
BYTE_VOCAB_SIZE = 256

# --------------------------------------------------------------------------------------
# Generated text
# --------------------------------------------------------------------------------------

_SINGULAR = (
    "the cat", "the dog", "a small bird", "the old man", "my sister", "the teacher",
    "a farmer", "the little girl", "our neighbour", "the baker", "the captain", "a tall boy",
)  # fmt: skip
_PLURAL = (
    "the cats", "two dogs", "the children", "my parents", "the farmers", "some birds",
    "the students", "our friends", "the sailors", "three girls",
)  # fmt: skip
# (base form, third person singular)
_VERBS = (
    ("see", "sees"), ("like", "likes"), ("find", "finds"), ("carry", "carries"),
    ("watch", "watches"), ("want", "wants"), ("paint", "paints"), ("follow", "follows"),
    ("bring", "brings"), ("clean", "cleans"), ("open", "opens"), ("hide", "hides"),
)  # fmt: skip
_OBJECTS = (
    "the red ball", "a green apple", "the small box", "an old book", "the blue door",
    "a warm coat", "the long rope", "some fresh bread", "the yellow kite", "a wooden chair",
    "the black hat", "a letter",
)  # fmt: skip
_PLACES = (
    "in the garden", "near the river", "at the market", "under the bridge", "on the hill",
    "in the kitchen", "by the sea", "at school", "behind the house", "in the forest",
)  # fmt: skip
_TIMES = ("Every morning", "Today", "At night", "On Sunday", "In the summer", "After lunch", "Sometimes")
_ADJECTIVES = ("happy", "tired", "quiet", "hungry", "busy", "kind", "late", "cold")
_GREETINGS = ("Good morning", "Hello", "Look at that", "Come here", "Thank you", "Good night")
_NUMBERS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_PLURAL_NOUNS = ("apples", "boats", "trees", "houses", "birds", "stones", "books", "cups")


def _subject(rng: random.Random) -> tuple[str, bool]:
    """A noun phrase and whether it is singular."""
    if rng.random() < 0.6:
        return rng.choice(_SINGULAR), True
    return rng.choice(_PLURAL), False


def _verb(rng: random.Random, singular: bool) -> str:
    base, third = rng.choice(_VERBS)
    return third if singular else base


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(7)
    subj, sing = _subject(rng)
    if kind == 0:
        text = f"{subj} {_verb(rng, sing)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
    elif kind == 1:
        text = f"{rng.choice(_TIMES)}, {subj} {_verb(rng, sing)} {rng.choice(_OBJECTS)}."
    elif kind == 2:
        aux = "Does" if sing else "Do"
        return f"{aux} {subj} {rng.choice(_VERBS)[0]} {rng.choice(_OBJECTS)}?"
    elif kind == 3:
        be = "is" if sing else "are"
        text = f"{subj} {be} {rng.choice(_ADJECTIVES)} and {_verb(rng, sing)} {rng.choice(_OBJECTS)}."
    elif kind == 4:
        speaker = rng.choice(_SINGULAR)
        return f'"{rng.choice(_GREETINGS)}!" says {speaker}.'
    elif kind == 5:
        subj2, sing2 = _subject(rng)
        text = (
            f"{subj} {_verb(rng, sing)} {rng.choice(_OBJECTS)}, "
            f"but {subj2} {_verb(rng, sing2)} {rng.choice(_OBJECTS)}."
        )
    else:
        text = f"There are {rng.choice(_NUMBERS)} {rng.choice(_PLURAL_NOUNS)} {rng.choice(_PLACES)}."
    return text[0].upper() + text[1:]


def generate_text(num_chars: int = 200_000, seed: int = 1234) -> str:
    """Deterministic English-like text with learnable structure.

    Sentences are drawn from a few templates over small word lists, with subject-verb
    agreement, questions, quoted speech and punctuation, grouped into lines of 3 to 6
    sentences. A small byte-level transformer brings its loss from ln(256) ~ 5.5 to about
    1 nat per byte within a few hundred steps. All characters are ASCII.

    Args:
        num_chars: Exact length of the returned text.
        seed: Seed of a private ``random.Random``; the global RNGs are not touched.

    Returns:
        The text, ``num_chars`` characters long.

    Example::

        text = generate_text(1000)
        assert text == generate_text(1000) and len(text) == 1000
    """
    if num_chars < 0:
        raise ValueError(f"num_chars must be >= 0, got {num_chars}")
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < num_chars:
        line = " ".join(_sentence(rng) for _ in range(rng.randint(3, 6))) + "\n"
        parts.append(line)
        total += len(line)
    return "".join(parts)[:num_chars]


# --------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------


def encode_bytes(data: str | bytes) -> torch.Tensor:
    """Byte-level tokens: the UTF-8 bytes of ``data`` as a 1-D LongTensor (values 0..255).

    Args:
        data: Text (encoded as UTF-8) or raw bytes.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))


def decode_bytes(tokens: torch.Tensor | list[int]) -> str:
    """Text from byte-level tokens; invalid UTF-8 sequences become U+FFFD."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return bytes(values).decode("utf-8", errors="replace")


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def char_vocabulary(text: str) -> str:
    """The character-level vocabulary of ``text``: its distinct characters, sorted.

    Token ``i`` is ``vocab[i]``. Sorting by code point makes the vocabulary depend only on
    the set of characters, not on their order of appearance.
    """
    return "".join(chr(c) for c in np.unique(_code_points(text)).tolist())


def encode_chars(text: str, vocab: str) -> torch.Tensor:
    """Character-level tokens of ``text`` under ``vocab`` (see :func:`char_vocabulary`).

    Args:
        text: The text to encode.
        vocab: Sorted vocabulary string, as returned by :func:`char_vocabulary`.

    Raises:
        ValueError: A character of ``text`` is not in ``vocab``, or ``vocab`` is not sorted
            and free of duplicates.
    """
    table = _code_points(vocab)
    if len(table) > 1 and not bool(np.all(table[1:] > table[:-1])):
        raise ValueError("vocab must be sorted and free of duplicates, as char_vocabulary() returns it")
    points = _code_points(text)
    if len(table) == 0:
        if len(points):
            raise ValueError(f"character {text[0]!r} is not in the (empty) vocabulary")
        return torch.zeros(0, dtype=torch.long)
    ids = np.searchsorted(table, points)
    ids_clipped = np.minimum(ids, len(table) - 1)
    unknown = table[ids_clipped] != points
    if bool(unknown.any()):
        missing = sorted({chr(c) for c in points[unknown][:1000].tolist()})
        raise ValueError(f"characters not in the vocabulary: {''.join(missing)!r}")
    return torch.from_numpy(ids_clipped.astype(np.int64))


def decode_chars(tokens: torch.Tensor | list[int], vocab: str) -> str:
    """Text from character-level tokens under ``vocab``."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return "".join(vocab[i] for i in values)


# --------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------


def num_windows(num_tokens: int, context_length: int) -> int:
    """How many samples :class:`TextDataset` makes of ``num_tokens`` tokens (windows of
    ``context_length + 1`` tokens sharing one boundary token)."""
    return max(0, (num_tokens - 1) // context_length)


class TextDataset(Dataset):
    """Non-overlapping windows of a token stream for next-token prediction.

    Window ``i`` covers tokens ``[i*T, i*T + T]`` (``T + 1`` tokens): ``input_ids`` are the
    first ``T``, ``labels`` the last ``T``, so ``labels[t]`` is the token after
    ``input_ids[t]``. Consecutive windows share one boundary token, so every token except
    the very first is predicted exactly once per epoch.

    Args:
        tokens: 1-D integer tensor of token ids.
        context_length: ``T``, tokens per sample.

    Example::

        ds = TextDataset(encode_bytes("hello world"), context_length=4)
        len(ds)  # 2 == (11 - 1) // 4
        ds[0]["input_ids"], ds[0]["labels"]  # "hell", "ello" as bytes
    """

    def __init__(self, tokens: torch.Tensor, context_length: int):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {context_length}")
        self.tokens = tokens.long()
        self.context_length = context_length

    def __len__(self) -> int:
        return num_windows(len(self.tokens), self.context_length)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"window {index} out of range for {n} windows")
        start = index * self.context_length
        # clone: a view would keep (and, across DataLoader workers, send) the whole stream.
        window = self.tokens[start : start + self.context_length + 1].clone()
        return {"input_ids": window[:-1], "labels": window[1:]}
