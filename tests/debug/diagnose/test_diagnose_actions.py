"""Next actions, table-driven from hand-built diagnoses (no model, no replay): one row per cause and, for a
failure of the arithmetic, per kind of op; and the cause classes they are chosen by."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

from stabletrain.debug.diagnose import (
    DETERMINISTIC_NUMERICAL,
    NOT_REPRODUCIBLE,
    PRECISION_INDUCED,
    DataReport,
    Diagnosis,
    Evidence,
    ParamStat,
    ReplayOutcome,
    WeightsReport,
)
from stabletrain.debug.diagnose.actions import OP_FIXES, next_actions
from stabletrain.debug.diagnose.classify import cause_class, op_kind, precision_failure
from stabletrain.debug.op_trace import OpFinding, TensorStat

CAPTURE = Path("/runs/boom/debug/nan_capture/rank0/nan_capture.pt")
REPLAY = "stabletrain replay /runs/boom/debug/nan_capture/rank0 --model train.py:Net"
SOURCE = "train.py:12: y = torch.log(x)"


def stat(abs_min: float = 0.5, abs_max: float = 2.0, nan: int = 0, posinf: int = 0, neginf: int = 0) -> TensorStat:
    return TensorStat(0, "float32", [8, 4], abs_min, abs_max, nan, posinf, neginf)


def op(name: str = "aten.log.default", phase: str = "forward", output: Optional[TensorStat] = None,
       inputs: Optional[list[TensorStat]] = None, **kw: Any) -> OpFinding:
    return OpFinding(op=name, phase=phase, module="gate", module_type="Gate", dtype="float32",
                     output=output or stat(neginf=8), inputs=inputs or [stat(abs_min=0.0)], source=SOURCE, **kw)


def isolated(*rows: int, indices: Optional[list[int]] = None) -> DataReport:
    return DataReport(status="isolated", microbatches=[(0, 0)], row_sets=[[r] for r in rows],
                      index_sets=[[i] for i in indices] if indices else None, microbatch_size=8)


HEALTHY = WeightsReport("healthy", 1e3, [ParamStat("fc.weight", [4, 4], 0.5, 0.1, 0)], [], [])


def evidence(cause: str = DETERMINISTIC_NUMERICAL, precision: str = "32-true", reason: str = "nonfinite_loss",
             finding: Optional[OpFinding] = None, data: Optional[DataReport] = None,
             weights: WeightsReport = HEALTHY, origin: Optional[str] = None, loss_scale: Optional[float] = None,
             ranks: tuple[int, ...] = (0,)) -> Evidence:
    replay = ReplayOutcome("captured precision", precision, cause != NOT_REPRODUCIBLE, [math.nan], [], math.nan, 0.1)
    return Evidence(
        path=str(CAPTURE.parent), step=3, ranks=list(ranks), world_size=len(ranks), precision=precision,
        loss_scale=loss_scale, reason=reason, model_class="Net", device="cpu", cause=cause, deterministic=True,
        matches_capture=True, replays=[replay, replay], reproduces_in={precision: cause != NOT_REPRODUCIBLE},
        finding=finding, traced_on=None, origin=origin, data=data or DataReport(status="not_data_specific"),
        weights=weights,
    )


def capture(settings: Optional[dict[str, Any]] = None, **raw: Any) -> SimpleNamespace:
    """What the actions read of a NaNCapture (``model_meta`` is a field of the file, as in a real one)."""
    rank = SimpleNamespace(path=CAPTURE, raw={"replay_command": REPLAY, **raw},
                           largest_gradients=[("fc.weight", 2.5e19)], model_meta=raw.get("model_meta"))
    return SimpleNamespace(ranks=[rank], settings=settings, step=3, world_size=1, path=CAPTURE.parent)


RUN = {"model_args": {"lr": 0.01, "optimizer": "adamw"}, "gradient_clip_val": 0, "precision": "32-true"}
SGD_RUN = {**RUN, "model_args": {"lr": 0.01, "optimizer": "sgd"}}
LR = "model_args.lr=0.001 or lower (was 0.01)"
CLIP = "gradient_clip_val=1.0 (clipping is off)"
#: AdamW's update is about lr whatever the gradient: clipping is not offered as what bounds it.
NO_CLIP = "Clipping gradients would not keep single steps small: AdamW's update is about lr in size whatever"
REPLAY_ACTION = f"Replay the step yourself: {REPLAY}"


def checkpoints(*healthy: bool) -> list[dict[str, Any]]:
    return [{"path": f"/runs/boom/checkpoints/step_{s:06d}.ckpt", "step": s, "abs_max": 0.5 if ok else 2e3,
             "healthy": ok} for s, ok in enumerate(healthy, 1)]


def damaged(status: str, ckpts: list[dict[str, Any]], nonfinite: bool = True, buffers: tuple[str, ...] = ()):
    params = [ParamStat("fc.weight", [4, 4], 2e3, 1.0, 3 if nonfinite else 0)]
    good = [c["path"] for c in ckpts if c["healthy"]]
    return WeightsReport(status, 1e3, params, params if nonfinite else [], list(buffers), ckpts,
                         good[-1] if good else None)


#: id -> (evidence, settings, raw capture fields, out exists, the actions: each starts with its prefix).
CASES: dict[str, tuple[Evidence, Optional[dict[str, Any]], dict[str, Any], bool, list[str]]] = {
    "not-reproducible": (
        evidence(NOT_REPRODUCIBLE), RUN, {}, True,
        ["Rerun from the last checkpoint: rerun your training command with resume_interrupted=true "
         "(/runs/boom/checkpoints/last.ckpt holds no NaN: nancapture stopped before the optimizer step). A sporadic",
         "If it fails again at another step, localise it while it happens: debug_args.underflow_overflow.enabled=true",
         f"On a GPU: make kernels deterministic (torch.use_deterministic_algorithms(True)) and check the hardware "
         f"(nvidia-smi -q for ECC errors, temperatures); replay the capture on the original machine ({REPLAY} "
         "--device cuda)."],
    ),
    "not-reproducible-other-rank": (
        evidence(NOT_REPRODUCIBLE, reason="other_rank"), RUN, {}, True,
        ["Diagnose all ranks together: stabletrain diagnose /runs/boom/debug/nan_capture"],
    ),
    "huge-weights-healthy-checkpoint": (
        evidence(weights=damaged("huge", checkpoints(True, True, False), nonfinite=False)), RUN, {}, True,
        ["Resume from before the damage: the newest checkpoint with healthy weights is step 2 (|w| up to 0.5); "
         "rerun your training command with resume_from=/runs/boom/checkpoints/step_000002.ckpt "
         f"and {LR}.",
         NO_CLIP, REPLAY_ACTION],
    ),
    "huge-weights-no-healthy-checkpoint": (
        evidence(weights=damaged("huge", checkpoints(False, False), nonfinite=False)), SGD_RUN, {}, True,
        [f"No checkpoint of this run has healthy weights (the newest, step 2: |w| up to 2e+03, huge from 1e+03): "
         f"start again with overwrite=true and {LR}.", f"Keep single steps from blowing the weights up: {CLIP}.",
         REPLAY_ACTION],
    ),
    # AdamW at lr 0.01 moves a weight by about 0.01 a step: 2e3 at step 3, huge in every checkpoint, was
    # not grown by training (issue 25: the HF example's planted row is not divergence).
    "huge-weights-from-initialisation": (
        evidence(weights=damaged("huge", checkpoints(False, False), nonfinite=False)), RUN, {}, True,
        ["Fix the initialisation or the weights loaded: fc.weight holds |w| up to 2e+03 when step 3 begins, and "
         "AdamW moves a weight by about lr = 0.01 per step, so 3 step(s) cannot carry one from its initial scale",
         REPLAY_ACTION],
    ),
    "nonfinite-weights-16-true-adamw": (
        evidence(precision="16-true", weights=damaged("nonfinite", []), origin="weights",
                 finding=op(inputs_nonfinite=True)), RUN, {}, True,
        [f"No checkpoint of this run was found under /runs/boom/checkpoints (written before step 3): start again with "
         f"overwrite=true and {LR}.",
         "With precision=16-true the optimizer runs in float16 too: AdamW's second moment",
         NO_CLIP, REPLAY_ACTION],
    ),
    "nonfinite-weights-outside-a-run": (
        evidence(weights=damaged("nonfinite", [])), {**RUN, "model_args": {"lr": 0.01, "optimizer": "sgd"}}, {}, False,
        [f"Resume from a checkpoint written before the weights went bad (rerun your training command with "
         f"resume_interrupted=true) with {LR}.", "Keep single steps from blowing the weights up", REPLAY_ACTION],
    ),
    "nonfinite-buffer-read-by-the-op": (
        evidence(weights=damaged("nonfinite", checkpoints(True, False), nonfinite=False, buffers=("norm.mean",)),
                 origin="buffers", finding=op(inputs_nonfinite=True)), RUN, {}, True,
        ["Resume from before the damage: the newest checkpoint with healthy weights and buffers is step 1 "
         "(|w| up to 0.5); rerun your training command with resume_from=/runs/boom/checkpoints/step_000001.ckpt "
         "and the same settings.",
         "Find what put NaN/Inf into norm.mean: the forward pass updates them from the data", REPLAY_ACTION],
    ),
    "precision-conversion-of-the-batch": (
        evidence(PRECISION_INDUCED, "16-true", origin="precision_conversion", finding=op(inputs_nonfinite=True),
                 data=DataReport(status="isolated", microbatches=[(0, 0)], row_sets=[[4]], out_of_range_inputs=[
                     {"rank": 0, "micro_step": 0, "row": 4, "index": 9, "field": "batch['x']", "count": 4,
                      "abs_max": 1e5}])),
        {**RUN, "task": "image_classification"}, {}, True,
        ["Train with precision=bf16-mixed or precision=32-true, which keep the batch in float32: 16-true converts "
         "every input to float16, whose largest value is 65504.",
         "Or keep 16-true and scale the inputs into float16's range: batch['x'] of sample 9 reaches 1e+05 in "
         "magnitude (transform_args.normalize).", REPLAY_ACTION],
    ),
    "precision-rounding-bf16": (
        evidence(PRECISION_INDUCED, "bf16-mixed", finding=op()), RUN, {}, True,
        ["Train with precision=32-true: bfloat16 keeps only about 3 significant digits, and log gets a value that "
         "float32 keeps but bfloat16 rounds away.",
         f"Or keep bf16-mixed and compute the value that loses its precision in float32 (x.float()) or in a stable "
         f"form (F.logsigmoid(-z) for log(1 - sigmoid(z)), torch.log1p(x) for log(1 + x), x.clamp_min(eps) before "
         f"log, division or sqrt) at {SOURCE}.", REPLAY_ACTION],
    ),
    "precision-fp16-gradients-skipped-steps": (
        evidence(PRECISION_INDUCED, "16-mixed", reason="skipped_steps", loss_scale=256.0,
                 finding=op("aten.mul.Tensor", "backward", output=stat(posinf=2), inputs=[stat(abs_max=7e4)])),
        {**RUN, "debug_args": {"nancapture": {"max_skipped_steps": 2}}}, {"consecutive_skipped_steps": 3}, True,
        ["Train with precision=bf16-mixed (float32's range, no loss scaling needed) or precision=32-true: the "
         "float16 gradients overflow even at loss scale 256.",
         "If training had only just started, the GradScaler may still have been lowering its initial scale (it "
         "skips a step each time it halves it): allow more skipped steps in a row with "
         "debug_args.nancapture.max_skipped_steps=6 (was 2).", REPLAY_ACTION],
    ),
    "precision-fp16-activation": (
        evidence(PRECISION_INDUCED, "16-mixed", finding=op("aten.mul.Tensor", output=stat(posinf=2))), RUN, {}, True,
        ["Train with precision=bf16-mixed (same exponent range as float32; GPUs with bfloat16 support) or "
         "precision=32-true: a float16 activation exceeds 65504, which loss scaling cannot help.",
         f"Or keep 16-mixed and keep the value in range where it grows: {SOURCE}.", REPLAY_ACTION],
    ),
    "precision-16-true-gradients": (
        evidence(PRECISION_INDUCED, "16-true", finding=op("aten.mul.Tensor", "backward", output=stat(posinf=2))),
        RUN, {}, True,
        ["Train with precision=16-mixed (float32 master weights, and dynamic loss scaling", REPLAY_ACTION],
    ),
    "precision-16-true-activation": (
        evidence(PRECISION_INDUCED, "16-true", finding=op("aten.mul.Tensor", output=stat(posinf=2))), RUN, {}, True,
        ["Train with precision=bf16-mixed (float32's range) or precision=32-true: a float16 value exceeds 65504",
         "Or keep 16-true and keep the value in range where it grows", REPLAY_ACTION],
    ),
    "precision-bf16-overflow": (
        evidence(PRECISION_INDUCED, "bf16-true", finding=op("aten.mul.Tensor", "backward", output=stat(posinf=2))),
        RUN, {}, True,
        ["Train with precision=32-true: the values reach the edge of bfloat16's range.", REPLAY_ACTION],
    ),
    "log-of-one-sample": (
        evidence(finding=op(), data=isolated(5, indices=[77])), RUN, {}, True,
        [f"Guard the logarithm at {SOURCE}: torch.log(x.clamp_min(1e-12)) (or log1p / log_softmax) — the sample at "
         "dataset index 77 drives its argument to 0 or below.",
         "Look at the sample at dataset index 77: what sets it apart (an outlier, an empty or constant input) is "
         "what the guard must handle.", REPLAY_ACTION],
    ),
    "division-by-two-samples": (
        evidence(finding=op("aten.div.Tensor", output=stat(posinf=1)), data=isolated(2, 6)), RUN, {}, True,
        [f"Guard the division at {SOURCE}: divide by x.clamp_min(1e-12) or x + 1e-12 (keeping the sign) — rows 2, 6 "
         "make the denominator 0.", "Look at rows 2, 6: what sets them apart", REPLAY_ACTION],
    ),
    "sqrt-of-a-negative-any-data": (
        evidence(finding=op("aten.sqrt.default", output=stat(nan=1))), RUN, {}, True,
        [f"Guard the square root at {SOURCE}: torch.sqrt(x.clamp_min(0)) — the data make its argument negative.",
         REPLAY_ACTION],
    ),
    "infinite-sqrt-gradient": (
        evidence(finding=op("aten.div.Tensor", "backward", output=stat(posinf=1), forward_op="SqrtBackward0"),
                 data=isolated(3)), RUN, {}, True,
        [f"Make the derivative finite at {SOURCE}: torch.sqrt(x + 1e-12) instead of torch.sqrt(x) — its gradient "
         "1/(2 sqrt(x)) is infinite at x = 0, where row 3 puts it.", "Look at row 3", REPLAY_ACTION],
    ),
    "overflow-in-float32": (
        evidence(finding=op("aten.exp.default", output=stat(posinf=1))), RUN, {}, True,
        [f"Activations overflow at {SOURCE}: lower the learning rate ({LR}) and bound updates ({CLIP}).",
         REPLAY_ACTION],
    ),
    "softmax-over-a-fully-masked-row": (
        evidence(finding=op("aten._softmax.default", output=stat(nan=4), origin="inf")), RUN, {}, True,
        [f"Keep at least one unmasked position in every row at {SOURCE}: some samples leave a row masked everywhere",
         REPLAY_ACTION],
    ),
    "mask-in-arithmetic": (
        evidence(finding=op("aten.mul.Tensor", output=stat(nan=4), origin="inf")), RUN, {}, True,
        [f"Keep the masking -Inf out of arithmetic at {SOURCE}: NaN born in mul in gate (Gate), forward. Mask with "
         "torch.finfo(dtype).min instead of -inf, or apply the mask after this op.", REPLAY_ACTION],
    ),
    "bad-image-data": (
        evidence(finding=op("aten.convolution.default", inputs_nonfinite=True), origin="data", data=DataReport(
            status="isolated", microbatches=[(0, 0)], row_sets=[[6]], index_sets=[[41]], approximate=True,
            nonfinite_inputs=[{"rank": 0, "micro_step": 0, "row": 6, "index": 41, "field": "batch[0]", "count": 1}])),
        {**RUN, "task": "image_classification"}, {}, True,
        ["Fix or drop the sample at dataset index 41: batch[0] of sample 41 holds 1 non-finite value, and NaN/Inf in "
         "the data reaches the loss whatever the precision or learning rate.",
         "Check transform_args (transform_args.normalize.std must be well above 0 for every channel).",
         "Confirm the culprit samples in a full batch: BatchNorm makes their isolation approximate.", REPLAY_ACTION],
    ),
    "gradient-norm-overflow": (
        evidence(reason="gradient_norm_overflow", data=isolated(1)), RUN, {}, True,
        [f"Keep the gradients in range (|gradient| reached 2.5e+19 in fc.weight): lower the learning rate ({LR}) and "
         f"clip ({CLIP}) if they grew over steps; if row 1 is an outlier", "Look at row 1", REPLAY_ACTION],
    ),
    "untraced-without-settings": (
        evidence(), None, {}, False,
        ["Inspect the failing op; lower the learning rate (a 10x lower learning rate (model_args.lr)) if values grow "
         "over steps.", REPLAY_ACTION],
    ),
    "independent-of-a-reduced-precision": (
        evidence(precision="bf16-mixed", finding=op("aten.add.Tensor", output=stat(nan=1))),
        {**RUN, "precision": "bf16-mixed"}, {}, True,
        [f"Inspect add at {SOURCE}; lower the learning rate ({LR}) if values grow over steps.",
         "The failure is independent of precision; keep precision=bf16-mixed.", REPLAY_ACTION],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_next_actions(case, tmp_path):
    ev, settings, raw, out_exists, expected = CASES[case]
    out = Path("/runs/boom") if out_exists else None
    if out_exists and "No checkpoint of this run was found" in expected[0]:
        out = tmp_path  # a run folder that exists, without checkpoints
        expected = [expected[0].replace("/runs/boom", str(tmp_path)), *expected[1:]]
    actions = next_actions(ev, capture(settings, **raw), out)
    assert len(actions) == len(expected), "\n".join(actions)
    for got, want in zip(actions, expected, strict=True):
        assert got.startswith(want), f"\n got: {got}\nwant: {want}"
        assert "\n" not in got


def test_an_integrations_capture_gets_its_frameworks_settings(tmp_path):
    """A capture of stabletrain.integrations records the framework: the actions name its settings,
    and its run folder (here one without stabletrain checkpoints) is not a stabletrain run's."""
    meta = {"framework": "accelerate", "lr": 0.05, "clipping": False}
    ev = evidence(weights=damaged("huge", [], nonfinite=False))
    assert next_actions(ev, capture(None, model_meta=meta), tmp_path) == [
        "Resume from a checkpoint written before the weights went bad (accelerator.load_state(<last healthy "
        "checkpoint>)) with a 10x lower learning rate (the optimizer's learning rate, now 0.05).",
        "Keep single steps from blowing the weights up: accelerator.clip_grad_norm_(model.parameters(), 1.0) "
        "before optimizer.step().",
        REPLAY_ACTION,
    ]
    # Clipping on already: lower its threshold. Not reproducible: rerun from the framework's checkpoint.
    meta = {"framework": "lightning", "lr": None, "clipping": True}
    actions = next_actions(ev, capture(None, model_meta=meta), None)
    assert actions[0].endswith("with a 10x lower learning rate (the learning rate in configure_optimizers).")
    assert actions[1] == "Keep single steps from blowing the weights up: a lower Trainer(gradient_clip_val=...)."
    actions = next_actions(evidence(NOT_REPRODUCIBLE), capture(None, model_meta=meta), tmp_path)
    assert actions[0].startswith("Rerun from the last checkpoint: Trainer.fit(..., ckpt_path=<last healthy "
                                 "checkpoint>). A sporadic failure")
    assert actions[1].startswith("If it fails again at another step, localise it while it happens: "
                                 "StabletrainCallback(debug_args={'underflow_overflow': {'enabled': True}})")
    # The run's own settings win over a framework name (stabletrain train's captures have settings).
    assert "model_args.lr" in next_actions(ev, capture(SGD_RUN, model_meta=meta), None)[0]


