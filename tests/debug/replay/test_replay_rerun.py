"""replay's pieces on hand-written captures (no training run): forward_backward against a float64
reference (ranks averaged as DDP does, row subsets, forward only), the precision table, and the text of a
ReplayResult section by section."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from stabletrain.debug.nan_capture import FILE_NAME, NaNCaptureError, write_capture_file
from stabletrain.debug.replay import (
    RankOutcome,
    ReplayResult,
    forward_backward,
    load_nan_capture,
    normalize_precision,
    replay_dtype,
)
from stabletrain.utils.rng import raw_rng_state

ACCUM = 2


class Lin(nn.Module):
    """y = x W^T + b with a mean squared error: gradients easy to compute by hand."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def training_step(self, batch):
        return ((self.fc(batch["x"]) - batch["y"]) ** 2).mean()


def _batches(rank: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [{"x": torch.randn(4, 3, generator=g), "y": torch.randn(4, 2, generator=g)} for _ in range(ACCUM)]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Two ranks' captures of one step of :class:`Lin`: (folder, parameters the step started from)."""
    folder = tmp_path_factory.mktemp("cap") / "nan_capture"
    torch.manual_seed(0)
    params = dict(Lin().named_parameters())
    for rank in (0, 1):
        batches = _batches(rank)
        write_capture_file(
            folder / f"rank{rank}" / FILE_NAME, step=3, rank=rank, world_size=2, reason="nonfinite_gradients",
            precision="32-true", device="cpu", loss_scale=None, consecutive_skipped_steps=0,
            gradient_accumulation_steps=ACCUM, params=[(n, p.detach()) for n, p in params.items()], buffers=[],
            microbatches=batches, indices=[list(range(4 * m, 4 * m + 4)) for m in range(ACCUM)],
            step_args=[[] for _ in batches], rng=[raw_rng_state() for _ in batches], losses=[],
            nan_param_names=[], largest_gradients=[], settings=None, model_meta=None, model_class="t.Lin",
            step_fn=None, replay_command="",
        )
    return folder, {n: p.detach().clone() for n, p in params.items()}


def _reference(params, parts):
    """float64 losses and the DDP gradient over ``parts``: {rank: [(micro, rows or None), ...]}."""
    w = params["fc.weight"].double().requires_grad_()
    b = params["fc.bias"].double().requires_grad_()
    grads, losses = [], []
    for rank, micros in parts.items():
        gw, gb = torch.zeros_like(w), torch.zeros_like(b)
        for micro, rows in micros:
            batch = _batches(rank)[micro]
            x, y = batch["x"].double(), batch["y"].double()
            if rows is not None:
                x, y = x[rows], y[rows]
            loss = ((x @ w.T + b - y) ** 2).mean()
            dw, db = torch.autograd.grad(loss / ACCUM, (w, b))
            gw, gb = gw + dw, gb + db
            losses.append(float(loss.detach()))
        grads.append((gw, gb))
    n = len(grads)
    # One rank: its own gradient. Several: each rank's divided by the world size (2) and summed.
    scale = 1.0 if n == 1 else 0.5
    return losses, sum(g[0] for g in grads) * scale, sum(g[1] for g in grads) * scale


def test_both_ranks_are_averaged_as_ddp_does(captured):
    folder, params = captured
    cap = load_nan_capture(folder, model=Lin())
    res = forward_backward(cap)
    losses, gw, gb = _reference(params, {0: [(0, None), (1, None)], 1: [(0, None), (1, None)]})
    assert res.microbatches == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert res.loss_values == pytest.approx(losses, rel=1e-6)
    assert torch.allclose(res.model.fc.weight.grad.double(), gw, rtol=1e-5, atol=1e-7)
    assert torch.allclose(res.model.fc.bias.grad.double(), gb, rtol=1e-5, atol=1e-7)
    assert res.finite and res.grad_finite == {"fc.weight": True, "fc.bias": True}
    assert res.gradient_norm == pytest.approx(math.sqrt(float((gw ** 2).sum() + (gb ** 2).sum())), rel=1e-5)
    # The parameters are those the step started from (restored, not stepped).
    assert torch.equal(res.model.fc.weight.detach(), params["fc.weight"])


def test_one_rank_rows_subset_in_float64_and_forward_only(captured):
    folder, params = captured
    cap = load_nan_capture(folder, model=Lin())
    res = forward_backward(cap, microbatches=[(1, 1)], rows={(1, 1): [0, 2]}, precision="64-true")
    losses, gw, gb = _reference(params, {1: [(1, [0, 2])]})
    assert res.precision == "64-true" and res.model.fc.weight.dtype == torch.float64
    # Fabric converts the output back to the default dtype (as training did): the loss is float32-rounded,
    # the gradient float64 throughout.
    assert res.loss_values == pytest.approx(losses, rel=1e-7) and res.losses[0].dtype == torch.float32
    assert torch.allclose(res.model.fc.weight.grad, gw, rtol=1e-12) and torch.allclose(res.model.fc.bias.grad, gb)

    fwd = forward_backward(cap, microbatches=[(0, 0)], backward=False)
    assert fwd.grad_finite == {} and fwd.loss_values == pytest.approx(_reference(params, {0: [(0, None)]})[0])

    def not_a_scalar(model, batch):
        return model.fc(batch["x"])

    with pytest.raises(NaNCaptureError, match=r"must return a scalar loss tensor, got Tensor of shape \(4, 2\)"):
        forward_backward(cap, microbatches=[(0, 0)], step_fn=not_a_scalar)
    with pytest.raises(ValueError, match=r"use \(rank, micro_step\) pairs"):
        forward_backward(cap, microbatches=[0])


def test_precision_names_and_parameter_dtypes():
    assert [normalize_precision(p) for p in ("32", "64", "16", "bf16", "half", "double", "bf16-true")] == [
        "32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "64-true", "bf16-true"
    ]
    with pytest.raises(ValueError, match="cannot replay in 'fp8'; valid: 32-true, 64-true"):
        normalize_precision("fp8")
    assert replay_dtype("64-true", "32-true") is torch.float64
    assert replay_dtype("16-true", "32-true") is torch.float16
    assert replay_dtype("32-true", "16-true") is torch.float32, "a .half() run replayed in float32"
    assert replay_dtype("bf16-mixed", "bf16-true") is torch.float32
    assert replay_dtype("bf16-mixed", "32-true") is None, "mixed precision keeps the stored float32 weights"


def _result(**changes) -> ReplayResult:
    fields = dict(
        reproduced=False, nan_param_names=[], losses=[1.5, 2.0], step=4, precision="64-true",
        captured_precision="bf16-mixed", device="cpu", captured_losses=[float("nan"), 2.0],
        losses_bitwise_equal=False, captured_nan_param_names=["fc.weight"], gradient_norm=0.5,
        microbatches=[(0, 0), (1, 0)], ranks=[0, 1], world_size=3, missing_ranks=[2], reason="nonfinite_loss",
        per_rank=[RankOutcome(0, False, [], [1.5]), RankOutcome(1, True, ["fc.bias"], [float("inf")])],
        path="out/x", sample_indices=[[0, 1], None],
    )
    fields.update(changes)
    return ReplayResult(**fields)


def test_replay_text_section_by_section():
    lines = _result().to_text().splitlines()
    assert lines[0] == "Replayed step 4 from out/x"
    assert lines[1] == (
        "  ranks 0, 1 of world size 3, 2 microbatch(es), precision 64-true (captured in bf16-mixed), device cpu"
    )
    assert lines[2].startswith("  warning: no capture of rank(s) 2")
    assert lines[3] == "  reproduced: NO - every replayed loss and gradient is finite"
    assert lines[4] == "  gradient_norm: 0.5"
    assert lines[6].split()[:3] == ["0", "0", "1.5"] and lines[7].split()[-1] == "-"
    assert lines[8] == "  losses: differ from the captured ones (expected: replayed in another precision)"
    assert lines[9:12] == [
        "  rank 0's microbatches alone: finite",
        "  rank 1's microbatches alone: non-finite -> reproduces the failure alone",
        "  -> the data of rank(s) 1 alone reproduces the NaN",
    ]
    assert lines[12].startswith("  In 64-true this step is finite: the failure comes from the range or rounding")
    assert len(lines) == 13

    again = _result(reproduced=True, nan_param_names=["fc.bias"], per_rank=[], missing_ranks=[]).to_text()
    assert "  reproduced: YES - non-finite gradients in 1 parameter(s): fc.bias" in again.splitlines()
    assert "In 64-true" not in again and "warning" not in again
    overflow = _result(
        reproduced=True, reason="gradient_norm_overflow", largest_gradients=[("fc.weight", 2e19)], per_rank=[]
    ).to_text()
    assert "gradient norm overflow: every gradient element is finite" in overflow and "fc.weight 2e+19" in overflow
