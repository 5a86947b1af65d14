"""stabletrain's tools in Accelerate loops: the documented example on 2 processes, precisions."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stabletrain import NaNDetectedError, NonFiniteStepError, UnderflowOverflowError, diagnose, load_nan_capture

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from conftest import cli_env, plant_exp_avg_sq_overflow  # noqa: E402
from stabletrain.integrations.accelerate import StepMonitor  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "integrations" / "accelerate_example.py"
sys.path.insert(0, str(EXAMPLE.parent))
from accelerate_example import Pairs, Siamese, step_fn  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    # Accelerate keeps its state in process-wide singletons; each test makes its own Accelerator.
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(worker: str, tmp_path) -> list[dict]:
    """Run a worker script of this folder on 2 processes (torchrun, gloo); each rank's rank<r>.json."""
    import json

    env = cli_env()
    env["PYTHONPATH"] = str(EXAMPLE.parent) + ":" + env["PYTHONPATH"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(Path(__file__).with_name(worker)), str(tmp_path)]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def run_loop(accelerator, out, *, steps=12, debug_args=None, bad=29):
    """The example's loop in this process; returns {step: (gradient_norm, accelerate's norm)}."""
    torch.manual_seed(0)
    model = Siamese()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(Pairs(bad=bad), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    norms = {}
    batches = iter(loader)
    with StepMonitor(accelerator, model, out_dir=out, step_fn=step_fn, debug_args=debug_args) as monitor:
        for step in range(steps):
            monitor.begin_step(step)
            for _ in range(accelerator.gradient_accumulation_steps):
                batch = next(batches)
                with accelerator.accumulate(model):
                    monitor.collect_batch(batch, indices=batch["index"])
                    loss = step_fn(model, batch)
                    monitor.collect_loss(loss)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        values = monitor.check(optimizer, read=True)
                        # Accelerate un-scales (under fp16) and returns the pre-clip norm itself.
                        theirs = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                        norms[step] = (values.gradient_norm, float(theirs))
                    optimizer.step()
                    optimizer.zero_grad()
            monitor.end_step()
    return norms


def _step_to_end(monitor, accelerator, model, optimizer, step, batch):
    """One step of a one-microbatch loop, up to (not including) ``monitor.end_step()``."""
    monitor.begin_step(step)
    loss = step_fn(model, batch)
    monitor.collect_loss(loss)
    accelerator.backward(loss)
    monitor.check(optimizer)
    optimizer.step()
    optimizer.zero_grad()


def test_an_optimizer_state_gone_inf_with_finite_weights_stops_at_its_step(tmp_path):
    """end_step checks the update: Adam's exp_avg_sq holds an Inf after step 2 while every weight is
    finite; end_step raises there naming the entry (guard=False: the loop runs on)."""
    for guard in (False, True):
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        model = Siamese()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        handle = plant_exp_avg_sq_overflow(optimizer, at_step=2)
        loader = torch.utils.data.DataLoader(Pairs(), batch_size=2)  # its bad sample is step 14's
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        done = []
        with StepMonitor(accelerator, model, out_dir=tmp_path / str(guard), step_fn=step_fn, guard=guard) as monitor:
            batches = iter(loader)
            try:
                for step in range(5):
                    _step_to_end(monitor, accelerator, model, optimizer, step, next(batches))
                    monitor.end_step()
                    done.append(step)
            except NonFiniteStepError as e:
                err = e
        handle.remove()
        if not guard:
            assert done == [0, 1, 2, 3, 4]
            continue
        assert done == [0, 1]
        assert (err.step, err.origin, err.nonfinite) == (2, "optimizer_step", ["optimizer_state"])
        assert err.state_entries == ["embed.0.weight: exp_avg_sq"] and err.param_names == []
        assert str(err).endswith("\nNext: fix the optimizer step (see above) and restart from weights saved before "
                                 "this step. nancapture captures steps whose loss or gradients go non-finite, not this "
                                 "one; `stabletrain train` with debug_args.nancapture.enabled=true captures an "
                                 "optimizer step that fails and replays it (docs/blowups.md).")
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_norm_equals_accelerates_and_capture_replays(tmp_path):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    # One process: sample 29 is batch 14, so step 7, micro step 0, row 1.
    with pytest.raises(NaNDetectedError) as info:
        run_loop(accelerator, tmp_path, debug_args={"nancapture": {"enabled": True}})
    err = info.value
    assert (err.step, err.reason) == (7, "nonfinite_gradients")
    assert err.replay_command.endswith("accelerate_example.py:step_fn")
    cap = load_nan_capture(err.capture_path, model=Siamese(), step_fn=step_fn)
    assert cap.precision == "32-true" and cap.gradient_accumulation_steps == 2
    assert cap.ranks[0].indices[0].tolist() == [28, 29]
    result = cap.replay()
    assert result.reproduced and result.losses_bitwise_equal
    d = diagnose(cap, write=False)
    assert (d.finding.module, d.finding.phase) == ("distance", "backward")
    assert d.data.dataset_indices == [29]


def test_norms_before_the_fault_equal_clip_grad_norm(tmp_path):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    norms = run_loop(accelerator, tmp_path, steps=6, debug_args={"nancapture": {"enabled": True}})
    assert sorted(norms) == list(range(6))
    for ours, theirs in norms.values():
        assert theirs > 1.0, "clipping at 1.0 acts: ours is the pre-clip norm"
        assert ours == pytest.approx(theirs, rel=1e-6)


def test_bf16_autocast_on_cpu_is_captured_and_replayed_in_bf16(tmp_path):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision="bf16")
    with pytest.raises(NaNDetectedError) as info:
        run_loop(accelerator, tmp_path, debug_args={"nancapture": {"enabled": True}})
    cap = load_nan_capture(info.value.capture_path, model=Siamese(), step_fn=step_fn)
    assert cap.precision == "bf16-mixed"
    result = cap.replay()
    assert result.reproduced and result.losses_bitwise_equal


