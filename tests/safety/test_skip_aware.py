"""The skip-aware step (safety/skip_aware.py): kept steps bitwise torch's own AdamW / Adam / SGD,
skipped steps leave parameters and state exactly as they were, no copy is made, no host sync is
added, and a configuration whose arithmetic does not match torch's falls back to the copy."""

from __future__ import annotations

import copy

import pytest
import torch

from stabletrain.safety import skip_aware
from stabletrain.safety.instability_guard import InstabilityGuard
from stabletrain.safety.skip_step import SkipStep
from stabletrain.utils.sync import CountSyncs

CONFIGS = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.95), "eps": 1e-6, "foreach": True}),
    (torch.optim.Adam, {"lr": 1e-2}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05, "foreach": True}),
    (torch.optim.SGD, {"lr": 1e-2}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-3}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "foreach": True}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1, "foreach": True}),
    # Each path of the step once more: Adam's L2 decay tensor by tensor, Adam with decoupled decay
    # (as AdamW) both ways, SGD's decay with and without momentum by foreach, dampening and
    # Nesterov tensor by tensor.
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05, "decoupled_weight_decay": True}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05, "decoupled_weight_decay": True, "foreach": True}),
    (torch.optim.SGD, {"lr": 1e-2, "weight_decay": 1e-3, "foreach": True}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-3, "foreach": True}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
]
SKIPPED = {0, 3, 6}  # 0: a skipped first step (no state yet); 3 and 6 with NaN/Inf gradients


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _grads(step: int, model: torch.nn.Module) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    grads = [torch.randn(p.shape, generator=gen) * 10.0 ** (step % 3 - 1) for p in model.parameters()]
    if step in (3, 6):
        grads[0][0, 0], grads[1][1] = float("nan"), float("inf")
    return grads


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for p in opt.state for v in opt.state[p].values() if isinstance(v, torch.Tensor)]


def _bits(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().view(torch.int32) if t.dtype == torch.float32 else t.detach().clone() for t in ts]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b)))


@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_kept_steps_are_torch_s_own_and_skipped_steps_change_nothing(cls, kwargs):
    model, ref_model = _model(), _model()
    opt, ref = cls(model.parameters(), **kwargs), cls(ref_model.parameters(), **kwargs)
    skipper = SkipStep(opt)
    for step in range(8):
        skip = step in SKIPPED
        for p, r, g in zip(model.parameters(), ref_model.parameters(), _grads(step, model)):
            p.grad, r.grad = g.clone(), g.clone()
        before_params, before_state = _bits(list(model.parameters())), _bits(_state(opt))
        flag = torch.tensor(skip)
        with CountSyncs() as syncs:
            skipper.save(flag)
        assert skipper.mode == "skip_aware", "torch's AdamW / Adam / SGD take the skip-aware step"
        with CountSyncs() as ours:
            opt.step()
        with CountSyncs() as applied:
            skipper.apply(flag)
        assert syncs.count == applied.count == 0
        if skip:
            assert _same(list(model.parameters()), before_params), step
            # State created by a skipped first step starts from zeros (Adam's moments, SGD's buffer),
            # as the copy leaves it; existing state is untouched. Adam's step count still advances.
            kept = [s for s in _state(opt) if s.ndim]
            assert _same(kept, [s for s in before_state if s.ndim]) or not before_state, step
            if not before_state:
                assert all(not s.any() for s in kept)
            for r in ref_model.parameters():  # the reference skips too
                r.grad = None
            if cls is not torch.optim.SGD:
                for s_ref, s in zip(ref.state.values(), opt.state.values()):
                    s_ref["step"] = s["step"].clone()
            if not ref.state:  # the reference's state as the skipped first step left ours
                ref.load_state_dict(copy.deepcopy(opt.state_dict()))
        else:
            with CountSyncs() as theirs:
                ref.step()
            assert ours.count == theirs.count, "no host read beyond torch's own (CPU step counts)"
            assert _same(list(model.parameters()), list(ref_model.parameters())), step
            assert _same(_state(opt), _state(ref)), step
    assert skipper.saved_bytes == 0, "no copy of parameters or state"


@pytest.mark.parametrize("cls,kwargs", CONFIGS[:2] + CONFIGS[5:7], ids=lambda v: getattr(v, "__name__", str(v)))
def test_the_skip_aware_step_and_the_copy_give_the_same_bits(cls, kwargs):
    runs = {}
    for skip_aware_on in (True, False):
        model = _model()
        opt = cls(model.parameters(), **kwargs)
        skipper = SkipStep(opt, skip_aware=skip_aware_on)
        for step in range(8):
            for p, g in zip(model.parameters(), _grads(step, model)):
                p.grad = g
            flag = torch.tensor(step in SKIPPED)
            skipper.save(flag)
            opt.step()
            skipper.apply(flag)
        assert skipper.mode == ("skip_aware" if skip_aware_on else "copy")
        runs[skip_aware_on] = list(model.parameters()) + _state(opt)
    assert _same(runs[True], runs[False])


