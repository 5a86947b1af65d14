"""The always-on guard: a blow-up stops at its first non-finite step, nothing damaged is saved,
an optimizer step that writes NaN/Inf from finite gradients is named and reproduced."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import stabletrain
from conftest import LinearData, cli_env, tiny_lm
from stabletrain.debug.grad_norm import compute_grad_norm
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.safety.guard import NonFiniteStepError, StepGuard
from stabletrain.safety.net import NonFiniteCheckpointError
from stabletrain.training.loop import train
from stabletrain.utils.sync import SyncsPerStep

BOOM = tiny_lm(steps=60, log_every_num_steps=10, checkpoint_every_num_steps=2, model_args={"lr": 1e3})


def _all_finite(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return all(_all_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_all_finite(v) for v in obj)
    if isinstance(obj, float):
        return math.isfinite(obj)
    return True


def _checkpoints_finite(out) -> list[str]:
    files = sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").is_dir() else []
    for name in files:
        state = torch.load(out / "checkpoints" / name, weights_only=True)
        assert _all_finite(state["model"]) and _all_finite(state["optimizer"]["state"]), name
    return files


@pytest.fixture(scope="module")
def first_nan_step(tmp_path_factory) -> int:
    """Where the lr=1e3 run first goes non-finite, seen with the guard off and every step logged."""
    out = tmp_path_factory.mktemp("guard") / "off"
    with pytest.raises(NonFiniteCheckpointError) as info:
        train(out=out, guard={"enabled": False}, **{**BOOM, "log_every_num_steps": 1})
    rows, events = read_metrics(out / "metrics.jsonl")
    bad = [r["step"] for r in rows if not (math.isfinite(r["loss"]) and math.isfinite(r["gradient_norm"]))]
    # Without the guard, the first checkpoint after the NaN is refused: the previous file stays.
    assert info.value.step == (bad[0] // 2 + 1) * 2 and "model" in info.value.entries[0]
    assert [e["event"] for e in events] .count("checkpoint_refused") == 1
    assert _checkpoints_finite(out)
    assert "ERROR NonFiniteCheckpointError: Refused to write the checkpoint" in (out / "train.log").read_text()
    return bad[0]


def test_lr_1e3_stops_at_the_first_nonfinite_step_and_every_checkpoint_is_finite(tmp_path, first_nan_step):
    out = tmp_path / "boom"
    with pytest.raises(NonFiniteStepError) as info:
        train(out=out, **BOOM)
    err = info.value
    assert first_nan_step > 2 and (err.step, err.stopped_at) == (first_nan_step, first_nan_step)
    assert err.origin == "forward_backward" and err.nonfinite == ["loss", "gradient_norm"]
    text = str(err)
    assert text.startswith(f"Non-finite loss and gradient norm at step {first_nan_step} (rank 0 of 1): the loss is nan")
    assert f"Training stopped before the optimizer step of step {first_nan_step}" in text
    assert "Nothing damaged was saved" in text
    assert "turn on debug_args.nancapture.enabled=true for a capture of that step: stabletrain train " in text
    # Every checkpoint written is finite, and the last one is from right before the failing step.
    files = _checkpoints_finite(out)
    assert f"step_{first_nan_step // 2 * 2:06d}.ckpt" in files
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["step"] == first_nan_step // 2 * 2
    # The error is in train.log, and metrics.jsonl records the step and the last finite one.
    log = (out / "train.log").read_text()
    assert f"ERROR NonFiniteStepError: Non-finite loss and gradient norm at step {first_nan_step}" in log
    rows, events = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, first_nan_step - 1, first_nan_step]
    assert math.isnan(rows[-1]["loss"]) and rows[1]["loss"] > 1e6
    assert [(e["event"], e["step"], e["origin"]) for e in events if e["event"] == "nonfinite_step"] == [
        ("nonfinite_step", first_nan_step, "forward_backward")]


def test_report_on_the_lr_1e3_run_names_the_explosion_and_the_nan_step(tmp_path):
    out = tmp_path / "boom"
    with pytest.raises(NonFiniteStepError) as info:
        train(out=out, **BOOM)
    r = stabletrain.report(out, quiet=True)
    assert r.verdict == "non-finite" and r.status["loss"] == "non-finite"
    explode = [e for e in r.episodes if e.kind == "exploding" and e.signal == "loss"]
    assert explode and explode[0].end_step == info.value.step - 1, "5.5 at step 0 to > 1e6: orders of magnitude"
    assert any(e.kind == "nonfinite" and e.start_step == info.value.step for e in r.episodes)
    assert f"non-finite at step {info.value.step}" in r.text and "exploding at step" in r.text
    assert "checkpoints: none of" in r.text, "none of the checkpoints written during the explosion is healthy"
    summary = (out / "report" / "summary.md").read_text()
    assert f"- step {info.value.step}: **nonfinite_step**" in summary
    import numpy as np
    from PIL import Image

    from stabletrain.reporting import KIND_COLORS

    def near(img, hex_color, alpha=1.0, tol=6):
        rgb = [int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]
        rgb = [round(255 + alpha * (c - 255)) for c in rgb]
        return int((np.abs(img - np.array(rgb)).max(axis=2) <= tol).sum())

    for png in ("loss.png", "gradient_norm.png"):
        img = np.asarray(Image.open(out / "report" / png).convert("RGB")).astype(int)
        assert near(img, KIND_COLORS["exploding"], alpha=0.28) > 2_000, f"{png}: the explosion is shaded"
        assert near(img, KIND_COLORS["nonfinite"], tol=30) > 100, f"{png}: the NaN step and the guard's line"


def test_a_verdict_the_host_cannot_see_yet_stops_at_the_next_read(tmp_path, first_nan_step, monkeypatch):
    """On a GPU the verdict reaches the host only with a read the loop does anyway: here the
    next checkpoint's verification. Nothing damaged is written, the first bad step is named."""
    monkeypatch.setattr(StepGuard, "visible", lambda self: None)
    out = tmp_path / "late"
    with pytest.raises(NonFiniteStepError) as info:
        train(out=out, **BOOM)
    err = info.value
    checkpoint = (first_nan_step // 2 + 1) * 2
    assert (err.step, err.stopped_at) == (first_nan_step, checkpoint - 1)
    assert f"Training stopped at step {checkpoint - 1}, the first point where the verdict could be read" in str(err)
    assert f"damaged from step {first_nan_step} on" in str(err)
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["step"] == checkpoint - 2
    _checkpoints_finite(out)


def test_the_guard_adds_no_host_sync(tmp_path):
    counts = {}
    for enabled in (True, False):
        counter = SyncsPerStep()
        train(out=tmp_path / str(enabled), callbacks=[counter], guard={"enabled": enabled},
              **tiny_lm(steps=8, log_every_num_steps=5, checkpoint_every_num_steps=3))
        counts[enabled] = counter.counts
    assert sorted(counts[True]) == list(range(8)) and counts[True] == counts[False]


def test_16_true_adamw_stops_at_step_0_and_no_checkpoint_holds_a_nonfinite_value(tmp_path):
    out = tmp_path / "half"
    with pytest.raises(NonFiniteStepError) as info:
        train(out=out, precision="16-true", **tiny_lm(steps=5, checkpoint_every_num_steps=1))
    err = info.value
    assert (err.step, err.stopped_at, err.origin) == (0, 0, "optimizer_step")
    assert err.optimizer == "torch.optim.AdamW" and "tok_emb.weight" in err.param_names
    text = str(err)
    assert "The optimizer step of step 0 (rank 0 of 1) wrote non-finite values from finite gradients" in text
    assert "Optimizer: torch.optim.AdamW." in text and "tok_emb.weight (" in text
    assert "eps=1e-08 is 0 in float16 (its smallest positive value is 6e-08)" in text
    assert "capture the optimizer step for stabletrain diagnose (debug_args.nancapture.enabled=true): " in text
    assert err.capture_path is None and not (out / "debug").exists()
    assert _checkpoints_finite(out) == [], "the checkpoint after step 0 would hold Inf: none is written"


def test_16_true_adamw_capture_diagnose_explains_and_reproduces_the_optimizer_step(tmp_path):
    """With nancapture on, the guard re-runs to the failing step (from the state training
    started from) and captures its optimizer step; ``stabletrain diagnose`` replays it."""
    out = tmp_path / "half"
    with pytest.raises(NonFiniteStepError) as info:
        train(out=out, precision="16-true", debug_args={"nancapture": {"enabled": True}},
              **tiny_lm(steps=5, checkpoint_every_num_steps=1))
    err = info.value
    assert err.capture_path == out / "debug" / "nan_capture" / "rank0" / "nan_capture.pt"
    raw = torch.load(err.capture_path, weights_only=True)
    assert raw["reason"] == "optimizer_step" and raw["step"] == 0
    entry = raw["optimizer_step"]
    assert entry["optimizer"] == "torch.optim.AdamW" and entry["source"]["path"] == "the start of the run"
    assert entry["reproduced_in_rerun"] and sorted(entry["after"]["nonfinite_params"]) == sorted(err.param_names)
    assert _all_finite(raw["params"]) and _all_finite(entry["grads"]), "the state before the step, finite"

    result = subprocess.run([sys.executable, "-m", "stabletrain", "diagnose", str(err.capture_path.parent)],
                            cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    text = result.stdout
    assert ("**Verdict: the optimizer step** — torch.optim.AdamW wrote NaN/Inf into the weights from "
            "finite gradients") in text
    assert "give finite gradients (gradient norm" in text
    assert ("The optimizer step replayed from the captured state (16-true) reproduces the failure: "
            "NaN/Inf in tok_emb.weight") in text
    assert "The same step in float32 keeps every value finite" in text
    assert "eps=1e-08 is 0 in float16" in text and "exp_avg_sq holds" in text
    d = stabletrain.diagnose(err.capture_path, write=False)
    assert d.reproduced and set(d.nonfinite_params) == set(err.param_names) and d.float32_finite
    assert d.gradients_finite and d.gradient_norm == d.captured_gradient_norm, "forward/backward replayed bitwise"
    assert d.verdict.startswith("the optimizer step: torch.optim.AdamW wrote NaN/Inf"), "one line, as Diagnosis has"
    # The advice fits this run: the built-in model's AdamW takes model_args.eps (no configure_optimizer of
    # its own to edit), and no checkpoint was written before step 0 (none is "not healthy").
    actions = "\n".join(d.next_actions)
    assert "raise AdamW's eps above that resolution: model_args.eps=1e-4." in actions, actions
    assert "configure_optimizer" not in actions
    assert "No checkpoint was written before step 0: start again with overwrite=true and the change above." in actions


class _BrokenAdamW(torch.optim.AdamW):
    """A custom optimizer that writes Inf into the first parameter when its step count reaches
    4 (a function of the optimizer state, so that a re-run from a checkpoint does it again)."""

    def step(self, closure=None):
        out = super().step(closure)
        p = self.param_groups[0]["params"][0]
        if float(self.state[p]["step"]) == 4:
            with torch.no_grad():
                p.view(-1)[0] = math.inf
                self.state[p]["exp_avg"].view(-1)[0] = math.nan
        return out


class _Regression(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch):
        return nn.functional.mse_loss(self.body(batch["x"]), batch["y"])

    def configure_optimizer(self, args):
        return _BrokenAdamW(self.parameters(), lr=args.lr)


def test_a_custom_optimizer_that_misbehaves_is_named_and_its_step_captured(tmp_path):
    out = tmp_path / "custom"
    with pytest.raises(NonFiniteStepError) as info:
        train(out=out, model=_Regression(), data=LinearData(), steps=10, batch_size=16, log_every_num_steps=1,
              checkpoint_every_num_steps=2, debug_args={"nancapture": {"enabled": True}},
              model_args={"lr": 0.01, "warmup_steps": 0})
    err = info.value
    assert (err.step, err.origin) == (3, "optimizer_step")
    assert err.optimizer.endswith("test_guard._BrokenAdamW")
    assert err.param_names == ["body.0.weight"] and err.state_entries == ["body.0.weight: exp_avg"]
    assert "Parameters with NaN/Inf: 1: body.0.weight (1)." in str(err)
    # Re-run from the checkpoint at step 2 (resume is bitwise exact on the CPU): it fails the same way.
    entry = torch.load(err.capture_path, weights_only=True)["optimizer_step"]
    assert entry["source"] == {"path": str(out / "checkpoints" / "step_000002.ckpt"), "step": 2}
    assert entry["after"] == {"nonfinite_params": {"body.0.weight": 1}, "nonfinite_state": ["body.0.weight: exp_avg"]}
    d = stabletrain.diagnose(err.capture_path, model=_Regression(), write=False)
    assert d.cause == "optimizer_step" and not d.reproduced, "a custom optimizer is not rebuilt from the capture"
    assert "_BrokenAdamW is not a torch.optim optimizer" in d.explanation
    assert _checkpoints_finite(out) == ["last.ckpt", "step_000002.ckpt"]


def _fp16_fabric(init_scale: float):
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])


