"""The built-in language-model task: checks, building, rebuilding and the model itself."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset, default_collate

from stabletrain.config import TrainSettings
from stabletrain.data.text import decode_chars
from stabletrain.tasks import check_task, language_model

TINY = {"n_layers": 1, "n_heads": 2, "dim": 32, "context_length": 16, "dropout": 0.0}


def settings(tmp_path: Path, **kw: Any) -> TrainSettings:
    model_args = {**TINY, **kw.pop("model_args", {})}
    return TrainSettings(out=tmp_path / "out", model_args=model_args, **kw)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --------------------------------------------------------------------------------------
# build / build_model
# --------------------------------------------------------------------------------------


def test_build_default_generated_text(tmp_path: Path):
    task = language_model.build(settings(tmp_path))
    assert task.name == "language_model" and task.in_memory
    assert task.model_meta == {"tokenizer": "byte", "vocab_size": 256}
    assert len(task.dataset) == (200_000 - 1) // 16
    item = task.dataset[0]
    assert item["input_ids"].shape == (16,) and torch.equal(item["input_ids"][1:], item["labels"][:-1])
    names = dict(task.model.named_modules())
    for name in ("tok_emb", "pos_emb", "blocks.0.ln1", "blocks.0.attn.qkv", "blocks.0.attn.proj",
                 "blocks.0.ln2", "blocks.0.mlp.fc1", "blocks.0.mlp.act", "blocks.0.mlp.fc2", "ln_f", "head"):  # fmt: skip
        assert name in names, name
    assert isinstance(names["blocks.0.mlp.act"], torch.nn.GELU)


def test_build_and_build_model_give_identical_weights_for_the_seed(tmp_path: Path):
    s = settings(tmp_path, seed=5)
    task = language_model.build(s)
    rebuilt = language_model.build_model(s, task.model_meta)
    assert same_weights(task.model, rebuilt)
    other = language_model.build_model(settings(tmp_path, seed=6), task.model_meta)
    assert not same_weights(task.model, other)


def test_building_leaves_the_global_rng_alone(tmp_path: Path):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    language_model.build(settings(tmp_path))
    assert torch.equal(state, torch.get_rng_state())


def test_char_tokenizer_meta_rebuilds_without_the_file(tmp_path: Path):
    text = "hello world, héllo wörld!\n" * 10
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    s = settings(tmp_path, data=str(path), model_args={"tokenizer": "char"})
    task = language_model.build(s)
    vocab = "".join(sorted(set(text)))
    assert task.model_meta == {"tokenizer": "char", "vocab_size": len(vocab), "vocab": vocab}
    assert task.model.tok_emb.num_embeddings == len(vocab)
    item = task.dataset[0]
    assert decode_chars(item["input_ids"], vocab) == text[:16]
    assert decode_chars(item["labels"], vocab) == text[1:17]
    path.unlink()
    assert same_weights(task.model, language_model.build_model(s, task.model_meta))


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


def test_attention_is_causal(tmp_path: Path):
    model = language_model.build(settings(tmp_path)).model.eval()
    ids = torch.randint(256, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert a.shape == (1, 16, 256)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.nonfinite: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        self.ops.append(name)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                self.nonfinite.append(name)
        return out


def test_attention_ops_are_visible_and_finite(tmp_path: Path):
    model = language_model.build(settings(tmp_path)).model
    ids = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.roll(-1, dims=1)}
    with _RecordOps() as rec:
        model.training_step(batch).backward()
    # Spelled out rather than fused, so op-level tools can blame each step.
    assert "_softmax" in rec.ops and "masked_fill" in rec.ops
    assert not any("scaled_dot_product" in op for op in rec.ops)
    # The causal mask uses a finite fill: no op of forward or backward produces inf or NaN.
    assert rec.nonfinite == []


def test_forward_rejects_sequences_longer_than_context(tmp_path: Path):
    model = language_model.build(settings(tmp_path)).model
    try:
        model(torch.zeros(1, 17, dtype=torch.long))
    except ValueError as exc:
        assert "context_length 16" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_a_few_steps_reduce_the_loss(tmp_path: Path):
    task = language_model.build(settings(tmp_path, seed=1))
    model = task.model
    batch = default_collate([task.dataset[i] for i in range(16)])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model.training_step(batch)
    assert first.dim() == 0 and abs(first.item() - math.log(256)) < 0.3
    for _ in range(30):
        loss = model.training_step(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model.training_step(batch).item() < first.item() - 1.5


# --------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------


def test_check_accepts_defaults_and_a_good_file(tmp_path: Path):
    assert language_model.check(settings(tmp_path)) == []
    path = tmp_path / "t.txt"
    path.write_text("x" * 17)
    assert language_model.check(settings(tmp_path, data=str(path))) == []
    assert language_model.check(settings(tmp_path, data=path, model="transformer")) == []


def test_check_unknown_model_lists_valid_names(tmp_path: Path):
    (problem,) = language_model.check(settings(tmp_path, model="gpt", task="language_model"))
    assert problem.startswith("model: unknown language model 'gpt'") and "'transformer'" in problem


@pytest.mark.parametrize("task", [None, "language_model", "image_classification"])
@pytest.mark.parametrize("model, cls", [("own.py:MLP", "MLP"), ("pkg.models:Net", "Net"), ("own.py", "MyModel")])
def test_a_model_named_by_its_code_is_sent_to_python_not_to_another_task(tmp_path: Path, model, cls, task):
    # (the tiny language-model args are foreign to the image task: those lines are not looked at here)
    (problem,) = [p for p in check_task(settings(tmp_path, model=model, task=task)) if p.startswith("model:")]
    assert problem.startswith(f"model: {model!r} names your own code, but model= takes a built-in model's name")
    assert f"stabletrain.train(out=..., model={cls}(), data=<your map-style Dataset>)" in problem
    assert "image_classification" not in problem and "unknown" not in problem
    # Built-in names are not taken for code.
    assert check_task(settings(tmp_path, model="transformer")) == []


def test_check_dim_not_multiple_of_heads(tmp_path: Path):
    (problem,) = language_model.check(settings(tmp_path, model_args={"dim": 30, "n_heads": 4}))
    assert problem.startswith("model_args.dim: 30 is not a multiple of model_args.n_heads=4")
    assert "28 or 32" in problem


def test_check_missing_file_and_directory(tmp_path: Path):
    missing = tmp_path / "nope.txt"
    (problem,) = language_model.check(settings(tmp_path, data=str(missing)))
    assert problem == (
        f"data: file not found: {missing} (give a UTF-8 text file, or omit data for the built-in generated text)"
    )
    (problem,) = language_model.check(settings(tmp_path, data=str(tmp_path)))
    assert problem.startswith(f"data: {tmp_path} is a directory") and "model='cnn'" in problem


def test_check_file_too_short_says_how_many_tokens(tmp_path: Path):
    path = tmp_path / "short.txt"
    path.write_text("héllo")  # 6 bytes, 5 characters
    (problem,) = language_model.check(settings(tmp_path, data=str(path)))
    assert "too short: 6 tokens" in problem and "context_length + 1 = 17" in problem
    (problem,) = language_model.check(settings(tmp_path, data=str(path), model_args={"tokenizer": "char"}))
    assert "too short: 5 tokens" in problem


def test_check_char_tokenizer_empty_and_invalid_utf8(tmp_path: Path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    (problem,) = language_model.check(settings(tmp_path, data=str(empty), model_args={"tokenizer": "char"}))
    assert problem == f"data: {empty} is empty; the char tokenizer needs a non-empty UTF-8 text file"
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"abc\xff" * 10)
    (problem,) = language_model.check(settings(tmp_path, data=str(binary), model_args={"tokenizer": "char"}))
    assert "not valid UTF-8 (byte 3" in problem
    # Bytes need no decoding.
    assert language_model.check(settings(tmp_path, data=str(binary))) == []


def test_check_reports_every_problem_at_once(tmp_path: Path):
    problems = language_model.check(
        settings(tmp_path, model="gpt", data=str(tmp_path / "nope"), model_args={"dim": 30, "n_heads": 4})
    )
    assert [p.split(":")[0] for p in problems] == ["model", "model_args.dim", "data"]


def test_check_a_dataset_object_needs_a_custom_model(tmp_path: Path):
    s = settings(tmp_path, data=TensorDataset(torch.zeros(4)), task="language_model")
    (problem,) = check_task(s)
    assert problem.startswith("data: the language model task reads a text file path, got a TensorDataset")


def test_num_samples_is_the_built_datasets_length(tmp_path: Path):
    ascii_file = tmp_path / "a.txt"
    ascii_file.write_text("hello world " * 20)
    utf8_file = tmp_path / "u.txt"
    utf8_file.write_text("héllo wörld ✓ " * 20, encoding="utf-8")  # bytes and characters differ
    cases = [
        settings(tmp_path),
        settings(tmp_path, model_args={"tokenizer": "char"}),
        settings(tmp_path, data=str(ascii_file)),
        settings(tmp_path, data=str(utf8_file)),
        settings(tmp_path, data=str(utf8_file), model_args={"tokenizer": "char"}),
    ]
    counts = [language_model.num_samples(s) for s in cases]
    assert counts == [len(language_model.build(s).dataset) for s in cases]
    assert counts[3] != counts[4]
