"""underflow_overflow: faults planted at known places in real models are named, forward and
backward, in the error and in the report, at 2 host synchronisations per step."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stabletrain
from stabletrain.debug.underflow_overflow import UnderflowOverflowAbort, UnderflowOverflowMonitor
from stabletrain.errors import ConfigError
from stabletrain.tasks.language_model import MLP, TransformerLM
from stabletrain.utils.sync import CountSyncs

UnderflowOverflowError = stabletrain.UnderflowOverflowError


# --------------------------------------------------------------------------------------
# Helpers: a real multi-layer model, planted faults, reading the report
# --------------------------------------------------------------------------------------


class Planted(nn.Module):
    """``fn(x)`` on the calls listed in ``fire_at`` (every call when None), else ``act(x)``."""

    def __init__(self, fn, fire_at=None, act=None):
        super().__init__()
        self.fn, self.fire_at, self.calls = fn, fire_at, 0
        self.act = act if act is not None else nn.GELU()

    def forward(self, x):
        call, self.calls = self.calls, self.calls + 1
        if self.fire_at is None or call in self.fire_at:
            return self.fn(x)
        return self.act(x)


def lm(seed=0):
    torch.manual_seed(seed)
    return TransformerLM(vocab_size=64, n_layers=2, n_heads=2, dim=32, context_length=16)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(64, (4, 16), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


def run(model, tmp_path, steps=1, **kw):
    """A plain training loop under the monitor; returns the error raised, if any."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with UnderflowOverflowMonitor(model, out_dir=tmp_path, **kw) as monitor:
        for step in range(steps):
            monitor.set_step(step)
            try:
                loss = model.training_step(batch(step))
                loss.backward()
            except UnderflowOverflowError as exc:
                return exc
            opt.zero_grad(set_to_none=True)
    return None


def last_frame(report: str) -> str:
    """The last frame of the report's last section: its header and its lines."""
    frames = re.split(r"\n(?=\[(?:forward|backward)\])", report.strip())
    return frames[-1]


def assert_named(exc, tmp_path, *, module, tensor, phase, value=None, step=0):
    assert isinstance(exc, UnderflowOverflowError), exc
    assert (exc.module, exc.tensor, exc.phase, exc.step, exc.rank) == (module, tensor, phase, step, 0)
    if value is not None:
        assert exc.value == value
    assert exc.detected_by == [0]
    assert exc.report_path == tmp_path / "underflow_overflow_rank0.log"
    text = str(exc)
    assert f"step {step}, rank 0, {phase}" in text and module in text and tensor in text and str(exc.report_path) in text
    report = exc.report_path.read_text()
    report = report[report.rindex("\n=== "):]  # the last section: this failure
    frame = last_frame(report)
    assert frame.startswith(f"[{phase}] step {step}  {module or '<model>'} ("), frame
    assert report.count("<-- first non-finite") == 1
    return report


# --------------------------------------------------------------------------------------
# Forward faults
# --------------------------------------------------------------------------------------


def test_log_of_zero_names_the_module_output(tmp_path):
    model = lm()
    model.blocks[1].mlp.act = Planted(lambda x: torch.log(F.relu(x)))  # log(0) = -inf
    exc = run(model, tmp_path)
    report = assert_named(exc, tmp_path, module="blocks.1.mlp.act", tensor="output[0]", phase="forward", value="-inf")
    assert re.search(r"inf  output\[0\] +float32\[4, 16, 128\]   <-- first non-finite \(-inf\)", report)
    assert "culprit: module blocks.1.mlp.act (Planted)" in report
    # The frames before it are the healthy ones, in execution order, the last 21 at most.
    assert len(re.findall(r"^\[forward\]", report, re.M)) == 21
    assert report.index("] step 0  blocks.1.mlp.fc1 (Linear)") < report.index("] step 0  blocks.1.mlp.act (Planted)")


@pytest.mark.parametrize(
    "fn, value",
    [
        (lambda x: x.abs() / torch.zeros_like(x), "inf"),
        (lambda x: -x.abs() / torch.zeros_like(x), "-inf"),
        (lambda x: (x * 0) / torch.zeros_like(x), "nan"),
    ],
    ids=["inf", "-inf", "nan"],
)
def test_division_by_zero(tmp_path, fn, value):
    model = lm()
    model.blocks[0].mlp.act = Planted(fn)
    exc = run(model, tmp_path)
    assert_named(exc, tmp_path, module="blocks.0.mlp.act", tensor="output[0]", phase="forward", value=value)


