"""gradient_norm: exact against float64, after accumulation and un-scaling, before clipping,
and free of host synchronisation on steps that are not logged."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import stabletrain.training.loop as trainer_module
from conftest import tiny_lm
from stabletrain.config import load_settings
from stabletrain.debug.grad_norm import GradNorm, clip_grad_norm_with_total, compute_grad_norm
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.training.loop import Trainer, train
from stabletrain.utils.sync import SyncsPerStep


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)


class Blobs(Dataset):
    def __init__(self, n=128):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 6, generator=g) * 3
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Recorder:
    """Keeps each step's starting weights and microbatches, and the gradients the norm saw."""

    def __init__(self):
        self.states, self.batches, self.grads, self.clipped = {}, {}, {}, {}

    def on_step_start(self, trainer, *, step):
        self.states[step] = copy.deepcopy(trainer.model.state_dict())
        self.batches[step] = []

    def on_microbatch(self, trainer, *, step, micro_step, batch, indices):
        self.batches[step].append(tuple(t.clone() for t in batch))

    def on_after_backward(self, trainer, *, step, grad_norm):
        self.grads[step] = [p.grad.detach().double().clone() for p in trainer.model.parameters()]

    def on_before_optimizer_step(self, trainer, *, step):
        self.clipped[step] = [p.grad.detach().double().clone() for p in trainer.model.parameters()]


def float64_reference_norm(state, microbatches):
    """The step recomputed in float64 from scratch: mean of microbatch losses, then the L2 norm."""
    model = MLP().double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    for x, y in microbatches:
        (model.training_step((x.double(), y)) / len(microbatches)).backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def _norm64(grads):
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


@pytest.mark.parametrize("accum", [1, 4])
def test_matches_float64_reference_after_whole_accumulation_cycle(tmp_path, accum):
    rec = Recorder()
    train(
        out=tmp_path / "run", model=MLP(), data=Blobs(), callbacks=[rec], steps=5, batch_size=16,
        gradient_accumulation_steps=accum, log_every_num_steps=1, model_args={"lr": 0.05, "warmup_steps": 0},
    )
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 5
    for row in rows:
        step = row["step"]
        assert len(rec.batches[step]) == accum
        ref = float64_reference_norm(rec.states[step], rec.batches[step])
        assert row["gradient_norm"] == pytest.approx(ref, rel=1e-5)


def test_with_clipping_it_is_the_pre_clipping_norm(tmp_path):
    rec = Recorder()
    train(
        out=tmp_path / "run", model=MLP(), data=Blobs(), callbacks=[rec], steps=4, batch_size=16,
        gradient_clip_val=0.01, log_every_num_steps=1, model_args={"lr": 0.05, "warmup_steps": 0},
    )
    for row in read_metrics(tmp_path / "run" / "metrics.jsonl")[0]:
        step = row["step"]
        ref = float64_reference_norm(rec.states[step], rec.batches[step])
        assert ref > 0.1, "the test needs norms well above the clip value"
        assert row["gradient_norm"] == pytest.approx(ref, rel=1e-5)
        assert _norm64(rec.clipped[step]) == pytest.approx(0.01, rel=1e-4), "gradients reaching the optimizer are clipped"


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_reduced_precision_norm_is_exact_for_the_gradients_it_saw(tmp_path, precision):
    rec = Recorder()
    train(
        out=tmp_path / "run", model=MLP(), data=Blobs(), callbacks=[rec], steps=4, batch_size=16,
        precision=precision, gradient_accumulation_steps=2, log_every_num_steps=1,
        model_args={"lr": 0.05, "warmup_steps": 0},
    )
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for row in rows:
        assert row["gradient_norm"] == pytest.approx(_norm64(rec.grads[row["step"]]), rel=1e-5)
    # and the run really was in reduced precision
    assert (tmp_path / "run" / "settings.json").read_text().count(f'"precision": "{precision}"') == 1


def test_fp16_gradients_do_not_overflow_the_norm():
    p = nn.Parameter(torch.zeros(4096, dtype=torch.float16))
    p.grad = torch.full((4096,), 300.0, dtype=torch.float16)  # sum of squares 3.7e8 >> fp16 max 65504
    gn = compute_grad_norm([("p", p)])
    assert gn.total.dtype == torch.float32
    assert gn.total.item() == pytest.approx(300.0 * 64, rel=1e-6)
    assert gn.nonfinite_names() == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_gradient_makes_the_total_nonfinite_and_is_named(bad):
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    a.grad, b.grad = torch.ones(3), torch.tensor([1.0, bad, 1.0])
    gn = compute_grad_norm([("a", a), ("b", b)])
    assert not torch.isfinite(gn.total)
    assert gn.nonfinite_names() == ["b"]


def test_finite_gradients_can_overflow_the_float32_total():
    """A finite total means every element is finite, not the reverse: 2.5e19 squared is past
    float32's 3.4e38. Which is which takes the elements themselves (nan_capture does that)."""
    from stabletrain.debug.nan_capture import largest_abs_grads, nonfinite_grad_names

    w, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    w.grad, b.grad = torch.tensor([2.5e19, -1.0]), torch.tensor([3.0])
    params = [("w", w), ("b", b)]
    gn = compute_grad_norm(params)
    assert all(bool(torch.isfinite(p.grad).all()) for _, p in params)
    assert gn.total.item() == math.inf and gn.nonfinite_names() == ["w"]
    assert nonfinite_grad_names(params) == []
    assert largest_abs_grads(params) == [("w", pytest.approx(2.5e19, rel=1e-7)), ("b", 3.0)]
    # Clipping would divide by the infinite norm and zero these finite gradients: hidden, had
    # nancapture not checked before clipping.
    clip_grad_norm_with_total(gn.params, 1.0, gn.total)
    assert torch.equal(w.grad, torch.zeros(2)) and torch.equal(b.grad, torch.zeros(1))


