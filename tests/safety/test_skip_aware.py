"""The skip-aware step (safety/skip_aware.py): kept steps bitwise torch's own AdamW / Adam / SGD,
skipped steps leave parameters and state exactly as they were, no copy is made, no host sync is
added, and a configuration whose arithmetic does not match torch's falls back to the copy."""

from __future__ import annotations

import contextlib
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


def _run_against_torch(params, ref_params, opt, ref, grads_of_step, skips=()):
    """The skip-aware step of ``opt`` beside torch's own step of ``ref`` on the same gradients (None: no
    gradient that step), ``skips`` skipped by both: the parameters and the state end bitwise equal."""
    skipper = SkipStep(opt)
    for step, grads in enumerate(grads_of_step):
        for p, r, g in zip(params, ref_params, grads):
            p.grad, r.grad = (None, None) if g is None else (g.clone(), g.clone())
        flag = torch.tensor(step in skips)
        skipper.save(flag)
        assert skipper.mode == "skip_aware"
        opt.step()
        skipper.apply(flag)
        if step not in skips:
            ref.step()
        else:  # the reference skips too; Adam's step count advances on a skipped step (documented)
            for s_ref, s in zip(ref.state.values(), opt.state.values()):
                if "step" in s:
                    s_ref["step"] = s["step"].clone()
    assert _same(params, ref_params)
    assert _same(_state(opt), _state(ref))


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
    grads = [[g.double() for g in _grads(step, model)] for step in (1, 2, 4)]
    _run_against_torch(list(model.parameters()), list(ref_model.parameters()), cls(model.parameters(), **kwargs),
                       cls(ref_model.parameters(), **kwargs), grads)


# ------------------------------------------------------------------------------------------------
# The check against torch finds a disagreement wherever it is (planted on purpose), and the step
# then falls back to the copy, which gives torch's own result.


def _plant(monkeypatch, call: int, what: str) -> None:
    """Make the skip-aware Adam step go wrong at its ``call``-th run (1-3: the check's kept steps,
    4: its skipped one), in ``what``: the first parameter, its ``exp_avg``, or an error."""
    calls = [0]
    real = skip_aware._adam_group

    def planted(opt, group, f, foreach):
        real(opt, group, f, foreach)
        calls[0] += 1
        if calls[0] != call:
            return
        p = group["params"][0]
        if what == "raise":
            raise RuntimeError("an operation this device lacks")
        t = p if what == "param" else opt.state[p]["exp_avg"]
        t.copy_(torch.nextafter(t, torch.full_like(t, float("inf"))))  # one ulp up

    monkeypatch.setattr(skip_aware, "_adam_group", planted)


@pytest.mark.parametrize("call,what", [(1, "param"), (3, "state"), (4, "param"), (4, "state"), (1, "raise")],
                         ids=["kept-param", "last-kept-state-of-the-first-param", "skipped-param", "skipped-state",
                              "an-error"])
def test_a_planted_disagreement_is_found_and_the_copy_gives_torch_s_step(monkeypatch, call, what):
    monkeypatch.setattr(skip_aware, "_AGREES", {})
    _plant(monkeypatch, call, what)
    model, ref_model = _model(), _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    assert not skip_aware.supported(opt), (call, what)
    skipper = SkipStep(opt)
    for step in (1, 2):
        for p, r, g in zip(model.parameters(), ref_model.parameters(), _grads(step, model)):
            p.grad, r.grad = g.clone(), g.clone()
        flag = torch.tensor(False)
        skipper.save(flag)
        assert skipper.mode == "copy"
        opt.step()
        ref.step()
        skipper.apply(flag)
    assert _same(list(model.parameters()), list(ref_model.parameters()))
    assert _same(_state(opt), _state(ref))


def test_a_skipped_step_that_lets_a_nan_gradient_through_is_found(monkeypatch):
    """The check's skipped step has NaN and Inf gradients: without the mask they reach the moments."""
    monkeypatch.setattr(skip_aware, "_AGREES", {})
    monkeypatch.setattr(skip_aware, "_mask", lambda t, bits: t)  # kept steps stay exact
    opt = torch.optim.AdamW(_model().parameters(), lr=1e-2)
    assert not skip_aware.supported(opt)


@pytest.mark.parametrize("key,change", [("step", lambda t: t.view(torch.int32)), ("exp_avg", lambda t: t.reshape(-1))],
                         ids=["a-step-count-as-int32", "a-flat-moment"])