@pytest.mark.parametrize("max_skipped", [10, 3])
def test_fp16_skipped_steps_are_normal_until_too_many_in_a_row(tmp_path, max_skipped):
    """A scale of 2**20 overflows the fp16 gradients: the GradScaler skips steps and halves the
    scale until they fit (a few steps). That is normal, unless more than max_skipped_steps."""
    from stabletrain.config import load_settings
    from stabletrain.training.loop import Trainer

    debug = {"nancapture": {"max_skipped_steps": max_skipped}}
    settings = load_settings({"out": tmp_path / str(max_skipped), "debug_args": debug,
                              **tiny_lm(steps=20, log_every_num_steps=1)})
    trainer = Trainer(settings, fabric=_fp16_fabric(2.0**20))
    if max_skipped == 3:
        with pytest.raises(NonFiniteStepError) as info:
            trainer.fit()
        assert (info.value.step, info.value.origin) == (2, "skipped_steps")
        assert "fp16 loss scaling skipped 3 steps in a row up to step 2" in str(info.value)
        # It names what tripped (the scaled gradients, the scale now) and the change its command carries.
        scale = info.value.failure.loss_scale
        assert scale is not None and scale < 2.0**20 and f"the loss scale (now {scale:.4g})" in str(info.value)
        assert "It carries precision=bf16-mixed" in str(info.value)
        return
    trainer.fit()
    rows, _ = read_metrics(tmp_path / "10" / "metrics.jsonl")
    skipped = [r["skipped_steps"] for r in rows]
    assert skipped[:4] == [1, 2, 3, 3] and skipped[-1] == 3, "three skipped steps, then the scale fits"
    assert all(math.isfinite(r["loss"]) for r in rows) and math.isinf(rows[0]["gradient_norm"])


