"""on_instability: skip_step and rollback with faults planted at known steps and samples."""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib
import matplotlib.axes
import pytest
import torch
from heal_faults import NAN_STEP, SPIKE_STEP, planted, settings

import stabletrain
from conftest import cli_env
from stabletrain import ConfigError, InstabilityGuard, NonFiniteStepError, RecoveryLimitError, load_nan_capture
from stabletrain.config import load_settings, parse_cli_overrides
from stabletrain.runfiles.history import read_run
from stabletrain.safety.healing import _few
from stabletrain.utils.sync import CountSyncs


def _events(out: Path, kind: str) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if f'"event": "{kind}"' in line]


class _WatchStep:
    """Parameters and optimizer state before and after the optimizer step of ``step``."""

    def __init__(self, step: int):
        self.step, self.before, self.after = step, None, None

    def _state(self, trainer):
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        moments = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"].items()
                   for k, v in [(f"{k}:{kk}", vv) for kk, vv in v.items()]}
        return params, moments

    def on_step_start(self, trainer, *, step):
        if step == self.step:
            self.before = self._state(trainer)

    def on_after_optimizer_step(self, trainer, *, step):
        if step == self.step:
            self.after = self._state(trainer)


def test_skip_step_in_train_records_exactly_the_planted_steps_and_samples(tmp_path, monkeypatch):
    out = tmp_path / "run"
    watch = _WatchStep(NAN_STEP)
    result = stabletrain.train(**settings(out, "skip_step", callbacks=[watch]))
    assert result.steps_done == 40
    rows = _events(out, "recovery")
    nan_samples, spike_samples = planted()
    assert [r["step"] for r in rows] == [NAN_STEP, SPIKE_STEP]
    assert [r["trigger"] for r in rows] == ["nonfinite_loss", "loss_spike"]
    assert [r["skipped_samples"] for r in rows] == [nan_samples, spike_samples]
    assert all(r["action"] == "skip_step" for r in rows)
    assert rows[1]["zscore"] > 6 and rows[1]["loss"] > 1e6
    # The skipped step changed no parameter and no moment; the step count advanced.
    (p0, s0), (p1, s1) = watch.before, watch.after
    assert all(torch.equal(p0[n], p1[n]) for n in p0)
    for key in s0:
        if key.endswith(":step"):
            assert float(s1[key]) == float(s0[key]) + 1, "AdamW's step count advances on a skipped step"
        else:
            assert torch.equal(s0[key], s1[key]), key
    # The lr schedule advances: the logged lr of the step after the skip follows the cosine.
    logged = {r["step"]: r for r in read_run(out / "metrics.jsonl").rows}
    lr0 = 0.01
    expect = lr0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (NAN_STEP + 1) / 40)))
    assert logged[NAN_STEP + 1]["lr"] == pytest.approx(expect, rel=1e-12)
    # Evidence: captures that load, console lines, and a finite final state.
    for row, samples in zip(rows, (nan_samples, spike_samples)):
        cap = load_nan_capture(row["capture"])
        assert cap.step == row["step"] and cap.ranks[0].indices[0].tolist() == samples
    log = (out / "train.log").read_text()
    assert f"Recovered step {NAN_STEP}: nonfinite_loss; update skipped" in log
    assert f"Recovered step {SPIKE_STEP}: loss_spike" in log
    final = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in final["model"].values())
    assert [r["step"] for r in final["callbacks"]["on_instability"]["recoveries"]] == [NAN_STEP, SPIKE_STEP]
    # Diagnosed after training; the report's summary has a section and its plots a marker per recovery.
    assert "Diagnosis of the recovery at step 25: deterministic numerical: bad data" in log
    marked = []
    real_scatter = matplotlib.axes.Axes.scatter

    def scatter(ax, x, y, *args, **kwargs):
        if kwargs.get("label") == "recovery (on_instability)":
            marked.append(list(x))
        return real_scatter(ax, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", scatter)
    stabletrain.report(out, quiet=True)
    md = (out / "report" / "summary.md").read_text()
    assert "## Recoveries (on_instability)" in md
    assert f"| {NAN_STEP} | nonfinite_loss | skip_step | {', '.join(map(str, nan_samples))} |" in md
    assert f"| {SPIKE_STEP} | loss_spike (z=" in md and "bad data: batch['x'] of sample" in md
    assert marked and all(m == [NAN_STEP, SPIKE_STEP] for m in marked), marked


def test_a_recovery_line_names_the_sample_with_bad_data_first_in_a_long_list(tmp_path, capsys):
    # Batch 32: the list shows 16 samples and "(16 more)"; the NaN sample is the batch's last.
    from nan_models import PoisonData, PoisonNet, samples_of_step

    batch = samples_of_step(3, n=128, batch_size=32)
    victim = batch[-1]
    stabletrain.train(out=tmp_path / "run", model=PoisonNet(), data=PoisonData(n=128, input_poison={victim: math.nan}),
                      steps=5, batch_size=32, num_workers=0, model_args={"warmup_steps": 0},
                      trend_alerts={"enabled": False}, on_instability={"policy": "skip_step", "diagnose": False})
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Recovered step 3:")]
    shown = [str(i) for i in batch[:-1]][:15]
    assert f"samples [{victim} (NaN/Inf in its data), {', '.join(shown)}, ... (16 more)]" in line, line
    # A spike in clean data marks nobody: the list is the batch in order.
    assert "NaN/Inf in its data" not in _few([5, 6, 7], first=[])
    assert _few(list(range(20)), first=[19, 3]) == (
        "[19 (NaN/Inf in its data), 3 (NaN/Inf in its data), 0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, ... (4 more)]")


def test_the_default_stop_policy_ends_at_the_first_fault(tmp_path):
    with pytest.raises(NonFiniteStepError) as info:
        stabletrain.train(**settings(tmp_path / "run", "stop"))
    assert info.value.step == NAN_STEP
    assert not _events(tmp_path / "run", "recovery")


def test_over_max_recoveries_the_run_stops_with_a_capture(tmp_path):
    run = settings(tmp_path / "run", "skip_step")
    run["on_instability"]["max_recoveries"] = 1
    with pytest.raises(RecoveryLimitError) as info:
        stabletrain.train(**run)
    assert info.value.step == SPIKE_STEP and info.value.recoveries == 1
    assert load_nan_capture(info.value.capture_path).step == SPIKE_STEP
    assert [r["action"] for r in _events(tmp_path / "run", "recovery")] == ["skip_step", "stop"]


def test_on_instability_from_cli_keys_and_errors_name_the_value():
    parsed = load_settings({"out": "x", **parse_cli_overrides(
        ["on_instability.policy=rollback", "on_instability.zscore=4", "on_instability.rollback_steps=25"])})
    assert (parsed.on_instability.policy, parsed.on_instability.zscore, parsed.on_instability.rollback_steps) == (
        "rollback", 4.0, 25)
    assert load_settings({"out": "x"}).on_instability.policy == "stop", "the default is today's behaviour"
    with pytest.raises(ConfigError, match="on_instability.policy"):
        load_settings({"out": "x", "on_instability": {"policy": "retry"}})


class _SeenSamples:
    """Every dataset index the trainer loads, and the steps it runs."""

    def __init__(self):
        self.samples, self.steps = set(), []

    def on_microbatch(self, trainer, *, step, micro_step, batch, indices):
        self.samples.update(int(i) for i in indices.tolist())
        self.steps.append(step)


def _timeline(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_run(out / "metrics.jsonl").rows}


def test_rollback_skips_the_data_since_the_snapshot_and_resumes_bitwise(tmp_path):
    out = tmp_path / "run"
    result = stabletrain.train(**settings(out, "rollback"))
    assert result.steps_done == 40
    rows = _events(out, "recovery")
    nan_samples, spike_samples = planted()
    # The NaN at step 25 is explained by its sample (quarantined): the weights are undamaged, so the
    # update is skipped and nothing is rolled back. The spike at step 32 rolls back to the snapshot of
    # step 30: the data of steps 30-32 is skipped.
    assert [(r["step"], r["trigger"], r["action"], r.get("rolled_back_to")) for r in rows] == [
        (NAN_STEP, "nonfinite_loss", "skip_step", None), (SPIKE_STEP, "loss_spike", "rollback", 30)]
    assert rows[0]["samples"] == nan_samples and rows[1]["samples"] == spike_samples
    assert rows[0]["culprits"] == rows[0]["quarantined"] == [nan_samples[-1]]
    assert rows[1]["skipped_steps"] == list(range(30, 33)) and len(rows[1]["skipped_samples"]) == 3 * 8
    assert rows[1]["skipped_samples"][-8:] == spike_samples
    losses = _timeline(out)
    assert sorted(losses) == list(range(40))
    assert [s for s, v in losses.items() if not math.isfinite(v)] == [NAN_STEP], "the skipped step's loss is logged"
    # Resumed from a checkpoint after the quarantine: bitwise the same losses.
    again = tmp_path / "again_30"
    shutil.copytree(out, again)
    stabletrain.train(**settings(again, "rollback", resume_from=again / "checkpoints" / "step_000030.ckpt"))
    assert _timeline(again) == losses
    assert [r["step"] for r in _events(again, "recovery")][-2:] == [NAN_STEP, SPIKE_STEP]
    # Resumed from before it: the quarantined sample is never loaded again (quarantine.json), so step
    # 25 trains on a kept sample in its place; the steps before it are bitwise the same.
    again = tmp_path / "again_10"
    shutil.copytree(out, again)
    seen = _SeenSamples()
    stabletrain.train(**settings(again, "rollback", resume_from=again / "checkpoints" / "step_000010.ckpt",
                                 callbacks=[seen]))
    assert seen.steps and min(seen.steps) == 10 and nan_samples[-1] not in seen.samples
    resumed = _timeline(again)
    assert {k: resumed[k] for k in range(NAN_STEP)} == {k: losses[k] for k in range(NAN_STEP)}
    assert all(math.isfinite(v) for v in resumed.values())
    assert [r["step"] for r in _events(again, "recovery")][2:] == [SPIKE_STEP]


def test_rollback_to_the_start_judges_the_rerun_with_the_window_of_then(tmp_path):
    """The only snapshot is step 0's: after the rollback the detector must judge the re-run
    with its window of step 0 (empty, warming up), not the low losses of the abandoned steps."""
    from nan_models import PoisonData

    run = settings(tmp_path / "run", "rollback")
    run["checkpoint_every_num_steps"] = 100
    run["on_instability"]["rollback_steps"] = 100
    run["data"] = data = PoisonData(n=512)
    data.y[planted()[0][-1]] = 1e4  # a spike: rollback acts on it (a NaN explained by its sample is skipped)
    seen = []

    class Window:
        def on_step_start(self, trainer, *, step):
            seen.append((step, int(trainer.safety.healer.guard.detector.count)))

    run["callbacks"] = [Window()]
    assert stabletrain.train(**run).steps_done == 40
    rows = _events(tmp_path / "run", "recovery")
    assert [(r["step"], r["trigger"], r["rolled_back_to"]) for r in rows] == [(NAN_STEP, "loss_spike", 0)]
    assert rows[0]["skipped_steps"] == list(range(NAN_STEP + 1))
    assert seen[NAN_STEP] == (NAN_STEP, NAN_STEP), "25 good steps in the window before the NaN"
    assert seen[NAN_STEP + 1] == (0, 0), "the re-run starts with the window of step 0"


def test_plain_loop_guard_matches_adamw_bitwise_and_skips_exactly_the_planted_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    guard = InstabilityGuard(opt, warmup=5)
    x, y = torch.randn(30, 8, 4), torch.randn(30, 8, 1)
    x[12, 3, 0] = float("nan")  # a NaN sample in step 12
    y[20, 5] = 1e4  # a loss spike in step 20
    found = []
    for step in range(30):
        loss = torch.nn.functional.mse_loss(model(x[step]), y[step])
        loss.backward()
        gn = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        ref_model, ref_opt = copy.deepcopy(model), None
        for a, b in zip(ref_model.parameters(), model.parameters()):
            a.grad = b.grad.clone()
        if opt.state:
            ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
            ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        with CountSyncs() as syncs:
            guard.check(step, loss, gn, samples=torch.arange(8) + 8 * step)
        opt.step()
        with CountSyncs() as after:
            guard.after_step()
        assert syncs.count == 0 and after.count == 0, (syncs.by_op, after.by_op)
        opt.zero_grad()
        found += guard.poll()
        if step in (12, 20):
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
        elif ref_opt is not None:
            ref_opt.step()
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters())), step
    assert [(r.step, r.trigger) for r in found] == [(12, "nonfinite_loss"), (20, "loss_spike")]
    assert found[0].samples == list(range(96, 104)) and found[1].samples == list(range(160, 168))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip_step", "rollback"])
