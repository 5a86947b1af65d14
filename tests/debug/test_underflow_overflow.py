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
from conftest import tiny_lm
from stabletrain.debug.underflow_overflow import UnderflowOverflowAbort, UnderflowOverflowMonitor
from stabletrain.errors import ConfigError
from stabletrain.safety.guard import NonFiniteStepError
from stabletrain.tasks.language_model import MLP, TransformerLM
from stabletrain.utils.sync import CountSyncs, SyncsPerStep

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
    report = assert_named(exc, tmp_path, module="blocks.1.mlp.act", tensor="output[0]", phase="forward", value="inf")
    assert re.search(r"inf  output\[0\] +float32\[4, 16, 128\]   <-- first non-finite \(inf\)", report)
    assert "culprit: module blocks.1.mlp.act (Planted)" in report
    # The frames before it are the healthy ones, in execution order, the last 21 at most.
    assert len(re.findall(r"^\[forward\]", report, re.M)) == 21
    assert report.index("] step 0  blocks.1.mlp.fc1 (Linear)") < report.index("] step 0  blocks.1.mlp.act (Planted)")


@pytest.mark.parametrize(
    "fn, value",
    [
        (lambda x: x.abs() / torch.zeros_like(x), "inf"),
        (lambda x: -x.abs() / torch.zeros_like(x), "inf"),  # abs min/max: either sign is "inf"
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
    report = assert_named(exc, tmp_path, module="blocks.1.attn.qkv", tensor="weight", phase="forward", value="nan" if math.isnan(bad) else "inf")
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

    # With max_frames_to_save=1 the report still shows where the value was seen, then the culprit.
    short = tmp_path / "short"
    run(model, short, max_frames_to_save=1)
    report = (short / "underflow_overflow_rank0.log").read_text()
    assert report.count("first non-finite (nan)") == 1 and report.count("<-- culprit") == 1
    assert "frames:  the last 2 in execution order" in report


def test_inf_made_by_the_parent_between_its_children_names_the_parent_not_the_next_child(tmp_path):
    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            h = h / torch.zeros_like(h)  # the parent's own op makes Inf; b makes NaN of it
            return self.b(h)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stage = Stage()

        def forward(self, x):
            return self.stage(x)

    torch.manual_seed(0)
    model = Net()
    with pytest.raises(UnderflowOverflowError) as info, UnderflowOverflowMonitor(model, out_dir=tmp_path):
        model(torch.randn(3, 4)).sum().backward()
    exc = info.value
    assert (exc.module, exc.module_type, exc.tensor, exc.value) == ("stage", "Stage", "stage.b input[0]", "inf")
    assert "an operation in the own forward of module stage (Stage), between its child modules" in str(exc)
    assert "attention mask" not in str(exc)
    assert last_frame((tmp_path / "underflow_overflow_rank0.log").read_text()).startswith(
        "[forward] step 0  stage (Stage) own ops  <-- culprit")


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
    assert (info.value.module, info.value.tensor, info.value.value) == ("", "loss", "inf")


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


def test_hugging_face_gpt2_gradients_are_unchanged_and_a_bad_weight_is_found(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config)  # random weights, nothing downloaded
    ids = torch.randint(64, (2, 16))
    reference = copy.deepcopy(model)
    reference(input_ids=ids, labels=ids).loss.backward()
    with UnderflowOverflowMonitor(model, out_dir=tmp_path):
        out = model(input_ids=ids, labels=ids)  # a ModelOutput (a dict), keyword inputs
        out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name

    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("-inf")
    with pytest.raises(UnderflowOverflowError) as info, UnderflowOverflowMonitor(model, out_dir=tmp_path):
        model(input_ids=ids, labels=ids)
    assert (info.value.module, info.value.module_type, info.value.tensor) == ("transformer.h.1.mlp.c_fc", "Conv1D", "weight")


@pytest.mark.parametrize("used", [True, False])
def test_tuple_and_dict_outputs_are_named_by_position_and_key(tmp_path, used):
    """A -inf in a nested output is named by position and key when it reaches the model's
    output; one that nothing uses does no harm and stops nothing."""

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
            h = out["a"] + out["b"][0]
            return self.head(h + out["b"][1] if used else h)

    monitor = UnderflowOverflowMonitor(Net(), out_dir=tmp_path)
    if not used:
        with monitor as m:
            out = m.model(torch.randn(3, 8))
            out.sum().backward()
        assert torch.isfinite(out).all() and not (tmp_path / "underflow_overflow_rank0.log").exists()
        return
    with pytest.raises(UnderflowOverflowError) as info, monitor as m:
        m.model(torch.randn(3, 8))
    assert (info.value.module, info.value.tensor, info.value.value) == ("split", "output['b'][1]", "inf")


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
    report = info.value.log_path.read_text()
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


# --------------------------------------------------------------------------------------
# In the trainer: debug_args.underflow_overflow
# --------------------------------------------------------------------------------------

UO_ON = {"underflow_overflow": {"enabled": True}}


def lm_task(**overrides):
    """The built-in language-model task (model and data) to plant faults in."""
    from stabletrain.config import load_settings
    from stabletrain.tasks import build_task

    settings = load_settings({"out": "unused", **tiny_lm(**overrides)})
    return build_task(settings)


def train_custom(tmp_path, model, dataset, **kw):
    """Train ``model`` on ``dataset`` with the tiny-LM loop settings (no architecture keys)."""
    settings = {"batch_size": 8, "steps": 4, "log_every_num_steps": 1, "model_args": {"warmup_steps": 0}}
    settings.update(kw)
    return stabletrain.train(out=tmp_path / "run", model=model, data=dataset, **settings)


def test_trainer_names_the_module_in_the_users_names_and_stops_before_the_checkpoint(tmp_path):
    task = lm_task(model_args={"n_layers": 2})
    # Forward calls 4 and 5 are step 2 (2 microbatches per step); NaN in the second one.
    task.model.blocks[1].mlp.act = Planted(lambda x: torch.log(-x.abs() - 1), fire_at={5})
    with pytest.raises(UnderflowOverflowError) as info:
        train_custom(tmp_path, task.model, task.dataset, steps=6, gradient_accumulation_steps=2,
                     checkpoint_every_num_steps=2, debug_args=UO_ON)
    exc = info.value
    assert (exc.step, exc.phase, exc.module, exc.tensor, exc.value, exc.rank) == (2, "forward", "blocks.1.mlp.act", "output[0]", "nan", 0)
    assert exc.report_path == tmp_path / "run" / "debug" / "underflow_overflow_rank0.log"
    report = exc.report_path.read_text()
    assert "_forward_module" not in report and "module.model" not in report and "model: TransformerLM, 34 modules watched" in report
    assert last_frame(report).startswith("[forward] step 2.1  blocks.1.mlp.act (Planted)")
    from stabletrain.loggers.jsonl import read_metrics

    _, events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [e for e in events if e["event"] == "underflow_overflow"] == [{
        "event": "underflow_overflow", "step": 2, "phase": "forward", "module": "blocks.1.mlp.act", "tensor": "output[0]",
        "value": "nan", "detected_by": [0], "report": str(exc.report_path),
    }]
    # Step 2 never reached the optimizer: the last checkpoint is the one after step 1.
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["step"] == 2
    # The message says so, and names that checkpoint as the place to continue from.
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert "Training stopped at step 2 before its backward pass: this step did not update the weights" in str(exc)
    assert exc.advice.count(f"{last} holds the healthy state from before step 2") == 1
    assert exc.advice in str(exc) and str(exc).index(exc.advice) < str(exc).index("Next: read the report")


def test_trainer_backward_fault(tmp_path):
    task = lm_task()
    task.model.blocks[0].mlp.act = Planted(nn.Sequential(nn.ReLU(), Sqrt()), fire_at={1})
    with pytest.raises(UnderflowOverflowError) as info:
        train_custom(tmp_path, task.model, task.dataset, debug_args=UO_ON)
    exc = info.value
    assert (exc.step, exc.phase, exc.module, exc.tensor) == (1, "backward", "blocks.0.mlp.act.fn.1", "grad of input[0]")
    # Where to continue, as nancapture and the guard say it: no checkpoint before step 1.
    assert "Training stopped at step 1 before its optimizer step: this step did not update the weights" in str(exc)
    assert "No checkpoint was written before step 1 (checkpoint_every_num_steps=100)" in exc.advice
    assert str(exc).endswith("continue as said above once fixed.") and "resume_from=) once fixed" not in str(exc)




@pytest.mark.parametrize("n_layers, accumulation", [(1, 1), (3, 1), (1, 3)])
def test_trainer_adds_two_syncs_per_step_whatever_the_model_size_and_accumulation(tmp_path, n_layers, accumulation):
    counts = {}
    for enabled in (False, True):
        counter = SyncsPerStep()
        stabletrain.train(
            out=tmp_path / str(enabled), callbacks=[counter],
            **tiny_lm(steps=4, batch_size=12, gradient_accumulation_steps=accumulation, log_every_num_steps=3,
                      model_args={"n_layers": n_layers}, debug_args={"underflow_overflow": {"enabled": enabled}}),
        )
        counts[enabled] = counter.counts
    assert sorted(counts[True]) == [0, 1, 2, 3]
    assert {s: counts[True][s] - counts[False][s] for s in counts[True]} == {0: 2, 1: 2, 2: 2, 3: 2}


class Aux(nn.Module):
    """Returns (x, aux); the caller ignores aux. On the calls in ``nan_aux`` aux is NaN (harmless:
    unused), on the calls in ``nan_x`` x itself is NaN (a real fault)."""

    def __init__(self, nan_aux=(), nan_x=()):
        super().__init__()
        self.nan_aux, self.nan_x, self.calls = set(nan_aux), set(nan_x), 0

    def forward(self, x):
        call, self.calls = self.calls, self.calls + 1
        aux = x * float("nan") if call in self.nan_aux else x * 2
        return (x * float("nan") if call in self.nan_x else x), aux


class AuxNet(nn.Module):
    def __init__(self, aux):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.aux, self.fc2 = nn.Linear(4, 16), aux, nn.Linear(16, 1)

    def forward(self, x):
        h, _ = self.aux(self.fc1(x))
        return self.fc2(h)

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self(x), y)


class Points(torch.utils.data.Dataset):
    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_trainer_trace_then_detection_after_a_traced_nan(tmp_path):
    model = AuxNet(Aux(nan_aux={1}, nan_x={3}))
    debug = {"underflow_overflow": {"enabled": True, "trace_batch_nums": [1]}}
    with pytest.raises(UnderflowOverflowError) as info:
        train_custom(tmp_path, model, Points(), steps=6, debug_args=debug)
    exc = info.value
    assert (exc.step, exc.module, exc.tensor, exc.value) == (3, "aux", "output[0]", "nan")
    report = exc.report_path.read_text()
    trace = report[report.index("=== step 1: trace") : report.index("=== step 3,")]
    assert "the first: module aux (Aux), output[1] (forward). Not aborting" in trace
    assert re.findall(r"^\[(\w+)\] step 1  (\S+)", trace, re.M)[:5] == [
        ("forward", "<model>"), ("forward", "fc1"), ("forward", "aux"), ("forward", "fc2"), ("forward", "<model>")
    ]
    assert ("backward", "fc2") in re.findall(r"^\[(\w+)\] step 1  (\S+)", trace, re.M)


def test_trainer_abort_after_batch_num(tmp_path):
    debug = {"underflow_overflow": {"enabled": True, "trace_batch_nums": [1], "abort_after_batch_num": 2}}
    result = stabletrain.train(out=tmp_path / "run", **tiny_lm(steps=10, debug_args=debug))
    assert result.steps_done == 3
    assert result.stop_reason.startswith("debug_args.underflow_overflow.abort_after_batch_num=2 reached")
    log = (tmp_path / "run" / "train.log").read_text()
    assert "Stopped after step 2: debug_args.underflow_overflow.abort_after_batch_num=2 reached" in log
    report = (tmp_path / "run" / "debug" / "underflow_overflow_rank0.log").read_text()
    assert report.count("=== step 1: trace") == 1 and "step 0" not in report and "step 2" not in report


def test_trainer_fp16_loss_scaling_overflow_is_not_a_failure_but_a_persistent_one_is(tmp_path):
    """Fabric allows no fp16 on the CPU, so give the trainer a GradScaler("cpu") plugin directly."""
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision

    from stabletrain.config import load_settings
    from stabletrain.debug.underflow_overflow import SCALER_PATIENCE
    from stabletrain.loggers.jsonl import read_metrics
    from stabletrain.training.loop import Trainer

    def fit(out, model=None, dataset=None, steps=6, init_scale=2.0**20, accum=1):
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        settings = tiny_lm(steps=steps, debug_args=UO_ON) if model is None else dict(
            model=model, data=dataset, batch_size=8, steps=steps, log_every_num_steps=1, debug_args=UO_ON)
        settings["gradient_accumulation_steps"] = accum
        return Trainer(load_settings({"out": tmp_path / out, **settings}), fabric=fabric).fit()

    # Too high a scale: the first steps' scaled gradients overflow, the scaler skips them. With
    # accumulation, the overflow of an earlier microbatch's gradients is not taken for a fault
    # either, and a skipped step counts once.
    for accum in (1, 2):
        result = fit(f"scaled{accum}", accum=accum)
        assert result.steps_done == 6
        _, events = read_metrics(tmp_path / f"scaled{accum}" / "metrics.jsonl")
        skips = [e for e in events if e["event"] == "underflow_overflow_scaler_skip"]
        assert 1 <= len(skips) < SCALER_PATIENCE
        assert [e["in_a_row"] for e in skips] == list(range(1, len(skips) + 1))
        assert [e["step"] for e in skips] == list(range(len(skips)))

    # A gradient that is inf at any scale: named on the SCALER_PATIENCE-th skipped step in a row,
    # with accumulation too, where it first shows in the first microbatch's backward.
    for accum in (1, 2):
        task = lm_task()
        task.model.blocks[0].mlp.act = nn.Sequential(nn.ReLU(), Sqrt())
        with pytest.raises(UnderflowOverflowError) as info:
            fit(f"fault{accum}", task.model, task.dataset, steps=SCALER_PATIENCE + 2, init_scale=2.0**8, accum=accum)
        err = info.value
        assert (err.step, err.phase, err.module) == (SCALER_PATIENCE - 1, "backward", "blocks.0.mlp.act.1")
        report = (tmp_path / f"fault{accum}" / "debug" / "underflow_overflow_rank0.log").read_text()
        culprit = report.split("=== step")[-1]
        assert culprit.count("<-- first non-finite") == 1
        header = [ln for ln in culprit.split("<-- first non-finite")[0].splitlines() if ln.startswith("[")][-1]
        # The first microbatch's backward ("step N", where the second one would be "step N.1").
        assert header.startswith(f"[backward] step {SCALER_PATIENCE - 1}  blocks.0.mlp.act.1 "), header


@pytest.mark.slow
def test_trainer_cli_turns_it_on_and_reports_bad_values(cli, tmp_path):
    result = cli("train", "out=run", "steps=2", "model_args.n_layers=1", "model_args.dim=32", "model_args.n_heads=2",
                 "model_args.context_length=16", "batch_size=8", "debug_args.underflow_overflow.enabled=true",
                 "debug_args.underflow_overflow.trace_batch_nums=[1]")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "underflow_overflow: watching 20 modules forward and backward" in result.stdout
    assert "=== step 1: trace" in (tmp_path / "run" / "debug" / "underflow_overflow_rank0.log").read_text()

    bad = cli("train", "out=bad", "debug_args.underflow_overflow.max_frames_to_save=0",
              "debug_args.underflow_overflow.abort_after_batch_num=-1", "debug_args.underflow_overflow.trace_batch_nums=[3,-1]")
    assert bad.returncode == 2
    assert "debug_args.underflow_overflow.max_frames_to_save: Input should be greater than or equal to 1 (got 0)" in bad.stderr
    assert "debug_args.underflow_overflow.abort_after_batch_num: Input should be greater than or equal to 0 (got -1)" in bad.stderr
    assert "debug_args.underflow_overflow.trace_batch_nums: step numbers must be >= 0, got [-1]" in bad.stderr


@pytest.mark.slow
def test_ddp_only_rank1_bad_every_rank_stops_each_writes_its_report(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import cli_env

    script = Path(__file__).with_name("ddp_underflow_overflow_script.py")
    out = tmp_path / "run"
    # A hang would be the gloo timeout (30 min); 240 s is generous for two CPU processes.
    proc = subprocess.run([sys.executable, str(script), str(out)], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 3, proc.stderr[-3000:]
    r0 = json.loads((out / "error_rank0.json").read_text())
    r1 = json.loads((out / "error_rank1.json").read_text())
    assert (r1["rank"], r1["step"], r1["detected_by"], r1["phase"], r1["module"], r1["tensor"], r1["value"]) == (
        1, 2, [1], "forward", "square", "output[0]", "inf")
    assert (r0["rank"], r0["step"], r0["detected_by"], r0["module"]) == (0, 2, [1], None)
    assert "rank 1 found a non-finite value in the forward pass" in r0["message"]
    rep1 = (out / "debug" / "underflow_overflow_rank1.log").read_text()
    rep0 = (out / "debug" / "underflow_overflow_rank0.log").read_text()
    assert last_frame(rep1).startswith("[forward] step 2  square (Square)") and "module." not in rep1
    assert "rank 1 found a non-finite value (forward); none on this rank (rank 0)" in rep0
    assert "inf" not in rep0.split("===")[-1], "rank 0's own frames are finite"
    assert "step 3" not in rep0 + rep1, "both ranks stopped at step 2"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_stats_are_exact_abs_min_and_max(dtype):
    from stabletrain.debug.underflow_overflow import tensor_stats

    g = torch.Generator().manual_seed(0)
    scratch: dict = {}
    for shape in [(7,), (3, 5, 4), (64, 33)]:
        t = (torch.randn(shape, generator=g) * 10).to(dtype)
        for view in (t, t.transpose(0, -1), t[..., ::2]):
            ref = view.abs().float()
            for got in (tensor_stats(view), tensor_stats(view, scratch)):
                assert (got[0].item(), got[1].item()) == (ref.min().item(), ref.max().item())
    t = torch.randn(10, generator=g)
    for bad, kind in [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "inf")]:
        u = t.clone()
        u[4] = bad
        amin, amax = tensor_stats(u, scratch)
        assert str(amax.item()) == kind and torch.isfinite(tensor_stats(t, scratch)[1])


def test_settings_defaults_and_forward_only_through_the_trainer(tmp_path, capsys):
    from stabletrain.config import load_settings

    uo = load_settings({"out": tmp_path / "x"}).debug_args.underflow_overflow
    assert (uo.enabled, uo.max_frames_to_save, uo.trace_batch_nums, uo.abort_after_batch_num, uo.include_backward) == (
        False, 21, [], None, True)

    # include_backward=false: gradients are not watched, so a backward-only fault (sqrt at 0)
    # passes the monitor; a forward fault is still named.
    class SqrtAtZero(nn.Module):
        def forward(self, x):
            return torch.sqrt(torch.relu(x) * 0.0) + x

    task = lm_task()
    task.model.blocks[0].mlp.act = nn.Sequential(nn.GELU(), SqrtAtZero())
    forward_only = {"underflow_overflow": {"enabled": True, "include_backward": False}}
    with pytest.raises(NonFiniteStepError) as info:  # the always-on guard stops at the non-finite gradients
        stabletrain.train(out=tmp_path / "fw", model=task.model, data=task.dataset, batch_size=8, steps=1,
                          log_every_num_steps=1, debug_args=forward_only)
    assert info.value.step == 0 and "gradient_norm" in info.value.nonfinite
    assert re.search(r"underflow_overflow: watching \d+ modules \(forward only\)", capsys.readouterr().out)
    from stabletrain.loggers.jsonl import read_metrics

    rows, _ = read_metrics(tmp_path / "fw" / "metrics.jsonl")
    assert not math.isfinite(rows[0]["gradient_norm"]), "the backward fault is real, only not watched"


def test_public_accessors_say_what_the_monitor_holds(tmp_path):
    """What the trainer's callback reads: modules watched, unchecked records, whether the log exists."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with UnderflowOverflowMonitor(model, out_dir=tmp_path, trace_batch_nums=[0], auto_check=False) as monitor:
        assert monitor.num_watched_modules == 4, "the Sequential and its 3 children"
        assert not monitor.has_records and not monitor.log_written
        monitor.set_step(0)
        model(torch.ones(2, 3)).sum().backward()
        assert monitor.has_records
        path = monitor.write_trace()
        assert not monitor.has_records and monitor.log_written
        assert path == monitor.log_path == tmp_path / "underflow_overflow_rank0.log"
        assert "=== step 0: trace" in path.read_text()
    with UnderflowOverflowMonitor(model, out_dir=tmp_path / "nan") as monitor:
        monitor.set_step(0)
        with pytest.raises(UnderflowOverflowError) as info:
            model(torch.full((2, 3), math.nan))
    assert info.value.log_path == tmp_path / "nan" / "underflow_overflow_rank0.log" and monitor.log_written
    assert info.value.report_path == info.value.log_path, "the README's name for the log"
