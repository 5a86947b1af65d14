"""Per-layer gradient norms: exact, from the same per-parameter norms as the total, read back
in the step's one host read-back, off by default."""

from __future__ import annotations

import math

import torch
from torch import nn

from conftest import tiny_lm
from stabletrain.config import load_settings
from stabletrain.debug.grad_norm import compute_grad_norm, layer_grad_norms
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.safety.guard import VERDICT_LEN
from stabletrain.tasks import build_task
from stabletrain.training.loop import Trainer, train


def _reference(model: nn.Module) -> dict[str, float]:
    """float64 norms of every parameter and every module above one, straight from the grads."""
    sq: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        s = float(p.grad.double().pow(2).sum())
        sq[name] = s
        parts = name.split(".")
        for depth in range(1, len(parts)):
            module = ".".join(parts[:depth])
            sq[module] = sq.get(module, 0.0) + s
    return {k: math.sqrt(v) for k, v in sq.items()}


def _lm_with_grads():
    settings = load_settings({"out": "unused", **tiny_lm(model_args={"n_layers": 2})})
    torch.manual_seed(0)
    task = build_task(settings)
    batch = torch.utils.data.default_collate([task.dataset[i] for i in range(4)])
    task.model.training_step(batch).backward()
    return task.model


def test_matches_float64_reference_on_the_builtin_transformer():
    model = _lm_with_grads()
    gn = compute_grad_norm(model.named_parameters())
    names, norms = layer_grad_norms(gn)
    ref = _reference(model)
    assert sorted(names) == sorted(ref), "every parameter and every module above one"
    assert names[: len(gn.names)] == gn.names, "parameters first, in model order"
    got = dict(zip(names, norms.tolist()))
    for name, value in ref.items():
        assert math.isclose(got[name], value, rel_tol=1e-5), name
    for module in ("blocks", "blocks.0", "blocks.1.attn", "blocks.1.attn.qkv", "tok_emb"):
        assert module in got
    # The root module would be the total: the per-parameter norms add up to it.
    params = norms[: len(gn.names)]
    assert math.isclose(float(params.square().sum().sqrt()), float(gn.total), rel_tol=1e-6)


def test_built_from_the_per_parameter_norms_without_touching_gradients_again():
    model = _lm_with_grads()
    gn = compute_grad_norm(model.named_parameters())
    for p in model.parameters():
        p.grad = None  # if layer_grad_norms looked at gradients, it would fail now
    gn.per_param[0] = gn.per_param[0] * 0 + 3.0
    names, norms = layer_grad_norms(gn)
    assert norms[0].item() == 3.0, "uses GradNorm.per_param as given"


def test_nonfinite_parameter_makes_its_modules_nonfinite_only():
    model = _lm_with_grads()
    with torch.no_grad():
        model.blocks[1].mlp.fc1.weight.grad[0, 0] = float("inf")
    names, norms = layer_grad_norms(compute_grad_norm(model.named_parameters()))
    got = dict(zip(names, norms.tolist()))
    for bad in ("blocks.1.mlp.fc1.weight", "blocks.1.mlp.fc1", "blocks.1.mlp", "blocks.1", "blocks"):
        assert math.isinf(got[bad]), bad
    assert math.isfinite(got["blocks.0"]) and math.isfinite(got["blocks.1.attn"])


class GradRecorder:
    def __init__(self):
        self.norms: dict[int, dict[str, float]] = {}

    def on_after_backward(self, trainer, *, step, grad_norm):
        self.norms[step] = _reference(trainer.model)


def test_trainer_logs_them_at_the_logging_cadence(tmp_path, monkeypatch):
    rec = GradRecorder()
    reads: list[int] = []
    logging = [False]
    original_tolist, original_log_step = torch.Tensor.tolist, Trainer._log_step

    def counting_tolist(self):
        if logging[0]:
            reads.append(self.numel())
        return original_tolist(self)

    def log_step(self, *args, **kwargs):
        logging[0] = True
        try:
            return original_log_step(self, *args, **kwargs)
        finally:
            logging[0] = False

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(Trainer, "_log_step", log_step)
    train(out=tmp_path / "run", callbacks=[rec], gradient_norm_per_layer=True, **tiny_lm(steps=7, log_every_num_steps=3))
    monkeypatch.undo()
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 3, 6]
    for row in rows:
        layer = {k[len("gradient_norm/"):]: v for k, v in row.items() if k.startswith("gradient_norm/")}
        ref = rec.norms[row["step"]]
        assert sorted(layer) == sorted(ref)
        for name, value in ref.items():
            assert math.isclose(layer[name], value, rel_tol=1e-5), (row["step"], name)
    n_layer_keys = len(ref)
    n_signals = len([k for k in rows[0] if k.startswith("signals/")])  # the mechanism signals, on by default
    assert n_signals > 0
    # Logging reads back one tensor per logged step: loss, total, every per-layer norm, the
    # mechanism signals and the guard's verdict together.
    assert reads == [2 + n_layer_keys + n_signals + VERDICT_LEN] * 3, reads


def test_off_by_default(tmp_path):
    train(out=tmp_path / "run", **tiny_lm(steps=2))
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert not any(k.startswith("gradient_norm/") for r in rows for k in r)
