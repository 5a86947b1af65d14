"""The report's verdict remembers what the logged rows no longer show: recoveries, a stop at the
recovery limit, and a blow-up before a resume; rollbacks are drawn apart from resumes (issue 25, item 8)."""

from __future__ import annotations

import json
import math

import pytest
from nan_models import PoisonData, PoisonNet, samples_of_step

import stabletrain
from conftest import tiny_lm
from stabletrain.reporting import RunData, report, signal_figure
from stabletrain.reporting.verdict import run_episodes


def test_a_run_that_skipped_a_nan_step_is_not_stable(tmp_path):
    # Step 3's batch holds a NaN sample: skip_step recovers, every logged loss is finite.
    victim = samples_of_step(3, n=128, batch_size=8)[0]
    out = tmp_path / "run"
    stabletrain.train(out=out, model=PoisonNet(), data=PoisonData(n=128, input_poison={victim: math.nan}),
                      steps=24, batch_size=8, num_workers=0, model_args={"warmup_steps": 0},
                      trend_alerts={"enabled": False}, on_instability={"policy": "skip_step", "diagnose": False})
    data = RunData(out)
    assert all(math.isfinite(r["loss"]) for r in data.rows if "loss" in r), "the skipped step is not logged"
    r = report(out, quiet=True, plots=False)
    assert r.verdict == "non-finite", r.verdict
    assert "recovered by skip_step (nonfinite_loss)" in (out / "report" / "summary.md").read_text()


def test_a_blow_up_before_a_resume_stays_in_the_verdict(tmp_path):
    out = tmp_path / "boom"
    with pytest.raises(stabletrain.NaNDetectedError):
        stabletrain.train(out=out, debug_args={"nancapture": {"enabled": True}}, checkpoint_every_num_steps=2,
                          **tiny_lm(steps=40, model_args={"optimizer": "sgd", "lr": 30.0, "warmup_steps": 0}))
    before = report(out, quiet=True, plots=False).verdict
    assert before == "non-finite"
    stabletrain.train(out=out, resume_from=str(out / "checkpoints" / "step_000002.ckpt"),
                      **tiny_lm(steps=12, model_args={"optimizer": "sgd", "lr": 0.01, "warmup_steps": 0}))
    data = RunData(out)
    assert data.resumes == [2] and data.rollbacks == []
    assert all(math.isfinite(r["loss"]) for r in data.rows if "loss" in r), "the resumed timeline is finite"
    # The resumed timeline alone is "exploding" (the step-2 weights were already large); the NaN of
    # the abandoned one is what makes it "non-finite".
    r = report(out, quiet=True, plots=False)
    assert r.verdict == "non-finite", r.verdict
    assert "before the resume from step 2" in (out / "report" / "summary.md").read_text()


