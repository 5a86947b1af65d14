"""Op-level tracing finds the first non-finite op, its module, phase and source line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stabletrain.debug.op_trace import trace_first_nonfinite


class Net(nn.Module):
    """A small model with a configurable fault between or inside modules."""

    def __init__(self, fault: str):
        super().__init__()
        torch.manual_seed(0)
        self.fault = fault
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.decoder = nn.Linear(16, 4)

    def forward(self, x):
        h = self.encoder(x)
        if self.fault == "log0":
            h = torch.log(h * 0)  # between encoder and decoder: the parent's forward ran it
        elif self.fault == "div0":
            h = h / (h - h)
        elif self.fault == "sqrt_neg":
            h = torch.sqrt(h - 1e3)
        elif self.fault == "sqrt_at_0":
            h = torch.sqrt(h * 0)  # finite forward (0), infinite gradient
        elif self.fault == "fp16_overflow":
            h = (h + 1) * 1e5
            h = h.half().float()  # cast of a large activation: inf only in fp16
        return self.decoder(h)


def _run(fault, backward=True):
    model = Net(fault)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    finding, loss = trace_first_nonfinite(model, lambda: model(x).pow(2).mean(), backward=backward)
    return finding


@pytest.mark.parametrize(
    "fault, op, kind, line",
    [
        ("log0", "aten.log.default", "neginf", "h = torch.log(h * 0)"),
        ("div0", "aten.div.Tensor", "nan", "h = h / (h - h)"),
        ("sqrt_neg", "aten.sqrt.default", "nan", "h = torch.sqrt(h - 1e3)"),
    ],
)
def test_forward_fault_names_op_parent_module_and_line(fault, op, kind, line):
    f = _run(fault)
    assert f is not None
    assert f.op == op and f.phase == "forward"
    assert f.module == "" and f.module_type == "Net", "a functional op in Net.forward is blamed on Net"
    assert getattr(f.output, kind) > 0
    assert not f.inputs_nonfinite
    assert line in f.source and "test_op_trace.py:" in f.source


def test_fp16_cast_overflow_is_found_at_the_cast():
    f = _run("fp16_overflow")
    assert f.op == "aten._to_copy.default" and f.dtype == "float16" and f.output.posinf > 0
    assert f.inputs[0].dtype == "float32" and f.inputs[0].abs_max > 65504
    assert "h.half()" in f.source


def test_backward_only_fault_is_attributed_to_its_forward_op():
    assert _run("sqrt_at_0", backward=False) is None, "the forward pass is finite"
    f = _run("sqrt_at_0")
    assert f.phase == "backward"
    assert f.forward_op == "SqrtBackward0"
    assert f.module == ""
    assert f.source is not None and "torch.sqrt(h * 0)" in f.source


def test_fault_inside_a_submodule_is_blamed_on_it():
    model = Net("none")
    with torch.no_grad():
        model.decoder.weight[0, 0] = float("inf")
    x = torch.randn(4, 8)
    f, _ = trace_first_nonfinite(model, lambda: model(x).pow(2).mean())
    assert f.module == "decoder" and f.module_type == "Linear" and f.phase == "forward"
    assert any(s.posinf for s in f.inputs) and f.inputs_nonfinite, "the inf weight is an input of the op"


def test_attention_mask_infinities_are_not_faults():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            scores = self.proj(x) @ x.transpose(-1, -2)
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            return scores.softmax(-1) @ x

    model = Masked()
    f, loss = trace_first_nonfinite(model, lambda: model(torch.randn(2, 5, 4)).sum())
    assert f is None and torch.isfinite(loss)


def test_builtin_transformer_with_a_poisoned_token_embedding():
    from stabletrain.config import load_settings
    from stabletrain.tasks import build_task

    task = build_task(load_settings({"out": "x", "model_args": {"n_layers": 2, "dim": 32, "n_heads": 2, "context_length": 16}}))
    model = task.model
    batch = torch.utils.data.default_collate([task.dataset[i] for i in range(4)])
    token = int(batch["input_ids"][2, 5])
    with torch.no_grad():
        model.tok_emb.weight[token] = float("nan")
    f, _ = trace_first_nonfinite(model, lambda: model.training_step(batch))
    assert f.phase == "forward" and f.module == "tok_emb" and f.op.startswith("aten.embedding")


def test_backward_fault_inside_a_submodule_and_inplace_relu_model():
    import torchvision

    class SafeSqrt(nn.Module):
        def forward(self, x):
            return torch.sqrt(torch.relu(x - 10))  # zero forward, inf gradient at 0

    model = torchvision.models.resnet18(weights=None, num_classes=3)
    model.fc = nn.Sequential(SafeSqrt(), nn.Linear(512, 3))
    x = torch.randn(2, 3, 32, 32)
    f, loss = trace_first_nonfinite(model, lambda: model(x).sum())
    assert torch.isfinite(loss)
    assert f.phase == "backward" and f.module == "fc.0" and f.module_type == "SafeSqrt"
    assert f.forward_op == "SqrtBackward0"
    assert "torch.sqrt(torch.relu(x - 10))" in f.source


class TwoCalls(nn.Module):
    """training_step calls two submodules directly with a functional op between them."""

    def __init__(self, fault):
        super().__init__()
        torch.manual_seed(0)
        self.fault = fault
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 1)

    def training_step(self, x):
        h = self.enc(x)
        if self.fault == "backward":
            h = torch.sqrt(h * 0)  # outside every forward: finite, infinite gradient
        else:
            h = torch.log(h * 0)
        return self.dec(h).pow(2).mean()


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_op_outside_every_forward_is_not_blamed_on_a_neighbour(phase):
    model = TwoCalls(phase)
    f, _ = trace_first_nonfinite(model, lambda: model.training_step(torch.randn(3, 4)))
    assert f.phase == phase and f.outside_forward
    assert f.module == "" and f.module_type == "TwoCalls", "not dec, whose gradient ran just before"
    assert "outside forward" in f.where
    assert ("torch.sqrt(h * 0)" if phase == "backward" else "torch.log(h * 0)") in f.source
    if phase == "backward":
        assert f.forward_op == "SqrtBackward0"


def test_tracer_armed_later_ignores_earlier_ops():
    from stabletrain.debug.op_trace import OpTracer

    model = Net("none")
    with OpTracer(model, armed=False) as tracer:
        bad = torch.full((2,), float("nan")) * 2  # e.g. restoring a non-finite state before the step
        tracer.arm()
        model(torch.randn(2, 8)).sum().backward()
    assert tracer.finding is None and tracer.op_count > 1 and bad.isnan().all()


def test_uninitialised_memory_is_not_a_finding():
    """empty_like (dropout's mask buffer) returns whatever the memory held, NaN bit patterns
    included, until the next op writes it: its output is not checked. An op that uses such
    memory passes on a NaN that no traced op made, and is named once it reaches the loss."""
    from stabletrain.debug.op_trace import OpTracer

    tracer = OpTracer(Net("none"))
    garbage = torch.full((4,), float("nan"))
    tracer.inspect(torch.ops.aten.empty_like.default, (garbage,), {}, garbage)
    assert tracer.finding is None
    tracer.inspect(torch.ops.aten.mul.Tensor, (garbage, garbage), {}, garbage)
    tracer.check_loss(garbage)
    assert tracer.finding is not None and tracer.finding.op == "aten.mul.Tensor"
    assert tracer.finding.inputs_nonfinite and tracer.finding.origin == "untracked"


def test_inplace_overflow_reports_the_input_as_it_was():
    class InPlace(nn.Module):
        def forward(self, x):
            h = x * 1e38
            h.add_(h)  # 2e38 + 2e38 overflows in place
            return h.sum()

    model = InPlace()
    f, _ = trace_first_nonfinite(model, lambda: model(torch.full((3,), 2.0)), backward=False)
    assert f.module == "" and not f.outside_forward
    assert f.op == "aten.add_.Tensor" and f.output.posinf == 3
    assert not f.inputs_nonfinite and f.inputs[0].abs_max == pytest.approx(2e38, rel=1e-6)
