"""SkipStep on its own: a skipped step leaves parameters and optimizer state bitwise as they were,
also after the optimizer's state tensors were replaced (a rollback loads a snapshot into the
optimizer, then training and skipping go on); what the saved copy costs."""

from __future__ import annotations

import copy

import pytest
import torch

from stabletrain.safety.skip_step import SkipStep, optimizer_tensors


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _backward(model):
    model(torch.randn(4, 3)).pow(2).sum().backward()


def _values(opt):
    return [t.detach().clone() for t in optimizer_tensors(opt)]


def test_saved_bytes_is_the_parameters_and_their_floating_state():
    model, opt = _setup()
    skipper = SkipStep(opt)
    assert skipper.saved_bytes == 0
    _backward(model)
    opt.step()
    skipper.save()
    params = sum(p.numel() for p in model.parameters())
    assert skipper.saved_bytes == 3 * params * 4, "weights, exp_avg, exp_avg_sq in float32 (not the 0-dim step)"


def test_a_skip_after_the_optimizer_state_was_replaced_restores_the_new_state():
    model, opt = _setup()
    skipper = SkipStep(opt)
    for _ in range(2):
        _backward(model)
        skipper.save()
        opt.step()
        skipper.apply(torch.tensor(False))
        opt.zero_grad()
    # A rollback: the optimizer gets a snapshot's state (new tensors, as many as before).
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    before = _values(opt)
    _backward(model)
    skipper.save()
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, _values(opt)))
    skipper.apply(torch.tensor(True))
    assert all(torch.equal(a, b) for a, b in zip(before, _values(opt))), "skipped: bitwise as before the step"


# ------------------------------------------------------------------------------------------------
# Which step is taken follows the optimizer's settings as they change (the choice is cached)


def _sgd(**settings):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, **settings)


@pytest.mark.parametrize("change", [
    {"amsgrad": True}, {"maximize": True}, {"differentiable": True}, {"fused": True}, {"capturable": True},
])
def test_a_setting_changed_mid_run_that_the_skip_aware_step_does_not_follow_switches_to_the_copy(change,
                                                                                                  monkeypatch):
    from stabletrain.safety import skip_aware

    monkeypatch.setattr(skip_aware, "_AGREES", {})
    model, opt = _setup()
    skipper = SkipStep(opt)
    _backward(model)
    skipper.save(torch.tensor(False))
    assert skipper.mode == "skip_aware"
    opt.step()
    checked = dict(skip_aware._AGREES)
    opt.param_groups[0].update(change)
    skipper.save(torch.tensor(False))
    assert skipper.mode == "copy", change
    assert skip_aware._AGREES == checked, f"{change}: refused from the settings, without running the check"


@pytest.mark.parametrize("optimizer, change", [
    ("sgd", {"lr": torch.tensor(0.1)}), ("sgd", {"weight_decay": torch.tensor(0.1)}),
    ("adam", {"betas": (torch.tensor(0.9), 0.999)}),
])
def test_a_tensor_hyperparameter_is_refused_without_running_the_check(optimizer, change, monkeypatch):
    """The same values as tensors (weight decay 0.1 before and after): the type alone is refused."""
    from stabletrain.safety import skip_aware

    monkeypatch.setattr(skip_aware, "_AGREES", {})
    _, opt = _sgd(weight_decay=0.1) if optimizer == "sgd" else _setup()
    skipper = SkipStep(opt)
    skipper.save(torch.tensor(False))
    assert skipper.mode == "skip_aware"
    checked = dict(skip_aware._AGREES)
    opt.param_groups[0].update(change)
    skipper.save(torch.tensor(False))
    assert skipper.mode == "copy" and skip_aware._AGREES == checked


def test_an_lr_tensor_params_of_another_dtype_or_a_new_group_are_seen_mid_run():
    model, opt = _setup()
    skipper = SkipStep(opt)
    skipper.save(torch.tensor(False))
    assert skipper.mode == "skip_aware"
    opt.param_groups[0]["lr"] = torch.tensor(0.1)  # a tensor lr: not followed
    skipper.save(torch.tensor(False))
    assert skipper.mode == "copy"
    opt.param_groups[0]["lr"] = 0.1
    skipper.save(torch.tensor(False))
    assert skipper.mode == "skip_aware"
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    opt.add_param_group({"params": [half]})  # float16 parameters: not followed
    skipper.save(torch.tensor(False))
    assert skipper.mode == "copy"
    model2, opt2 = _setup()
    skipper2 = SkipStep(opt2)
    group = opt2.param_groups[0]
    group["params"] = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float16)), *group["params"]]
    skipper2.save(torch.tensor(False))
    assert skipper2.mode == "copy", "a float16 parameter put first in the group: not followed"
    empty = torch.optim.SGD([{"params": []}, {"params": list(torch.nn.Linear(2, 2).parameters())}], lr=0.1)
    assert SkipStep(empty).can_skip_aware(), "an empty group takes no step"


