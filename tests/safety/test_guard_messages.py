"""The guard's messages in the cases its runs reach rarely: a huge-but-finite step whose norm
overflowed without a tensor to name, weights and optimizer state both past the limit, a trip
recorded without its size, fp16 skips without a known scale, and the error's ``other_rank`` across
a pickle (what a DDP or FSDP2 run's worker hands back to the launcher)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from test_step_guard import _scaled_step
from torch import nn

from stabletrain.debug.grad_norm import compute_grad_norm
from stabletrain.debug.optimizer_damage import NORM_OVERFLOW_AT, RangeTrip
from stabletrain.safety.guard import ORIGIN_OPTIMIZER, ORIGIN_SKIPPED, GuardFailure, NonFiniteStepError, StepGuard

HEAD = ("The optimizer step of step 5 (rank 0 of 1) made the weights so large, from finite gradients (loss 2.5, "
        "gradient norm 3), that their float32 norm overflows: every value is still finite, but |w| reaches ")


def _optimizer_failure(**kw) -> GuardFailure:
    base = dict(step=5, rank=0, world_size=1, origin=ORIGIN_OPTIMIZER, nonfinite=["parameters"], loss=2.5,
                gradient_norm=3.0, stopped_at=5)
    return GuardFailure(**{**base, **kw})


def test_a_norm_overflow_without_a_tripped_tensor_names_the_largest_weight_and_the_limit():
    # Older verdicts (and a failure joined from ranks that sent no trips) know only the largest value.
    f = _optimizer_failure(nonfinite=[], largest_name="head.weight", largest_abs=2e19)
    assert NORM_OVERFLOW_AT == math.sqrt(3.4028234663852886e38)
    assert f.describe() == (HEAD + "2e+19 in head.weight (the guard's check takes the float32 L2 norm of the "
                            "weights, which overflows once values pass about 1.8e+19).")


def test_the_tripped_weight_is_named_not_the_largest_value():
    """A bias holding one value of 1.5e19 does not overflow its norm; the million values of 1e17 of
    the weight do. The message names the weight and its own largest value."""
    trip = RangeTrip("fc.weight", "parameter", 1e17, alone=True, square_sum=1e40, numel=1_000_000)
    f = _optimizer_failure(nonfinite=[], trips=[trip], largest_name="fc.bias", largest_abs=1.5e19)
    assert f.describe() == (HEAD + "1e+17 in fc.weight (the squares of its 1,000,000 values sum to 1e+40, past "
                            "float32's largest value 3.4e+38, so the float32 L2 norm the guard checks overflows (one "
                            "value alone does it from about 1.8e+19)).")


def test_weights_past_the_limit_are_told_before_optimizer_state_past_it():
    """When both the weights and the optimizer state overflow the norm, the weights are what moved
    (the state is how they got there): the message is about the weights."""
    weight = RangeTrip("fc.weight", "parameter", 3e19, alone=True, square_sum=9e38, numel=1)
    state = RangeTrip("fc.weight: exp_avg_sq", "optimizer state", 1e35, alone=True, square_sum=1e70, numel=1)
    for trips in ([weight, state], [state, weight]):
        text = _optimizer_failure(nonfinite=[], trips=trips, largest_name="fc.weight", largest_abs=3e19).describe()
        assert text.startswith(HEAD + "3e+19 in fc.weight (the squares of its 1 values sum to 9e+38"), trips
        assert "exp_avg_sq" not in text


def test_a_trip_recorded_without_its_size_falls_back_to_the_limit():
    trip = RangeTrip("fc.weight", "parameter", 4e19)  # numel 0: how many values was not recorded
    f = _optimizer_failure(nonfinite=[], trips=[trip], largest_name="fc.weight", largest_abs=4e19)
    assert f.describe() == (HEAD + "4e+19 in fc.weight (the guard's check takes the float32 L2 norm of the weights, "
                            "which overflows once values pass about 1.8e+19).")


def test_fp16_skips_with_and_without_a_known_loss_scale():
    base = dict(step=9, rank=0, world_size=1, origin=ORIGIN_SKIPPED, nonfinite=["skipped_steps"], loss=math.nan,
                gradient_norm=math.nan, stopped_at=9, skipped_in_a_row=25)
    tail = ("(debug_args.nancapture.max_skipped_steps): each time the scaled gradients held Inf/NaN, and the loss "
            "scale{} cannot recover.")
    prefix = "fp16 loss scaling skipped 25 steps in a row up to step 9 (rank 0 of 1) "
    assert GuardFailure(**base).describe() == prefix + tail.format("")
    assert GuardFailure(**base, loss_scale=2.0 ** -10).describe() == prefix + tail.format(" (now 0.0009766)")


def test_other_rank_is_false_unless_given_and_survives_a_pickle():
    f = _optimizer_failure(param_names=["w"])
    assert NonFiniteStepError("m", f).other_rank is False
    for flag in (True, False):
        err = NonFiniteStepError("m", f, other_rank=flag)
        back = pickle.loads(pickle.dumps(err))
        assert err.other_rank is flag and back.other_rank is flag
        assert (str(back), back.step, back.param_names) == ("m", 5, ["w"])


# ---------------------------------------------------------------------------------------------
# StepGuard.failure: where a failure comes from, and what it says about the gradients
# ---------------------------------------------------------------------------------------------


class _TwoParams(nn.Module):
    """A weight and a bias with gradients, and a parameter that never gets one (frozen)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        self.bias = nn.Parameter(torch.zeros(1))
        self.unused = nn.Parameter(torch.zeros(2))