def test_a_step_that_does_not_match_torch_bitwise_falls_back_to_the_copy(monkeypatch):
    """The check against torch is real: one ulp off in the moment update and the copy is used."""
    monkeypatch.setattr(skip_aware, "_AGREES", {})
    real = skip_aware._adam_group

    def off_by_one_ulp(opt, group, f, foreach):
        real(opt, group, f, foreach)
        for p in group["params"]:
            m = opt.state[p]["exp_avg"]
            m.copy_(torch.nextafter(m, torch.full_like(m, float("inf"))))

    monkeypatch.setattr(skip_aware, "_adam_group", off_by_one_ulp)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    skipper = SkipStep(opt)
    assert not skip_aware.supported(opt)
    for p, g in zip(model.parameters(), _grads(1, model)):
        p.grad = g
    skipper.save(torch.tensor(False))
    assert skipper.mode == "copy"


def test_unsupported_optimizers_and_settings_use_the_copy():
    model = _model()
    for opt in (torch.optim.AdamW(model.parameters(), amsgrad=True), torch.optim.RMSprop(model.parameters()),
                torch.optim.Adam(model.parameters(), maximize=True)):
        skipper = SkipStep(opt)
        skipper.save(torch.tensor(False))
        assert skipper.mode == "copy", opt
    opt = torch.optim.AdamW(model.parameters())
    opt.step = lambda closure=None: None  # someone else's wrapper of the step: left alone
    skipper = SkipStep(opt)
    skipper.save(torch.tensor(False))
    assert skipper.mode == "copy"


def test_hooks_and_lr_scheduler_see_one_step_and_the_step_is_put_back():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    wrapper = vars(opt)["step"]  # torch's lr scheduler wraps the step to see it called
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    guard = InstabilityGuard(opt)
    for step in range(3):
        for p, g in zip(model.parameters(), _grads(step, model)):
            p.grad = g
        loss = torch.tensor(1.0)
        guard.check(step, loss, torch.tensor(1.0))
        assert guard.skipper is not None and guard.skipper.mode == "skip_aware"
        guard.step()
        sched.step()
    assert calls == ["pre", "post"] * 3
    assert vars(opt)["step"] is wrapper, "the scheduler's wrapper is back in place"
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    assert getattr(opt, "_opt_called", False)


def test_a_grad_scaler_that_skips_the_step_leaves_no_skip_aware_step_behind():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    skipper = SkipStep(opt)
    for p, g in zip(model.parameters(), _grads(3, model)):  # NaN/Inf: the scaler would not step
        p.grad = g
    skipper.save(torch.tensor(True))
    skipper.apply(torch.tensor(True))  # optimizer.step() never called
    assert "step" not in vars(opt)
    before = _bits(list(model.parameters()))
    for p, g in zip(model.parameters(), _grads(1, model)):
        p.grad = g
    opt.step()  # torch's own, as if the guard were not there
    assert not _same(list(model.parameters()), before)


def test_a_scheduled_lr_keeps_steps_torch_s_own_and_the_factor_constants_bounded():
    """AdamW's decoupled decay factor 1 - lr * wd is a new value at every step of a schedule: each
    step is still torch's own, and the 0-dim constants the factors are made of stay few."""
    model, ref_model = _model(), _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, ref)]
    skipper = SkipStep(opt)
    skip_aware._CONSTANTS.clear()
    for step in range(3 * skip_aware._MAX_CONSTANTS):
        for p, r, g in zip(model.parameters(), ref_model.parameters(), _grads(step % 3, model)):
            p.grad, r.grad = g.clone(), g.clone()
        skipper.save(torch.tensor(False))
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
        assert len(skip_aware._CONSTANTS) <= skip_aware._MAX_CONSTANTS
    assert _same(list(model.parameters()), list(ref_model.parameters()))
    assert _same(_state(opt), _state(ref))


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
                                        (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "foreach": True})],
                         ids=["AdamW", "SGD"])
def test_float64_parameters_take_the_skip_aware_step_bitwise_torch_s(cls, kwargs):
    """The factors are made in the parameters' dtype: float64 weights take the skip-aware step, and
    its kept steps are torch's to the bit."""
    model, ref_model = _model().double(), _model().double()
    opt, ref = cls(model.parameters(), **kwargs), cls(ref_model.parameters(), **kwargs)
    skipper = SkipStep(opt)
    for step in (1, 2, 4):
        for p, r, g in zip(model.parameters(), ref_model.parameters(), _grads(step, model)):
            p.grad, r.grad = g.double(), g.double()
        skipper.save(torch.tensor(False))
        assert skipper.mode == "skip_aware"
        opt.step()
        ref.step()
    assert all(torch.equal(a.view(torch.int64), b.view(torch.int64))
               for a, b in zip(model.parameters(), ref_model.parameters()))