def test_clip_never_makes_a_nan_or_inf_gradient_finite():
    for bad in (float("nan"), float("inf"), float("-inf")):
        a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
        a.grad, b.grad = torch.ones(3), torch.tensor([1.0, bad, 1.0])
        gn = compute_grad_norm([("a", a), ("b", b)])
        clip_grad_norm_with_total(gn.params, 1.0, gn.total)
        assert not torch.isfinite(b.grad).all(), f"{bad}: the non-finite gradient stays non-finite"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradients_below_the_clip_value_come_back_bitwise_unchanged(dtype):
    """Clipping only ever scales down: a norm below gradient_clip_val leaves every gradient's bits
    as they were (a coefficient above 1 would scale small gradients up)."""
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(4, 4).to(dtype)) for _ in range(3)]
    for p in ps:
        p.grad = (torch.randn(4, 4) * 1e-3).to(dtype)
    before = [p.grad.clone() for p in ps]
    gn = compute_grad_norm([(str(i), p) for i, p in enumerate(ps)])
    assert 0 < float(gn.total) < 0.1
    clip_grad_norm_with_total(gn.params, 1.0, gn.total)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for p, b in zip(ps, before):
        assert p.grad.dtype == dtype and torch.equal(p.grad.view(bits), b.view(bits))


def test_clip_with_precomputed_norm_matches_torch():
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(5, 5)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn(5, 5) * 10
    ref = [p.grad.clone() for p in ps]
    gn = compute_grad_norm([(str(i), p) for i, p in enumerate(ps)])
    clip_grad_norm_with_total(gn.params, 1.0, gn.total)
    ref_params = [nn.Parameter(torch.zeros(5, 5)) for _ in range(3)]
    for p, g in zip(ref_params, ref):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
    for p, r in zip(ps, ref_params):
        torch.testing.assert_close(p.grad, r.grad)


def test_fp16_loss_scaling_norm_is_unscaled(tmp_path):
    """Fabric allows no fp16 on the CPU, so give the trainer a GradScaler("cpu") plugin directly."""
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision

    rec = Recorder()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    settings = load_settings(dict(
        out=tmp_path / "run", model=MLP(), data=Blobs(), callbacks=[rec], steps=4, batch_size=16,
        log_every_num_steps=1, model_args={"lr": 0.01, "warmup_steps": 0},
    ))
    Trainer(settings, fabric=fabric).fit()
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["loss_scale"] == 2.0**12
    for row in rows:
        ref = float64_reference_norm(rec.states[row["step"]], rec.batches[row["step"]])
        # fp16 autocast differs from float64 by rounding, never by the 4096x loss scale
        assert row["gradient_norm"] == pytest.approx(ref, rel=2e-2)




def _run_counting(tmp_path, name, extra=(), **kw):
    counter = SyncsPerStep()
    train(out=tmp_path / name, callbacks=[counter, *extra], **tiny_lm(steps=8, log_every_num_steps=5, checkpoint_every_num_steps=100, **kw))
    return counter.counts


def test_norm_adds_no_sync_on_steps_that_are_not_logged(tmp_path, monkeypatch):
    ours = _run_counting(tmp_path, "ours", gradient_clip_val=1.0)
    logged = {0, 5, 7}
    quiet = [s for s in ours if s not in logged]
    assert quiet == [1, 2, 3, 4, 6]

    # The same loop with the norm replaced by nothing: the baseline every PyTorch loop pays.
    def no_norm(named_parameters):
        params = [p for _, p in named_parameters if p.grad is not None]
        return GradNorm(total=torch.zeros(()), per_param=[], names=[], params=params)

    monkeypatch.setattr(trainer_module, "compute_grad_norm", no_norm)
    monkeypatch.setattr(trainer_module, "clip_grad_norm_with_total", lambda *a, **k: None)
    baseline = _run_counting(tmp_path, "baseline")
    for step in quiet:
        assert ours[step] == baseline[step], (step, ours, baseline)

    # Positive control: reading the norm on the host once per step is seen as one more sync.
    class ReadsNorm:
        def on_after_backward(self, trainer, *, step, grad_norm):
            float(grad_norm.total)

    monkeypatch.undo()
    reading = _run_counting(tmp_path, "reading", extra=[ReadsNorm()], gradient_clip_val=1.0)
    for step in quiet:
        assert reading[step] == ours[step] + 1


def test_float64_gradients_64_true(tmp_path):
    """precision=64-true: float64 gradients (their norm used to raise in _foreach_norm's dtype check)."""
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad = torch.tensor([3.0, 4.0, 12.0], dtype=torch.float64)
    gn = compute_grad_norm([("p", p)])
    assert gn.total.dtype == torch.float32 and gn.total.item() == 13.0
    rec = Recorder()
    train(out=tmp_path / "run", model=MLP(), data=Blobs(), callbacks=[rec], steps=2, batch_size=16,
          precision="64-true", log_every_num_steps=1, model_args={"lr": 0.05, "warmup_steps": 0})
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for row in rows:
        assert row["gradient_norm"] == pytest.approx(_norm64(rec.grads[row["step"]]), rel=1e-6)