@pytest.mark.parametrize("change", [
    {"weight_decay": 0.1}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}, {"momentum": 0.9, "dampening": 0.5},
    {"foreach": True},
])
def test_each_sgd_configuration_is_checked_against_torch_before_its_first_step(change, monkeypatch):
    from stabletrain.safety import skip_aware

    monkeypatch.setattr(skip_aware, "_AGREES", {})  # checks made in this test only
    model, opt = _sgd()
    skipper = SkipStep(opt)
    skipper.save(torch.tensor(False))  # the plain configuration, checked once and cached
    assert len(skip_aware._AGREES) == 1
    before = set(skip_aware._AGREES)
    opt.param_groups[0].update(change)
    skipper.save(torch.tensor(False))
    checked = set(skip_aware._AGREES) - before
    assert skipper.mode == "skip_aware" and checked, f"{change}: checked, not taken from the plain one's cache"
    _backward(model)
    opt.step()  # and the step it takes is torch's (checked) one


def test_the_adam_configurations_that_select_different_operations_are_told_apart():
    from stabletrain.safety.skip_aware import _structure

    base = {"weight_decay": 0.0}
    assert _structure(torch.optim.Adam, base) == ("adam", False, False)
    assert _structure(torch.optim.AdamW, base) == ("adam", True, False)
    assert _structure(torch.optim.Adam, {"weight_decay": 0.1, "decoupled_weight_decay": True}) == ("adam", True, True)
    sgd = {"weight_decay": 0.1, "momentum": 0.9, "nesterov": 1, "dampening": 0.5}
    assert _structure(torch.optim.SGD, sgd) == ("sgd", True, True, True, True)


def test_the_local_view_of_an_fsdp_shard_is_one_object_while_its_memory_stays(gloo_group_of_one):
    """Under FSDP2 the saved copies are matched to the live tensors by identity: the local view of a
    DTensor is the same object on every call while its shard stays where it is, a new one once it
    moved, and its cache entry goes with the DTensor."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from stabletrain.safety import skip_step

    mesh = init_device_mesh("cpu", (1,))
    plain = torch.zeros(3)
    assert skip_step.local_view(plain) is plain, "a plain tensor is its own view"
    d = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    first = skip_step.local_view(d)
    assert skip_step.local_view(d) is first and torch.equal(first, torch.arange(4.0))
    first.add_(1)  # writing the view writes the DTensor
    assert torch.equal(d.to_local(), torch.arange(4.0) + 1)
    with torch.no_grad():
        d._local_tensor = torch.zeros(4)  # the shard moved (as FSDP2 may reallocate it)
    moved = skip_step.local_view(d)
    assert moved is not first and moved.data_ptr() == d.to_local().data_ptr()
    assert skip_step.local_view(d) is moved
    with torch.no_grad():
        d._local_tensor = torch.zeros(2)  # a resharded shard of another size, same storage kind
    assert skip_step.local_view(d).shape == (2,)
    other = distribute_tensor(torch.ones(2), mesh, [Shard(0)])
    assert skip_step.local_view(other) is not skip_step.local_view(d)
    key = id(d)
    assert key in skip_step._LOCAL_VIEWS
    del d, first, moved
    gc.collect()
    assert key not in skip_step._LOCAL_VIEWS, "the entry goes with its DTensor"


def test_mode_is_none_until_the_first_save():
    model, opt = _setup()
    skipper = SkipStep(opt)
    assert skipper.mode is None
    skipper.save()
    assert skipper.mode == "copy"


def test_the_skip_aware_step_returns_what_torch_s_step_returns():
    """``optimizer.step()`` gives None, and ``optimizer.step(closure)`` the closure's loss (computed with grad)."""
    model, opt = _setup()
    skipper = SkipStep(opt)
    _backward(model)
    skipper.save(torch.tensor(False))
    assert skipper.mode == "skip_aware"
    assert opt.step() is None
    x = torch.randn(4, 3)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    skipper.save(torch.tensor(False))
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        expected = model(x).pow(2).sum()  # the loss at the weights before the step
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and torch.equal(loss.detach(), expected)
    assert loss.requires_grad, "the closure ran with grad enabled"
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the closure's gradients stepped"


@pytest.mark.parametrize("flag", [torch.tensor(1), torch.tensor([1.0]), torch.tensor([True])], ids=str)
def test_a_flag_of_another_dtype_or_of_shape_one_skips_as_a_bool_does(flag):
    for skip_aware in (True, False):
        model, opt = _setup()
        skipper = SkipStep(opt, skip_aware=skip_aware)
        _backward(model)
        opt.step()  # the state exists
        before = _values(opt)
        skipper.save(flag)
        assert skipper.mode == ("skip_aware" if skip_aware else "copy")
        opt.step()
        skipper.apply(flag)
        assert all(torch.equal(a, b) for a, b in zip(before, _values(opt))), (flag, skip_aware)


