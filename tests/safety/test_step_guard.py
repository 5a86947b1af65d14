"""StepGuard in a plain loop, piece by piece: the norms it decides on (against float64), what its
verdict keeps (the first bad step, the last finite one before it), what it tolerates (a skipped
update, fp16 loss scaling's own skips), and the error it raises (its data, its message, pickling)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from torch import nn

from stabletrain.debug.grad_norm import compute_grad_norm
from stabletrain.safety.guard import (
    NonFiniteStepError,
    StepGuard,
    finite_norms,
    next_steps_text,
    optimizer_state_tensors,
)

CPU = torch.device("cpu")


def _norm64(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def test_finite_norms_is_the_l2_norm_over_every_floating_tensor_of_every_dtype():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, generator=g)
    b = (torch.randn(7, generator=g) * 300).half()  # squares beyond float16's range: accumulated in float32
    c = torch.randn(3, generator=g).bfloat16()
    d = torch.randn(4, generator=g).double()
    ignored = [torch.arange(4), torch.empty(0), torch.tensor([True])]
    norm = finite_norms([a, b, *ignored, c, d], CPU)
    assert norm.dtype == torch.float32 and norm.shape == () and norm.device == CPU
    assert float(norm) == pytest.approx(_norm64([a, b, c, d]), rel=1e-5)
    assert float(finite_norms([b], CPU)) == pytest.approx(_norm64([b]), rel=1e-5), "one half group alone"
    assert float(finite_norms([a], CPU)) == pytest.approx(_norm64([a]), rel=1e-6)
    empty = finite_norms(ignored, CPU)
    assert float(empty) == 0.0 and empty.dtype == torch.float32


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_finite_norms_is_non_finite_exactly_when_a_value_is(bad, dtype):
    t = torch.ones(6, dtype=dtype)
    assert math.isfinite(float(finite_norms([torch.ones(3), t], CPU)))
    t[2] = bad
    assert not math.isfinite(float(finite_norms([torch.ones(3), t], CPU)))


def test_finite_norms_overflows_past_float32_for_huge_finite_values():
    """Documented: non-finite also 'when elements beyond ~1e19 overflow float32's square'."""
    assert math.isinf(float(finite_norms([torch.tensor([3e19, 1.0])], CPU)))
    assert math.isfinite(float(finite_norms([torch.tensor([3e18, 1.0])], CPU)))


def test_optimizer_state_tensors_are_the_floating_entries_of_every_parameter():
    assert optimizer_state_tensors(None) == []
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert optimizer_state_tensors(opt) == []
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.state[model.bias]["count"] = torch.tensor([1, 2])  # not floating: not checked
    opt.state[model.bias]["nothing"] = torch.empty(0)
    found = optimizer_state_tensors(opt)
    expected = [v for p in (model.weight, model.bias) for k, v in opt.state[p].items() if k in ("step", "exp_avg",
                                                                                               "exp_avg_sq")]
    assert len(found) == 6 and all(any(f is e for e in expected) for f in found)


def test_max_skipped_steps_below_1_is_refused():
    with pytest.raises(ValueError, match="max_skipped_steps must be >= 1, got 0"):
        StepGuard(nn.Linear(2, 1), max_skipped_steps=0)
    assert StepGuard(nn.Linear(2, 1), max_skipped_steps=1).max_skipped_steps == 1


def _loop(guard, model, opt, losses, *, skip_at=()):
    """Feed the guard one step per loss value (a scaled copy of a fixed loss); returns what each
    step's loss and gradient norm were."""
    torch.manual_seed(0)
    x = torch.randn(8, 3)
    seen = []
    for step, scale in enumerate(losses):
        loss = model(x).pow(2).mean() * scale
        loss.backward()
        gn = compute_grad_norm(model.named_parameters()).total
        skip = torch.tensor(step in skip_at)
        guard.check_gradients(step, gn, losses=[loss], skip=skip)
        seen.append((float(loss.detach()), float(gn)))
        if step not in skip_at and math.isfinite(float(loss.detach())):
            opt.step()
        guard.check_update(step)
        opt.zero_grad()
    return seen


