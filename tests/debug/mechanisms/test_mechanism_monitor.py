"""MechanismMonitor in a plain loop: the optimizer statistics against float64, the host reads
it costs, and what it says when a signal cannot be measured."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stabletrain import MechanismMonitor
from stabletrain.utils.sync import CountSyncs


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.body(x) * self.scale


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _groups(model: Net) -> list[dict]:
    return [{"params": [model.body[0].weight, model.body[2].weight], "name": "matrices"},
            {"params": [model.body[0].bias, model.body[2].bias, model.scale]}]


def float64_update_values(before: dict, after: dict, optimizer: torch.optim.AdamW, model: Net) -> dict[str, float]:
    """The update statistics written out in float64 from the weights before and after the step
    and the optimizer's state."""
    names = {id(p): n for n, p in model.named_parameters()}
    out, ratios = {}, {}
    for group, key in zip(optimizer.param_groups, ("matrices", "group1")):
        ws = [before[names[id(p)]] for p in group["params"]]
        wa = [after[names[id(p)]] for p in group["params"]]
        out[f"signals/weight_rms/{key}"] = math.sqrt(sum((w**2).sum().item() for w in wa) / sum(w.numel() for w in wa))
        delta = math.sqrt(sum(((a - b) ** 2).sum().item() for a, b in zip(wa, ws)))
        out[f"signals/update_rms/{key}"] = delta / math.sqrt(sum((w**2).sum().item() for w in ws))
        for p, a, b in zip(group["params"], wa, ws):
            if b.norm() > 0:
                ratios[names[id(p)]] = ((a - b).norm() / b.norm()).item()
    top = max(ratios, key=ratios.get)
    out["signals/update_rms_max"] = ratios[top]
    below = total = 0
    for group in optimizer.param_groups:
        beta2, eps = group["betas"][1], group["eps"]
        for p in group["params"]:
            state = optimizer.state[p]
            v_hat = state["exp_avg_sq"].double() / (1 - beta2 ** state["step"].item())
            below += (v_hat.sqrt() < eps).sum().item()
            total += v_hat.numel()
    out["signals/adam_eps_fraction"] = below / total
    return out, top


