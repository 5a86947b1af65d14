"""Replay of NaN captures: bitwise on the CPU, precision as captured, the lower-level
forward_backward, the command line as pasted from the error, resume from the healthy
checkpoint, two DDP ranks of which only one has poisoned data, the gradient DDP synced on a
healthy step, finite gradients whose float32 norm overflows, and paths with spaces and quotes
in the pasted command (or a template when no command can build the model)."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from nan_models import PoisonData, PoisonNet, samples_of_step
from torch.utils._python_dispatch import TorchDispatchMode

import stabletrain.debug.replay.rerun as rerun_module
from conftest import cli_env, tiny_lm
from stabletrain import NaNCaptureError, NaNCaptureMonitor, NaNDetectedError, load_nan_capture
from stabletrain.debug.nan_capture import default_replay_command, no_replay_command_reason
from stabletrain.debug.replay import forward_backward, load_object
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.runfiles.checkpoint import load_checkpoint
from stabletrain.training.loop import train

NANCAPTURE = {"nancapture": {"enabled": True}}
#: The tiny language model diverges with SGD at lr 1000: non-finite at step 4.
BOOM = {"optimizer": "sgd", "lr": 1000.0, "warmup_steps": 0, "lr_schedule": "constant"}


def shell_env() -> dict[str, str]:
    """This checkout's sources, and the venv's ``stabletrain`` executable on PATH."""
    env = cli_env()
    env["PATH"] = str(Path(sys.executable).parent) + ":" + env.get("PATH", "")
    return env


def pasted_command(message: str) -> str:
    """The line under 'Replay it offline:' in an error message."""
    match = re.search(r"Replay it offline:\n(?:\[rank\d+\]: )?\s+(.+)", message)  # DDP prefixes [rankN]:
    assert match, message
    return match.group(1).strip()


def replay_json(command: str, cwd: Path, capsys) -> dict:
    """The same command with --json, run in this process (a subprocess costs seconds of imports)."""
    from stabletrain.cli import main

    argv = shlex.split(command)
    assert argv[:2] == ["stabletrain", "replay"]
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        assert main([*argv[1:], "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("accum", [1, 4])
def test_builtin_model_failure_replays_bitwise(tmp_path, accum):
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "boom", debug_args=NANCAPTURE,
              **tiny_lm(steps=10, gradient_accumulation_steps=accum, model_args={**BOOM, "dropout": 0.1}))
    err = info.value
    cap = load_nan_capture(err.capture_path.parent)  # rebuilt from the stored settings
    assert (cap.step, cap.rank, cap.gradient_accumulation_steps) == (err.step, 0, accum)
    result = cap.replay()
    assert result.reproduced and result.step == err.step
    assert result.nan_param_names == err.nan_param_names and "head.weight" in result.nan_param_names
    assert len(result.losses) == accum and result.losses_bitwise_equal
    assert [m for _, m in result.microbatches] == list(range(accum))
    assert all(len(ix) == 8 // accum for ix in result.sample_indices)
    # a Fabric overrides the precision: in float64 this step does not overflow
    from lightning_fabric import Fabric

    wide = cap.replay(fabric=Fabric(accelerator="cpu", devices=1, precision="64-true"))
    assert wide.precision == "64-true" and wide.losses_bitwise_equal is False


def _poison_capture(tmp_path, precision="32-true", accum=2, step=2, value=float("nan")):
    """A PoisonNet run whose step ``step`` has a gradient fault in microbatch 1, row 2;
    returns the error and the gradients training computed for that step."""
    victim = samples_of_step(step, accum=accum)[8 // accum + 2]
    grads = {}

    class KeepGrads:
        def on_after_microbatch(self, trainer, *, step, micro_step, loss):
            if micro_step == accum - 1:
                grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})

    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "run", model=PoisonNet(), data=PoisonData(grad_poison={victim: value}), steps=6,
              batch_size=8, gradient_accumulation_steps=accum, num_workers=0, precision=precision,
              model_args={"lr": 0.01, "warmup_steps": 0}, callbacks=[KeepGrads()], debug_args=NANCAPTURE)
    return info.value, grads


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_forward_backward_on_chosen_microbatches_samples_and_precision(tmp_path, monkeypatch):
    err, trained = _poison_capture(tmp_path)
    cap = load_nan_capture(err.capture_path, model=PoisonNet())
    captured = cap.ranks[0].losses

    full = forward_backward(cap)
    assert full.nonfinite_param_names == ["fc2.weight"] and not full.finite
    for name, p in full.model.named_parameters():  # the very gradients training computed
        assert torch.equal(p.grad.view(torch.int32), trained[name].view(torch.int32)), f"{name} bitwise"

    first = forward_backward(cap, microbatches=[0])
    assert first.finite and first.microbatches == [(0, 0)]
    assert torch.equal(first.losses[0], captured[0])
    second = forward_backward(cap, microbatches=[(0, 1)])
    assert second.nonfinite_param_names == ["fc2.weight"]
    assert torch.equal(second.losses[0], captured[1]), "each microbatch gets its own RNG state, run alone too"

    forward_only = forward_backward(cap, microbatches=[(0, 1)], backward=False)
    assert torch.equal(forward_only.losses[0], captured[1]) and forward_only.grad_finite == {}
    assert all(p.grad is None for p in forward_only.model.parameters()), "no backward pass"
    assert forward_backward(cap, microbatches=[1], rows={1: [2]}).nonfinite_param_names == ["fc2.weight"]
    assert forward_backward(cap, microbatches=[1], rows={1: [0, 1, 3]}).finite

    wide = forward_backward(cap, precision="64-true")
    assert wide.model.fc1.weight.grad.dtype == torch.float64 and wide.nonfinite_param_names == ["fc2.weight"]
    assert wide.loss_values == pytest.approx([float(x) for x in captured], rel=1e-5)

    counter = CountOps()
    forward_backward(cap, microbatches=[0], context=counter)
    assert "aten.addmm.default" in counter.ops and "aten.tanh_backward.default" in counter.ops, "forward and backward"
    made = []
    forward_backward(cap, microbatches=[0], context=lambda: made.append(CountOps()) or made[-1])  # or a factory
    assert len(made) == 1 and made[0].ops == counter.ops

    # Positive control: without restoring the RNG, dropout draws other masks.
    monkeypatch.setattr(rerun_module, "set_rng_state", lambda state: None)
    assert not torch.equal(forward_backward(cap, microbatches=[0]).losses[0], captured[0])


def test_bf16_mixed_capture_replays_in_bf16_by_default(tmp_path):
    err, _ = _poison_capture(tmp_path, precision="bf16-mixed")
    cap = load_nan_capture(err.capture_path, model=PoisonNet())
    assert cap.precision == "bf16-mixed"
    default = cap.replay()
    assert default.precision == "bf16-mixed" and default.reproduced and default.losses_bitwise_equal
    fp32 = cap.replay(precision="32-true")
    assert fp32.reproduced and fp32.losses_bitwise_equal is False, "fp32 computes other losses: bf16 was really used"
    assert fp32.losses == pytest.approx(default.losses, rel=0.05)


@pytest.mark.slow
def test_error_message_command_works_when_pasted(cli, tmp_path, capsys):
    args = ["train", "out=boom", "steps=10", "batch_size=8", "checkpoint_every_num_steps=3",
            "model_args.n_layers=1", "model_args.n_heads=2", "model_args.dim=32", "model_args.context_length=16",
            "model_args.optimizer=sgd", "model_args.lr=1000", "model_args.warmup_steps=0",
            "debug_args.nancapture.enabled=true"]
    trained = cli(*args)
    assert trained.returncode == 1
    assert "stabletrain train: NaNDetectedError: " in trained.stderr
    command = pasted_command(trained.stderr)
    assert command == f"stabletrain replay {shlex.quote(str(tmp_path / 'boom/debug/nan_capture/rank0'))}"
    # The only checkpoint (step 3) is finite but was written while the loss exploded: not called healthy.
    assert ("No non-finite value reached the optimizer or a checkpoint. No checkpoint of this run is healthy "
            "(step 3: loss at step 2 is") in trained.stderr
    assert f"start again with overwrite=true: stabletrain train out={tmp_path / 'boom'} " in trained.stderr

    pasted = subprocess.run(command, shell=True, cwd=tmp_path, env=shell_env(), capture_output=True, text=True, timeout=120)
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    assert "reproduced: YES" in pasted.stdout and "losses: bitwise equal" in pasted.stdout

    data = replay_json(command, tmp_path, capsys)
    assert data["reproduced"] is True and data["losses_bitwise_equal"] is True and data["step"] == 4
    assert data["nan_param_names"] and data["gradient_norm"] == "nan"


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


def test_resume_from_the_healthy_checkpoint_with_a_lower_lr(tmp_path):
    from nan_models import SpikeNet

    torch.manual_seed(0)  # SpikeNet's initial weights, whatever ran before
    out = tmp_path / "run"
    outlier = samples_of_step(4)[0]  # an outlier batch at step 4; at lr 0.01 it drives s below 0
    run = dict(data=PoisonData(spikes={outlier: 1000.0}), steps=12, batch_size=8, num_workers=0,
               checkpoint_every_num_steps=4, log_every_num_steps=1, debug_args=NANCAPTURE)
    lr = {"optimizer": "sgd", "momentum": 0.0, "warmup_steps": 0, "lr_schedule": "constant"}
    with pytest.raises(NaNDetectedError) as info:
        train(out=out, model=SpikeNet(), model_args={**lr, "lr": 0.01}, **run)
    assert (info.value.step, info.value.reason) == (5, "nonfinite_loss")  # log(s) of a negative s
    assert "last.ckpt holds the healthy state from before step 4" in str(info.value)
    state = load_checkpoint(out / "checkpoints" / "last.ckpt")
    assert state["step"] == 4
    assert _all_finite(state["model"]) and _all_finite(state["optimizer"]), "no NaN reached a checkpoint"
    assert float(state["model"]["s"]) > 0

    result = train(out=out, model=SpikeNet(), resume_interrupted=True, model_args={**lr, "lr": 0.001}, **run)
    assert result.steps_done == 12
    rows, events = read_metrics(out / "metrics.jsonl")
    # (Other events, such as trend alerts on the outlier step, may come in between.)
    assert [(e["event"], e["step"]) for e in events if e["event"] in ("nan_detected", "resume")] == [
        ("nan_detected", 5), ("resume", 4)]
    resumed = rows[-8:]
    assert [r["step"] for r in resumed] == list(range(4, 12))
    assert all(r["lr"] == 0.001 for r in resumed)
    assert resumed[0]["loss"] == rows[4]["loss"], "step 4 starts from the checkpoint exactly as before"
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["gradient_norm"]) for r in resumed)
    final = load_checkpoint(out / "checkpoints" / "last.ckpt")
    assert _all_finite(final["model"]) and float(final["model"]["s"]) > 0


@pytest.mark.slow
def test_two_ddp_ranks_only_rank1_poisoned(tmp_path, capsys):
    script = Path(__file__).with_name("nan_models.py")
    proc = subprocess.run([sys.executable, str(script), "run", "2"], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "NaNDetectedError" in proc.stderr, proc.stderr[-3000:]
    folder = tmp_path / "run" / "debug" / "nan_capture"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0", "rank1"], "each rank wrote its own capture"
    r0, r1 = (torch.load(folder / f"rank{r}" / "nan_capture.pt", weights_only=True) for r in (0, 1))
    assert r0["step"] == r1["step"] == 2 and r0["world_size"] == 2
    assert math.isfinite(float(r0["losses"][0])) and math.isnan(float(r1["losses"][0]))
    assert (r0["reason"], r1["reason"]) == ("nonfinite_gradients", "nonfinite_loss")
    assert samples_of_step(2, world_size=2, rank=1)[1] in r1["indices"][0].tolist()

    command = pasted_command(proc.stderr)
    assert command.startswith(f"stabletrain replay {shlex.quote(str(tmp_path / 'run/debug/nan_capture'))} --model ")
    assert command.endswith("nan_models.py:PoisonNet")
    pasted = subprocess.run(command, shell=True, cwd=tmp_path, env=shell_env(), capture_output=True, text=True, timeout=120)
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    assert "reproduced: YES" in pasted.stdout
    assert "rank 0's microbatches alone: finite" in pasted.stdout
    assert "rank 1's microbatches alone: non-finite" in pasted.stdout

    data = replay_json(command, tmp_path, capsys)
    assert data["ranks"] == [0, 1] and data["reproduced"] is True
    assert data["ranks_reproducing_alone"] == [1]
    assert data["losses_bitwise_equal"] is True


# ------------------------------------------------------------- DDP's gradient, finite values


def test_ranks_gradients_combine_as_ddp_averages_them(tmp_path):
    """Two ranks simulated in one process, a healthy step captured on both (as when another
    rank fails): replaying both ranks' microbatches gives the average of their local
    gradients, which is what DDP syncs (each rank's gradient divided by the world size, summed)."""
    torch.manual_seed(0)
    init = PoisonNet().state_dict()
    data = PoisonData()
    local = []
    for rank in (0, 1):
        model = PoisonNet()
        model.load_state_dict(init)
        monitor = NaNCaptureMonitor(model, tmp_path / "caps", rank=rank, world_size=2, gradient_accumulation_steps=2,
                                    any_rank=lambda flag: True)  # "another rank failed": capture this healthy step
        monitor.begin_step(5)
        for micro in range(2):
            start = rank * 16 + micro * 8
            batch = torch.utils.data.default_collate([data[i] for i in range(start, start + 8)])
            monitor.collect_batch(batch)
            loss = model.training_step(batch)  # dropout on: replay must restore each microbatch's RNG
            monitor.collect_loss(loss)
            (loss / 2).backward()
        local.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with pytest.raises(NaNDetectedError) as info:
            monitor.check_and_capture()
        assert info.value.reason == "other_rank" and info.value.nan_param_names == []

    cap = load_nan_capture(tmp_path / "caps", model=PoisonNet())
    res = cap.forward_backward()
    assert res.finite and res.microbatches == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for name, p in res.model.named_parameters():
        assert torch.equal(p.grad, local[0][name] / 2 + local[1][name] / 2), name
        assert torch.allclose(p.grad, (local[0][name] + local[1][name]) / 2, rtol=1e-6, atol=0), name
        assert not torch.allclose(p.grad, local[0][name]), f"{name}: rank 1's data changes the gradient"
    alone = cap.forward_backward(microbatches=[(1, 0), (1, 1)])
    for name, p in alone.model.named_parameters():
        assert torch.equal(p.grad, local[1][name]), f"{name}: one rank alone gives its local gradient"
    assert cap.replay().reproduced is False


@pytest.mark.slow
def test_two_ddp_ranks_healthy_step_replays_the_synced_gradient_bitwise(tmp_path):
    """Real DDP on 2 CPU processes with accumulation: a healthy step captured on both ranks
    replays, in one process, to exactly the gradient DDP synced."""
    script = Path(__file__).with_name("nan_models.py")
    proc = subprocess.run([sys.executable, str(script), "run", "1", "healthy"], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert "NaNDetectedError" in proc.stderr, proc.stderr[-3000:]
    cap = load_nan_capture(tmp_path / "run" / "debug" / "nan_capture", model=PoisonNet())
    assert [r.rank for r in cap.ranks] == [0, 1] and cap.step == 1 and cap.gradient_accumulation_steps == 2
    synced = [torch.load(tmp_path / "run" / f"synced_grads_rank{r}.pt", weights_only=True) for r in (0, 1)]
    res = cap.forward_backward()
    assert res.finite
    for name, p in res.model.named_parameters():
        assert torch.equal(synced[0][name], synced[1][name]), f"{name}: DDP gave every rank the same gradient"
        assert torch.equal(p.grad, synced[0][name]), f"{name}: the replay gives DDP's synced gradient bitwise"
    alone = cap.forward_backward(microbatches=[(0, 0), (0, 1)])
    assert not torch.equal(alone.model.fc1.weight.grad, synced[0]["fc1.weight"]), "rank 1's data matters"


# ----------------------------------------------------- finite gradients, overflowing norm


def test_gradient_norm_overflow_is_captured_and_replayed_as_such(tmp_path, capsys):
    """An input of 1e20: every gradient element finite (2.5e19 at most), the float32 norm inf.
    Captured as gradient_norm_overflow, not as NaN/Inf, and the replay reproduces it."""
    from nan_models import L1Net

    step = 3
    victim = samples_of_step(step, batch_size=4)[1]
    model = L1Net()
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "run", model=model, data=PoisonData(input_poison={victim: 1e20}), steps=8, batch_size=4,
              num_workers=0, log_every_num_steps=1, model_args={"lr": 0.01, "warmup_steps": 0}, debug_args=NANCAPTURE)
    err = info.value
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(bool(torch.isfinite(g).all()) for g in grads.values()), "every element is finite"
    assert not math.isfinite(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))))
    assert (err.step, err.reason, err.nan_param_names) == (step, "gradient_norm_overflow", [])
    text = str(err)
    assert "NaN/Inf" not in text and "every gradient element is finite" in text
    assert "Largest |gradient|: fc.weight 2.5e+19, fc.bias" in text
    assert "gradient_clip_val" in text and "model_args.lr" in text
    state = torch.load(err.capture_path, weights_only=True)
    assert state["reason"] == "gradient_norm_overflow" and state["nan_param_names"] == []
    assert state["largest_gradients"][0]["name"] == "fc.weight"
    assert state["largest_gradients"][0]["abs_max"] == pytest.approx(2.5e19, rel=1e-6)
    _, events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    events = [e for e in events if e["event"] != "mechanism_signals"]  # the signals' row: docs/mechanisms.md
    assert events[0]["reason"] == "gradient_norm_overflow" and events[0]["nan_param_names"] == []

    cap = load_nan_capture(err.capture_path, model=L1Net())
    assert cap.reason == "gradient_norm_overflow" and cap.ranks[0].largest_gradients[0][0] == "fc.weight"
    result = cap.replay()
    assert result.reproduced is True and result.losses_bitwise_equal is True
    assert result.gradient_norm == math.inf and result.gradient_norm_overflow and result.nan_param_names == []
    assert result.largest_gradients[0] == ("fc.weight", pytest.approx(2.5e19, rel=1e-6))
    assert "reproduced: YES - gradient norm overflow: every gradient element is finite" in result.to_text()
    wide = cap.replay(precision="64-true")  # 2.5e19 squared fits in float64
    assert wide.reproduced is False and wide.gradient_norm == pytest.approx(2.5e19, rel=1e-6)
    assert "In 64-true this step is finite" in wide.to_text()

    command = pasted_command(text)
    data = replay_json(command, Path.cwd(), capsys)
    assert data["reproduced"] is True and data["reason"] == "gradient_norm_overflow"
    assert data["gradient_norm"] == "inf" and data["gradient_norm_overflow"] is True and data["nan_param_names"] == []
    assert data["largest_gradients"][0]["name"] == "fc.weight"

    d = cap.diagnose(write=False)  # a capture with the new reason is diagnosed, with the culprit sample
    assert d.cause == "deterministic_numerical" and d.reproduces_in == {"32-true": True, "64-true": False}
    assert d.data.dataset_indices == [victim]
    assert "finite gradients too large for a float32 norm" in d.probable_cause and "fc.weight" in d.probable_cause
    assert "gradient norm overflow" in d.summary and "NaN/Inf gradients" not in d.summary
    assert any("clip" in a for a in d.next_actions)


