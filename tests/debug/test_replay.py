"""Replay of NaN captures: bitwise on the CPU, precision as captured, the lower-level
forward_backward, the command line as pasted from the error, resume from the healthy
checkpoint, and two DDP ranks of which only one has poisoned data."""

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
from torch.utils._python_dispatch import TorchDispatchMode

import stabletrain.debug.replay as replay_module
from stabletrain import NaNDetectedError, load_nan_capture
from stabletrain.checkpoint import load_checkpoint
from stabletrain.debug.replay import forward_backward
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.trainer import train

from conftest import cli_env, tiny_lm
from nan_models import PoisonData, PoisonNet, samples_of_step

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
    monkeypatch.setattr(replay_module, "set_rng_state", lambda state: None)
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


def test_error_message_command_works_when_pasted(cli, tmp_path, capsys):
    args = ["train", "out=boom", "steps=10", "batch_size=8", "checkpoint_every_num_steps=3",
            "model_args.n_layers=1", "model_args.n_heads=2", "model_args.dim=32", "model_args.context_length=16",
            "model_args.optimizer=sgd", "model_args.lr=1000", "model_args.warmup_steps=0",
            "debug_args.nancapture.enabled=true"]
    trained = cli(*args)
    assert trained.returncode == 1
    assert "stabletrain train: NaNDetectedError: " in trained.stderr
    command = pasted_command(trained.stderr)
    assert command == "stabletrain replay boom/debug/nan_capture/rank0"
    assert "boom/checkpoints/last.ckpt holds the healthy state from before step 3" in trained.stderr

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
    assert [(e["event"], e["step"]) for e in events] == [("nan_detected", 5), ("resume", 4)]
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
    assert command.startswith("stabletrain replay run/debug/nan_capture --model ") and command.endswith("nan_models.py:PoisonNet")
    pasted = subprocess.run(command, shell=True, cwd=tmp_path, env=shell_env(), capture_output=True, text=True, timeout=120)
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    assert "reproduced: YES" in pasted.stdout
    assert "rank 0's microbatches alone: finite" in pasted.stdout
    assert "rank 1's microbatches alone: non-finite" in pasted.stdout

    data = replay_json(command, tmp_path, capsys)
    assert data["ranks"] == [0, 1] and data["reproduced"] is True
    assert data["ranks_reproducing_alone"] == [1]
    assert data["losses_bitwise_equal"] is True
