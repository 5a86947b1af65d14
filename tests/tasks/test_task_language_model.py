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


# --------------------------------------------------------------------------------------
# The mitigations: qk_norm, z_loss (docs/mechanisms.md)
# --------------------------------------------------------------------------------------


def _layer_norm64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * weight + bias


def _reference_logits(model: torch.nn.Module, ids: torch.Tensor, qk_norm: bool) -> torch.Tensor:
    """The language model's forward pass written out in float64 from its state dict."""
    w = {k: v.double() for k, v in model.state_dict().items()}
    n_heads = model.blocks[0].attn.n_heads  # type: ignore[index,union-attr]
    B, T = ids.shape
    x = w["tok_emb.weight"][ids] + w["pos_emb.weight"][:T]
    for i in range(len(model.blocks)):  # type: ignore[arg-type]
        p = f"blocks.{i}."
        h = _layer_norm64(x, w[p + "ln1.weight"], w[p + "ln1.bias"])
        qkv = h @ w[p + "attn.qkv.weight"].T + w[p + "attn.qkv.bias"]
        C = x.shape[-1]
        hd = C // n_heads
        q, k, v = (qkv[..., j * C:(j + 1) * C].reshape(B, T, n_heads, hd).transpose(1, 2) for j in range(3))
        if qk_norm:
            q = _layer_norm64(q, w[p + "attn.q_norm.weight"], w[p + "attn.q_norm.bias"])
            k = _layer_norm64(k, w[p + "attn.k_norm.weight"], w[p + "attn.k_norm.bias"])
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + att @ w[p + "attn.proj.weight"].T + w[p + "attn.proj.bias"]
        h = _layer_norm64(x, w[p + "ln2.weight"], w[p + "ln2.bias"])
        h = torch.nn.functional.gelu(h @ w[p + "mlp.fc1.weight"].T + w[p + "mlp.fc1.bias"])
        x = x + h @ w[p + "mlp.fc2.weight"].T + w[p + "mlp.fc2.bias"]
    return _layer_norm64(x, w["ln_f.weight"], w["ln_f.bias"]) @ w["head.weight"].T


def test_qk_norm_normalises_queries_and_keys_as_a_float64_reference_does(tmp_path: Path):
    plain = language_model.build_model(settings(tmp_path, seed=3), {"vocab_size": 256})
    normed = language_model.build_model(settings(tmp_path, seed=3, model_args={"qk_norm": True}), {"vocab_size": 256})
    names = dict(normed.named_parameters())
    assert {"blocks.0.attn.q_norm.weight", "blocks.0.attn.k_norm.bias"} <= names.keys()
    assert names["blocks.0.attn.q_norm.weight"].shape == (16,)  # head_dim = 32 / 2: one LayerNorm over each head
    assert not any("q_norm" in n or "k_norm" in n for n, _ in plain.named_parameters())  # default: no new weights
    # Large qkv weights (the growth qk_norm is for) and gains that are not the identity.
    with torch.no_grad():
        for model in (plain, normed):
            model.blocks[0].attn.qkv.weight.mul_(30)  # type: ignore[index,union-attr,operator]
        for name, p in names.items():
            if "q_norm" in name or "k_norm" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    ids = torch.randint(256, (3, 16), generator=torch.Generator().manual_seed(0))
    got = normed(ids).double()
    torch.testing.assert_close(got, _reference_logits(normed, ids, qk_norm=True), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plain(ids).double(), _reference_logits(plain, ids, qk_norm=False), rtol=1e-4, atol=1e-4)
    # The shared weights are the same (same seed), yet the logits differ: the norm is in the path.
    assert (got - _reference_logits(normed, ids, qk_norm=False)).abs().max() > 0.1


def test_z_loss_adds_exactly_its_term(tmp_path: Path):
    task = language_model.build(settings(tmp_path, seed=2))
    batch = default_collate([task.dataset[i] for i in range(4)])
    with_z = language_model.build_model(settings(tmp_path, seed=2, model_args={"z_loss": 0.05}), task.model_meta)
    with torch.no_grad():  # logits far from normalised, so the term is large
        for model in (task.model, with_z):
            model.head.weight.add_(0.3)  # type: ignore[union-attr,operator]
    plain_loss = task.model.training_step(batch)
    z_loss = with_z.training_step(batch)
    logits = _reference_logits(with_z, batch["input_ids"], qk_norm=False).flatten(0, 1)
    ce = torch.nn.functional.cross_entropy(logits, batch["labels"].flatten())
    term = 0.05 * torch.logsumexp(logits, -1).square().mean()
    assert term > 1.0
    torch.testing.assert_close(plain_loss.double(), ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z_loss.double(), ce + term, rtol=1e-5, atol=1e-5)
    z_loss.backward()  # the term is differentiable: it reaches the output layer's gradient
    assert with_z.head.weight.grad is not None  # type: ignore[union-attr]


def test_eps_and_betas_reach_adamw(tmp_path: Path):
    from stabletrain.training.optim import build_optimizer

    default = build_optimizer(torch.nn.Linear(2, 2), settings(tmp_path).model_args)
    assert all(g["eps"] == 1e-8 and g["betas"] == (0.9, 0.95) for g in default.param_groups)
    s = settings(tmp_path, model_args={"eps": 1e-3, "betas": (0.8, 0.9)})
    opt = build_optimizer(torch.nn.Linear(2, 2), s.model_args)
    assert [(g["name"], g["eps"], tuple(g["betas"])) for g in opt.param_groups] == [
        ("decay", 1e-3, (0.8, 0.9)),
        ("no_decay", 1e-3, (0.8, 0.9)),
    ]


def test_qk_norm_and_z_loss_belong_to_the_language_model(tmp_path: Path):
    from pydantic import ValidationError

    image = TrainSettings(out=tmp_path / "o", task="image_classification", model_args={"qk_norm": True, "z_loss": 1e-4})
    assert check_task(image) == [
        "model_args.qk_norm: not used by the image_classification task (got True)",
        "model_args.z_loss: not used by the image_classification task (got 0.0001)",
    ]
    try:
        TrainSettings(out=tmp_path / "o", model_args={"z_loss": -1})
    except ValidationError as exc:
        assert "z_loss" in str(exc)
    else:
        raise AssertionError("expected a negative z_loss to be refused")
