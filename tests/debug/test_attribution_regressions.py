"""Tests that fail when attribution breaks in ways the rest of the suite would let through
(issue 15, section 4.3 and 4.4), and the plain-loop precision of a captured step (section 2)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from diagnosis_checks import assert_consistent
from fault_models import FaultData, FaultNet
from torch import nn

import stabletrain
from stabletrain import NaNCaptureMonitor, NaNDetectedError, UnderflowOverflowError, UnderflowOverflowMonitor
from stabletrain.debug.diagnose import PRECISION_INDUCED
from stabletrain.debug.replay import forward_backward

# --------------------------------------------------------------------------------------
# 4.3: nested backward attribution names the innermost module
# --------------------------------------------------------------------------------------


class RootOfSquare(nn.Module):
    """sqrt(h * h): |h| in the forward pass, a NaN gradient where h is 0 (ReLU zeros)."""

    def forward(self, h):
        return torch.sqrt(h * h)


class PassThrough(nn.Module):
    """A wrapper that only calls its inner module (as DDP, checkpointing or adapters do)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class Consumer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.act = nn.Linear(4, 8), nn.ReLU()
        self.wrap = PassThrough(RootOfSquare())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.wrap(self.act(self.fc1(x))))


class Producer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 8)
        self.wrap = PassThrough(nn.ReLU())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.wrap(self.fc1(x))
        return self.head(torch.sqrt(h * h))  # this module's own op: the wrapper's output has no consumer module


def _backward_error(model, tmp_path):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(UnderflowOverflowError) as info, UnderflowOverflowMonitor(model, out_dir=tmp_path):
        out = model(x)
        assert torch.isfinite(out).all(), "a backward-only fault"
        out.sum().backward()
    assert info.value.phase == "backward"
    return info.value


def test_backward_fault_inside_a_pass_through_wrapper_names_the_inner_module(tmp_path):
    """The gradient of the wrapper's input is also the gradient of the inner module's input:
    the inner module's backward made it NaN, not the wrapper's."""
    err = _backward_error(Consumer(), tmp_path)
    assert (err.module, err.module_type, err.tensor) == ("wrap.inner", "RootOfSquare", "grad of input[0]")


def test_gradient_of_a_wrapped_output_used_by_the_parent_names_the_parent_and_the_inner_output(tmp_path):
    """The wrapper's output is also its inner module's output. No module consumed it: the
    parent's own ops did, so the parent of the outermost producer is to blame, and the tensor
    is named by the innermost producer."""
    err = _backward_error(Producer(), tmp_path)
    assert (err.module, err.module_type) == ("", "Producer"), "not the wrapper, whose forward did not use it"
    assert err.tensor == "grad of wrap.inner output[0]"
    assert "own forward of the model itself (Producer)" in err.explanation


# --------------------------------------------------------------------------------------
# 4.4: two bad samples in one microbatch are both isolated
# --------------------------------------------------------------------------------------


def _capture(model, batch, out_dir, indices=None, step_fn=None, **monitor_args):
    monitor = NaNCaptureMonitor(model, out_dir=out_dir, step_fn=step_fn, **monitor_args)
    step = step_fn or (lambda m, b: m.training_step(b))
    with pytest.raises(NaNDetectedError) as info:
        monitor.begin_step(0)
        monitor.collect_batch(batch, indices=indices)
        loss = step(model, batch)
        monitor.collect_loss(loss)
        loss.backward()
        monitor.check_and_capture()
    monitor.close()
    return info.value


def test_two_bad_samples_in_one_microbatch_are_both_isolated(tmp_path):
    data = FaultData(plant={3: {"s": 0.0}, 13: {"s": 0.0}})  # log(0) for samples 3 and 13
    indices = list(range(16))
    batch = torch.utils.data.default_collate([data[i] for i in indices])
    err = _capture(FaultNet("log0"), batch, tmp_path, indices=indices)
    d = stabletrain.diagnose(err.capture_path, model=FaultNet("log0"), write=False)

    assert d.data.status == "isolated", d.data.note
    assert d.data.row_sets == [[3], [13]] and d.data.index_sets == [[3], [13]]
    assert "the samples at dataset indices 3, 13 of microbatch 0 (16 samples) each trigger the failure on their own" \
        in d.data.note
    assert d.finding.op == "aten.log.default" and d.finding.module == "gate"
    assert "dataset indices 3, 13" in d.probable_cause
    assert_consistent(d)