def _gradient_failure(weight_grad: list[float], bias_grad: float, *, stopped_at=None, zero_grad=False):
    model = _TwoParams()
    model.weight.grad = torch.tensor(weight_grad)
    model.bias.grad = torch.tensor([bias_grad])
    guard = StepGuard(model)
    guard.check_gradients(3, compute_grad_norm(model.named_parameters()).total, losses=[torch.tensor(1.5)])
    if zero_grad:  # a plain loop that reads the verdict after optimizer.zero_grad()
        for p in model.parameters():
            p.grad = None
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed(stopped_at=stopped_at)
    return info.value


def test_finite_gradients_whose_norm_overflows_name_the_largest_gradient():
    # Every element finite, the float32 norm inf; the largest |g| is the bias's (5e20), not the
    # weight's largest (3e20), and not the alphabetically last name.
    err = _gradient_failure([1e20, -3e20, 1.0, 2.0], -5e20)
    f = err.failure
    assert (f.origin, f.nonfinite, f.param_names) == ("forward_backward", ["gradient_norm"], [])
    assert f.gradients_elementwise_finite is True
    assert f.largest_name == "bias" and f.largest_abs == pytest.approx(5e20, rel=1e-6)
    assert str(err).startswith(
        "Non-finite gradient norm at step 3 (rank 0 of 1): the gradient norm is inf: every gradient element is "
        "finite, but so large that their float32 norm overflows (the largest, |g| 5e+20 in bias's gradient; values "
        "past about 1.8e+19 overflow it).")


def test_a_nan_gradient_element_is_named_and_not_called_finite():
    err = _gradient_failure([1.0, math.nan, 1.0, 2.0], 3.0)
    f = err.failure
    assert (f.param_names, f.gradients_elementwise_finite, f.largest_name) == (["weight"], False, "")
    assert str(err).startswith("Non-finite gradient norm at step 3 (rank 0 of 1): the gradient norm is nan. "
                               "Gradients with NaN/Inf: 1: weight.")


def test_gradients_no_longer_there_or_of_a_later_step_are_not_described():
    """Read after zero_grad(set_to_none) there are no gradients to look at; read at a later step
    they are that step's. Either way the failure says nothing about the failing step's elements."""
    for err in (_gradient_failure([1e20, -3e20, 1.0, 2.0], 1.0, zero_grad=True),
                _gradient_failure([1.0, math.nan, 1.0, 2.0], 1.0, stopped_at=5)):
        f = err.failure
        assert (f.param_names, f.gradients_elementwise_finite, f.largest_name) == ([], None, "")
        assert "every gradient element is finite" not in str(err) and "Gradients with NaN/Inf" not in str(err)
        assert str(err).startswith("Non-finite gradient norm at step 3 (rank 0 of 1): the gradient norm is ")


