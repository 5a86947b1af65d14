"""The first optimizer step a StepGuard checks: it is blamed only for what it did. Weights or optimizer
state out of range before it (a model or a state loaded so) are told as such, from the check the
first ``check_gradients`` made before the step; with nothing checked before it the message says the
step is not known to have done it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stabletrain.safety.guard import ORIGIN_OPTIMIZER, NonFiniteStepError, StepGuard, next_steps_text

#: Past sqrt(float32's largest value): finite, but the guard's float32 L2 norm of the weights overflows.
HUGE = 2e19


def _model(first: float = 0.5) -> nn.Linear:
    """y = w0 x0 + w1 x1 with x0 = 0 below: w0 may be huge without the loss or the gradients being so."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[first, 0.5]]))
    return model


def _step(model: nn.Module, optimizer, guard: StepGuard, step: int, check_gradients: bool = True) -> None:
    loss = model(torch.tensor([[0.0, 1.0]])).pow(2).sum()
    loss.backward()
    if check_gradients:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        guard.check_gradients(step, norm, losses=[loss])
    optimizer.step()
    optimizer.zero_grad()
    guard.check_update(step)


def _run(model: nn.Module, optimizer, steps: int = 3, **kw) -> NonFiniteStepError:
    guard = StepGuard(model, optimizer)
    with pytest.raises(NonFiniteStepError) as info:
        for step in range(steps):
            _step(model, optimizer, guard, step, **kw)
            guard.raise_if_failed()
    assert info.value.failure.origin == ORIGIN_OPTIMIZER
    return info.value


def test_weights_already_past_the_limit_are_not_blamed_on_the_step():
    model = _model(HUGE)
    err = _run(model, torch.optim.SGD(model.parameters(), lr=0.1))
    f = err.failure
    assert (f.step, f.before) == (0, "already")
    assert str(err).startswith(
        "Before the optimizer step of step 0 (rank 0 of 1), the first this guard checked, the weights were already "
        "so large that their float32 norm overflows: every value is still finite, but |w| reaches 2e+19 in weight")
    assert "What was out of range before that step came in so" in str(err)
    assert "made the weights" not in str(err) and "learning rate" not in str(err)
    assert str(err).endswith(next_steps_text(f)) and "the run started from" in next_steps_text(f)


def test_a_first_step_that_makes_the_weights_too_large_is_blamed():
    """The case where "already" would be false: the weights are fine before step 0 and its update
    (lr x gradient, 1e20 x 1) makes them too large."""
    model = _model()
    err = _run(model, torch.optim.SGD(model.parameters(), lr=1e20))
    f = err.failure
    assert (f.step, f.before) == (0, "")
    assert str(err).startswith("The optimizer step of step 0 (rank 0 of 1) made the weights so large, from finite "
                               "gradients (loss 0.25, gradient norm 1), that their float32 norm overflows")
    assert "restart from weights saved before this step" in str(err)


def test_a_later_step_is_blamed_after_earlier_checks_passed():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard(model, optimizer)
    _step(model, optimizer, guard, 0)
    guard.raise_if_failed()
    with torch.no_grad():
        model.weight[0, 0] = HUGE  # between two checked steps: the guard can only see it after step 1
    _step(model, optimizer, guard, 1)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    assert (info.value.failure.step, info.value.failure.before) == (1, "")
    assert str(info.value).startswith("The optimizer step of step 1 (rank 0 of 1) made the weights so large")


def test_with_only_check_update_the_first_step_is_not_known_to_have_done_it():
    model = _model(HUGE)
    err = _run(model, torch.optim.SGD(model.parameters(), lr=0.1), check_gradients=False)
    assert err.failure.before == "unchecked"
    assert str(err).startswith(
        "After the optimizer step of step 0 (rank 0 of 1), the first this guard checked, the weights are so large "
        "(its loss and gradients were not checked) that their float32 norm overflows")
    assert "Nothing checked them before that step, so they may have come in so" in str(err)
    assert str(err).endswith(next_steps_text(err.failure)) and "guard.check_before" in str(err)


