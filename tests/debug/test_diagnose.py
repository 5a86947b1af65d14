"""diagnose: planted faults at known samples, each found with its op, module, phase, cause
class and culprit sample; the report files and the command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from fault_models import FAULTS, BCEData, BCENet, FaultData, FaultNet, FlakyNet, NormNet
from nan_models import PoisonData, PoisonNet, samples_of_step

import stabletrain
from conftest import cli_env, tiny_lm
from stabletrain import NaNCaptureMonitor, NaNDetectedError, load_nan_capture
from stabletrain.debug.diagnose import (
    DETERMINISTIC_NUMERICAL,
    NOT_REPRODUCIBLE,
    PRECISION_INDUCED,
    Diagnosis,
)
from stabletrain.debug.diagnose.search import ddmin as _ddmin
from stabletrain.safety.guard import NonFiniteStepError
from stabletrain.training.loop import train

NANCAPTURE = {"nancapture": {"enabled": True}}
RUN = dict(steps=8, batch_size=8, num_workers=0, log_every_num_steps=1, model_args={"lr": 0.01, "warmup_steps": 0})


def _fault_capture(tmp_path, fault, step=2, row=3, **settings):
    """Train FaultNet with ``fault`` planted in sample ``row`` of step ``step``; return the
    capture path and the planted dataset index."""
    victim = samples_of_step(step)[row]
    plant, _, _ = FAULTS[fault]
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / fault, model=FaultNet(fault), data=FaultData(plant={victim: plant}), debug_args=NANCAPTURE,
              **{**RUN, **settings})
    assert info.value.step == step
    return info.value.capture_path, victim


@pytest.mark.parametrize("fault", ["log0", "div0", "sqrt_neg", "sqrt_at_0"])
def test_planted_fault_is_found_with_its_op_module_phase_cause_and_sample(tmp_path, fault):
    path, victim = _fault_capture(tmp_path, fault)
    _, op, phase = FAULTS[fault]
    d = stabletrain.diagnose(path.parent, model=FaultNet(fault))

    assert d.cause == DETERMINISTIC_NUMERICAL and d.deterministic and d.matches_capture
    assert d.reproduces_in == {"32-true": True, "64-true": True}
    f = d.finding
    assert (f.op, f.phase, f.module, f.module_type) == (op, phase, "gate", "Gate")
    assert f.dtype == "float32" and not f.inputs_nonfinite and not f.outside_forward
    assert "fault_models.py:" in f.source
    # The input that breaks the op, as the report shows it: log(0), h / 0, sqrt(-1), and in
    # the backward pass the derivative's denominator 2 sqrt(u) = 0.
    which, abs_min, abs_max = {"log0": (0, 0.0, 0.0), "div0": (1, 0.0, 0.0), "sqrt_neg": (0, 1.0, 1.0),
                               "sqrt_at_0": (1, 0.0, 0.0)}[fault]
    assert (f.inputs[which].abs_min, f.inputs[which].abs_max) == (abs_min, abs_max)
    if fault in ("div0", "sqrt_at_0"):
        assert f.inputs[0].abs_min > 0, "the numerator is not what is wrong"
    assert f"input {which}: float32 {f.inputs[which].shape}, abs min {abs_min:.3g}, abs max {abs_max:.3g}" in d.to_markdown()
    if phase == "backward":
        assert f.forward_op == "SqrtBackward0" and "torch.sqrt(s * h * h)" in f.source
        assert d.data.check == "forward+backward"
        assert all(math.isfinite(x) for x in d.replays[0].losses), "the forward pass is finite"
    else:
        assert d.data.check == "forward"
    assert d.data.status == "isolated"
    assert d.data.microbatches == [(0, 0)] and d.data.row_sets == [[3]] and d.data.dataset_indices == [victim]
    assert d.weights.status == "healthy"
    assert d.data.nonfinite_inputs == [], "the data itself is finite: the op makes the NaN"
    words = {"log0": "log of zero", "div0": "division by zero", "sqrt_neg": "square root of a negative",
             "sqrt_at_0": "infinite gradient"}[fault]
    assert words in d.probable_cause and f"dataset index {victim}" in d.probable_cause
    guard = {"log0": "clamp_min", "div0": "clamp_min", "sqrt_neg": "clamp_min(0)", "sqrt_at_0": "torch.sqrt(x + 1e-12)"}[fault]
    assert guard in d.next_actions[0]


def test_fp16_overflow_of_a_large_activation_is_precision_induced(tmp_path):
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision

    from stabletrain.config import load_settings
    from stabletrain.training.loop import Trainer

    victim = samples_of_step(2)[5]
    plant, op, _ = FAULTS["square"]
    fabric = Fabric(accelerator="cpu", devices=1,
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))])
    settings = load_settings({"out": tmp_path / "fp16", "model": FaultNet("square"),
                              "data": FaultData(plant={victim: plant}), "debug_args": NANCAPTURE, **RUN})
    with pytest.raises(NaNDetectedError) as info:
        Trainer(settings, fabric=fabric).fit()
    assert (info.value.step, info.value.reason) == (2, "nonfinite_loss")

    d = load_nan_capture(info.value.capture_path, model=FaultNet("square")).diagnose()
    assert d.precision == "16-mixed"
    assert d.reproduces_in == {"16-mixed": True, "32-true": False, "64-true": False}
    assert d.cause == PRECISION_INDUCED
    f = d.finding
    assert (f.op, f.phase, f.module, f.dtype) == (op, "forward", "gate", "float16")
    assert f.output.posinf > 0 and not f.inputs_nonfinite
    assert 256 < max(s.abs_max for s in f.inputs) < 65504, "a finite float16 input whose square overflows"
    assert d.data.row_sets == [[5]] and d.data.dataset_indices == [victim]
    assert "float16 overflow" in d.probable_cause
    assert "precision=bf16-mixed" in d.next_actions[0] and "precision=32-true" in d.next_actions[0]


def test_fp16_loss_scaling_that_keeps_skipping_steps(tmp_path):
    """Scaled float16 gradients overflow step after step: precision-induced, in the backward
    pass, with the loss scale and the max_skipped_steps setting in the advice."""
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision

    from stabletrain.config import load_settings
    from stabletrain.training.loop import Trainer

    fabric = Fabric(accelerator="cpu", devices=1,
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))])
    settings = load_settings({"out": tmp_path / "fp16", "model": PoisonNet(), "data": PoisonData(),
                              "debug_args": {"nancapture": {"enabled": True, "max_skipped_steps": 2}}, **RUN})
    with pytest.raises(NaNDetectedError) as info:
        Trainer(settings, fabric=fabric).fit()
    assert info.value.reason == "skipped_steps"
    d = stabletrain.diagnose(info.value.capture_path, model=PoisonNet())
    assert d.cause == PRECISION_INDUCED and d.reproduces_in == {"16-mixed": True, "32-true": False, "64-true": False}
    assert all(math.isfinite(x) for x in d.replays[0].losses) and d.data.check == "forward+backward"
    f = d.finding
    assert f.phase == "backward" and f.dtype == "float16" and (f.output.posinf or f.output.neginf)
    assert max(s.abs_max for s in f.inputs) > 65504, "a scaled gradient beyond float16's range"
    assert f"loss scale {d.loss_scale:.3g}" in d.next_actions[0] and "precision=bf16-mixed" in d.next_actions[0]
    assert "debug_args.nancapture.max_skipped_steps=4 (was 2)" in d.next_actions[1]


def test_bf16_mixed_rounding_is_precision_induced(tmp_path):
    """A hand-written log(1 - sigmoid(z)) of a confident sample (z = 10): sigmoid(10) rounds to
    exactly 1 in bfloat16 (log(0) = -inf) but not in float32. bfloat16 has float32's range,
    so this is lost precision, not overflow, and the advice says so."""
    victim = samples_of_step(2)[3]
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "bf16", model=BCENet(), data=BCEData(plant={victim: 20.0}), precision="bf16-mixed",
              debug_args=NANCAPTURE, **RUN)
    assert (info.value.step, info.value.reason) == (2, "nonfinite_loss")
    d = stabletrain.diagnose(info.value.capture_path, model=BCENet())

    assert d.precision == "bf16-mixed"
    assert d.reproduces_in == {"bf16-mixed": True, "32-true": False, "64-true": False}
    assert d.cause == PRECISION_INDUCED
    f = d.finding
    assert (f.op, f.phase, f.dtype) == ("aten.log.default", "forward", "bfloat16")
    assert f.outside_forward and "torch.log(1 - p)" in f.source, "the loss is computed in training_step"
    assert f.output.neginf and not f.inputs_nonfinite
    assert (f.inputs[0].abs_min, f.inputs[0].abs_max) == (0.0, 0.0), "1 - sigmoid(10) is exactly 0 in bfloat16"
    assert d.data.status == "isolated" and d.data.rows == [3] and d.data.dataset_indices == [victim]
    assert d.weights.status == "healthy" and d.origin is None
    assert d.probable_cause.startswith("bfloat16 rounding: log in BCENet outside forward")
    assert "overflow" not in d.probable_cause and f"dataset index {victim}" in d.probable_cause
    assert d.next_actions[0].startswith("Train with precision=32-true: bfloat16 keeps only about 3 significant digits")
    assert "Or keep bf16-mixed" in d.next_actions[1] and "F.logsigmoid(-z)" in d.next_actions[1]
    assert f.source in d.next_actions[1]


@pytest.mark.parametrize("fault", ["conversion", "square"])
def test_16_true_failures_are_precision_induced_with_float16_advice(tmp_path, fault):
    """16-true converts the model and the batch to float16. "conversion": a sample holds
    1e5, finite in float32 and +Inf once converted (the first op only passes it on: the
    origin is the conversion). "square": an activation whose square exceeds 65504.
    SGD, because 16-true AdamW has a trap of its own (next test)."""
    victim = samples_of_step(2)[4]
    plant = {"x": 1e5} if fault == "conversion" else FAULTS["square"][0]
    gate = "none" if fault == "conversion" else "square"
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / fault, model=FaultNet(gate), data=FaultData(plant={victim: plant}), precision="16-true",
              debug_args=NANCAPTURE, **{**RUN, "model_args": {**RUN["model_args"], "optimizer": "sgd"}})
    assert info.value.step == 2
    d = stabletrain.diagnose(info.value.capture_path, model=FaultNet(gate))

    assert d.precision == "16-true" and d.cause == PRECISION_INDUCED
    assert d.reproduces_in == {"16-true": True, "32-true": False, "64-true": False}
    assert d.data.status == "isolated" and d.data.rows == [4] and d.data.dataset_indices == [victim]
    assert d.weights.status == "healthy" and d.data.nonfinite_inputs == []
    f = d.finding
    assert f.phase == "forward" and f.dtype == "float16"
    if fault == "conversion":
        assert f.module == "fc1" and f.inputs_nonfinite and d.origin == "precision_conversion"
        assert d.data.out_of_range_inputs == [{"rank": 0, "micro_step": 0, "row": 4, "index": victim,
                                               "field": "batch['x']", "count": 4, "abs_max": 1e5}]
        assert (f"the batch holds values beyond float16's range (batch['x'] of sample {victim} reaches 1e+05 in "
                "magnitude): 16-true converts the batch to float16") in d.probable_cause
        assert d.next_actions[0].startswith("Train with precision=bf16-mixed or precision=32-true, which keep the batch in float32")
        assert "largest value is 65504" in d.next_actions[0]
        assert "precision=16-mixed" not in d.next_actions[0], "autocast would cast the batch to float16 in fc1 all the same"
        assert d.next_actions[1].startswith("Or keep 16-true and scale the inputs into float16's range")
        assert "it came from the conversion of the batch to float16" in d.to_markdown()
    else:
        assert (f.op, f.module) == ("aten.mul.Tensor", "gate") and not f.inputs_nonfinite and d.origin is None
        assert f.output.posinf and 256 < max(s.abs_max for s in f.inputs) < 65504
        assert d.data.out_of_range_inputs == [], "2000 fits in float16: the square does not"
        assert d.probable_cause.startswith("float16 overflow: mul in gate (Gate)")
        first = d.next_actions[0]
        assert "precision=bf16-mixed" in first and "precision=32-true" in first and "exceeds 65504" in first
        assert "precision=16-mixed" in first and "loss scaling acts on gradients" in first
        assert d.next_actions[1].startswith("Or keep 16-true and keep the value in range where it grows")


def test_16_true_adamw_writes_inf_into_the_weights(tmp_path):
    """16-true runs AdamW in float16 too: a small gradient's squared value underflows to 0 and
    eps=1e-8 is 0 in float16, so step 0's update divides by 0. Step 0's gradients are finite:
    the guard stops right after that optimizer step (not one step later, as nancapture alone
    did), names the optimizer and why, and with nancapture on captures the optimizer step;
    diagnose replays it and gives the precision advice."""
    with pytest.raises(NonFiniteStepError) as info:
        train(out=tmp_path / "adamw", model=FaultNet("square"), data=FaultData(), precision="16-true",
              debug_args=NANCAPTURE, **RUN)
    err = info.value
    assert (err.step, err.stopped_at, err.origin, err.optimizer) == (0, 0, "optimizer_step", "torch.optim.AdamW")
    assert "fc1.weight" in err.param_names and "eps=1e-08 is 0 in float16" in str(err)
    d = stabletrain.diagnose(err.capture_path, model=FaultNet("square"))
    assert d.cause == "optimizer_step" and d.reproduced and d.gradients_finite and d.float32_finite
    assert "fc1.weight" in d.nonfinite_params and set(d.nonfinite_params) == set(err.param_names)
    trap = d.next_actions[0]
    assert trap.startswith("Train with precision=16-mixed or precision=bf16-mixed (float32 weights and optimizer state")
    assert "precision=32-true" in trap and "6e-08" in trap


def test_poisoned_sample_in_a_batch_of_32_with_accumulation_4(tmp_path):
    step, micro, row = 1, 2, 5
    victim = samples_of_step(step, batch_size=32, accum=4)[micro * 8 + row]
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "run", model=PoisonNet(), data=PoisonData(input_poison={victim: float("nan")}),
              gradient_accumulation_steps=4, debug_args=NANCAPTURE, **{**RUN, "batch_size": 32})
    d = stabletrain.diagnose(info.value.capture_path, model=PoisonNet())

    assert d.cause == DETERMINISTIC_NUMERICAL and d.step == step
    assert d.data.failing_microbatches == [(0, micro)] and d.data.microbatches == [(0, micro)]
    assert d.data.status == "isolated" and d.data.rows == [row] and d.data.dataset_indices == [victim]
    assert d.data.microbatch_size == 8 and d.data.check == "forward"
    assert d.data.replays <= 8, "bisection, not one replay per sample"
    assert d.data.nonfinite_inputs == [{"rank": 0, "micro_step": micro, "row": row, "index": victim,
                                        "field": "batch['x']", "count": 1}]
    f = d.finding
    assert f.phase == "forward" and f.module == "fc1" and f.inputs_nonfinite and d.origin == "data"
    assert d.traced_on == {"microbatches": [(0, micro)], "rows": [row], "dataset_indices": [victim]}
    assert d.weights.status == "healthy"
    assert f"batch['x'] of sample {victim} holds 1 non-finite value" in d.probable_cause and "bad data" in d.probable_cause
    assert f"dataset index {victim}" in d.next_actions[0]
    assert any("dropout" in c for c in d.data.caveats), "PoisonNet has dropout"


def test_failure_only_in_the_accumulated_gradient_is_a_combination(tmp_path):
    """Two microbatches each add 2e38 to a gradient: finite alone, +Inf once accumulated."""
    a, b = samples_of_step(2, accum=2)[1], samples_of_step(2, accum=2)[6]
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "run", model=PoisonNet(), data=PoisonData(grad_poison={a: 2e38, b: 2e38}),
              gradient_accumulation_steps=2, debug_args=NANCAPTURE, **RUN)
    d = stabletrain.diagnose(info.value.capture_path, model=PoisonNet())
    assert d.cause == DETERMINISTIC_NUMERICAL and d.reproduces_in == {"32-true": True, "64-true": False}
    assert d.data.status == "combination" and d.data.failing_microbatches == []
    assert d.data.microbatches == [(0, 0), (0, 1)] and d.data.check == "forward+backward"
    f = d.finding
    assert f.phase == "backward" and f.op == "aten.add_.Tensor" and f.forward_op == "torch::autograd::AccumulateGrad"
    assert f.output.posinf and all(1e38 < s.abs_max < 3.4e38 for s in f.inputs), "two finite gradients whose sum overflows"
    assert "accumulated gradient" in d.data.note


def test_weights_made_huge_by_earlier_steps(tmp_path):
    boom = {"optimizer": "sgd", "lr": 1000.0, "warmup_steps": 0, "lr_schedule": "constant"}
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "boom", debug_args=NANCAPTURE,
              **tiny_lm(steps=10, checkpoint_every_num_steps=1, max_checkpoints_to_keep=10, model_args=boom))
    d = stabletrain.diagnose(info.value.capture_path.parent)  # built-in model, rebuilt from the settings

    assert d.weights.status == "huge"
    top = d.weights.largest[0]
    assert top.abs_max >= 1e3 and top.abs_max == max(p.abs_max for p in d.weights.largest)
    assert "weights were already huge" in d.probable_cause and top.name in d.probable_cause
    assert d.cause == DETERMINISTIC_NUMERICAL and d.reproduces_in["32-true"]
    assert d.data.status == "not_data_specific", "any sample fails: no culprit sample"
    assert d.finding is not None and d.finding.phase == "forward" and not d.finding.inputs_nonfinite
    # The checkpoints are finite, but from the first one on the weights are 100x their start
    # (one SGD step at lr 1000): none is recorded healthy, so the advice is to start again.
    steps = [c["step"] for c in d.weights.checkpoints]
    assert steps == list(range(1, d.step + 1))
    assert not any(c["healthy"] for c in d.weights.checkpoints) and d.weights.healthy_checkpoint is None
    assert d.next_actions[0].startswith(f"No checkpoint of this run has healthy weights (the newest, step {d.step}: ")
    assert "the weight norm is" in d.next_actions[0] and "its" in d.next_actions[0]
    # SGD: never AdamW's default (0.001 barely trains SGD); a tenth of the run's own lr, said to be unverified.
    assert ("start again with overwrite=true and model_args.lr=100 or lower (was 1000; the run's lr x0.1, not verified"
            in d.next_actions[0])
    assert "gradient_clip_val=1.0" in d.next_actions[1]
    assert [h["step"] for h in d.history] == list(range(max(0, d.step - 5), d.step))


class _Damage:
    """After step ``step``'s optimizer step (and the guard's check of it) put ``value`` at
    ``index`` of a parameter or buffer: what a bad earlier step leaves behind. With checkpoints
    every 2 steps, the one after step 1 is written before the damage; none is written after it
    (a checkpoint with NaN/Inf is refused, tests/safety/test_checkpoint_health.py)."""

    def __init__(self, name, index, value, step=2):
        self.name, self.index, self.value, self.step = name, index, value, step

    def on_after_optimizer_step(self, trainer, *, step):
        if step == self.step:
            state = {**dict(trainer.model.named_parameters()), **dict(trainer.model.named_buffers())}
            with torch.no_grad():
                state[self.name][self.index] = self.value


def _damaged_run(tmp_path, model, damage):
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "run", model=model, data=FaultData(), callbacks=[damage], debug_args=NANCAPTURE,
              checkpoint_every_num_steps=2, max_checkpoints_to_keep=10, **RUN)
    assert info.value.step == 3, "the first step that starts from the damaged state"
    for ckpt in (tmp_path / "run" / "checkpoints").iterdir():
        state = torch.load(ckpt, weights_only=True)
        assert all(bool(torch.isfinite(t).all()) for t in state["model"].values()), ckpt
    return info.value.capture_path


def test_weights_already_nonfinite_when_the_step_began(tmp_path):
    path = _damaged_run(tmp_path, FaultNet(), _Damage("fc1.weight", (5, 2), float("nan")))
    d = stabletrain.diagnose(path, model=FaultNet())

    w = d.weights
    assert w.status == "nonfinite" and [(p.name, p.nonfinite) for p in w.nonfinite] == [("fc1.weight", 1)]
    assert w.nonfinite_buffers == []
    assert d.cause == DETERMINISTIC_NUMERICAL and d.reproduces_in == {"32-true": True, "64-true": True}
    f = d.finding
    assert (f.module, f.phase) == ("fc1", "forward") and f.inputs_nonfinite and d.origin == "weights"
    assert d.data.status == "not_data_specific" and d.data.nonfinite_inputs == [], "every sample meets the NaN weight"
    assert d.probable_cause == ("the weights were already non-finite when the step began (1 value(s) of fc1.weight): "
                                "step 2 did the damage")
    # Which earlier event: metrics.jsonl logs every step, and step 2's loss and gradient norm were finite.
    assert (w.damage.step, w.damage.last_finite, w.damage.first_nonfinite) == (2, 2, None)
    assert "so step 2's optimizer step, or code run after it, made them non-finite" in d.to_markdown()
    assert d.to_dict()["weights"]["damage"]["step"] == 2, "the JSON says what the Markdown says"
    # The checkpoint written before the damage is healthy (and none was written after it).
    healthy = tmp_path / "run" / "checkpoints" / "step_000002.ckpt"
    assert [(c["step"], c["healthy"]) for c in w.checkpoints] == [(2, True)]
    assert w.healthy_checkpoint == str(healthy)
    assert d.next_actions[0].startswith("Resume from before the damage: the newest checkpoint with healthy weights is step 2")
    assert f"resume_from={healthy}" in d.next_actions[0]
    assert "model_args.lr=0.001 or lower (was 0.01)" in d.next_actions[0]
    # AdamW (the default): its update is about lr whatever the gradient, so clipping is not offered as the bound.
    assert d.next_actions[1].startswith("Clipping gradients would not keep single steps small: AdamW's update is")
    report = d.to_markdown()
    assert "The weights already held NaN/Inf when the step began: fc1.weight (1)." in report
    assert "it came from the weights, non-finite at the start of the step" in report
    assert "fc1.weight 0.524 (and 1 NaN/Inf)" in report  # after 3 steps (the damage now follows step 2)


def test_buffer_already_nonfinite_when_the_step_began(tmp_path):
    """Running statistics held in buffers are state too: an Inf in one is damage from an
    earlier forward pass, found through the first op that reads it, and not the optimizer's."""
    path = _damaged_run(tmp_path, NormNet(), _Damage("norm.mean", 1, float("inf")))
    d = stabletrain.diagnose(path, model=NormNet())

    w = d.weights
    assert w.status == "nonfinite" and w.nonfinite == [] and w.nonfinite_buffers == ["norm.mean"]
    assert d.cause == DETERMINISTIC_NUMERICAL
    f = d.finding
    assert (f.module, f.module_type, f.phase) == ("norm", "RunningNorm", "forward")
    assert f.inputs_nonfinite and d.origin == "buffers" and "self.mean.lerp_" in f.source
    assert d.probable_cause.startswith("the buffer norm.mean already held NaN/Inf when the step began and lerp_ in norm")
    # The checkpoint from before the damage is where to resume from; none holds the Inf buffer.
    assert [(c["step"], c["healthy"]) for c in w.checkpoints] == [(2, True)]
    assert "healthy weights and buffers is step 2" in d.next_actions[0] and "step_000002.ckpt" in d.next_actions[0]
    assert "model_args.lr" not in d.next_actions[0], "the optimizer does not write buffers"
    assert d.next_actions[1].startswith("Find what put NaN/Inf into norm.mean: the forward pass updates them")
    report = d.to_markdown()
    assert "The weights were finite, but buffers already held NaN/Inf when the step began: norm.mean." in report
    assert "it came from buffers (norm.mean)" in report and "Checkpoints: step 2 |w| 0.5" in report
    assert "(non-finite buffers)" not in report and "(bad)" not in report


