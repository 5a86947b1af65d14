"""stabletrain's tools in PyTorch Lightning: faults planted at known steps and samples."""

from __future__ import annotations

import csv
import logging
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stabletrain
from stabletrain import NaNDetectedError, NonFiniteStepError, UnderflowOverflowError, load_nan_capture
from stabletrain.utils.sync import CountSyncs

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.utilities import grad_norm  # noqa: E402
from lit_models import LinearLit, MomentumSiameseLit, PairData, SiameseLit  # noqa: E402

from conftest import cli_env, plant_exp_avg_sq_overflow  # noqa: E402
from stabletrain.integrations.lightning import StabletrainCallback  # noqa: E402

HERE = Path(__file__).resolve().parent


def fit(model, data, tmp_path, callbacks, *, accumulate=2, batch_size=4, max_steps=8, log_every_n_steps=1,
        **kwargs):
    """Lightning's own loop on the CPU; CSV metrics in tmp_path/csv/version_0/metrics.csv."""
    trainer = L.Trainer(
        max_steps=max_steps, accumulate_grad_batches=accumulate, log_every_n_steps=log_every_n_steps,
        callbacks=callbacks,
        accelerator="cpu", devices=1, default_root_dir=tmp_path, logger=CSVLogger(tmp_path, name="csv"),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kwargs,
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=batch_size))
    return trainer


def logged(tmp_path, key):
    """{step: value} of one key, read back from Lightning's CSVLogger file."""
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