def test_every_kind_of_op_a_guard_fixes_has_its_own_action():
    kinds = {op_kind(f) for f in (
        op(), op("aten.div.Tensor"), op("aten.sqrt.default", output=stat(nan=1)), op("aten.exp.default"),
        op("aten.div.Tensor", "backward", forward_op="SqrtBackward0"), op(origin="inf"),
    )}
    assert kinds == set(OP_FIXES) == {"log", "div", "sqrt", "overflow", "sqrt_grad", "nan_from_inf"}
    assert op_kind(op(inputs_nonfinite=True)) == "propagated"
    assert op_kind(op("aten.add.Tensor", output=stat(nan=1))) == "other"


def test_a_diagnosis_carries_the_actions_into_its_report_and_json():
    ev, settings, raw, _, _ = CASES["log-of-one-sample"]
    actions = next_actions(ev, capture(settings, **raw), None)
    d = Diagnosis.of(ev, cause_explanation="It comes back every time in 32-true.", summary="Training stopped.",
                     probable_cause="log of zero", next_actions=actions, files=[])
    assert d.to_dict()["next_actions"] == actions and d.verdict == "deterministic numerical: log of zero"
    report = d.to_markdown()
    assert "## Next actions\n\n1. Guard the logarithm" in report and f"\n3. {REPLAY_ACTION}\n" in report