def test_the_verdict_keeps_the_first_bad_step_and_the_last_finite_one_before_it():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = StepGuard(model, opt, rank=1, world_size=2)
    assert not guard.failed() and guard.visible()[0] == -1 and guard.read()[0] == -1
    seen = _loop(guard, model, opt, [1.0, 2.0, 3.0, math.nan, math.inf, 1.0])
    assert guard.failed() and guard.failed(sync=False)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed(sync=False, stopped_at=5)
    err = info.value
    assert (err.step, err.rank, err.stopped_at, err.origin) == (3, 1, 5, "forward_backward")
    assert err.nonfinite == ["loss", "gradient_norm"], "step 3's flags, not step 4's"
    f = err.failure
    assert (f.world_size, f.previous_step) == (2, 2)
    assert f.previous_loss == pytest.approx(seen[2][0], rel=1e-6)
    assert f.previous_gradient_norm == pytest.approx(seen[2][1], rel=1e-6)
    assert math.isnan(f.loss) and math.isnan(f.gradient_norm)
    text = str(err)
    assert text.startswith("Non-finite loss and gradient norm at step 3 (rank 1 of 2): the loss is nan, the gradient "
                           "norm is nan.")
    assert text.endswith(next_steps_text(f))
    assert "debug_args.nancapture.enabled=true (or NaNCaptureMonitor in a plain loop)" in text
    # The host's copies agree (one read; the plain-loop raise without waiting used the free one).
    assert guard.read()[0] == 3 and guard.visible()[0] == 3


def test_a_skipped_update_is_not_a_failure_and_the_verdict_stays_clean():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = StepGuard(model, opt)
    seen = _loop(guard, model, opt, [1.0, math.nan, 2.0], skip_at=(1,))
    guard.raise_if_failed()  # nothing raised
    assert not guard.failed()
    host = guard.read()
    assert host[0] == -1 and host[9] == 2, "the last finite step is step 2 (the skipped NaN step is not)"
    assert host[10] == pytest.approx(seen[2][0], rel=1e-6) and host[11] == pytest.approx(seen[2][1], rel=1e-6)
    # The same NaN step without skip fails.
    guard2 = StepGuard(model, opt)
    _loop(guard2, model, opt, [1.0, math.nan])
    assert guard2.failed() and guard2.read()[0] == 1


def test_check_update_false_does_not_look_at_the_weights():
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight[0, 0] = math.nan
    off = StepGuard(model, None, check_update=False)
    off.check_update(0)
    assert not off.failed()
    on = StepGuard(model, None)
    on.check_update(0)
    assert on.failed()
    f = on.failure(on.read())
    assert (f.origin, f.nonfinite, f.param_names, f.param_counts) == (
        "optimizer_step", ["parameters"], ["weight"], {"weight": 1})
    assert "Parameters with NaN/Inf: 1: weight (1)." in f.describe()
    assert math.isfinite(float(StepGuard(nn.Linear(3, 1)).weight_norm)) is False, "NaN before the first check"


def test_the_weight_norm_after_each_checked_step_is_the_parameters_norm():
    model = nn.Linear(3, 2)
    guard = StepGuard(model)
    guard.check_update(0)
    assert float(guard.weight_norm) == pytest.approx(_norm64([p.detach() for p in model.parameters()]), rel=1e-6)


def _scaled_step(guard, model, opt, scaler, step, x, factor):
    base = model(x).pow(2).mean()
    loss = base / float(base.detach()) * factor  # the loss is `factor`
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    gn = compute_grad_norm(model.named_parameters()).total
    guard.check_gradients(step, gn, losses=[loss])
    scaler.step(opt)
    scaler.update()
    guard.check_update(step)
    opt.zero_grad()