def run_command(command, cwd):
    """A command from an error message, run with this checkout's sources."""
    args = shlex.split(command)
    assert args[0] == "stabletrain"
    return subprocess.run([sys.executable, "-m", "stabletrain", *args[1:]], cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_nancapture_names_step_and_sample_replays_and_diagnoses(tmp_path):
    # batch 4, 2 accumulation steps: sample 29 is in step 3, micro step 1 (batch_idx 7), row 1.
    torch.manual_seed(0)
    model = SiameseLit()
    callback = StabletrainCallback(debug_args={"nancapture": {"enabled": True}})
    with pytest.raises(NaNDetectedError) as info:
        fit(model, PairData(bad=29), tmp_path, [callback])
    err = info.value
    assert (err.step, err.rank, err.reason) == (3, 0, "nonfinite_gradients")
    assert err.nan_param_names == ["embed.0.weight", "embed.0.bias", "embed.2.weight", "embed.2.bias"]
    assert err.capture_path == tmp_path / "debug" / "nan_capture" / "rank0" / "nan_capture.pt"
    assert err.replay_command.endswith("lit_models.py:SiameseLit"), err.replay_command
    # Stopped before clipping and the optimizer step, and the callback took its wrapper away.
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert "training_step" not in model.__dict__

    cap = load_nan_capture(err.capture_path, model=SiameseLit())
    part = cap.ranks[0]
    assert part.step_args == [[6], [7]], "each microbatch's batch_idx, for training_step(batch, batch_idx)"
    assert torch.equal(part.microbatches[1]["x"][1], part.microbatches[1]["y"][1]), "the planted identical pair"
    result = cap.replay()
    assert result.reproduced and result.losses_bitwise_equal, result.report()

    # The command in the message, pasted: replays with the LightningModule's own training_step.
    replay = run_command(err.replay_command, cwd=Path.cwd())
    assert replay.returncode == 0, replay.stderr[-2000:]
    assert "reproduced: YES" in replay.stdout and "losses: bitwise equal to the captured ones" in replay.stdout

    d = stabletrain.diagnose(err.capture_path, model=SiameseLit(), write=False)
    assert d.cause == "deterministic_numerical"
    assert (d.finding.module, d.finding.phase) == ("distance", "backward")
    assert d.data.microbatches == [(0, 1)] and d.data.rows == [1]
    # And on the command line, with the same --model as the replay command.
    cli = run_command(err.replay_command.replace("stabletrain replay ", "stabletrain diagnose ", 1), cwd=Path.cwd())
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "**Verdict: deterministic numerical**" in cli.stdout
    assert "in distance (PairDistance), backward pass" in cli.stdout and "rows [1]" in cli.stdout
    assert (err.capture_path.parent / "diagnosis.json").is_file()


def test_partial_accumulation_at_epoch_end_counts_micro_steps_apart(tmp_path):
    # 10 batches of 2 per epoch, 3 accumulation steps: steps of 3, 3, 3 and 1 microbatch(es).
    # Sample 19 is in batch 9, the last step of the epoch (step 3), alone in it.
    torch.manual_seed(0)
    callback = StabletrainCallback(debug_args={"nancapture": {"enabled": True}})
    with pytest.raises(NaNDetectedError) as info:
        fit(SiameseLit(), PairData(n=20, bad=19), tmp_path, [callback], accumulate=3, batch_size=2)
    assert info.value.step == 3
    assert (callback.tools.step, callback.tools.micro_step) == (3, 0)
    cap = load_nan_capture(info.value.capture_path, model=SiameseLit())
    assert cap.ranks[0].step_args == [[9]] and cap.gradient_accumulation_steps == 3
    # Lightning divides even the lone microbatch's loss by 3: so does the replay.
    result = cap.replay()
    assert result.reproduced and result.losses_bitwise_equal


def test_bf16_mixed_is_captured_and_replayed_in_it(tmp_path):
    torch.manual_seed(0)
    callback = StabletrainCallback(debug_args={"nancapture": {"enabled": True}})
    with pytest.raises(NaNDetectedError) as info:
        fit(SiameseLit(), PairData(bad=29), tmp_path, [callback], precision="bf16-mixed")
    cap = load_nan_capture(info.value.capture_path, model=SiameseLit())
    assert cap.precision == "bf16-mixed" and cap.step == 3
    result = cap.replay()
    assert result.reproduced and result.losses_bitwise_equal, "the replay runs Lightning's autocast the same way"


def test_underflow_overflow_names_module_phase_and_step(tmp_path):
    torch.manual_seed(0)
    callback = StabletrainCallback(debug_args={"underflow_overflow": {"enabled": True}})
    with pytest.raises(UnderflowOverflowError) as info:
        fit(SiameseLit(), PairData(bad=29), tmp_path, [callback])
    err = info.value
    assert (err.step, err.phase, err.module, err.value) == (3, "backward", "distance", "nan")
    assert err.tensor.startswith("grad of input")
    assert err.report_path == tmp_path / "debug" / "underflow_overflow_rank0.log"
    assert "<-- first non-finite" in err.report_path.read_text()


class Reference(L.Callback):
    """Lightning's own ``grad_norm`` utility where Lightning documents it (before clipping),
    and a float64 norm."""

    def __init__(self):
        self.lightning: dict[int, dict[str, float]] = {}
        self.float64: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = trainer.global_step
        self.lightning[step] = {k: float(v) for k, v in grad_norm(pl_module, norm_type=2).items()}
        grads = [p.grad.double() for p in pl_module.parameters() if p.grad is not None]
        self.float64[step] = float(torch.sqrt(sum((g * g).sum() for g in grads)))


@pytest.mark.parametrize("nancapture", [False, True], ids=["norm-only", "with-nancapture"])
def test_logged_gradient_norm_equals_lightnings_grad_norm(tmp_path, nancapture):
    torch.manual_seed(0)
    reference = Reference()
    callback = StabletrainCallback(debug_args={"nancapture": {"enabled": nancapture}}, gradient_norm_per_layer=True)
    # Clipping at 0.05 changes every gradient after on_before_optimizer_step: the logged norm is pre-clip.
    fit(SiameseLit(), PairData(), tmp_path, [callback, reference], max_steps=6, gradient_clip_val=0.05)
    norms = logged(tmp_path, "gradient_norm")
    assert sorted(norms) == [0, 1, 2, 3, 4, 5], "one value per optimizer step, numbered from 0"
    for step, value in norms.items():
        assert value > 0.05, "pre-clip: above the clipping threshold"
        assert value == pytest.approx(reference.lightning[step]["grad_2.0_norm_total"], rel=1e-6)
        assert value == pytest.approx(reference.float64[step], rel=1e-6)
    layer = logged(tmp_path, "gradient_norm/embed.0.weight")
    module = logged(tmp_path, "gradient_norm/embed")
    for step in norms:
        assert layer[step] == pytest.approx(reference.lightning[step]["grad_2.0_norm/embed.0.weight"], rel=1e-6)
        ref = math.sqrt(sum(v**2 for k, v in reference.lightning[step].items() if k.startswith("grad_2.0_norm/embed.")))
        assert module[step] == pytest.approx(ref, rel=1e-6)


def test_one_host_read_per_step_with_gradient_norm_and_nancapture(tmp_path):
    """Lightning's loop with and without the callback (gradient_norm logged, nancapture on,
    trend alerts on), the same steps: the callback adds one host synchronisation per step, and one
    when training ends (the guard's verdict of the last optimizer step, which no later step reads)."""
    counts = {}
    # The mechanism signals' one read per logged step is counted in the test after this one.
    nancapture = {"nancapture": {"enabled": True}, "mechanisms": {"enabled": False}}
    for name, callbacks in (("without", []), ("with", [StabletrainCallback(debug_args=nancapture)])):
        torch.manual_seed(0)
        with CountSyncs() as syncs:
            fit(SiameseLit(dropout=0.0), PairData(), tmp_path / name, callbacks, max_steps=6, log_every_n_steps=3)
        counts[name] = syncs.count
    assert counts["with"] - counts["without"] == 6 + 1, counts


class AttentionLit(L.LightningModule):
    """Attention pooling (nn.MultiheadAttention) and a classifier trained with cross-entropy."""

    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x = torch.stack([batch["x"], batch["y"]], dim=1)  # two tokens per sample
        pooled, _ = self.mha(x, x, x)
        logits = self.head(pooled.mean(1))
        return torch.nn.functional.cross_entropy(logits, (batch["target"] > 0).long())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_mechanism_signals_reach_lightnings_loggers_with_one_read_per_logged_step(tmp_path):
    """log_every_n_steps=2: steps 1 and 3 are logged; the signals are in the CSV at those steps,
    and cost one host read each (none on steps 0 and 2)."""
    class Weights(L.Callback):
        """Each step's weights before and after, for the relative update in float64."""

        def __init__(self):
            self.before, self.after = {}, {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.before[trainer.global_step] = [p.detach().double().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.after[trainer.global_step - 1] = [p.detach().double().clone() for p in pl_module.parameters()]

    counts = {}
    weights = Weights()
    for name, mechanisms in (("off", False), ("on", True)):
        torch.manual_seed(0)
        callback = StabletrainCallback(debug_args={"mechanisms": {"enabled": mechanisms}})
        with CountSyncs() as syncs:
            fit(AttentionLit(), PairData(), tmp_path / name, [callback, weights], accumulate=1, max_steps=4,
                log_every_n_steps=2)
        counts[name] = syncs.count
    assert counts["on"] - counts["off"] == 2, counts
    for step, value in logged(tmp_path / "on", "signals/update_rms/group0").items():
        before, after = weights.before[step], weights.after[step]
        delta = math.sqrt(sum(((a - b) ** 2).sum().item() for a, b in zip(after, before)))
        assert value == pytest.approx(delta / math.sqrt(sum((b**2).sum().item() for b in before)), rel=1e-5), step
    for key in ("signals/attn_logit_max/mha", "signals/attn_entropy/mha", "signals/output_logsumexp",
                "signals/weight_rms/group0", "signals/update_rms/group0", "signals/adam_eps_fraction"):
        values = logged(tmp_path / "on", key)
        assert sorted(values) == [1, 3], key
        assert all(math.isfinite(v) for v in values.values())
    assert 0 < logged(tmp_path / "on", "signals/attn_entropy/mha")[1] <= math.log(2)


def test_trend_alert_in_lightnings_terms(tmp_path, caplog):
    torch.manual_seed(0)
    callback = StabletrainCallback()
    with caplog.at_level(logging.WARNING, logger="stabletrain"):
        fit(LinearLit(lr=3.0), PairData(n=512), tmp_path, [callback], accumulate=1, batch_size=8, max_steps=30)
    trends = [a for a in callback.alerts if a["event"] == "trend_alert"]
    kinds = {(a["kind"], a["signal"]) for a in trends}
    assert ("exploding", "gradient_norm") in kinds or ("exploding", "loss") in kinds, callback.alerts
    exploding = next(a for a in trends if a["kind"] == "exploding")
    # The same list holds the mechanism rows: SGD at lr 3 runs away from its first steps.
    assert "runaway_updates" in {a["id"] for a in callback.alerts if a["event"] == "mechanism"}
    assert "clip gradients: Trainer(gradient_clip_val=1.0)" in exploding["actions"]
    assert "lower the learning rate in configure_optimizers, e.g. by 10x (now 3)" in exploding["actions"]
    assert "is exploding" in caplog.text and "Trainer(gradient_clip_val=1.0)" in caplog.text


class _AdamLinearLit(LinearLit):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class _PlantOverflow(L.Callback):
    def on_train_start(self, trainer, pl_module):
        plant_exp_avg_sq_overflow(trainer.optimizers[0], at_step=2)


@pytest.mark.parametrize("guard", [True, False])
def test_an_optimizer_state_gone_inf_with_finite_weights_stops_at_its_step(tmp_path, guard):
    """The guard's check after the optimizer step: Adam's exp_avg_sq holds an Inf after step 2 while
    every weight is finite; the callback stops there naming the entry. guard=False: nothing stops."""
    torch.manual_seed(0)
    model = _AdamLinearLit(lr=0.01)
    callbacks = [_PlantOverflow(), StabletrainCallback(guard=guard)]
    if not guard:
        trainer = fit(model, PairData(n=512), tmp_path, callbacks, accumulate=1, max_steps=5)
        assert trainer.global_step == 5
        return
    with pytest.raises(NonFiniteStepError) as info:
        fit(model, PairData(n=512), tmp_path, callbacks, accumulate=1, max_steps=5)
    err = info.value
    assert (err.step, err.origin, err.nonfinite) == (2, "optimizer_step", ["optimizer_state"])
    assert err.state_entries == ["fc.weight: exp_avg_sq"] and err.param_names == []
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert str(err).startswith("The optimizer step of step 2 (rank 0 of 1) wrote non-finite values (its loss and "
                               "gradients were not checked). Optimizer: torch.optim.AdamW. Optimizer state with "
                               "NaN/Inf: fc.weight: exp_avg_sq.")


def test_settings_are_checked_when_the_callback_is_made():
    with pytest.raises(stabletrain.ConfigError) as info:
        StabletrainCallback(debug_args={"nancapture": {"enabeld": True}}, trend_alerts={"window": 1})
    text = str(info.value)
    assert "debug_args.nancapture.enabeld: unknown setting" in text and "enabled" in text
    assert "trend_alerts.window" in text and "(got 1)" in text


@pytest.mark.slow
def test_ddp_optimizer_state_gone_inf_on_one_rank_in_the_last_step_stops_both(tmp_path):
    """Lightning's DDP (2 CPU processes), nancapture off: rank 1's AdamW state gets an Inf in the last
    step (step 7), which no later step's check carries; on_train_end reads the agreed verdict and both
    ranks raise, with rank 1's message."""
    result = subprocess.run([sys.executable, str(HERE / "lit_models.py"), "guard", str(tmp_path)], cwd=tmp_path,
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    head = ("NonFiniteStepError: The optimizer step of step 7 (rank 1 of 2) wrote non-finite values (its loss and "
            "gradients were not checked). Optimizer: torch.optim.AdamW. Optimizer state with NaN/Inf: "
            "embed.0.weight: exp_avg_sq.")
    assert result.stderr.count(head) == 2, result.stderr[-3000:]
    assert "on_train_end" in result.stderr


@pytest.mark.slow
def test_ddp_two_processes_nan_on_one_rank_stops_both(tmp_path):
    # Lightning's DDP launcher runs this file again for rank 1 (strategy="ddp", 2 CPU processes).
    result = subprocess.run([sys.executable, str(HERE / "lit_models.py"), str(tmp_path)], cwd=tmp_path,
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert result.stderr.count("NaNDetectedError") >= 2, result.stderr[-3000:]
    folder = tmp_path / "debug" / "nan_capture"
    cap = load_nan_capture(folder, model=SiameseLit())
    assert [r.rank for r in cap.ranks] == [0, 1] and cap.step == 3 and cap.world_size == 2
    # DDP averaged the gradients: both ranks hold the NaN, under the LightningModule's own names.
    assert all(r.nan_param_names == ["embed.0.weight", "embed.0.bias", "embed.2.weight", "embed.2.bias"]
               for r in cap.ranks)
    result = cap.replay()
    assert result.reproduced and result.losses_bitwise_equal
    assert result.ranks_reproducing_alone == [1], "only rank 1 saw sample 29"


class _Snapshots(L.Callback):
    """The weights at each step's start and after it (on_train_batch_end of its last microbatch)."""

    def __init__(self):
        self.start, self.end = {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start.setdefault(trainer.global_step, [p.detach().clone() for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end[trainer.global_step - 1] = [p.detach().clone() for p in pl_module.parameters()]


def test_skip_step_puts_back_the_nan_steps_update_and_lightning_goes_on(tmp_path, caplog):
    """on_instability skip_step: sample 29's NaN gradient (step 3, micro step 1) is decided in
    on_before_optimizer_step, inside optimizer.step(closure); the parameters and momentum copied there are put
    back after it (bitwise), every other step is applied, and training reaches max_steps."""
    callback = StabletrainCallback(on_instability={"policy": "skip_step"})
    snaps = _Snapshots()  # after the callback: its on_train_batch_end sees the weights once they are put back
    model = MomentumSiameseLit()
    with caplog.at_level(logging.WARNING, logger="stabletrain"):
        trainer = fit(model, PairData(bad=29), tmp_path, [callback, snaps])
    assert trainer.global_step == 8
    assert [(r["step"], r["trigger"], r["action"]) for r in callback.recoveries] == [(3, "nonfinite_grad", "skip_step")]
    unchanged = [s for s in range(8) if all(torch.equal(a, b) for a, b in zip(snaps.start[s], snaps.end[s]))]
    assert unchanged == [3]
    assert callback.tools.healing.guard.skipper.mode == "copy"
    momentum = [model.trainer.optimizers[0].state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(bool(torch.isfinite(m).all()) for m in momentum)
    assert "Recovered step 3: nonfinite_grad; update skipped" in caplog.text
    # Its trend alert says the update was not applied, not to resume with a lower lr.
    assert "WARNING gradient_norm is not finite (step 3)" in caplog.text
    assert "next: the update of step 3 was not applied (on_instability.policy=skip_step)" in caplog.text
    assert "lower" not in caplog.text and "ckpt_path" not in caplog.text, caplog.text


class _DetectorAtStart(L.Callback):
    """The skip_step detector's state when training starts (after StabletrainCallback's own start)."""

    def on_train_start(self, trainer, pl_module):
        heal = next(c for c in trainer.callbacks if isinstance(c, StabletrainCallback))
        self.state = heal.tools.healing.guard.detector.state_dict()


def test_skip_step_state_goes_into_lightnings_checkpoint_and_on_after_a_resume(tmp_path):
    """The callback's state_dict: Lightning writes the spike detector's window and the recoveries into
    its checkpoint, and fit(ckpt_path=...) puts them back. The resumed fit restarts the epoch (a plain
    DataLoader is not resumable), so sample 29 comes again at step 7: its second recovery, past
    max_recoveries=1 (a fresh callback would take it as its first and go on)."""
    from stabletrain import RecoveryLimitError

    def trainer_for(callbacks, max_steps):
        return L.Trainer(max_steps=max_steps, accumulate_grad_batches=2, accelerator="cpu", devices=1,
                         default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks)

    loader = torch.utils.data.DataLoader(PairData(bad=29), batch_size=4)
    callback = StabletrainCallback(on_instability={"policy": "skip_step"})
    trainer = trainer_for([callback], 4)
    trainer.fit(MomentumSiameseLit(), loader)
    trainer.save_checkpoint(tmp_path / "step4.ckpt")
    saved = callback.tools.healing.guard.detector.state_dict()
    assert [r["step"] for r in callback.recoveries] == [3] and int(saved["count"]) == 3

    resumed = StabletrainCallback(on_instability={"policy": "skip_step", "max_recoveries": 1})
    probe = _DetectorAtStart()
    with pytest.raises(RecoveryLimitError) as info:
        trainer_for([resumed, probe], 8).fit(MomentumSiameseLit(), loader, ckpt_path=tmp_path / "step4.ckpt")
    assert all(torch.equal(saved[k], probe.state[k]) for k in saved), "the window as saved, bitwise"
    assert (info.value.step, info.value.recoveries) == (7, 1)
    assert [(r["step"], r["recovery"]) for r in resumed.recoveries] == [(3, 1), (7, 2)]


@pytest.mark.slow
def test_ddp_skip_step_skips_the_same_step_on_both_ranks(tmp_path):
    """Lightning's DDP (2 CPU processes): rank 1's sample 29 makes step 3's averaged gradient NaN on
    both ranks. Both skip that step and only it (weights and momentum bitwise as before it), record
    the same recovery, reach max_steps, and end with the same finite weights."""
    result = subprocess.run([sys.executable, str(HERE / "lit_models.py"), "heal", str(tmp_path)], cwd=tmp_path,
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"heal_rank{r}.pt", weights_only=True) for r in (0, 1)]
    for r in ranks:
        assert r["recoveries"] == [(3, "nonfinite_grad", "skip_step")], r["recoveries"]
        assert (r["unchanged"], r["global_step"]) == ([3], 8)
        assert all(bool(torch.isfinite(w).all()) for w in r["weights"])
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]))


def test_skip_step_refuses_manual_optimization(tmp_path):
    from stabletrain import ConfigError

    class Manual(SiameseLit):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = super().training_step(batch, batch_idx)["loss"]
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    with pytest.raises(ConfigError, match="on_instability.policy: skip_step needs automatic optimization"):
        fit(Manual(), PairData(), tmp_path, [StabletrainCallback(on_instability={"policy": "skip_step"})], accumulate=1)