@pytest.mark.parametrize("precision, reproducible, fp32_fails, cause", [
    ("16-mixed", True, False, PRECISION_INDUCED),
    ("bf16-true", True, False, PRECISION_INDUCED),
    ("16-mixed", True, True, DETERMINISTIC_NUMERICAL),
    ("32-true", True, True, DETERMINISTIC_NUMERICAL),
    ("64-true", True, False, DETERMINISTIC_NUMERICAL),
    ("16-mixed", False, True, NOT_REPRODUCIBLE),
    ("32-true", False, False, NOT_REPRODUCIBLE),
])
def test_the_cause_class_comes_from_the_captured_precision_and_float32(precision, reproducible, fp32_fails, cause):
    assert cause_class(precision, reproducible, fp32_fails) == cause


@pytest.mark.parametrize("finding, failure", [
    (op(), "rounding"),  # log(0)
    (op("aten.rsqrt.default", output=stat(posinf=1)), "rounding"),  # rsqrt is infinite only at 0
    (op("aten.div.Tensor", output=stat(posinf=1), inputs=[stat(), stat(abs_min=0.0)]), "rounding"),  # x / 0
    (op("aten.div.Tensor", output=stat(posinf=1), inputs=[stat(), stat(abs_min=1e-6)]), "overflow"),
    (op("aten.mul.Tensor", output=stat(posinf=1)), "overflow"),
    (op("aten.add.Tensor", output=stat(nan=1)), "rounding"),  # NaN from finite inputs
])
def test_how_a_reduced_precision_broke_an_op(finding, failure):
    assert precision_failure(finding) == failure


def test_one_ranks_capture_whose_own_step_replays_finite_is_handed_to_all_ranks(tmp_path):
    """A DDP rank whose loss was finite, its gradients non-finite only once averaged with another
    rank's: replayed alone it is finite. That is another rank's failure, not "nondeterminism or a
    hardware fault"; with every rank's folder (world size 1) the hardware advice stays."""
    from stabletrain.debug.diagnose.explain import probable_cause

    ev = evidence(NOT_REPRODUCIBLE, reason="nonfinite_gradients")
    cap = capture(RUN)
    cap.ranks[0].losses = [torch.tensor(0.5)]
    cap.world_size = 2
    assert next_actions(ev, cap, Path("/runs/boom")) == [
        "Diagnose all ranks together: stabletrain diagnose /runs/boom/debug/nan_capture"]
    assert probable_cause(ev, cap) == "another rank's step failed; this rank only stopped with it"
    cap.ranks[0].losses = [torch.tensor(math.nan)]  # its own loss failed: a genuine non-reproduction
    assert "hardware fault" in probable_cause(ev, cap)
    cap.ranks[0].losses, cap.world_size = [torch.tensor(0.5)], 1
    assert "hardware fault" in probable_cause(ev, cap)