def _plain_loop(model, data, out_dir, steps, with_indices=True):
    """A plain SGD loop (batches of 8 in order) under the standalone monitor that must end in
    NaNDetectedError, which it returns. ``with_indices=False``: collect_batch is not told the
    dataset indices."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = NaNCaptureMonitor(model, out_dir=out_dir)
    with pytest.raises(NaNDetectedError) as info:
        for step in range(steps):
            rows = list(range(step * 8, step * 8 + 8))
            batch = torch.utils.data.default_collate([data[i] for i in rows])
            monitor.begin_step(step)
            monitor.collect_batch(batch, indices=rows if with_indices else None)
            loss = model.training_step(batch)
            monitor.collect_loss(loss)
            loss.backward()
            monitor.check_and_capture()
            optimizer.step()
            optimizer.zero_grad()
    return info.value


def _plain_loop_capture(tmp_path, fires):
    """A plain loop with the standalone monitor over FlakyNet, failing at step 3."""
    torch.manual_seed(0)
    err = _plain_loop(FlakyNet(fires=fires), PoisonData(), tmp_path / "caps", steps=8)
    assert err.step == 3
    return err.capture_path


@pytest.mark.parametrize("replays_hit", [[False, False], [True, False]], ids=["never-again", "1-of-2"])
def test_nondeterministic_fault_is_not_reproducible(tmp_path, replays_hit):
    path = _plain_loop_capture(tmp_path, fires=[False, False, False, True])
    d = stabletrain.diagnose(path, model=FlakyNet(fires=replays_hit))

    assert d.cause == NOT_REPRODUCIBLE
    assert [r.reproduced for r in d.replays[:2]] == replays_hit
    assert d.finding is None and d.data.status == "not_searched"
    assert "nondeterminism" in d.cause_explanation and "hardware fault" in d.cause_explanation
    if replays_hit[0]:
        assert "failed only the first time" in d.cause_explanation
    else:
        assert "finite both times" in d.cause_explanation
    assert d.next_actions[0].startswith("Rerun from the last checkpoint") and "resume_interrupted=true" in d.next_actions[0]
    assert "not reproducible" in d.to_markdown()


def test_capture_without_dataset_indices_names_rows(tmp_path):
    """A plain loop that does not give collect_batch the dataset indices: the culprit sample
    is named by its row in the microbatch."""
    data = FaultData(plant={13: {"s": 0.0}})  # step 1, row 5
    err = _plain_loop(FaultNet("log0"), data, tmp_path / "caps", steps=4, with_indices=False)
    assert err.step == 1
    d = stabletrain.diagnose(err.capture_path, model=FaultNet("log0"))

    assert d.cause == DETERMINISTIC_NUMERICAL and d.finding.op == "aten.log.default"
    assert d.data.status == "isolated" and d.data.rows == [5]
    assert d.data.index_sets is None and d.data.dataset_indices is None
    assert d.traced_on == {"microbatches": [(0, 0)], "rows": [5], "dataset_indices": None}
    assert d.probable_cause.endswith(" for row 5")
    assert d.next_actions[0].endswith("row 5 drives its argument to 0 or below.")
    assert d.next_actions[1].startswith("Look at row 5: what sets it apart")
    report = d.to_markdown()
    assert "Row 5 of microbatch 0 (8 samples) triggers the failure" in report
    assert "- traced on microbatch(es) 0, rows [5], in 32-true" in report and "dataset ind" not in report
    assert d.to_dict()["data"]["dataset_indices"] is None and d.to_dict()["data"]["rows"] == [5]


def test_batchnorm_makes_single_sample_isolation_approximate(tmp_path):
    """The built-in CNN (BatchNorm) with an Inf pixel in one image of step 1. A NaN put into a
    BatchNorm running variance after step 0 is reported but not blamed: in training mode
    BatchNorm normalises with the batch's statistics and never reads it."""

    class PoisonImage:
        def on_microbatch(self, trainer, *, step, micro_step, batch, indices):
            if step == 1:
                batch[0][6, 1, 4, 7] = float("inf")  # the batch the model (and the capture) gets
                self.victim = int(indices[6])

        def on_after_optimizer_step(self, trainer, *, step):
            if step == 0:
                dict(trainer.model.named_buffers())["features.1.bn.running_var"][2] = float("nan")

    poison = PoisonImage()
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "cnn", model="cnn", model_args={"cnn_width": 4, "warmup_steps": 0},
              transform_args={"image_size": 16}, callbacks=[poison], debug_args=NANCAPTURE,
              **{k: v for k, v in RUN.items() if k != "model_args"})
    d = stabletrain.diagnose(info.value.capture_path.parent)  # rebuilt from the stored settings
    assert d.cause == DETERMINISTIC_NUMERICAL and d.step == 1
    assert d.data.approximate and "BatchNorm" in d.data.caveats[0] and "approximate" in d.data.caveats[0]
    assert d.data.status == "isolated" and d.data.dataset_indices == [poison.victim] and d.data.rows == [6]
    assert d.finding.module == "features.0.conv" and d.finding.phase == "forward"
    assert d.finding.inputs_nonfinite and d.origin == "data"
    assert f"dataset index {poison.victim}" in d.next_actions[0]
    assert "transform_args.normalize" in d.next_actions[1], "image data: check the input normalisation"
    assert "BatchNorm makes their isolation approximate" in d.next_actions[-2]
    assert d.weights.status == "nonfinite" and d.weights.nonfinite == []
    assert d.weights.nonfinite_buffers == ["features.1.bn.running_var"]
    assert d.probable_cause.startswith("bad data:"), "the unread buffer is not the cause"
    assert not any("Resume from" in a for a in d.next_actions)
    assert ("buffers already held NaN/Inf when the step began: features.1.bn.running_var. The damage happened in "
            "earlier steps, though the failure traces back to something else (see Where).") in d.to_markdown()