def test_a_state_of_another_dtype_or_shape_than_torch_s_is_a_disagreement(monkeypatch, key, change):
    """Same bits are not enough: a step count kept as int32 (the float's bits), or a moment kept
    flat, differs from torch's state."""
    monkeypatch.setattr(skip_aware, "_AGREES", {})
    calls = [0]
    real = skip_aware._adam_group

    def planted(opt, group, f, foreach):
        real(opt, group, f, foreach)
        calls[0] += 1
        if calls[0] == 3:
            st = opt.state[group["params"][0]]
            st[key] = change(st[key])

    monkeypatch.setattr(skip_aware, "_adam_group", planted)
    assert not skip_aware.supported(torch.optim.AdamW(_model().parameters(), lr=1e-2))


def test_same_bits_compares_bits_dtype_and_shape():
    same = skip_aware._same_bits
    assert not same(torch.tensor([0.0]), torch.tensor([-0.0])), "equal as numbers, not as bits"
    nan = torch.tensor([float("nan"), 1.0])
    assert same(nan, nan.clone()), "the same NaN, bit for bit"
    assert same(nan.double(), nan.double().clone())
    assert not same(torch.tensor([1.0]), torch.tensor([1.0]).view(torch.int32)), "another dtype"
    assert not same(torch.zeros(2, 3), torch.zeros(6))
    ints = torch.tensor([3, -1], dtype=torch.int16)  # other dtypes: by value
    assert same(ints, ints.clone()) and not same(ints, ints + 1)


def test_the_check_runs_once_per_configuration(monkeypatch):
    """Checked once: a second optimizer of the same configuration takes no step of the check, and
    neither does one whose check failed with an error."""
    monkeypatch.setattr(skip_aware, "_AGREES", {})
    steps = []
    real = skip_aware.skip_aware_step
    monkeypatch.setattr(skip_aware, "skip_aware_step", lambda opt, keep: (steps.append(1), real(opt, keep)))
    assert skip_aware.supported(torch.optim.AdamW(_model().parameters(), lr=1e-2))
    assert len(steps) == 4, "three kept steps and a skipped one"
    assert skip_aware.supported(torch.optim.AdamW(_model().parameters(), lr=1e-3, weight_decay=0.5))
    assert len(steps) == 4
    _plant(monkeypatch, 1, "raise")
    steps.clear()
    opt = torch.optim.Adam(_model().parameters(), lr=1e-2)
    assert not skip_aware.supported(opt) and len(steps) == 1, "the first step raised"
    assert not skip_aware.supported(opt) and not skip_aware.supported(torch.optim.Adam(_model().parameters()))
    assert len(steps) == 1, "a failed check is remembered too"


def test_the_check_leaves_the_global_random_stream_alone(monkeypatch):
    """Setting up the guard does not change the random numbers training draws next."""
    monkeypatch.setattr(skip_aware, "_AGREES", {})
    opt = torch.optim.AdamW(_model().parameters())
    torch.manual_seed(1)
    expected = torch.randn(4)
    torch.manual_seed(1)
    assert SkipStep(opt).can_skip_aware()
    assert skip_aware._AGREES, "the check ran"
    assert torch.equal(torch.randn(4), expected)


def test_the_check_runs_the_foreach_implementation_when_the_group_uses_it(monkeypatch):
    """A wrong foreach step is found by the check of a foreach group (not the tensor-by-tensor step's)."""
    monkeypatch.setattr(skip_aware, "_AGREES", {})
    real = skip_aware._multi_adam

    def planted(params, *args):
        real(params, *args)
        params[0].view(-1)[0] += 1e-3

    monkeypatch.setattr(skip_aware, "_multi_adam", planted)
    assert skip_aware.supported(torch.optim.AdamW(_model().parameters(), lr=1e-2, foreach=False))
    assert not skip_aware.supported(torch.optim.AdamW(_model().parameters(), lr=1e-2, foreach=True))


def test_each_dtype_is_checked_on_its_own(monkeypatch):
    """A step wrong only for float32 parameters: float64 ones still take it, float32 ones the copy."""
    monkeypatch.setattr(skip_aware, "_AGREES", {})
    real = skip_aware._adam_group

    def planted(opt, group, f, foreach):
        real(opt, group, f, foreach)
        p = group["params"][0]
        if p.dtype == torch.float32:
            p.view(-1)[0] += 1e-3

    monkeypatch.setattr(skip_aware, "_adam_group", planted)
    assert SkipStep(torch.optim.AdamW(_model().double().parameters())).can_skip_aware()
    assert not SkipStep(torch.optim.AdamW(_model().parameters())).can_skip_aware()


class _OwnParameter(torch.nn.Parameter):
    """A Parameter subclass (as some libraries wrap weights): its operations may be its own."""