def test_fp16_scaled_gradients_give_the_unscaled_norm_without_unscaling(tmp_path):
    """Accelerate gives a CPU no GradScaler; the same Accelerator with one (as on a GPU)
    exercises the fp16 path: the monitor reads the norm while the gradients are still scaled
    and divides it by the scale, and Accelerate's own unscale_ in clip_grad_norm_ still runs
    (a second unscale_ in one step would be an error)."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision="fp16")
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    norms = run_loop(accelerator, tmp_path, steps=5, debug_args={"nancapture": {"enabled": True}}, bad=255)
    for ours, theirs in norms.values():
        assert ours == pytest.approx(theirs, rel=1e-5)
    assert accelerator.scaler.get_scale() == 2.0**10, "no step was skipped"


def test_underflow_overflow_names_the_module_without_a_wrapper_prefix(tmp_path):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    with pytest.raises(UnderflowOverflowError) as info:
        run_loop(accelerator, tmp_path, debug_args={"underflow_overflow": {"enabled": True}})
    err = info.value
    assert (err.step, err.phase, err.module) == (7, "backward", "distance")


@pytest.mark.slow
def test_example_on_two_processes_stops_both_and_replays(tmp_path):
    # torchrun: two CPU processes, gloo. Each process reads every other batch of 2: sample 29
    # is rank 0's batch 7, so step 3, micro step 1; rank 1 never sees it.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(EXAMPLE), str(tmp_path / "out")]
    result = subprocess.run(cmd, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "NaNDetectedError: Non-finite gradients at step 3 (rank 0 of 2)" in result.stdout
    assert "-> the data of rank(s) 0 alone reproduces the NaN" in result.stdout
    folder = tmp_path / "out" / "debug" / "nan_capture"
    cap = load_nan_capture(folder, model=Siamese(), step_fn=step_fn)
    assert [r.rank for r in cap.ranks] == [0, 1] and cap.step == 3
    # The unwrapped model's names, not DDP's module.embed.0.weight.
    assert all(r.nan_param_names == ["embed.0.weight", "embed.0.bias", "embed.2.weight", "embed.2.bias"]
               for r in cap.ranks)
    assert 29 in cap.ranks[0].indices[1].tolist()


@pytest.mark.slow
def test_two_processes_stop_together_when_one_ranks_optimizer_state_goes_inf(tmp_path):
    """torchrun, 2 CPU processes: AdamW's exp_avg_sq gets an Inf after an optimizer step, on one rank (as
    one FSDP2 shard would) or both (DDP's replicated state). Every rank stops at the same point with the
    message of the lowest rank that found it, naming the failing step: a step later, on nancapture's
    read (check) or the lagged agreement (end_step); the last step's at close()."""

    ranks = _two_processes("accelerate_guard_worker.py", tmp_path)
    expected = {  # scenario: (raised in, failing step, stopped at, the rank the message names)
        "one_rank": ("step 3 check", 2, 3, 1),
        "both_nancapture_off": ("step 3 end_step", 2, 3, 0),
        "last_step_off": ("close", 4, 4, 0),
        "last_step_on": ("close", 4, 4, 1),
    }
    for name, (raised_in, step, stopped_at, leader) in expected.items():
        got = [r[name] for r in ranks]
        for rank, outcome in enumerate(got):
            assert (outcome["raised_in"], outcome["step"], outcome["stopped_at"]) == (raised_in, step, stopped_at), name
            assert outcome["entries"] == ["embed.0.weight: exp_avg_sq"], name
            assert outcome["other_rank"] == (rank != leader), name
        assert got[0]["message"] == got[1]["message"], name
        assert got[0]["message"].startswith(f"The optimizer step of step {step} (rank {leader} of 2) wrote non-finite "
                                            "values"), name


def test_mechanism_signals_on_the_steps_the_loop_logs(tmp_path):
    """begin_step(log=True) on steps 0 and 2: signals() gives the signals after the optimizer
    step there (one host read each), {} on the others; what accelerator.log receives."""
    from stabletrain.utils.sync import CountSyncs

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = Siamese()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Pairs(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    logged = {}
    with StepMonitor(accelerator, model, out_dir=tmp_path, step_fn=step_fn) as monitor:
        for step, batch in zip(range(4), loader):
            monitor.begin_step(step, log=step % 2 == 0)
            monitor.collect_batch(batch)
            loss = step_fn(model, batch)
            monitor.collect_loss(loss)
            accelerator.backward(loss)
            monitor.check(optimizer)
            before = [p.detach().double().clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            with CountSyncs() as syncs:
                values = monitor.signals()
            monitor.end_step()
            assert syncs.count == (1 if values else 0)
            if values:
                logged[step] = values
                after = [p.detach().double() for p in model.parameters()]
                delta = sum(((a - b) ** 2).sum().item() for a, b in zip(after, before)) ** 0.5
                ref = delta / sum((b**2).sum().item() for b in before) ** 0.5
                assert values["signals/update_rms/group0"] == pytest.approx(ref, rel=1e-5)
    assert sorted(logged) == [0, 2]
    for values in logged.values():
        assert 0 <= values["signals/adam_eps_fraction"] <= 1 and values["signals/weight_rms/group0"] > 0


@pytest.mark.parametrize("eps", [1.0, 1e-8])
def test_the_mechanism_rules_name_the_adam_eps_regime_in_a_loop(tmp_path, caplog, eps):
    """The logged signals are read by the same rules as stabletrain train's: AdamW with eps 1 (far above the
    gradients) is named on the first logged step, warned about and recorded; eps 1e-8 names nothing."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = Siamese()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, eps=eps)
    loader = torch.utils.data.DataLoader(Pairs(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with caplog.at_level("WARNING", logger="stabletrain"), \
            StepMonitor(accelerator, model, out_dir=tmp_path, step_fn=step_fn) as monitor:
        for step, batch in zip(range(4), loader):
            monitor.begin_step(step, log=True)
            monitor.collect_batch(batch)
            loss = step_fn(model, batch)
            monitor.collect_loss(loss)
            accelerator.backward(loss)
            monitor.check(optimizer)
            optimizer.step()
            optimizer.zero_grad()
            monitor.signals()
            monitor.end_step()
    named = [e for e in monitor.tools.alerts if e.get("event") == "mechanism"]
    if eps == 1.0:
        assert [(e["id"], e["step"]) for e in named] == [("adam_eps", 0)]
        assert "WARNING mechanism: the Adam epsilon regime" in caplog.text
        assert "model_args" not in caplog.text  # not stabletrain's trainer: no settings of ours are named
    else:
        assert named == [] and "mechanism" not in caplog.text


def test_optimizer_state_loaded_with_an_inf_is_not_blamed_on_the_first_step(tmp_path):
    """An AdamW state that holds an Inf before step 0 (loaded so): end_step stops at step 0 and says the
    state held it already, with advice about what the run started from, not about fixing the step. The
    guard is armed in check(), within step 0, and checks the state there, before the optimizer step."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = Siamese()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Pairs(), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = iter(loader)
    step_fn(model, next(batches)).backward()
    optimizer.step()  # the state a checkpoint would hold; then an Inf in it
    optimizer.zero_grad()
    first = next(p for p in model.parameters() if p in optimizer.optimizer.state)
    optimizer.optimizer.state[first]["exp_avg_sq"].view(-1)[0] = float("inf")
    with StepMonitor(accelerator, model, out_dir=tmp_path, step_fn=step_fn) as monitor:
        _step_to_end(monitor, accelerator, model, optimizer, 0, next(batches))
        with pytest.raises(NonFiniteStepError) as info:
            monitor.end_step()
    err = info.value
    assert (err.step, err.origin, err.failure.before) == (0, "optimizer_step", "already")
    assert str(err).startswith("Before the optimizer step of step 0 (rank 0 of 1), the first this guard checked, the "
                               "weights or the optimizer state already held non-finite values.")
    assert str(err).endswith("\nNext: check the weights and optimizer state the run started from (initialisation, "
                             "or the checkpoint loaded): they were out of range before the first optimizer step.")


def _prepared_siamese():
    """The example's model, SGD with momentum and data (sample 29 is the identical pair: a NaN gradient at
    step 14 with batches of 2), seeded and prepared by a CPU Accelerator: (accelerator, model, optimizer, loader)."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = Siamese()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(Pairs(bad=29), batch_size=2)
    return (accelerator, *accelerator.prepare(model, optimizer, loader))


def _healing_loop(tmp_path, unwrap: bool):
    """The example's model and data (sample 29 gives a NaN gradient: step 14 with batches of 2), 16
    steps, nancapture off, an InstabilityGuard on the step's pre-clip norm from check(). Returns the
    recoveries, the guard's step mode, and the weights before and after each step."""
    from stabletrain import InstabilityGuard

    accelerator, model, optimizer, loader = _prepared_siamese()
    # The torch optimizer inside Accelerate's wrapper gets the skip-aware step; the wrapper, the copy.
    heal = InstabilityGuard(optimizer.optimizer if unwrap else optimizer)
    weights, recoveries, modes = [], [], set()
    with StepMonitor(accelerator, model, out_dir=tmp_path, step_fn=step_fn) as monitor:
        for step, batch in zip(range(16), loader):
            weights.append([p.detach().clone() for p in model.parameters()])
            monitor.begin_step(step)
            monitor.collect_batch(batch, indices=batch["index"])
            loss = step_fn(model, batch)
            monitor.collect_loss(loss)
            accelerator.backward(loss)
            values = monitor.check(optimizer)
            heal.check(step, loss, values.grad_norm.total, samples=batch["index"])
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            heal.step(optimizer.step)
            modes.add(heal.skipper.mode)
            optimizer.zero_grad()
            monitor.end_step()  # the guard checks the optimizer state: finite, the bad update was skipped
            recoveries += heal.poll()
    weights.append([p.detach().clone() for p in model.parameters()])
    return recoveries + heal.poll(wait=True), modes, weights


@pytest.mark.parametrize("unwrap", [True, False])
def test_instability_guard_skips_the_nan_step_in_an_accelerate_loop(tmp_path, unwrap):
    """Self-healing in an Accelerate loop (docs/integrations/accelerate.md): the NaN gradient of sample
    29 at step 14 is not applied (weights and momentum unchanged, bitwise), every other step is, the
    loop runs to its end, and the recovery names the step and its samples."""
    recoveries, modes, weights = _healing_loop(tmp_path / str(unwrap), unwrap)
    assert [(r.step, r.trigger, r.samples, r.action) for r in recoveries] == [(14, "nonfinite_grad", [28, 29], "skip_step")]
    assert modes == ({"skip_aware"} if unwrap else {"copy"})
    changed = [s for s in range(16) if any(not torch.equal(a, b) for a, b in zip(weights[s], weights[s + 1]))]
    assert changed == [s for s in range(16) if s != 14]
    assert all(bool(torch.isfinite(p).all()) for p in weights[-1])
    if unwrap:  # the two ways give the same run, bitwise
        _, _, copied = _healing_loop(tmp_path / "copy", unwrap=False)
        assert all(torch.equal(a, b) for a, b in zip(weights[-1], copied[-1]))


def _monitor_healing_loop(tmp_path, steps=16, save_to=None, load_from=None, **on_instability):
    """The example's model and data with StepMonitor(on_instability=skip_step): sample 29's NaN gradient is
    step 14's (batches of 2). Returns the monitor's recoveries and the weights before and after each step.
    ``save_to`` / ``load_from``: ``accelerator.save_state`` after the loop / ``load_state`` before it, with
    the monitor registered for checkpointing."""
    accelerator, model, optimizer, loader = _prepared_siamese()
    weights = []
    with StepMonitor(accelerator, model, out_dir=tmp_path, step_fn=step_fn,
                     on_instability={"policy": "skip_step", **on_instability}) as monitor:
        accelerator.register_for_checkpointing(monitor)
        if load_from is not None:
            accelerator.load_state(load_from)
        for step, batch in zip(range(steps), loader):
            weights.append([p.detach().clone() for p in model.parameters()])
            monitor.begin_step(step)
            monitor.collect_batch(batch, indices=batch["index"])
            loss = step_fn(model, batch)
            monitor.collect_loss(loss)
            accelerator.backward(loss)
            monitor.check(optimizer)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            monitor.end_step()
        if save_to is not None:
            accelerator.save_state(save_to)
    weights.append([p.detach().clone() for p in model.parameters()])
    return monitor, weights


def test_step_monitor_skip_step_skips_the_nan_step_and_goes_on(tmp_path, caplog):
    """on_instability skip_step in StepMonitor: the loop's own optimizer.step() changes nothing at step 14
    (bitwise: weights and momentum), every other step is applied, the run ends, and the recovery is logged
    with its step and samples, as the trainer's row."""
    caplog.set_level("WARNING", logger="stabletrain")
    monitor, weights = _monitor_healing_loop(tmp_path)
    rows = monitor.recoveries
    assert [(r["step"], r["trigger"], r["action"], r["samples"], r["recovery"]) for r in rows] == [
        (14, "nonfinite_grad", "skip_step", [28, 29], 1)]
    changed = [s for s in range(16) if any(not torch.equal(a, b) for a, b in zip(weights[s], weights[s + 1]))]
    assert changed == [s for s in range(16) if s != 14]
    assert monitor.tools.healing.guard.skipper.mode == "skip_aware"  # the torch SGD inside Accelerate's wrapper
    assert ("Recovered step 14: nonfinite_grad; update skipped (on_instability.policy=skip_step, recovery 1 of at "
            "most 10); samples [28, 29]") in caplog.text


def test_step_monitor_skip_step_state_is_saved_and_loaded_by_accelerate(tmp_path):
    """register_for_checkpointing(monitor): save_state writes the spike detector's window and the
    recoveries, load_state puts them back (before the detector exists, or into it), and the resumed
    loop counts on towards max_recoveries: the same NaN sample again is its second recovery, past
    max_recoveries=1 (a fresh monitor would take it as its first and go on)."""
    from stabletrain import RecoveryLimitError

    first, _ = _monitor_healing_loop(tmp_path / "a", save_to=tmp_path / "state")
    saved = first.tools.healing.guard.detector.state_dict()
    assert int(saved["count"]) == 15, "the 15 applied steps: the skipped one is not in the window"
    for optimizer_given in (False, True):  # armed at the first check(), or when made
        accelerator, model, optimizer, _ = _prepared_siamese()
        monitor = StepMonitor(accelerator, model, out_dir=tmp_path / "c", step_fn=step_fn,
                              optimizer=optimizer if optimizer_given else None, on_instability={"policy": "skip_step"})
        accelerator.register_for_checkpointing(monitor)
        accelerator.load_state(tmp_path / "state")
        monitor.tools.healing.arm(optimizer)
        loaded = monitor.tools.healing.guard.detector.state_dict()
        assert all(torch.equal(saved[k], loaded[k]) for k in saved), "the window as saved, bitwise"
        assert [(r["step"], r["recovery"]) for r in monitor.recoveries] == [(14, 1)]
        assert monitor.recoveries is monitor.tools.healing.recoveries
        monitor.close()
    with pytest.raises(RecoveryLimitError) as info:
        _monitor_healing_loop(tmp_path / "b", load_from=tmp_path / "state", max_recoveries=1)
    assert (info.value.step, info.value.recoveries) == (14, 1)
    assert "after 1 recoveries (on_instability.max_recoveries=1)" in str(info.value)


def test_step_monitor_skip_step_stops_past_max_recoveries_and_refuses_rollback(tmp_path):
    from stabletrain import ConfigError, RecoveryLimitError

    with pytest.raises(RecoveryLimitError) as info:
        _monitor_healing_loop(tmp_path, max_recoveries=0)
    err = info.value
    assert (err.step, err.recoveries) == (14, 0)
    assert str(err).startswith("Step 14: nonfinite_grad, after 0 recoveries (on_instability.max_recoveries=0): "
                               "stopping. Its update was not applied; samples [28, 29].")
    with pytest.raises(ConfigError, match="on_instability.policy: rollback is not available in the integrations"):
        StepMonitor(Accelerator(cpu=True), Siamese(), out_dir=tmp_path, on_instability={"policy": "rollback"})


@pytest.mark.slow
def test_two_processes_skip_the_same_step_when_one_ranks_batch_is_bad(tmp_path):
    """DDP (torchrun, gloo): sample 29's NaN gradient is rank 0's step 7; after DDP's reduction both ranks'
    gradients hold it, the loss is averaged over ranks, and both skip step 7's update and go on with the
    same weights, bitwise. Each records its own samples."""

    ranks = _two_processes("accelerate_heal_worker.py", tmp_path)
    for got in ranks:
        assert [(r["step"], r["trigger"], r["action"]) for r in got["recoveries"]] == [(7, "nonfinite_grad", "skip_step")]
        assert got["changed"] == [s for s in range(10) if s != 7] and got["finite"]
    assert ranks[0]["recoveries"][0]["samples"] == [28, 29]
    assert ranks[0]["weights"] == ranks[1]["weights"]