def test_sqrt_of_a_negative_number(tmp_path):
    model = lm()
    model.blocks[0].attn.resid_drop = Planted(lambda x: torch.sqrt(x - 1.0))  # |x| < 1 here
    exc = run(model, tmp_path)
    assert_named(exc, tmp_path, module="blocks.0.attn.resid_drop", tensor="output[0]", phase="forward", value="nan")


def test_cast_of_a_large_activation_to_fp16_overflows(tmp_path):
    model = lm()
    with torch.no_grad():
        model.blocks[1].mlp.fc1.weight.mul_(1e6)  # activations of ~1e5..1e6: finite in fp32
    # The cast, a module of its own; cast back so the rest of the model runs in fp32.
    model.blocks[1].mlp.act = Planted(lambda x: x.to(torch.float16).float())
    exc = run(model, tmp_path)
    report = assert_named(exc, tmp_path, module="blocks.1.mlp.act", tensor="output[0]", phase="forward", value="inf")
    frame = last_frame(report)
    assert re.search(r"e\+0[56]  input\[0\]", frame), "the input was large but finite"


def test_fp16_autocast_overflow_is_the_linear_that_produced_it(tmp_path):
    model = lm()
    with torch.no_grad():  # activations of a few hundred into fc2, whose fp16 output overflows (> 65504)
        model.blocks[0].mlp.fc1.weight.mul_(1000)
        model.blocks[0].mlp.fc2.weight.mul_(2000)
    with torch.autocast("cpu", dtype=torch.float16):
        exc = run(model, tmp_path)
    report = assert_named(exc, tmp_path, module="blocks.0.mlp.fc2", tensor="output[0]", phase="forward", value="inf")
    frame = last_frame(report)
    assert "float16[4, 16, 32]   <-- first non-finite (inf)" in frame
    assert re.search(r"e\+02  input\[0\] +float16\[4, 16, 128\]", frame), "a large but finite fp16 input"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite_weight(tmp_path, bad):
    model = lm()
    with torch.no_grad():
        model.blocks[1].attn.qkv.weight[3, 5] = bad
    exc = run(model, tmp_path)
    report = assert_named(exc, tmp_path, module="blocks.1.attn.qkv", tensor="weight", phase="forward", value=str(bad))
    frame = last_frame(report)
    assert "weight" in frame and "input[0]" not in frame, "the frame stops at the bad weight"


def test_functional_op_between_modules_is_blamed_on_the_parent(tmp_path):
    class LogMLP(MLP):
        def forward(self, x):  # torch.log of GELU outputs (some negative) between fc1/act and fc2
            return self.drop(self.fc2(torch.log(self.act(self.fc1(x)))))

    model = lm()
    mlp = LogMLP(32, 0.0)
    mlp.load_state_dict(model.blocks[1].mlp.state_dict())
    model.blocks[1].mlp = mlp
    exc = run(model, tmp_path)
    report = assert_named(
        exc, tmp_path, module="blocks.1.mlp", tensor="blocks.1.mlp.fc2 input[0]", phase="forward", value="nan"
    )
    assert "an operation in the own forward of module blocks.1.mlp (LogMLP)" in str(exc)
    frame = last_frame(report)
    assert frame.startswith("[forward] step 0  blocks.1.mlp (LogMLP) own ops  <-- culprit")
    # The frame before it shows where the value was first seen: fc2's input.
    assert re.search(r"blocks\.1\.mlp\.fc2 \(Linear\) inputs\n(.*\n){2}.*nan +nan  input\[0\].*first non-finite", report)


def test_nonfinite_data_is_blamed_on_the_input_of_the_model(tmp_path):
    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def forward(self, x):
            return self.body(x)

    model = Regressor()
    x = torch.randn(5, 4)
    x[2, 1] = float("inf")
    with pytest.raises(UnderflowOverflowError) as info, UnderflowOverflowMonitor(model, out_dir=tmp_path):
        model(x)
    assert (info.value.module, info.value.module_type, info.value.tensor) == ("", "Regressor", "input[0]")
    assert "check the batch" in str(info.value)


def test_loss_made_outside_the_forward_is_blamed_on_the_model(tmp_path):
    model = lm()
    with UnderflowOverflowMonitor(model, out_dir=tmp_path, auto_check=False) as monitor:
        logits = model(batch()["input_ids"])
        monitor.record_loss(torch.log(logits.softmax(-1) * 0).mean())
        with pytest.raises(UnderflowOverflowError) as info:
            monitor.check()
    assert (info.value.module, info.value.tensor, info.value.value) == ("", "loss", "-inf")