def test_which_parameters_the_skip_aware_step_takes(monkeypatch):
    """Plain float32/float64 tensors and Parameters: the skip-aware step, bitwise torch's; a Parameter
    subclass, a sparse parameter, float16 weights or a tensor lr: the copy, refused before any check."""
    leaf = torch.randn(5, generator=torch.Generator().manual_seed(0)).requires_grad_()
    ref_leaf = leaf.detach().clone().requires_grad_()
    opt, ref = torch.optim.AdamW([leaf], lr=0.1), torch.optim.AdamW([ref_leaf], lr=0.1)
    skipper = SkipStep(opt)
    for step in range(3):
        leaf.grad, ref_leaf.grad = torch.full((5,), step - 1.5), torch.full((5,), step - 1.5)
        skipper.save(torch.tensor(False))
        assert skipper.mode == "skip_aware", "a plain leaf tensor"
        opt.step()
        ref.step()
    assert _same([leaf], [ref_leaf])

    checked = []
    monkeypatch.setattr(skip_aware, "agrees_with_torch", lambda *a: checked.append(a) or True)
    refused = [
        torch.optim.AdamW([_OwnParameter(torch.zeros(3))]),
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(3).to_sparse())], lr=0.1),
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))]),
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]),
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=torch.tensor(0.1)),
    ]
    for opt in refused:
        skipper = SkipStep(opt)
        skipper.save(torch.tensor(False))
        assert skipper.mode == "copy", opt
    assert checked == [], "refused without a check against torch"


def test_weight_decay_or_momentum_of_exactly_one_is_torch_s_step():
    """1.0 is a value like any other: the decay and the momentum are applied, bitwise as torch does."""
    for cls, kwargs in [(torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1.0}),
                        (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 1.0}),
                        (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 1.0, "foreach": True}),
                        (torch.optim.SGD, {"lr": 1e-2, "weight_decay": 1.0, "momentum": 1.0}),
                        (torch.optim.SGD, {"lr": 1e-2, "weight_decay": 1.0, "momentum": 1.0, "foreach": True})]:
        model, ref_model = _model(), _model()
        _run_against_torch(list(model.parameters()), list(ref_model.parameters()), cls(model.parameters(), **kwargs),
                           cls(ref_model.parameters(), **kwargs), [_grads(step, model) for step in (1, 2, 4)])


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
                                        (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "foreach": True})],
                         ids=["AdamW", "SGD"])
def test_a_group_of_one_parameter_takes_the_foreach_step(cls, kwargs):
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3, generator=gen))
    r = torch.nn.Parameter(w.detach().clone())
    grads = [[torch.randn(4, 3, generator=gen)] for _ in range(3)]
    _run_against_torch([w], [r], cls([w], **kwargs), cls([r], **kwargs), grads)


def test_a_parameter_whose_first_gradient_comes_later_gets_torch_s_momentum_buffer():
    """Foreach SGD with some momentum buffers made and some not yet: each as torch does it."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(3, generator=gen)) for _ in range(2)]
    rs = [torch.nn.Parameter(w.detach().clone()) for w in ws]
    grads = [[torch.randn(3, generator=gen), None]] + [[torch.randn(3, generator=gen) for _ in ws] for _ in range(3)]
    kwargs = {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1, "foreach": True}
    _run_against_torch(ws, rs, torch.optim.SGD(ws, **kwargs), torch.optim.SGD(rs, **kwargs), grads)


@pytest.mark.parametrize("foreach", [False, True])
def test_float32_and_float64_parameters_in_one_optimizer(foreach):
    gen = torch.Generator().manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(3, generator=gen, dtype=dtype)) for dtype in (torch.float32, torch.float64)]
    rs = [torch.nn.Parameter(w.detach().clone()) for w in ws]
    grads = [[torch.randn(3, generator=gen, dtype=w.dtype) for w in ws] for _ in range(4)]
    grads[2][0][0] = float("nan")
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "foreach": foreach}
    _run_against_torch(ws, rs, torch.optim.AdamW(ws, **kwargs), torch.optim.AdamW(rs, **kwargs), grads, skips={2})


def test_a_default_device_for_new_tensors_does_not_move_adam_s_step_counts():
    """Torch's foreach Adam adds to its CPU step counts with a CPU tensor whatever the default device is."""
    model, ref_model = _model(), _model()
    kwargs = {"lr": 1e-2, "foreach": True}
    opt, ref = torch.optim.AdamW(model.parameters(), **kwargs), torch.optim.AdamW(ref_model.parameters(), **kwargs)
    skipper = SkipStep(opt)
    for step in range(3):
        for p, r, g in zip(model.parameters(), ref_model.parameters(), _grads(step, model)):
            p.grad, r.grad = g.clone(), g.clone()
        skipper.save(torch.tensor(False))
        with torch.device("meta") if step else contextlib.nullcontext():
            opt.step()
            ref.step()
    assert _same(list(model.parameters()), list(ref_model.parameters()))
    assert all(s["step"].device.type == "cpu" for s in opt.state.values())