def test_step_guard_in_a_plain_loop():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard(model, optimizer)
    x = torch.randn(8, 4)
    with pytest.raises(NonFiniteStepError) as info:
        for step in range(5):
            loss = model(x if step != 3 else x * math.inf).pow(2).mean()
            loss.backward()
            guard.check_gradients(step, compute_grad_norm(model.named_parameters()).total, losses=[loss])
            guard.raise_if_failed(sync=False)
            optimizer.step()
            guard.check_update(step)
            optimizer.zero_grad()
    assert info.value.step == 3 and "loss" in info.value.nonfinite
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), "stopped before the optimizer step"
    assert "debug_args.nancapture.enabled=true (or NaNCaptureMonitor in a plain loop)" in str(info.value)


def test_errors_that_end_a_run_go_to_train_log_with_next_steps(tmp_path):
    from fault_models import FaultData, FaultNet
    from nan_models import samples_of_step

    victim = samples_of_step(1)[2]
    out = tmp_path / "run"
    with pytest.raises(stabletrain.UnderflowOverflowError) as info:
        train(out=out, model=FaultNet("log0"), data=FaultData(plant={victim: {"s": 0.0}}), steps=4, batch_size=8,
              num_workers=0, debug_args={"underflow_overflow": {"enabled": True}},
              model_args={"lr": 0.01, "warmup_steps": 0})
    assert info.value.step == 1 and "\nNext: read the report (the culprit frame is last)" in str(info.value)
    log = (out / "train.log").read_text()
    assert "ERROR UnderflowOverflowError: step 1, rank 0, forward" in log
    assert "Next: read the report" in log and "stabletrain diagnose" in log


def test_weights_huge_but_finite_are_not_called_non_finite():
    """lr 1e24 with SGD: the weights become ~1e24, finite in float32, but the check's float32 norm
    overflows. The run stops (nothing can train from there), and the message says what is true."""
    torch.manual_seed(0)
    model = nn.Linear(64, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e24)
    guard = StepGuard(model, optimizer)
    loss = model(torch.randn(8, 64)).pow(2).mean() + 1.0
    loss.backward()
    guard.check_gradients(0, compute_grad_norm(model.named_parameters()).total, losses=[loss])
    optimizer.step()
    guard.check_update(0)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), "the premise: every weight is finite"
    text = str(info.value)
    assert "wrote non-finite" not in text and "Parameters with NaN/Inf" not in text
    largest = max(float(p.detach().abs().max()) for p in model.parameters())
    assert "that their float32 norm overflows: every value is still finite" in text
    assert f"|w| reaches {largest:.4g} in " in text and "The learning rate is 1e+24" in text