def _rows(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def test_a_rollback_is_drawn_apart_from_a_resume(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    rows = [{"step": s, "loss": 2.0 - 0.01 * s, "gradient_norm": 1.0, "lr": 0.01} for s in range(0, 12)]
    rows.append({"event": "recovery", "step": 11, "trigger": "loss_spike", "action": "rollback", "rolled_back_to": 8})
    rows.append({"event": "resume", "step": 8, "reason": "rollback after step 11"})
    rows += [{"step": s, "loss": 2.0 - 0.01 * s, "gradient_norm": 1.0, "lr": 0.01} for s in range(8, 20)]
    rows.append({"event": "resume", "step": 20, "checkpoint": "x"})
    rows += [{"step": s, "loss": 2.0 - 0.01 * s, "gradient_norm": 1.0, "lr": 0.01} for s in range(20, 30)]
    _rows(out / "metrics.jsonl", rows)
    data = RunData(out)
    assert data.resumes == [8, 20] and data.rollbacks == [8]
    episodes = run_episodes(data, None, 0)
    assert any(e.kind == "spike" and e.start_step == 11 and "rollback" in e.note for e in episodes)
    fig = signal_figure(data, "loss", "spiking", episodes)
    labels = {t.get_text() for ax in fig.axes for leg in [ax.get_legend()] if leg for t in leg.get_texts()}
    assert "rolled back to (on_instability)" in labels and "resumed" in labels, labels
    r = report(out, quiet=True, plots=False)
    assert r.verdict == "spiking", r.verdict
    assert "recovered by rollback (loss_spike)" in (out / "report" / "summary.md").read_text()


def test_a_healthy_fp16_run_whose_grad_scaler_backs_off_is_stable(tmp_path, capsys):
    """16-mixed with a scale too high for the first steps: the GradScaler skips 8 steps in a row as it
    backs off, as it is built to. No alert, a "stable" verdict, and the report says what the scaler
    did (before: "gradient_norm is not finite", advice to lower the lr, verdict "non-finite")."""
    import torch
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision

    from stabletrain.config import load_settings
    from stabletrain.training.loop import Trainer

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    out = tmp_path / "fp16"
    settings = tiny_lm(steps=30, log_every_num_steps=1, checkpoint_every_num_steps=2, max_checkpoints_to_keep=20)
    Trainer(load_settings({"out": out, **settings}), fabric=fabric).fit()
    console = capsys.readouterr().out
    data = RunData(out)
    skips = [r["step"] for r in data.rows if not math.isfinite(r["gradient_norm"])]
    assert len(skips) >= 4 and skips == list(range(len(skips))), skips  # step after step, from step 0
    assert "WARNING" not in console and "not finite" not in console, console
    r = report(out, quiet=True, plots=False)
    assert (r.verdict, r.status["gradient_norm"]) == ("stable", "stable"), r.text
    assert (f"gradient_norm: stable (the fp16 GradScaler skipped {len(skips)} steps, the first by step 0, while its "
            "loss scale went from 8.389e+06 to") in r.text
    # The checkpoints written right after a skipped step are healthy: the skip made no update.
    from stabletrain.runfiles.checkpoint import list_checkpoints

    infos = list_checkpoints(out / "checkpoints")
    after_skip = [c for c in infos if c.step - 1 in skips]
    assert after_skip and all(c.healthy for c in infos), [c.reason() for c in infos]
    assert all("the fp16 GradScaler skipped that step" in c.why for c in after_skip)


def test_an_fp16_run_resumed_counts_the_scalers_skips_on(tmp_path, capsys):
    """The guard's count of fp16 skipped steps goes into the checkpoint and on after a resume:
    the logged ``skipped_steps`` never restarts from 0, so the report counts every skip and the
    skips after the resume are the scaler's, not a non-finite gradient norm."""
    import torch
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision

    from stabletrain.config import load_settings
    from stabletrain.training.loop import Trainer

    def fit(**settings):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        Trainer(load_settings({"out": out, **tiny_lm(log_every_num_steps=1, **settings)}), fabric=fabric).fit()

    out = tmp_path / "fp16"
    fit(steps=3)
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["guard"]["skipped_steps"] == 3
    fit(steps=30, resume_from=str(out / "checkpoints" / "last.ckpt"))
    console = capsys.readouterr().out
    data = RunData(out)
    assert data.resumes == [3]
    skips = [r["step"] for r in data.rows if not math.isfinite(r["gradient_norm"])]
    assert skips[:4] == [0, 1, 2, 3] and skips == list(range(len(skips))), skips  # on across the resume
    counts = [r["skipped_steps"] for r in data.rows if "skipped_steps" in r]
    assert counts == sorted(counts) and counts[-1] == len(skips), counts
    assert "WARNING" not in console and "not finite" not in console, console
    r = report(out, quiet=True, plots=False)
    assert (r.verdict, r.status["gradient_norm"]) == ("stable", "stable"), r.text
    assert f"the fp16 GradScaler skipped {len(skips)} steps, the first by step 0" in r.text