def test_two_ranks_the_culprit_sample_is_on_rank_1(tmp_path):
    """Captures of a 2-rank step (the standalone monitor, as under torch.distributed) where
    only rank 1's data holds a NaN; each rank alone, and both together."""
    import copy

    from torch.utils.data import default_collate

    data = PoisonData(input_poison={13: float("nan")})
    torch.manual_seed(0)
    base = PoisonNet()
    for rank in (0, 1):
        model = copy.deepcopy(base)
        monitor = NaNCaptureMonitor(model, out_dir=tmp_path / "caps", rank=rank, world_size=2, any_rank=lambda flag: True)
        rows = list(range(rank * 8, rank * 8 + 8))  # rank 1 holds sample 13, at row 5
        batch = default_collate([data[i] for i in rows])
        monitor.begin_step(0)
        monitor.collect_batch(batch, indices=rows)
        loss = model.training_step(batch)
        monitor.collect_loss(loss)
        loss.backward()
        with pytest.raises(NaNDetectedError):
            monitor.check_and_capture()

    d = stabletrain.diagnose(tmp_path / "caps", model=PoisonNet())
    assert d.ranks == [0, 1] and d.reason == "nonfinite_loss" and d.cause == DETERMINISTIC_NUMERICAL
    assert d.data.failing_microbatches == [(1, 0)] and d.data.microbatches == [(1, 0)]
    assert d.data.rows == [5] and d.data.dataset_indices == [13] and "microbatch 0 of rank 1" in d.data.note
    assert d.files == [str(tmp_path / "caps" / "diagnosis.md"), str(tmp_path / "caps" / "diagnosis.json")]

    alone = stabletrain.diagnose(tmp_path / "caps" / "rank0", model=PoisonNet())
    assert alone.reason == "other_rank" and alone.cause == NOT_REPRODUCIBLE
    assert "another rank" in alone.probable_cause
    assert alone.next_actions == [f"Diagnose all ranks together: stabletrain diagnose {tmp_path / 'caps'}"]