def test_the_choice_is_checked_once_while_the_settings_stay(monkeypatch):
    from stabletrain.safety import skip_step

    calls = []
    real = skip_step.supported
    monkeypatch.setattr(skip_step, "supported", lambda opt: calls.append(opt) or real(opt))
    model, opt = _setup()
    skipper = SkipStep(opt)
    for _ in range(3):
        _backward(model)
        skipper.save(torch.tensor(False))
        opt.step()
        skipper.apply(torch.tensor(False))
    assert len(calls) == 1, "at setup only"
    opt.param_groups[0]["weight_decay"] = 0.0
    skipper.save(torch.tensor(False))
    assert len(calls) == 2, "a setting changed: checked again"


class _OwnParameter(torch.nn.Parameter):
    """A Parameter subclass: its operations may be its own, so only the copy follows it."""


@pytest.mark.parametrize("replace", ["first-by-float16", "first-by-subclass", "group-by-a-new-one"])
def test_parameters_replaced_mid_run_are_seen(replace):
    """The group's list of parameters edited in place, or a new group in its place with as many
    parameters and the same settings: the choice is made again."""
    model, opt = _setup()
    skipper = SkipStep(opt)
    skipper.save(torch.tensor(False))
    assert skipper.mode == "skip_aware"
    group = opt.param_groups[0]
    first = group["params"][0]
    if replace == "first-by-float16":
        group["params"][0] = torch.nn.Parameter(first.detach().half())
    elif replace == "first-by-subclass":
        group["params"][0] = _OwnParameter(first.detach().clone())
    else:
        opt.param_groups[0] = {**group, "params": [first, torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))]}
    skipper.save(torch.tensor(False))
    assert skipper.mode == "copy", replace


def test_nesterov_switched_on_mid_run_is_checked_against_torch(monkeypatch):
    from stabletrain.safety import skip_aware

    monkeypatch.setattr(skip_aware, "_AGREES", {})
    model, opt = _sgd(momentum=0.9)
    skipper = SkipStep(opt)
    skipper.save(torch.tensor(False))
    before = set(skip_aware._AGREES)
    opt.param_groups[0]["nesterov"] = True
    skipper.save(torch.tensor(False))
    assert skipper.mode == "skip_aware" and set(skip_aware._AGREES) - before, "checked, not taken from the cache"


@pytest.mark.parametrize("optimizer, change", [
    ("sgd", {"dampening": 0.5}), ("adam", {"decoupled_weight_decay": False}),
])
def test_a_setting_that_selects_other_operations_changed_mid_run_is_checked_again(optimizer, change, monkeypatch):
    """Dampening (SGD with momentum) and Adam's decoupled decay pick other operations of torch's
    step: switched mid-run, the next step is checked against torch before it is taken."""
    from stabletrain.safety import skip_aware

    monkeypatch.setattr(skip_aware, "_AGREES", {})
    _, opt = _sgd(momentum=0.9) if optimizer == "sgd" else _setup()
    skipper = SkipStep(opt)
    skipper.save(torch.tensor(False))
    before = set(skip_aware._AGREES)
    opt.param_groups[0].update(change)
    skipper.save(torch.tensor(False))
    assert skipper.mode == "skip_aware" and set(skip_aware._AGREES) - before, "checked, not taken from the cache"


def test_betas_made_tensors_mid_run_turn_the_skip_aware_step_off():
    """Tensor betas are outside the skip-aware step: set mid-run, the next step is the copy."""
    model, opt = _setup()
    skipper = SkipStep(opt)
    skipper.save(torch.tensor(False))
    assert skipper.mode == "skip_aware"
    opt.param_groups[0]["betas"] = (torch.tensor(0.9), torch.tensor(0.999))
    _backward(model)
    skipper.save(torch.tensor(True))
    assert skipper.mode == "copy"


def test_sgd_with_and_without_dampening_are_checked_apart(monkeypatch):
    from stabletrain.safety import skip_aware

    monkeypatch.setattr(skip_aware, "_AGREES", {})
    SkipStep(_sgd(momentum=0.9)[1])
    SkipStep(_sgd(momentum=0.9, dampening=0.5)[1])
    assert len(skip_aware._AGREES) == 2


def test_a_skipped_step_leaves_fsdp_shards_bitwise_as_they_were(gloo_group_of_one):
    """DTensor parameters (FSDP2's) take the copy, saved and restored through their local shards:
    the same view object on every call, so that each saved copy finds its live tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])),
              torch.nn.Parameter(distribute_tensor(torch.randn(4), mesh, [Shard(0)]))]
    opt = torch.optim.AdamW(params, lr=0.1)
    skipper = SkipStep(opt)
    for step in range(3):
        for p in params:
            p.grad = distribute_tensor(torch.randn(p.shape), mesh, [Shard(0)])
        before = [t.detach().clone() for t in optimizer_tensors(opt)]
        flag = torch.tensor(step == 2)
        skipper.save(flag)
        assert skipper.mode == "copy"
        opt.step()
        skipper.apply(flag)
    after = [t.detach().clone() for t in optimizer_tensors(opt)]
    assert len(after) == len(before) == 6
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "skipped: every shard as before"