# --------------------------------------------------------------------------------------
# Backward faults
# --------------------------------------------------------------------------------------


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


def test_backward_only_fault_sqrt_at_zero_is_named_in_backward(tmp_path):
    model = lm()
    # ReLU then sqrt: zeros in, sqrt(0) = 0 out, finite; d sqrt/dx at 0 is inf.
    model.blocks[0].mlp.act = nn.Sequential(nn.ReLU(), Sqrt())
    exc = run(model, tmp_path)
    report = assert_named(exc, tmp_path, module="blocks.0.mlp.act.1", tensor="grad of input[0]", phase="backward", value="inf")
    assert "[backward]" in report and "first non-finite (inf)" in last_frame(report)
    # The gradients before it (the later modules, in backward order) are finite.
    frames = re.split(r"\n(?=\[(?:forward|backward)\])", report.strip())
    assert any("blocks.0.mlp.fc2 (Linear)" in f and f.startswith("[backward]") for f in frames[:-1])


def test_backward_fault_in_a_functional_op_is_blamed_on_the_parent(tmp_path):
    class SqrtMLP(MLP):
        def forward(self, x):
            return self.drop(self.fc2(torch.sqrt(self.act(self.fc1(x)))))

    model = lm()
    mlp = SqrtMLP(32, 0.0)
    mlp.act = nn.ReLU()
    model.blocks[1].mlp = mlp
    exc = run(model, tmp_path)
    assert_named(exc, tmp_path, module="blocks.1.mlp", tensor="grad of blocks.1.mlp.act output[0]", phase="backward")
    assert "No module took blocks.1.mlp.act output[0] as input" in str(exc)


def test_backward_fault_in_a_weight_gradient(tmp_path):
    class ScaledLinear(nn.Linear):
        def forward(self, x):  # sqrt of the weight: finite forward, inf gradient at the zero entry
            return F.linear(x, torch.sqrt(self.weight.abs()), self.bias)

    model = lm()
    layer = ScaledLinear(32, 32)
    with torch.no_grad():
        layer.weight[0, 0] = 0.0
    model.blocks[1].attn.proj = layer
    exc = run(model, tmp_path)
    # The gradient of proj's input is finite; its weight's is not (sqrt'(0) = inf).
    assert_named(exc, tmp_path, module="blocks.1.attn.proj", tensor="grad of weight", phase="backward")


def test_include_backward_false_does_not_watch_gradients(tmp_path):
    model = lm()
    model.blocks[0].mlp.act = nn.Sequential(nn.ReLU(), Sqrt())
    assert run(model, tmp_path, include_backward=False) is None
    assert not (tmp_path / "underflow_overflow_rank0.log").exists()


# --------------------------------------------------------------------------------------
# Real architectures: torchvision (in-place ReLU, shared modules), tuple and dict outputs
# --------------------------------------------------------------------------------------


def test_resnet18_gradients_are_unchanged_and_a_bad_batchnorm_weight_is_found(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    reference = copy.deepcopy(model)
    reference(x).logsumexp(-1).sum().backward()

    with UnderflowOverflowMonitor(model, out_dir=tmp_path) as monitor:
        monitor.set_step(0)
        model(x).logsumexp(-1).sum().backward()  # in-place ReLU, `out += identity`: no error
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert not (tmp_path / "underflow_overflow_rank0.log").exists()

    with torch.no_grad():
        model.layer3[0].bn2.weight[7] = float("inf")
    with pytest.raises(UnderflowOverflowError) as info, UnderflowOverflowMonitor(model, out_dir=tmp_path) as monitor:
        monitor.set_step(4)
        model(x)
    assert (info.value.module, info.value.module_type, info.value.tensor, info.value.step) == (
        "layer3.0.bn2", "BatchNorm2d", "weight", 4
    )


def test_tuple_and_dict_outputs_are_named_by_position_and_key(tmp_path):
    class Split(nn.Module):
        def forward(self, x):
            return {"a": x * 2, "b": (x, torch.log(x - x))}  # log(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.split = Split()
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            out = self.split(self.fc(x))
            return self.head(out["a"] + out["b"][0])  # the bad tensor is not even used

    with pytest.raises(UnderflowOverflowError) as info, UnderflowOverflowMonitor(Net(), out_dir=tmp_path) as m:
        m.model(torch.randn(3, 8))
    assert (info.value.module, info.value.tensor, info.value.value) == ("split", "output['b'][1]", "-inf")


def test_users_own_hooks_survive_and_still_fire(tmp_path):
    model = lm()
    fired = []
    target = model.blocks[0].mlp
    target.register_forward_pre_hook(lambda m, a: fired.append("pre"))
    target.register_forward_hook(lambda m, a, o: fired.append("fwd"))
    target.register_full_backward_hook(lambda m, gi, go: fired.append("bwd"))
    model.head.weight.register_hook(lambda g: fired.append("param"))
    counts = {n: (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks)) for n, m in model.named_modules()}

    assert run(model, tmp_path, steps=2) is None
    assert sorted(fired) == sorted(["pre", "fwd", "bwd", "param"] * 2)
    after = {n: (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks)) for n, m in model.named_modules()}
    assert after == counts, "exactly the monitor's hooks are gone"
    fired.clear()
    model.training_step(batch()).backward()
    assert sorted(fired) == sorted(["pre", "fwd", "bwd", "param"])