def test_report_files_json_and_command_line(tmp_path, capsys):
    from stabletrain.cli import main

    path, victim = _fault_capture(tmp_path, "log0")
    model_spec = f"{sys.modules[FaultNet.__module__].__file__}:LogFaultNet"
    capsys.readouterr()
    assert main(["diagnose", str(path.parent), "--model", model_spec]) == 0
    printed = capsys.readouterr().out
    md, js = path.parent / "diagnosis.md", path.parent / "diagnosis.json"
    assert md.read_text().strip() == printed.split("\nWritten: ")[0].strip()
    assert f"Written: {md}, {js}" in printed
    for heading in ("## What happened", "## Where", "## Why", "## Which data", "## Before or during the step", "## Next actions"):
        assert heading in printed
    assert "**Verdict: deterministic numerical**" in printed and "`aten.log.default`" in printed

    data = json.loads(js.read_text())
    assert main(["diagnose", str(path.parent), "--model", model_spec, "--json", "--no-write"]) == 0
    again = json.loads(capsys.readouterr().out)
    for key in ("verdict", "summary", "cause", "where", "data", "weights", "next_actions", "reproduces_in"):
        assert again[key] == data[key], key
    untimed = lambda replays: [{k: v for k, v in r.items() if k != "seconds"} for r in replays]  # noqa: E731
    assert untimed(again["replays"]) == untimed(data["replays"])
    assert data["cause"] == "deterministic_numerical" and data["where"]["op"] == "aten.log.default"
    assert data["where"]["module"] == "gate" and data["where"]["phase"] == "forward"
    assert data["data"]["dataset_indices"] == [victim] and data["weights"]["status"] == "healthy"
    assert data["replays"][0]["losses"][0] in ("nan", "inf", "-inf"), "non-finite numbers as strings"

    # Your own model is needed, and the error says how to pass it to this command: the file training named.
    assert main(["diagnose", str(path.parent)]) == 1
    err = capsys.readouterr().err
    assert f"stabletrain diagnose {path.parent} --model {sys.modules[FaultNet.__module__].__file__}:FaultNet" in err
    assert "path/to/file.py" not in err
    assert stabletrain.Diagnosis is Diagnosis