def _fp16_setup():
    """A seeded linear model, SGD, a CPU GradScaler at 2**10 and a guard with max_skipped_steps=3: (model,
    optimizer, scaler, guard, inputs)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    return model, opt, scaler, StepGuard(model, opt, scaler=scaler, max_skipped_steps=3), torch.randn(8, 3)


def test_fp16_scaler_skips_count_and_only_max_skipped_in_a_row_fail():
    model, opt, scaler, guard, x = _fp16_setup()
    # 1e38: a finite loss whose scaled value overflows, so its gradients are Inf: the scaler skips the step.
    for step, factor in enumerate([1.0, 1e38, 1e38, 1.0, 1e38, 1e38]):
        _scaled_step(guard, model, opt, scaler, step, x, factor)
    assert int(guard.skipped_total) == 4 and not guard.failed(), "two runs of 2 skips: below 3 in a row"
    _scaled_step(guard, model, opt, scaler, 6, x, 1e38)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    err = info.value
    assert (err.step, err.origin, err.nonfinite) == (6, "skipped_steps", ["skipped_steps"])
    assert err.failure.skipped_in_a_row == 3 and err.failure.loss_scale == scaler.get_scale()
    assert str(err).startswith(f"fp16 loss scaling skipped 3 steps in a row up to step 6 (rank 0 of 1) "
                               f"(debug_args.nancapture.max_skipped_steps): each time the scaled gradients held "
                               f"Inf/NaN, and the loss scale (now {scaler.get_scale():.4g}) cannot recover.")


def test_the_skip_counts_go_on_from_a_saved_state(tmp_path):
    """A resumed run continues both counts: the total (logged as ``skipped_steps``) and the run in
    a row, so that a run stopped 2 skips short of ``max_skipped_steps=3`` stops at the next skip."""
    model, opt, scaler, guard, x = _fp16_setup()
    for step, factor in enumerate([1e38, 1.0, 1e38, 1e38]):
        _scaled_step(guard, model, opt, scaler, step, x, factor)
    saved = guard.state_dict()
    torch.save(saved, tmp_path / "guard.pt")
    state = torch.load(tmp_path / "guard.pt", weights_only=True)
    assert {k: int(v) for k, v in state.items()} == {"skipped_steps": 3, "skipped_in_a_row": 2}
    guard.skipped_total += 5  # in place: what was saved is a copy
    guard._skip_run += 5
    assert {k: int(v) for k, v in saved.items()} == {"skipped_steps": 3, "skipped_in_a_row": 2}
    resumed = StepGuard(model, opt, scaler=scaler, max_skipped_steps=3)
    resumed.load_state_dict(state)
    assert (resumed.skipped_total.dtype, resumed.skipped_total.shape) == (torch.int64, torch.Size([]))
    _scaled_step(resumed, model, opt, scaler, 4, x, 1e38)
    assert int(resumed.skipped_total) == 4
    with pytest.raises(NonFiniteStepError) as info:
        resumed.raise_if_failed()
    assert info.value.failure.skipped_in_a_row == 3
    # A checkpoint from before the counts were kept: both start at 0, as in a fresh run.
    fresh = StepGuard(model, opt, scaler=scaler, max_skipped_steps=3)
    fresh.load_state_dict({})
    _scaled_step(fresh, model, opt, scaler, 5, x, 1e38)
    assert int(fresh.skipped_total) == 1 and not fresh.failed()
    partial = StepGuard(model, opt, scaler=scaler, max_skipped_steps=3)
    partial.load_state_dict({"skipped_in_a_row": 2.0})  # a count however it was stored: an int64 again
    assert int(partial.skipped_total) == 0 and int(partial._skip_run) == 2
    assert partial._skip_run.dtype == torch.int64


def test_a_disabled_scaler_is_no_scaler():
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert StepGuard(nn.Linear(2, 1), scaler=scaler).scaler is None
    enabled = torch.amp.GradScaler("cpu")
    assert StepGuard(nn.Linear(2, 1), scaler=enabled).scaler is enabled


def test_another_rank_s_failure_is_described_as_such():
    guard = StepGuard(nn.Linear(2, 1), rank=1, world_size=4)
    f = guard.failure(guard.read(), stopped_at=9, other_rank_step=7)
    assert (f.step, f.origin, f.other_rank_step, f.stopped_at) == (-1, "forward_backward", 7, 9)
    assert f.describe() == "Another rank found a non-finite value at step 7; rank 1 stopped with it."


def test_the_error_pickles_with_its_data():
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.bias[0] = math.inf
    guard = StepGuard(model)
    guard.check_update(4)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    err = info.value
    back = pickle.loads(pickle.dumps(err))
    for e in (err, back):
        assert (e.step, e.rank, e.origin, e.nonfinite, e.param_names) == (4, 0, "optimizer_step", ["parameters"],
                                                                           ["bias"])
        assert e.state_entries == [] and e.optimizer == "" and e.capture_path is None and e.checkpoint is None
        assert str(e) == str(err) and e.stopped_at == 4 and e.command == ""


def test_long_name_lists_are_shortened_with_a_count():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])  # 8 parameters
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.view(-1)[: i + 1] = math.nan
    guard = StepGuard(model)
    guard.check_update(0)
    f = guard.failure(guard.read())
    assert len(f.param_names) == 8
    assert ("Parameters with NaN/Inf: 8: 0.weight (1), 0.bias (2), 1.weight (3), 1.bias (2), 2.weight (4), 2.bias (2), "
            "... (2 more).") in f.describe()


def test_the_error_pickles_with_its_capture_checkpoint_and_command(tmp_path):
    guard = StepGuard(nn.Linear(2, 1))
    failure = guard.failure([3.0, 1, 0, 0, 0, 0, math.nan, math.nan, 0, -1, math.nan, math.nan])
    err = NonFiniteStepError("stopped", failure, capture_path=tmp_path / "c.pt", checkpoint=tmp_path / "last.ckpt",
                             command="stabletrain train out=x resume_from=y")
    back = pickle.loads(pickle.dumps(err))
    assert (back.capture_path, back.checkpoint, back.command) == (
        tmp_path / "c.pt", tmp_path / "last.ckpt", "stabletrain train out=x resume_from=y")
    assert (str(back), back.step, back.nonfinite) == ("stopped", 3, ["loss"])


def test_an_update_checked_without_its_gradients_says_so():
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight[0, 1] = math.inf
    guard = StepGuard(model)
    guard.check_update(2)  # a plain loop that checks updates only
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    # The first step the guard checked, and nothing before it: not said to have written them.
    assert str(info.value).startswith(
        "After the optimizer step of step 2 (rank 0 of 1), the first this guard checked, the weights or the optimizer "
        "state hold non-finite values (its loss and gradients were not checked). Nothing checked them before that "
        "step, so they may have come in so: the step is not known to have done it. Parameters with NaN/Inf: 1: "
        "weight (1).")


def test_huge_weights_checked_without_gradients_say_so_and_a_state_only_check_skips_them():
    """Finite weights of 1e30: the default check stops (their float32 L2 norm overflows) and says the
    step's loss and gradients were not checked; ``check_parameters=False`` (the integrations') checks
    the optimizer state only and stops on its Inf in Adam's exp_avg_sq, naming it."""
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight[0, 1] = 1e30
    guard = StepGuard(model)
    guard.check_update(2)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    assert str(info.value).startswith(
        "After the optimizer step of step 2 (rank 0 of 1), the first this guard checked, the weights are so large "
        "(its loss and gradients were not checked) that their float32 norm overflows: every value is still finite, "
        "but |w| reaches 1e+30 in weight")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    state_only = StepGuard(model, opt, check_parameters=False)
    state_only.check_update(2)
    state_only.raise_if_failed()  # the weights are not checked; the state is finite
    assert math.isnan(float(state_only.weight_norm))
    with torch.no_grad():
        model.bias[0] = math.nan
    state_only.check_update(3)
    state_only.raise_if_failed()  # a NaN weight: the next forward pass shows it, not this check
    opt.state[model.bias]["exp_avg_sq"][0] = math.inf
    state_only.check_update(4)
    with pytest.raises(NonFiniteStepError) as info:
        state_only.raise_if_failed()
    assert (info.value.step, info.value.state_entries, info.value.nonfinite) == (4, ["bias: exp_avg_sq"],
                                                                                 ["optimizer_state"])
    assert str(info.value).endswith("\nNext: fix the optimizer step (see above); restart from weights saved before "
                                    "this step. stabletrain diagnose replays the step offline from a capture "
                                    "(debug_args.nancapture in the trainer).")
    with pytest.raises(NonFiniteStepError) as info:
        state_only.raise_if_failed(next_steps="Next: your own advice.")
    assert str(info.value).endswith("\nNext: your own advice."), "the caller's last line instead of the plain loop's"
    assert "debug_args.nancapture in the trainer" not in str(info.value)