def test_a_model_that_fails_on_any_data_names_no_culprit_but_examples(tmp_path):
    """Section 2: a not_data_specific diagnosis does not list culprit samples in its JSON."""
    model = FaultNet("none")
    with torch.no_grad():
        model.fc2.weight.div_(model.fc2.weight.abs().max()).mul_(3e38)
    data = FaultData()
    indices = list(range(8))
    batch = torch.utils.data.default_collate([data[i] for i in indices])
    err = _capture(model, batch, tmp_path, indices=indices)
    d = stabletrain.diagnose(err.capture_path, model=FaultNet("none"), write=False)
    data_json = assert_consistent(d)["data"]
    assert data_json["status"] == "not_data_specific"
    assert data_json["rows"] == [] and data_json["dataset_indices"] is None and data_json["index_sets"] is None
    assert data_json["examples"] and data_json["example_indices"] == data_json["examples"]
    assert d.traced_on["rows"] == data_json["examples"][0] and d.finding.module == "fc2"


# --------------------------------------------------------------------------------------
# Section 2: a plain loop's precision comes from what it uses
# --------------------------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 2)

    def training_step(self, batch):
        return F.mse_loss(self.fc(batch["x"]), batch["y"])


@pytest.mark.parametrize(
    "dtype, autocast, given, expected",
    [
        (torch.float32, None, None, "32-true"),
        (torch.float16, None, None, "16-true"),
        (torch.bfloat16, None, None, "bf16-true"),
        (torch.float64, None, None, "64-true"),
        (torch.float32, torch.bfloat16, None, "bf16-mixed"),
        (torch.float32, torch.float16, None, "16-mixed"),
        (torch.bfloat16, None, "32-true", "32-true"),  # what the user says wins
    ],
)
def test_plain_loop_precision_is_inferred_from_parameters_and_autocast(tmp_path, dtype, autocast, given, expected):
    model = Tiny().to(dtype)
    batch = {"x": torch.full((2, 4), float("nan"), dtype=dtype), "y": torch.zeros(2, 2, dtype=dtype)}
    monitor = NaNCaptureMonitor(model, out_dir=tmp_path, precision=given)
    monitor.begin_step(0)
    monitor.collect_batch(batch)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = model.training_step(batch)  # the model's forward runs inside autocast
    loss.float().backward()
    with pytest.raises(NaNDetectedError) as info:
        monitor.check_and_capture()
    monitor.close()
    assert monitor.precision == expected
    assert stabletrain.load_nan_capture(info.value.capture_path, model=Tiny()).precision == expected
    assert not model._forward_pre_hooks and not model.fc._forward_pre_hooks, "close() removes the monitor's hooks"


def _gpt2_step(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def test_half_gpt2_with_an_mlp_overflow_is_precision_induced_and_replays_in_float32(tmp_path):
    """Issue 15: a transformers GPT-2 cast with .half(), one MLP weight scaled up: float16
    overflows where float32 does not. The plain loop passes no precision; the capture says
    16-true, the float32 replay really runs in float32, and the cause is precision-induced."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, attn_pdrop=0.0,
                                  embd_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # weights below 1e3 (not "huge"), whose products exceed float16's 65504
        base.transformer.h[1].ln_2.weight.fill_(900.0)
        w = base.transformer.h[1].mlp.c_fc.weight
        w.div_(w.abs().max()).mul_(900.0)
    batch = {"input_ids": torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(1))}
    assert torch.isfinite(_gpt2_step(copy.deepcopy(base), batch)), "finite in float32"

    err = _capture(copy.deepcopy(base).half(), batch, tmp_path, indices=[0, 1, 2, 3], step_fn=_gpt2_step)
    fresh = transformers.GPT2LMHeadModel(cfg)
    cap = stabletrain.load_nan_capture(err.capture_path, model=fresh, step_fn=_gpt2_step)
    assert cap.precision == "16-true"

    fp32 = forward_backward(cap, precision="32-true")
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32} and fp32.losses[0].dtype == torch.float32
    assert fp32.finite and all(torch.isfinite(x) for x in fp32.losses)

    d = stabletrain.diagnose(cap, write=False)
    assert d.precision == "16-true" and d.cause == PRECISION_INDUCED
    assert d.reproduces_in == {"16-true": True, "32-true": False, "64-true": False}
    f = d.finding
    assert (f.module, f.dtype, f.phase, f.origin) == ("transformer.h.1.mlp.c_fc", "float16", "forward", "op")
    assert "float16 overflow" in d.probable_cause and "reproduces in 32-true" not in d.to_markdown()
    assert "precision=bf16-mixed" in d.next_actions[0]
    assert_consistent(d)