def test_optimizer_state_loaded_with_an_inf_is_told_as_loaded_not_as_an_overflow():
    """Adam's exp_avg_sq holding an Inf before the first step (a state loaded so): the step leaves it
    Inf with the weights finite. The explanation that the squared gradient overflowed would be false."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.tensor([[0.0, 1.0]])).sum().backward()
    optimizer.step()  # creates the state; then it is "loaded" with an Inf
    optimizer.zero_grad()
    optimizer.state[model.weight]["exp_avg_sq"][0, 0] = float("inf")
    err = _run(model, optimizer)
    f = err.failure
    assert (f.step, f.before, f.state_entries) == (0, "already", ["weight: exp_avg_sq"])
    assert str(err).startswith("Before the optimizer step of step 0 (rank 0 of 1), the first this guard checked, "
                               "the weights or the optimizer state already held non-finite values.")
    assert f.explanation and f.explanation not in str(err)  # "the squared gradient overflowed": not what happened
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_the_same_inf_written_by_the_first_step_is_explained():
    """The counter-case: the state is finite before step 0 and its gradient (1e21: (1 - beta2) g^2 is
    past float32) overflows exp_avg_sq in that step: the step did it, and the explanation says how.
    (The norm handed to the guard is taken in float64: finite.)"""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    guard = StepGuard(model, optimizer)
    loss = model(torch.tensor([[0.0, 1e21]])).sum()
    loss.backward()
    guard.check_gradients(0, model.weight.grad.double().norm(), losses=[loss])
    optimizer.step()
    guard.check_update(0)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    f = info.value.failure
    assert (f.before, f.state_entries) == ("", ["weight: exp_avg_sq"])
    assert str(info.value).startswith("The optimizer step of step 0 (rank 0 of 1) wrote non-finite values")
    assert "the squared gradient overflowed" in f.explanation and f.explanation in str(info.value)


def test_the_check_before_the_first_step_runs_once():
    """Only the first check_gradients checks the weights and state: a later one costs nothing more."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard(model, optimizer)
    calls = []
    original = guard._update_flags
    guard._update_flags = lambda: calls.append(1) or original()  # type: ignore[method-assign]
    for step in range(3):
        _step(model, optimizer, guard, step)
    assert len(calls) == 1 + 3  # the first check_gradients, then each check_update
    guard.raise_if_failed()


class _Regressor(nn.Module):
    """A model whose unused parameter starts past the guard's limit (as if loaded so)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 1)
        self.unused = nn.Parameter(torch.tensor([HUGE, 0.0]))

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch):
        return nn.functional.mse_loss(self(batch["x"]), batch["y"]) + 0.0 * self.unused[1]


class _Points(torch.utils.data.Dataset):
    def __init__(self, n=64):
        self.x = torch.randn(n, 4)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def test_the_trainer_tells_weights_that_started_out_of_range_and_suggests_no_step_setting(tmp_path):
    import stabletrain

    torch.manual_seed(0)
    with pytest.raises(NonFiniteStepError) as info:
        stabletrain.train(out=tmp_path / "out", model=_Regressor(), data=_Points(), steps=4, batch_size=8, num_workers=0,
                          model_args={"lr": 1e-2})
    text = str(info.value)
    assert text.startswith("Before the optimizer step of step 0 (rank 0 of 1), the first this guard checked, the "
                           "weights were already so large that their float32 norm overflows")
    assert "|w| reaches 2e+19 in unused" in text
    nexts = text.split("\nNext:\n")[1].splitlines()
    assert nexts == ["  - check the weights and optimizer state the run started from (its initialisation, or the "
                     "checkpoint it resumed from): they were out of range before its first optimizer step"]
    assert "learning rate" not in text and "model_args.lr" not in text


def _huge_momentum(check_gradients: bool) -> NonFiniteStepError:
    """SGD's momentum buffer holds 3e19 before step 0 (finite, past the norm's limit; loaded so)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([[0.0, 1.0]])).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.state[model.weight]["momentum_buffer"][0, 0] = 3e19
    return _run(model, optimizer, check_gradients=check_gradients)