# ------------------------------------------------- the replay command: quoting and templates


def _weird_copy_of_nan_models(tmp_path) -> Path:
    """tests/debug/nan_models.py copied into a folder whose name holds a space, both quotes
    and a $, under a file name with a space, and imported from there."""
    weird = tmp_path / "my dir's \"models\" $HOME"
    weird.mkdir()
    file = weird / "nan models.py"
    file.write_text(Path(__file__).with_name("nan_models.py").read_text())
    return file


def _loop_until_nan(model, step_fn, out_dir):
    """A plain loop with the monitor; the target of one sample of step 2 is +Inf."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    y[2 * 4 + 1] = float("inf")
    monitor = NaNCaptureMonitor(model, out_dir=out_dir, step_fn=step_fn)
    for step in range(8):
        monitor.begin_step(step)
        batch = (x[step * 4:(step + 1) * 4], y[step * 4:(step + 1) * 4])
        monitor.collect_batch(batch)
        loss = step_fn(model, batch)
        monitor.collect_loss(loss)
        loss.backward()
        monitor.check_and_capture()
        optimizer.step()
        optimizer.zero_grad()
    raise AssertionError("no NaN was detected")


def test_error_message_command_works_when_pasted_with_spaces_and_quotes_in_paths(tmp_path):
    file = _weird_copy_of_nan_models(tmp_path)
    PlainNet = load_object(f"{file}:PlainNet")
    step_fn = load_object(f"{file}:plain_step_fn")
    out = file.parent / "out 'a' \"b\""
    torch.manual_seed(0)
    with pytest.raises(NaNDetectedError) as info:
        _loop_until_nan(PlainNet(), step_fn, out)
    command = pasted_command(str(info.value))
    assert command == info.value.replay_command
    assert shlex.split(command) == ["stabletrain", "replay", str(out / "rank0"), "--model", f"{file}:PlainNet",
                                    "--step-fn", f"{file}:plain_step_fn"]
    pasted = subprocess.run(command, shell=True, cwd=tmp_path, env=shell_env(), capture_output=True, text=True, timeout=120)
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    assert "reproduced: YES" in pasted.stdout and "losses: bitwise equal" in pasted.stdout


def test_a_model_no_command_can_build_gets_a_python_template_to_fill_in(tmp_path):
    """SizedNet needs a constructor argument: the message shows a Python template, never a
    command that fails when pasted; filled in, it replays."""
    file = _weird_copy_of_nan_models(tmp_path)
    SizedNet = load_object(f"{file}:SizedNet")
    step_fn = load_object(f"{file}:plain_step_fn")
    out = file.parent / "out 'a' \"b\""
    torch.manual_seed(0)
    with pytest.raises(NaNDetectedError) as info:
        _loop_until_nan(SizedNet(16), step_fn, out)
    text = str(info.value)
    assert "Replay it offline:" not in text and "python -c" not in text
    assert "No shell command can rebuild the model (its constructor needs arguments: hidden)" in text
    _, _, rest = text.partition("then run it:\n")
    assert rest, text
    template = "\n".join(line[4:] for line in rest.splitlines() if line.startswith("    "))
    assert template == info.value.replay_command
    lines = template.splitlines()
    assert lines[lines.index("model = ...") - 1].startswith("# FILL IN"), "the placeholder has its own line"

    # Run unfilled, it says what to do (no NameError) ...
    with pytest.raises(NaNCaptureError, match="got ellipsis.*FILL IN"):
        exec(template, {})
    # ... and filled in, it replays (in a fresh process, from another folder).
    script = tmp_path / "replay it.py"
    script.write_text(template.replace("\nmodel = ...\n", "\nmodel = SizedNet(16)\n"))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=shell_env(), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "reproduced: YES" in run.stdout and "losses: bitwise equal" in run.stdout

    class Local(torch.nn.Module):  # not importable at all: the whole model line is to fill in
        def training_step(self, batch):
            return torch.zeros(())

    template = default_replay_command(out, model=Local())
    assert no_replay_command_reason(Local()) == (
        "test_a_model_no_command_can_build_gets_a_python_template_to_fill_in.<locals>.Local is defined inside a function")
    assert template.splitlines()[1:3] == [
        f"# FILL IN: build the model as in training (an instance of {Local.__module__}.{Local.__qualname__}):",
        "model = ...",
    ]
    assert f"load_nan_capture({str(out)!r}, model=model)" in template