def test_damaged_weights_after_a_non_finite_loss_or_gradient_norm_come_from_the_gradients():
    """The optimizer step is blamed only when the loss and the gradient norm it was given were finite.
    (A verdict holding both kinds of flags is one agreed over ranks: one rank's loss, another's weights.)"""
    guard = StepGuard(nn.Linear(2, 1))
    nan = math.nan
    for flags, origin in (((1, 0, 0, 1, 0), "forward_backward"), ((0, 1, 0, 0, 1), "forward_backward"),
                          ((1, 1, 0, 1, 1), "forward_backward"), ((0, 0, 1, 1, 0), "optimizer_step"),
                          ((0, 0, 0, 1, 0), "optimizer_step"), ((0, 0, 0, 0, 1), "optimizer_step")):
        f = guard.failure([2.0, *flags, 1.0, 1.0, 0, -1, nan, nan])
        assert f.origin == origin, flags
        assert f.nonfinite == [w for w, on in zip(("loss", "gradient_norm", "skipped_steps", "parameters",
                                                   "optimizer_state"), flags) if on]


# ---------------------------------------------------------------------------------------------
# StepGuard's verdict: what it keeps, and fp16 loss scaling
# ---------------------------------------------------------------------------------------------


def test_the_first_bad_step_is_kept_even_when_it_is_step_0():
    guard = StepGuard(nn.Linear(2, 1))
    guard.check_gradients(0, torch.tensor(math.inf), losses=[torch.tensor(1.0)])
    guard.check_gradients(1, torch.tensor(1.0), losses=[torch.tensor(math.nan)])
    f = guard.failure(guard.read())
    assert (f.step, f.nonfinite) == (0, ["gradient_norm"])


def test_a_step_number_past_float32_s_integers_is_kept_exactly():
    step = 2**24 + 1  # 16,777,217: float32 has no such integer (it rounds to 16,777,216)
    guard = StepGuard(nn.Linear(2, 1))
    guard.check_gradients(step, torch.tensor(math.nan), losses=[torch.tensor(1.0)])
    for sync in (False, True):  # the host mirror the loop reads without waiting (first), and the device verdict
        with pytest.raises(NonFiniteStepError) as info:
            guard.raise_if_failed(sync=sync)
        assert info.value.step == step and f"at step {step} (rank 0 of 1)" in str(info.value)


def test_gradients_checked_without_losses_and_a_model_without_parameters():
    for model in (nn.Linear(2, 1), nn.ReLU()):
        guard = StepGuard(model)
        assert guard.device == torch.device("cpu")
        guard.check_gradients(4, torch.tensor(math.inf))  # a plain loop that passes no losses
        guard.check_update(4)
        assert guard.failed(sync=False)
        with pytest.raises(NonFiniteStepError) as info:
            guard.raise_if_failed(sync=False)
        assert (info.value.step, info.value.nonfinite) == (4, ["gradient_norm"])


def test_a_skipped_update_excuses_its_non_finite_loss_and_norm_only():
    for loss, norm in ((math.nan, 1.0), (1.0, math.inf)):
        guard = StepGuard(nn.Linear(2, 1))
        guard.check_gradients(0, torch.tensor(norm), losses=[torch.tensor(loss)], skip=torch.tensor(True))
        assert not guard.failed()
        guard.check_gradients(1, torch.tensor(norm), losses=[torch.tensor(loss)], skip=torch.tensor(False))
        f = guard.failure(guard.read())
        assert (f.step, f.nonfinite) == (1, ["loss"] if math.isnan(loss) else ["gradient_norm"])


def test_ten_fp16_skips_in_a_row_is_the_default_limit():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    guard = StepGuard(model, opt, scaler=scaler)
    x = torch.randn(8, 3)
    for step in range(9):
        _scaled_step(guard, model, opt, scaler, step, x, 1e38)  # the scaled loss overflows: skipped
    assert int(guard.skipped_total) == 9 and not guard.failed()
    _scaled_step(guard, model, opt, scaler, 9, x, 1e38)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    assert (info.value.step, info.value.origin, info.value.failure.skipped_in_a_row) == (9, "skipped_steps", 10)