def test_huge_but_finite_weights_and_state_are_told_apart_by_value():
    """Every value finite, but the float32 norm the guard checks overflowed: of the weights (SGD, lr
    1e24) or of AdamW's second moment (gradients of 1e19); the message names the tensor and its size."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -0.25]]))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    guard = StepGuard(model, opt)
    model.weight.grad = torch.full_like(model.weight, 1e19)
    guard.check_gradients(0, compute_grad_norm(model.named_parameters()).total, losses=[torch.tensor(2.0)])
    opt.step()
    guard.check_update(0)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    w = float(model.weight.detach().abs().max())
    assert str(info.value).startswith(
        "The optimizer step of step 0 (rank 0 of 1) left optimizer state so large, from finite gradients (loss 2, "
        "gradient norm 1.414e+19), that its float32 norm overflows: every value is still finite, but weight: exp_avg_sq "
        "reaches 1e+35 (the squares of its 2 values sum to 2e+70, past float32's largest value 3.4e+38, so the float32 "
        "L2 norm the guard checks overflows (one value alone does it from about 1.8e+19)); the weights stay smaller, "
        f"|w| up to {w:.4g} in weight. Optimizer: torch.optim.AdamW. exp_avg_sq holds an average of squared gradients: "
        "1e+35 needs a gradient of at least 3.16e+17 (gradient norm 1.414e+19): the gradients are exploding, not the "
        "weights.")

    sgd_model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        sgd_model.weight.copy_(torch.tensor([[0.5, -0.25]]))
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=1e24)
    guard = StepGuard(sgd_model, sgd)
    sgd_model.weight.grad = torch.tensor([[2.0, -4.0]])
    guard.check_gradients(0, compute_grad_norm(sgd_model.named_parameters()).total, losses=[torch.tensor(2.0)])
    sgd.step()
    guard.check_update(0)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    assert str(info.value).startswith(
        "The optimizer step of step 0 (rank 0 of 1) made the weights so large, from finite gradients (loss 2, gradient "
        "norm 4.472), that their float32 norm overflows: every value is still finite, but |w| reaches 4e+24 in weight "
        "(the squares of its 2 values sum to 2e+49, past float32's largest value 3.4e+38, so the float32 L2 norm the "
        "guard checks overflows (one value alone does it from about 1.8e+19)). Optimizer: torch.optim.SGD. The learning rate is 1e+24: SGD moves a weight by lr x its gradient.")


def _nan_state(n_params: int):
    """A model of ``n_params`` parameters whose AdamW state is NaN (weights finite): 2 entries each
    (exp_avg, exp_avg_sq; the 0-dim step is finite)."""
    model = nn.Sequential(*[nn.Linear(1, 1, bias=False) for _ in range(n_params)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    guard = StepGuard(model, opt)
    guard.check_gradients(0, torch.tensor(1.0), losses=[torch.tensor(1.0)])
    for st in opt.state.values():  # as step 0's update would: after the check before it
        st["exp_avg"].fill_(math.nan)
        st["exp_avg_sq"].fill_(math.nan)
    guard.check_update(0)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    return info.value


def test_the_message_is_the_description_then_the_next_steps():
    err = _nan_state(3)  # 6 state entries: all shown
    f = err.failure
    assert err.state_entries == [f"{i}.weight: {k}" for i in range(3) for k in ("exp_avg", "exp_avg_sq")]
    assert str(err) == f.describe() + "\n" + next_steps_text(f)
    assert f.describe() == (
        "The optimizer step of step 0 (rank 0 of 1) wrote non-finite values from finite gradients (loss 1, gradient "
        "norm 1). Optimizer: torch.optim.AdamW. Optimizer state with NaN/Inf: 0.weight: exp_avg, 0.weight: exp_avg_sq, "
        "1.weight: exp_avg, 1.weight: exp_avg_sq, 2.weight: exp_avg, 2.weight: exp_avg_sq.")
    assert next_steps_text(f) == (
        "Next: fix the optimizer step (see above); restart from weights saved before this step. stabletrain diagnose "
        "replays the step offline from a capture (debug_args.nancapture in the trainer).")
    more = _nan_state(4)  # 8 entries: 6 shown
    assert more.failure.describe().endswith(
        "Optimizer state with NaN/Inf: 0.weight: exp_avg, 0.weight: exp_avg_sq, 1.weight: exp_avg, 1.weight: "
        "exp_avg_sq, 2.weight: exp_avg, 2.weight: exp_avg_sq, ... (2 more).")


def test_the_plain_loop_advice_for_a_forward_backward_failure():
    guard = StepGuard(nn.Linear(2, 1))
    guard.check_gradients(0, torch.tensor(math.inf), losses=[torch.tensor(1.0)])
    f = guard.failure(guard.read())
    assert next_steps_text(f) == ("Next: turn on debug_args.nancapture.enabled=true (or NaNCaptureMonitor in a plain "
                                  "loop) for a capture of that step, then stabletrain diagnose on it.")


def test_six_names_are_shown_without_a_count():
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(3)])  # 6 parameters
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan)
    guard = StepGuard(model)
    guard.check_update(0)
    f = guard.failure(guard.read())
    assert f.describe().endswith("Parameters with NaN/Inf: 6: 0.weight (1), 0.bias (1), 1.weight (1), 1.bias (1), "
                                 "2.weight (1), 2.bias (1).")