def test_two_ddp_ranks_agree_and_record_every_rank_s_samples_and_fsdp2_recovers_alike(tmp_path, policy):
    """DDP on 2 CPU processes, then FSDP2 on 2 (each rank saves and restores its own shards, the decision
    agreed): the same planted steps recovered, and the kept steps bitwise the DDP run's."""
    from stabletrain.runfiles.checkpoint import load_checkpoint

    script = Path(__file__).with_name("heal_faults.py")
    finals, logged = {}, {}
    for strategy in ("ddp", "fsdp"):
        out = tmp_path / strategy
        proc = subprocess.run([sys.executable, str(script), str(out), policy, strategy], cwd=tmp_path,
                              env=cli_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = _events(out, "recovery")
        nan_samples, spike_samples = planted(world_size=2)
        # The NaN is explained by its sample (on one rank; gathered): skipped under both policies, quarantined.
        assert [(r["step"], r["trigger"]) for r in rows] == [(NAN_STEP, "nonfinite_loss"), (SPIKE_STEP, "loss_spike")]
        assert [r["samples"] for r in rows] == [nan_samples, spike_samples]
        assert rows[0]["action"] == "skip_step" and rows[0]["culprits"] == rows[0]["quarantined"] == [nan_samples[-1]]
        assert [e["index"] for e in json.loads((out / "quarantine.json").read_text())["samples"]] == [nan_samples[-1]]
        for r in rows:
            step_folder = Path(r["capture"]).parent.parent
            assert {"rank0", "rank1"} <= {p.name for p in step_folder.iterdir()}, "each rank wrote its capture"
            assert json.loads((step_folder / "diagnosis.json").read_text())["world_size"] == 2, "diagnosed after"
        finals[strategy] = load_checkpoint(out / "checkpoints" / "last.ckpt")
        assert finals[strategy]["step"] == 40 and all(torch.isfinite(v).all() for v in finals[strategy]["model"].values())
        logged[strategy] = read_run(out / "metrics.jsonl").rows
    # Every kept step's loss and the final weights bitwise; the global gradient norm, summed from the shards'
    # squared norms, equal to float32 rounding.
    assert [(r["step"], r["loss"]) for r in logged["fsdp"]] == [(r["step"], r["loss"]) for r in logged["ddp"]]
    for a, b in zip(logged["fsdp"], logged["ddp"]):
        assert a["gradient_norm"] == pytest.approx(b["gradient_norm"], rel=1e-6, nan_ok=True), a["step"]
    for name, value in finals["ddp"]["model"].items():
        assert torch.equal(finals["fsdp"]["model"][name], value), name


def test_plain_loop_with_an_fp16_grad_scaler_the_scaler_keeps_its_own_rules():
    """A skipped step leaves the weights alone; the GradScaler still backs off on the NaN step
    (its own found-inf) and keeps its scale on the spike step (finite gradients)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    guard = InstabilityGuard(opt, warmup=5, scaler=scaler)  # its found-inf read, and a NaN loss is still bad
    x, y = torch.randn(20, 8, 4), torch.randn(20, 8, 1)
    x[10, 0, 0] = float("nan")
    y[15, 0] = 1e4
    scales, found = {}, []
    for step in range(20):
        loss = torch.nn.functional.mse_loss(model(x[step]), y[step])
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gn = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        guard.check(step, loss, gn)
        before = [p.detach().clone() for p in model.parameters()]
        guard.step(lambda: scaler.step(opt))
        scaler.update()
        opt.zero_grad()
        found += guard.poll()
        scales[step] = scaler.get_scale()
        if step in (10, 15):
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), step
    assert [(r.step, r.trigger) for r in found] == [(10, "nonfinite_loss"), (15, "loss_spike")]
    assert scales[10] == scales[9] / 2, "the scaler backs off on its own found-inf"
    assert scales[15] == scales[14], "a finite spike does not concern the scaler"


def test_fp16_steps_the_grad_scaler_skips_itself_are_not_recoveries(tmp_path):
    """16-mixed with a scale too high for the first steps: the GradScaler skips them and backs off, as
    it is built to. skip_step used to count each as a nonfinite_grad recovery and stopped this healthy
    run at max_recoveries, blaming "the updates" (and so would every few thousand steps of growth)."""
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision

    from conftest import tiny_lm
    from stabletrain.training.loop import Trainer

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    settings = tiny_lm(steps=20, on_instability={"policy": "skip_step", "max_recoveries": 3})
    result = Trainer(load_settings({"out": tmp_path / "run", **settings}), fabric=fabric).fit()
    assert result.steps_done == 20
    assert scaler.get_scale() <= 2.0**24 / 2**4, "the scaler backed off several times: its skips happened"
    assert _events(tmp_path / "run", "recovery") == []
    assert not (tmp_path / "run" / "debug" / "recoveries").exists() or not any(
        (tmp_path / "run" / "debug" / "recoveries").iterdir())


def test_plain_loop_rollback_restores_the_snapshot_bitwise_and_skips_the_data_since():
    from stabletrain import RollbackSnapshots

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = InstabilityGuard(opt, warmup=5)
    snapshots = RollbackSnapshots(model, opt, every=5, extra=(guard,))
    data = [(torch.arange(8) + 8 * i, torch.randn(8, 4), torch.randn(8, 1)) for i in range(40)]
    data[12][1][2, 0] = float("nan")  # batch 12: steps 10-12 roll back, batches 10-12 are skipped
    at_start, position, step, seen = {}, 0, 0, []
    while step < 20:
        snapshots.maybe_take(step)
        at_start.setdefault(step, ([p.detach().clone() for p in model.parameters()], torch.get_rng_state()))
        indices, x, y = data[position]
        position += 1
        seen.append((step, int(indices[0]) // 8))
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.check(step, loss, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]), samples=indices)
        guard.step()
        opt.zero_grad()
        step += 1
        found = guard.poll()
        if found:
            assert [(r.step, r.samples) for r in found] == [(12, list(range(96, 104)))]
            step = snapshots.restore()
            params, rng = at_start[10]
            assert step == 10 and all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
            assert torch.equal(torch.get_rng_state(), rng)
    assert seen[10:14] == [(10, 10), (11, 11), (12, 12), (10, 13)], "after the rollback, step 10 gets batch 13"
    assert position == 23 and snapshots.nbytes > 0


def test_healing_adds_no_host_sync_on_steps_where_nothing_happens(tmp_path):
    from conftest import tiny_lm
    from stabletrain.utils.sync import SyncsPerStep

    counts = {}
    for policy in ("stop", "skip_step", "rollback"):
        counter = SyncsPerStep()
        stabletrain.train(out=tmp_path / policy, callbacks=[counter],
                          on_instability={"policy": policy, "rollback_steps": 4, "diagnose": False},
                          **tiny_lm(steps=8, log_every_num_steps=5, checkpoint_every_num_steps=3))
        counts[policy] = counter.counts
    assert sorted(counts["stop"]) == list(range(8))
    assert counts["skip_step"] == counts["stop"]
    # rollback copies the state to the host at its snapshots (every 4 steps) and checkpoints
    # (every 3 steps, and the last): one copy per tensor there, and nothing added elsewhere.
    quiet = [s for s in range(8) if (s + 1) % 4 and (s + 1) % 3 and s != 7]
    assert quiet == [0, 1, 4, 6]
    assert [counts["rollback"][s] for s in quiet] == [counts["stop"][s] for s in quiet]
    assert all(counts["rollback"][s] > counts["stop"][s] for s in (2, 3))


def test_spike_recoveries_in_a_row_get_one_diagnosis_line_naming_their_steps(tmp_path, monkeypatch):
    """Six spike recoveries in a row printed six identical "no verdict on a spike" lines; now one
    line names the steps, while a non-finite recovery keeps its own line with its verdict."""
    import types

    import stabletrain.debug.diagnose as diagnose_mod
    from stabletrain.safety.healing import Healer

    verdicts = {}

    def fake_diagnose(folder, model=None):
        return types.SimpleNamespace(verdict=verdicts[Path(folder).name])

    monkeypatch.setattr(diagnose_mod, "diagnose", fake_diagnose)
    lines: list[str] = []
    trainer = types.SimpleNamespace(is_rank_zero=True, world_size=1, model=None, resolved_settings=lambda: {},
                                    console=types.SimpleNamespace(info=lines.append))
    healer = Healer.__new__(Healer)
    healer.trainer = trainer
    healer.recoveries = []
    for k, (step, trigger) in enumerate([(54, "loss_spike"), (55, "loss_spike"), (56, "nonfinite_loss"),
                                         (57, "loss_spike")]):
        folder = tmp_path / "debug" / "recoveries" / f"step{step}_r{k}"
        verdicts[folder.name] = f"verdict of {step}"
        healer.recoveries.append({"step": step, "trigger": trigger, "recovery": k,
                                  "capture": str(folder / "nan_capture.pt")})
    assert healer._diagnose_captures() == {k: f"verdict of {s}" for k, s in enumerate([54, 55, 56, 57])}
    assert lines[0] == "Diagnosis of the recovery at step 56: verdict of 56"
    assert len(lines) == 2, lines
    assert lines[1].startswith("Diagnosis of the recoveries at steps 54, 55, 57 (loss_spike): their values were "
                               "finite and the diagnosis looks for NaN/Inf, so it has no verdict on a spike; "
                               "the replay shows step 54's loss: stabletrain replay ")
    assert lines[1].endswith("step54_r0")
    # One spike alone keeps the singular line.
    healer.recoveries = healer.recoveries[:1]
    lines.clear()
    healer._diagnose_captures()
    assert lines == [f"Diagnosis of the recovery at step 54 (loss_spike): its values were finite and the diagnosis "
                     f"looks for NaN/Inf, so it has no verdict on a spike; the replay shows the step's loss: "
                     f"stabletrain replay {tmp_path / 'debug' / 'recoveries' / 'step54_r0'}"]


def test_the_trend_alert_on_a_recovered_nan_step_follows_the_recovery_evidence(tmp_path, capsys):
    """Issue 25: under skip_step the trend alert on the NaN step proposed a re-run with a lower lr,
    although the recovery named the sample whose data holds the NaN. The alert now waits for the
    recovery and says what it found: the data, no setting to change."""
    torch.manual_seed(0)
    s = settings(tmp_path / "run", "skip_step")
    s.update(trend_alerts={"enabled": True}, log_every_num_steps=5)  # NAN_STEP 25 is a logged step
    stabletrain.train(**s)
    (alert,) = [a for a in _events(tmp_path / "run", "trend_alert") if a["kind"] == "nonfinite"]
    (recovery,) = [r for r in _events(tmp_path / "run", "recovery") if r["step"] == NAN_STEP]
    culprit = recovery["culprits"][0]
    assert alert["step"] == NAN_STEP and len(alert["actions"]) == 1, alert["actions"]
    action = alert["actions"][0]
    assert (f"on_instability skipped step {NAN_STEP}'s update, and its samples explain it ({culprit}: batch['x'] "
            "holds 1 non-finite value(s)): they are quarantined") in action
    assert "the cause is the data, not a setting such as the learning rate" in action
    assert "model_args.lr" not in action and "re-run" not in action
    printed = capsys.readouterr().out
    assert printed.index(f"Recovered step {NAN_STEP}:") < printed.index(f"WARNING loss is not finite (step {NAN_STEP})")


def test_a_recovered_nan_step_no_sample_explains_keeps_the_lr_advice():
    from stabletrain.debug.trends.callback import recovery_answer
    from stabletrain.debug.trends.episode import AlertContext

    history = [{"step": i, "lr": 0.1, "loss": 2.0, "gradient_norm": 1.0} for i in range(10)]
    context = AlertContext(lr=0.1, optimizer="sgd", history=history)
    text = recovery_answer({"step": 12, "action": "skip_step", "culprits": []}, {}, context)
    assert text.startswith("on_instability skipped step 12's update; no sample of the step explains it, so the "
                           "updates are the suspect: if it recurs, lower the learning rate: model_args.lr=")
    text = recovery_answer({"step": 12, "action": "rollback", "rolled_back_to": 10, "culprits": []}, {}, context)
    assert text.startswith("on_instability rolled back to step 10; no sample")
    assert "the stop message names the cause" in recovery_answer({"step": 12, "action": "stop"}, {}, context)