def test_under_fp16_finite_gradients_whose_norm_overflows_are_a_failure_not_a_skip():
    """The scaler found no Inf (it takes the step), yet the unscaled gradients' float32 norm
    overflows: that is the gradient-norm failure, not one more skipped step."""
    model = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)
    guard = StepGuard(model, opt, scaler=scaler)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    model.weight.grad = torch.tensor([[3e19, -3e19]])  # finite; squares past float32's largest value
    scaler.unscale_(opt)
    gn = compute_grad_norm(model.named_parameters()).total
    assert math.isinf(float(gn))
    guard.check_gradients(0, gn, losses=[torch.tensor(1.0)])
    scaler.step(opt)
    scaler.update()
    assert int(guard.skipped_total) == 0
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    assert (info.value.origin, info.value.nonfinite) == ("forward_backward", ["gradient_norm"])
    assert info.value.failure.gradients_elementwise_finite is True


class _ScalerWithoutIsEnabled:
    """A loss scaler that keeps GradScaler's per-optimizer found-inf flags but has no
    ``is_enabled()`` (a wrapper or an older scaler): the guard still reads its skips."""

    def __init__(self, found_inf: bool) -> None:
        from torch.amp.grad_scaler import OptState

        self._per_optimizer_states = {0: {"stage": OptState.UNSCALED,
                                          "found_inf_per_device": {"cpu": torch.tensor(float(found_inf))}}}


def test_a_scaler_without_is_enabled_is_used():
    scaler = _ScalerWithoutIsEnabled(found_inf=True)
    guard = StepGuard(nn.Linear(2, 1), scaler=scaler, max_skipped_steps=2)
    assert guard.scaler is scaler
    for step in range(2):
        guard.check_gradients(step, torch.tensor(math.inf), losses=[torch.tensor(1.0)])
    assert int(guard.skipped_total) == 2
    assert guard.failure(guard.read()).origin == "skipped_steps"


def test_skip_counters_are_integers_and_start_at_zero_for_an_update_only_loop():
    guard = StepGuard(nn.Linear(2, 1))
    assert guard.skipped_total.dtype == torch.int64 and int(guard.skipped_total) == 0
    model = guard.model
    with torch.no_grad():
        model.weight.fill_(math.nan)
    guard.check_update(0)  # a plain loop that checks updates only: no losses, norms or skips known
    f = guard.failure(guard.read())
    assert (f.origin, f.skipped_in_a_row) == ("optimizer_step", 0)
    assert math.isnan(f.loss) and math.isnan(f.gradient_norm)


def test_a_non_finite_norm_before_the_scaler_unscaled_counts_as_a_skip():
    """Checked before ``scaler.unscale_`` the scaler has not looked yet; ``scaler.step`` will find
    the same Inf and skip the step, so the guard counts it as a skip, not a failure."""
    model = nn.Linear(2, 1)
    scaler = torch.amp.GradScaler("cpu")
    guard = StepGuard(model, scaler=scaler, max_skipped_steps=3)
    guard.check_gradients(0, torch.tensor(math.inf), losses=[torch.tensor(1.0)])
    assert int(guard.skipped_total) == 1 and not guard.failed()
    guard.check_gradients(1, torch.tensor(2.0), losses=[torch.tensor(1.0)])
    assert int(guard.skipped_total) == 1 and not guard.failed()


def test_an_overflowing_gradient_norm_without_a_named_largest_gradient():
    f = GuardFailure(step=2, rank=1, world_size=2, origin="forward_backward", nonfinite=["gradient_norm"],
                     loss=1.0, gradient_norm=math.inf, stopped_at=2, gradients_elementwise_finite=True)
    assert f.describe() == ("Non-finite gradient norm at step 2 (rank 1 of 2): the gradient norm is inf: every "
                            "gradient element is finite, but so large that their float32 norm overflows.")