@pytest.mark.slow
def test_diagnose_command_as_a_user_runs_it(tmp_path):
    boom = {"optimizer": "sgd", "lr": 1000.0, "warmup_steps": 0, "lr_schedule": "constant"}
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "boom", debug_args=NANCAPTURE, **tiny_lm(steps=10, model_args=boom))
    run = subprocess.run([sys.executable, "-m", "stabletrain", "diagnose", "boom/debug/nan_capture/rank0", "--json"],
                         cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(run.stdout)
    assert data["step"] == info.value.step and data["weights"]["status"] == "huge"
    # No checkpoint was written before the failure: resuming is not offered, starting again is.
    assert data["weights"]["checkpoints"] == []
    assert "No checkpoint of this run" in data["next_actions"][0] and "overwrite=true" in data["next_actions"][0]
    assert (tmp_path / "boom/debug/nan_capture/rank0/diagnosis.md").is_file()
    bad = subprocess.run([sys.executable, "-m", "stabletrain", "diagnose", "nowhere"], cwd=tmp_path, env=cli_env(),
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "no such file or folder: nowhere" in bad.stderr


def test_subset_search_stops_at_its_budget_and_keeps_only_what_replays_decided(tmp_path):
    path, victim = _fault_capture(tmp_path, "log0")
    d = stabletrain.diagnose(path.parent, model=FaultNet("log0"), write=False, max_subset_replays=2)
    assert d.data.replays == 2
    assert "stopped after 2 subset replays (max_subset_replays)" in d.data.caveats
    # The halving search was cut short: its half-decided answer is dropped, the whole microbatch stays.
    assert d.data.row_sets == [list(range(8))] and victim in d.data.index_sets[0]
    full = stabletrain.diagnose(path.parent, model=FaultNet("log0"), write=False)
    assert full.data.row_sets == [[3]] and full.data.replays > 2 and not full.data.caveats


def test_ddmin_finds_one_minimal_culprit_set():
    calls = []

    def fails(s):
        calls.append(list(s))
        return 13 in s

    assert _ddmin(list(range(32)), fails) == [13]
    assert len(calls) <= 2 * 5, "a bisection: about 2 log2(32) checks"
    assert sorted(_ddmin(list(range(16)), lambda s: 3 in s and 11 in s)) == [3, 11], "a pair needed together"
