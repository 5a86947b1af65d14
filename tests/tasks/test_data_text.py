"""Generated text, tokenizers and the window dataset."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import default_collate

from stabletrain.data.text import (
    TextDataset,
    char_vocabulary,
    decode_bytes,
    decode_chars,
    encode_bytes,
    encode_chars,
    generate_text,
)


def test_generate_text_is_deterministic_and_exact_length():
    a = generate_text(5000, seed=7)
    assert a == generate_text(5000, seed=7)
    assert len(a) == 5000
    assert a != generate_text(5000, seed=8)
    assert generate_text(0) == ""


def test_generate_text_looks_like_english_sentences():
    text = generate_text(20_000)
    assert text.isascii()
    lines = text.splitlines()
    assert len(lines) > 50
    # Every full line is sentences ending in punctuation, starting with a capital or a quote.
    for line in lines[:-1]:
        assert line[-1] in ".?", line
        assert line[0].isupper() or line[0] == '"', line
    # Structure a model can learn: subject-verb agreement.
    assert re.search(r"\bthe children (?:see|like|find|want|paint)\b", text, re.IGNORECASE)
    assert not re.search(r"\bthe children (?:sees|likes|finds|wants|paints)\b", text, re.IGNORECASE)
    assert re.search(r"\bthe cat (?:sees|likes|finds|wants|paints)\b", text, re.IGNORECASE)
    assert not re.search(r"\bDoes (?:the children|my parents)\b", text)


def test_text_dataset_windows_and_shifted_labels():
    ds = TextDataset(torch.arange(10), context_length=3)
    assert len(ds) == 3  # (10 - 1) // 3 full windows of 3 inputs + 1 label
    first = ds[0]
    assert first["input_ids"].tolist() == [0, 1, 2]
    assert first["labels"].tolist() == [1, 2, 3]
    assert ds[2]["input_ids"].tolist() == [6, 7, 8]
    assert ds[2]["labels"].tolist() == [7, 8, 9]
    assert ds[-1]["input_ids"].tolist() == [6, 7, 8]
    assert first["input_ids"].dtype == torch.long
    with pytest.raises(IndexError):
        ds[3]
    batch = default_collate([ds[0], ds[1]])
    assert batch["input_ids"].shape == (2, 3) and batch["labels"].shape == (2, 3)


def test_text_dataset_too_short_has_no_windows():
    assert len(TextDataset(torch.arange(3), context_length=3)) == 0
    assert len(TextDataset(torch.arange(4), context_length=3)) == 1


def test_text_dataset_items_do_not_alias_the_stream():
    tokens = torch.arange(10)
    item = TextDataset(tokens, context_length=3)[0]
    item["input_ids"][0] = 99
    assert tokens[0] == 0


def test_byte_tokens_round_trip_non_ascii():
    text = "héllo ✓\n"
    ids = encode_bytes(text)
    assert ids.dtype == torch.long
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert int(ids.max()) < 256
    assert decode_bytes(ids) == text
    assert torch.equal(encode_bytes(text.encode("utf-8")), ids)


def test_char_vocabulary_round_trip():
    text = "ba ✓c\nab"
    vocab = char_vocabulary(text)
    assert vocab == "".join(sorted(set(text)))
    ids = encode_chars(text, vocab)
    assert ids.tolist() == [vocab.index(c) for c in text]
    assert decode_chars(ids, vocab) == text
    assert encode_chars("", vocab).tolist() == []


def test_encode_chars_names_unknown_characters():
    with pytest.raises(ValueError, match="'z'"):
        encode_chars("abz", char_vocabulary("ab"))
    with pytest.raises(ValueError, match="sorted"):
        encode_chars("ab", "ba")
