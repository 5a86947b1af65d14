"""The pieces the three integrations share: one host read for two values, the status code."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from stabletrain import ConfigError
from stabletrain.integrations.common import (
    StepTools,
    decode_status,
    encode_status,
    next_actions,
    parse_tool_settings,
    pending_scale,
    read_pair,
)
from stabletrain.utils.sync import CountSyncs


def f32(x: float) -> float:
    return struct.unpack("=f", struct.pack("=f", x))[0]


@pytest.mark.parametrize("a, b", [(1.5, -2.25), (3.4e38, 1e-45), (math.inf, -math.inf), (0.0, -0.0), (0.1, 1e10)])
def test_read_pair_is_exact_and_one_sync(a, b):
    with CountSyncs() as syncs:
        got = read_pair(torch.tensor(a), torch.tensor(b, dtype=torch.float64))
    assert syncs.count == 1
    assert got == (f32(a), f32(b)) and math.copysign(1, got[1]) == math.copysign(1, f32(b))


def test_read_pair_keeps_nan():
    first, second = read_pair(torch.tensor(float("nan")), torch.tensor(2.0))
    assert math.isnan(first) and second == 2.0


@pytest.mark.parametrize("failed, total, expected", [
    (False, 2.5, (False, 2.5)), (False, float("inf"), (False, math.inf)), (True, 2.5, (True, math.nan)),
    (True, float("nan"), (True, math.nan)), (False, 0.0, (False, 0.0)),
])
def test_status_round_trip(failed, total, expected):
    got = decode_status(float(encode_status(torch.tensor(failed), torch.tensor(total))))
    assert got[0] == expected[0]
    assert (math.isnan(got[1]) and math.isnan(expected[1])) or got[1] == expected[1]


def test_nan_norm_is_coded_apart_from_failure_and_min_over_ranks_finds_the_failure():
    codes = torch.stack([encode_status(torch.tensor(False), torch.tensor(float("nan"))),
                         encode_status(torch.tensor(True), torch.tensor(float("nan")))])
    assert not torch.isnan(codes).any(), "no NaN enters the all-reduce"
    assert decode_status(float(codes.min())) == (True, pytest.approx(math.nan, nan_ok=True))
    assert decode_status(float(codes[0])) == (False, pytest.approx(math.nan, nan_ok=True))


def test_settings_problems_of_both_groups_at_once():
    with pytest.raises(ConfigError) as info:
        parse_tool_settings({"underflow_overflow": {"max_frames_to_save": 0}}, {"windw": 3})
    assert info.value.problems == [
        "debug_args.underflow_overflow.max_frames_to_save: Input should be greater than or equal to 1 (got 0)",
        "trend_alerts.windw: unknown setting. Valid keys here: " + ", ".join(
            ["enabled", "window", "persist", "explode_factor", "vanish_factor", "spike_factor",
             "loss_explode_factor", "loss_spike_factor", "plateau_min_improvement", "z"]),
    ]


def test_pending_scale_follows_the_scalers_state_for_the_optimizer():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(p.sum()).backward()
    assert float(pending_scale(scaler, opt)) == 8.0, "still scaled before unscale_"
    scaler.unscale_(opt)
    assert pending_scale(scaler, opt) is None
    assert pending_scale(None, opt) is None


def test_grads_final_divides_a_pending_scale_out_of_the_norm(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    tools = StepTools(model, framework="accelerate", out_dir=tmp_path, scaler=scaler, trend_alerts={"enabled": False})
    tools.begin_step(0)
    x = torch.randn(8, 4)
    tools.before_forward(x)
    loss = model(x).square().mean()
    tools.after_forward(loss)
    scaler.scale(loss).backward()
    values = tools.grads_final(opt, read=True)
    expected = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters())) / 1024
    assert values.gradient_norm == pytest.approx(float(expected), rel=1e-6)
    assert values.loss == pytest.approx(float(loss.detach()), rel=1e-6)


def test_next_actions_speak_each_frameworks_settings():
    assert "clip gradients: TrainingArguments(max_grad_norm=1.0)" in next_actions("exploding", "transformers")
    assert next_actions("exploding", "lightning", clipping=True, lr=0.1) == [
        "lower the learning rate in configure_optimizers, e.g. by 10x (now 0.1)"]
    nonfinite = next_actions("nonfinite", "accelerate", precision="bf16-mixed")
    assert "isolate reduced precision: Accelerator(mixed_precision='no')" in nonfinite


@pytest.mark.parametrize("finite_at", [None, 5])
def test_underflow_overflow_tolerates_fp16_skipped_steps_until_ten_in_a_row(tmp_path, finite_at):
    """Under fp16 loss scaling the GradScaler skips a step whose scaled gradients overflow: for
    underflow_overflow only gradients are non-finite then, which it tolerates for 9 steps in a row and
    stops at the 10th (SCALER_PATIENCE), in the backward phase. A step with finite gradients starts the
    count again."""
    from torch import nn

    from stabletrain import UnderflowOverflowError
    from stabletrain.integrations.common import SCALER_PATIENCE

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # A loss of about 1e9 at a scale so large that every scaled loss and gradient overflows, for more steps
    # than the test runs (each skip halves the scale): the forward values stay finite.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126, growth_interval=10_000)
    tools = StepTools(model, framework="accelerate", out_dir=tmp_path, scaler=scaler, optimizer=optimizer,
                      debug_args={"underflow_overflow": {"enabled": True}, "mechanisms": {"enabled": False}},
                      trend_alerts={"enabled": False})
    done = []
    with pytest.raises(UnderflowOverflowError) as info:
        for n in range(30):
            tools.begin_step(n)
            x = torch.randn(8, 4)
            tools.before_forward(x)
            loss = model(x).pow(2).mean() * (0.0 if n == finite_at else 1e10)
            tools.after_forward(loss)
            tools.before_last_backward()
            scaler.scale(loss).backward()
            tools.grads_final(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            tools.end_step()
            done.append(n)
    stop = SCALER_PATIENCE - 1 if finite_at is None else finite_at + SCALER_PATIENCE
    assert SCALER_PATIENCE == 10 and done == list(range(stop))
    assert (info.value.step, info.value.phase) == (stop, "backward")