# --------------------------------------------------------------------------------------
# Trace mode, abort_after_batch_num
# --------------------------------------------------------------------------------------


def test_trace_writes_every_frame_and_a_traced_nan_does_not_poison_later_steps(tmp_path):
    model = lm()
    # NaN at the forward calls of steps 1 and 3 (one forward per step).
    model.blocks[1].mlp.act = Planted(lambda x: x * float("nan"), fire_at={1, 3})
    exc = run(model, tmp_path, steps=5, trace_batch_nums=[1])
    assert_named(exc, tmp_path, module="blocks.1.mlp.act", tensor="output[0]", phase="forward", value="nan", step=3)
    report = exc.report_path.read_text()
    trace = report[report.index("=== step 1: trace") : report.index("=== step 3,")]
    assert "first: module blocks.1.mlp.act (Planted), output[0] (forward). Not aborting" in trace
    forward = re.findall(r"^\[forward\] step 1  (\S+)", trace, re.M)
    backward = re.findall(r"^\[backward\] step 1  (\S+)", trace, re.M)
    # Every module call of the forward, and the backward, not just the last 21 frames.
    assert forward[0] == "tok_emb" and "head" in forward and "blocks.0.attn.qkv" in forward
    assert "<model>" in forward and len(forward) > 21
    assert backward[0] == "head" and backward[-1] in ("tok_emb", "pos_emb")
    assert "step 2" not in report, "step 2 was healthy and not traced"


def test_abort_after_batch_num_in_a_plain_loop(tmp_path):
    with pytest.raises(UnderflowOverflowAbort) as info:
        run(lm(), tmp_path, steps=5, trace_batch_nums=[0, 1], abort_after_batch_num=1)
    assert info.value.step == 1 and "abort_after_batch_num=1: stopped after step 1" in str(info.value)
    report = info.value.report_path.read_text()
    assert "=== step 0: trace" in report and "=== step 1: trace" in report and "step 2" not in report


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_frames_to_save must be at least 1, got 0"):
        UnderflowOverflowMonitor(lm(), max_frames_to_save=0)
    with pytest.raises(ValueError, match=r"trace_batch_nums must be step numbers >= 0, got \[-2, 1\]"):
        UnderflowOverflowMonitor(lm(), trace_batch_nums=[1, -2])


# --------------------------------------------------------------------------------------
# Cost: statistics on the device, one decision per forward and one per backward
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers", [1, 4])
def test_plain_loop_adds_two_syncs_per_step_whatever_the_model_size(tmp_path, n_layers):
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=64, n_layers=n_layers, n_heads=2, dim=32, context_length=16)
    b = batch()
    with UnderflowOverflowMonitor(model, out_dir=tmp_path) as monitor:
        monitor.set_step(0)
        with CountSyncs() as fwd:
            loss = model.training_step(b)
        with CountSyncs() as bwd:
            loss.backward()
    with CountSyncs() as plain:
        model.training_step(b).backward()
    assert plain.count == 0
    assert (fwd.count, bwd.count) == (1, 1)


def test_compile_conflict_is_a_config_error_before_training(tmp_path):
    with pytest.raises(ConfigError) as info:
        stabletrain.train(
            out=tmp_path / "run",
            torch_compile_args={"disable": False},
            debug_args={"underflow_overflow": {"enabled": True}},
            steps=1,
        )
    assert len(info.value.problems) == 1
    assert "debug_args.underflow_overflow.enabled: cannot be combined with torch_compile_args.disable=false" in str(info.value)
    assert not (tmp_path / "run").exists()