TRIP = ("that its float32 norm overflows: every value is still finite, but weight: momentum_buffer reaches 2.7e+19 (the "
        "squares of its 2 values sum to 7.29e+38, past float32's largest value 3.4e+38, so the float32 L2 norm the "
        "guard checks overflows (one value alone does it from about 1.8e+19)); the weights stay smaller, |w| up to "
        "2.7e+18 in weight.")


def test_optimizer_state_already_past_the_limit_is_told_in_full():
    err = _huge_momentum(check_gradients=True)
    assert err.failure.describe() == (
        "Before the optimizer step of step 0 (rank 0 of 1), the first this guard checked, the optimizer state was "
        "already so large " + TRIP + " What was out of range before that step came in so (the initial or loaded "
        "weights or optimizer state), not from a step this guard watched. Optimizer: torch.optim.SGD.")
    assert next_steps_text(err.failure) == (
        "Next: check the weights and optimizer state the run started from (initialisation, or the checkpoint loaded): "
        "they were out of range before the first optimizer step.")


def test_optimizer_state_past_the_limit_with_nothing_checked_before_is_told_in_full():
    err = _huge_momentum(check_gradients=False)
    assert err.failure.describe() == (
        "After the optimizer step of step 0 (rank 0 of 1), the first this guard checked, the optimizer state is so "
        "large (its loss and gradients were not checked) " + TRIP + " Nothing checked them before that step, so they "
        "may have come in so: the step is not known to have done it. Optimizer: torch.optim.SGD. weight: "
        "momentum_buffer is past what its float32 norm holds.")  # no "(gradient norm nan)": none was checked
    assert next_steps_text(err.failure) == (
        "Next: call guard.check_gradients (or guard.check_before) before the optimizer step too: it checks the "
        "weights and optimizer state before the first step, so a failure there says whether that step did it. If "
        "it did, fix the optimizer step and restart from weights saved before it.")


def test_non_finite_state_already_there_is_told_in_full():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([[0.0, 1.0]])).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.state[model.weight]["momentum_buffer"][0, 0] = float("nan")
    err = _run(model, optimizer)
    assert err.failure.describe() == (
        "Before the optimizer step of step 0 (rank 0 of 1), the first this guard checked, the weights or the optimizer "
        "state already held non-finite values. What was out of range before that step came in so (the initial or "
        "loaded weights or optimizer state), not from a step this guard watched. Optimizer: torch.optim.SGD. "
        "Parameters with NaN/Inf: 1: weight (1). Optimizer state with NaN/Inf: weight: momentum_buffer.")


def test_a_callers_advice_gives_way_only_when_no_step_did_it():
    """The integrations pass their own last line (fix the step...): false when the values came in so."""
    model = _model(HUGE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard(model, optimizer)
    _step(model, optimizer, guard, 0)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed(next_steps="Next: mine.")
    assert str(info.value).endswith("\n" + next_steps_text(info.value.failure))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e20)
    guard = StepGuard(model, optimizer)
    _step(model, optimizer, guard, 0)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed(next_steps="Next: mine.")
    assert info.value.failure.before == "" and str(info.value).endswith("\nNext: mine.")


def test_a_guard_that_checks_no_updates_checks_nothing_before_them():
    model = _model(HUGE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard(model, optimizer, check_update=False)
    calls = []
    original = guard._update_flags
    guard._update_flags = lambda: calls.append(1) or original()  # type: ignore[method-assign]
    for step in range(2):
        _step(model, optimizer, guard, step)
    guard.raise_if_failed()  # huge weights, but the updates are not checked
    assert calls == []