def test_weight_update_and_adam_values_against_float64():
    model = Net()
    # eps large enough that a share of the second moments sits below it.
    optimizer = torch.optim.AdamW(_groups(model), lr=0.05, eps=0.02)
    monitor = MechanismMonitor(model, optimizer, report=lambda n: None)
    for step in range(4):
        log = step in (0, 3)
        monitor.begin_step(log=log)
        before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        x, y = _data(step)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.after_step()
        after = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        values = monitor.values()
        if not log:
            assert values == {}
            continue
        expected, top = float64_update_values(before, after, optimizer, model)
        for key, value in expected.items():
            assert values[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (step, key)
        assert 0 < values["signals/adam_eps_fraction"] < 1
        assert monitor.update_rms_max_param == top
        assert monitor.parameter_names[int(values["signals/update_rms_argmax"])] == top
    monitor.close()


def test_zero_weights_are_left_out_of_the_max_and_sgd_has_no_adam_fraction():
    model = Net()
    with torch.no_grad():
        model.body[0].bias.zero_()  # a fresh bias: its relative update is undefined
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    notices = []
    with MechanismMonitor(model, optimizer, report=notices.append) as monitor:
        monitor.begin_step(log=True)
        x, y = _data(0)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        monitor.after_step()
        values = monitor.values()
    assert math.isfinite(values["signals/update_rms_max"])
    assert monitor.update_rms_max_param != "body.0.bias"
    assert "signals/adam_eps_fraction" not in values
    assert [n.text for n in notices] == [
        "no attention found in Net (no scaled_dot_product_attention call, and no softmax over the last dimension "
        "inside an attention module, in the forward pass): signals/attn_* not measured",
        "SGD keeps no exp_avg_sq (not an Adam-family optimizer): signals/adam_eps_fraction not measured",
    ]
    assert "signals/output_logsumexp" in values  # cross_entropy was found


class Attn(nn.Module):
    """Hand-written attention (a class named *Attn*), then an output softmax that is not attention."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qk = nn.Linear(8, 16)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, dim=-1)
        return (q @ k.transpose(-2, -1) / math.sqrt(8)).softmax(dim=-1) @ x


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return torch.softmax(self.head(self.attn(x)), dim=-1)  # probabilities: not attention


def test_the_output_softmax_is_not_attention():
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 5, 8, generator=g) * 2 for _ in range(2)]
    with MechanismMonitor(model, optimizer, report=lambda n: None) as monitor:
        monitor.begin_step(log=True)
        for x in xs:
            model(x).log().mean().backward()
        optimizer.step()
        monitor.after_step()
        values = monitor.values()
    assert sorted(k for k in values if k.startswith("signals/attn")) == [
        "signals/attn_entropy/attn", "signals/attn_entropy_min", "signals/attn_logit_max", "signals/attn_logit_max/attn"]


def test_accumulated_microbatches_against_float64():
    model = Classifier()
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 5, 8, generator=g) * 2 for _ in range(2)]
    w, b = model.attn.qk.weight.detach().double(), model.attn.qk.bias.detach().double()
    maxes, entropies = [], []
    for x in xs:
        q, k = (x.double() @ w.T + b).chunk(2, dim=-1)
        s = q @ k.transpose(-2, -1) / math.sqrt(8)
        p = s.softmax(-1)
        maxes.append(s.max().item())
        entropies.append(-(p * p.log()).sum(-1).reshape(-1))
    with MechanismMonitor(model, report=lambda n: None) as monitor:
        monitor.begin_step(log=True)
        for x in xs:
            model(x).log().mean().backward()
        monitor.after_step()
        values = monitor.values()
    assert values["signals/attn_logit_max/attn"] == pytest.approx(max(maxes), rel=1e-5)
    assert values["signals/attn_entropy/attn"] == pytest.approx(torch.cat(entropies).mean().item(), rel=1e-5)


def test_no_host_read_before_values_and_one_read_for_all_of_them():
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, 5, 8)
    with MechanismMonitor(model, optimizer, report=lambda n: None) as monitor:
        for log in (False, True):
            with CountSyncs() as plain:
                model(x).log().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            with CountSyncs() as syncs:
                monitor.begin_step(log=log)
                model(x).log().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                monitor.after_step()
                device_values = monitor.device_values()
            assert syncs.count == plain.count, (log, syncs.by_op, plain.by_op)
            assert bool(device_values) == log
        with CountSyncs() as read:
            values = monitor.values()
        assert read.count == 1 and len(values) > 8, read.by_op


def test_a_skipped_optimizer_step_has_no_update_values():
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with MechanismMonitor(model, optimizer, report=lambda n: None) as monitor:
        monitor.begin_step(log=True)
        x, y = _data(0)
        F.cross_entropy(model(x), y).backward()  # a GradScaler that found an Inf would not call step()
        monitor.after_step()
        values = monitor.values()
    assert "signals/weight_rms/group0" in values
    assert not any(k.startswith("signals/update_rms") for k in values)


def test_updates_off_and_a_compiled_model_are_named():
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    notices = []
    compiled = torch.compile(model, backend="eager")
    with MechanismMonitor(compiled, optimizer, updates=False, report=notices.append) as monitor:
        monitor.begin_step(log=True)
        x, y = _data(0)
        F.cross_entropy(compiled(x), y).backward()
        optimizer.step()
        monitor.after_step()
        values = monitor.values()
    texts = [n.text for n in notices]
    assert texts[0] == ("OptimizedModule is torch.compile'd: the probes run Python inside the forward, which a compiled "
                        "graph does not: signals/attn_*, signals/output_* not measured")
    assert texts[1] == ("updates=False (debug_args.mechanisms.updates=false): signals/update_rms/*, "
                        "signals/update_rms_max, signals/update_rms_argmax not measured")
    assert set(values) == {"signals/weight_rms/group0", "signals/adam_eps_fraction"}


def test_a_failing_probe_is_named_and_training_goes_on(monkeypatch):
    import stabletrain.debug.mechanisms.probes as probes

    def broken(*args, **kwargs):
        raise RuntimeError("unexpected shape")

    monkeypatch.setattr(probes, "softmax_stats", broken)
    model = Classifier()
    notices = []
    with MechanismMonitor(model, report=notices.append) as monitor:
        monitor.begin_step(log=True)
        out = model(torch.randn(2, 5, 8))
        monitor.after_step()
    assert out.shape == (2, 5, 4)
    assert notices[0].text == ("the probe of softmax in attn failed (RuntimeError: unexpected shape): the signals of "
                               "that call not measured")


def test_close_removes_the_hooks_and_the_mode():
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = MechanismMonitor(model, optimizer, report=lambda n: None)
    monitor.begin_step(log=True)
    assert torch.overrides._get_current_function_mode_stack()
    monitor.close()
    assert not torch.overrides._get_current_function_mode_stack()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    copy.deepcopy(optimizer)  # nothing of the monitor is left in it


def test_keys_hold_only_characters_every_logger_accepts():
    """The model itself is ':root' and group names are cleaned: MLflow refuses '<', '>' and more."""
    validation = pytest.importorskip("mlflow.utils.validation")  # what MLflow checks each key with

    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    optimizer = torch.optim.AdamW([{"params": mha.parameters(), "name": "attn <all>"}], lr=1e-3)
    with MechanismMonitor(mha, optimizer, report=lambda n: None) as monitor:
        monitor.begin_step(log=True)
        x = torch.randn(2, 5, 8)
        mha(x, x, x)[0].sum().backward()
        optimizer.step()
        monitor.after_step()
        values = monitor.values()
    assert "signals/attn_logit_max/:root" in values and "signals/weight_rms/attn _all_" in values
    for key in values:
        validation._validate_metric_name(key)
