"""Real DDP on the CPU: two processes over gloo."""

from __future__ import annotations

import json

import pytest
import torch

from stabletrain.loggers.jsonl import read_metrics

pytestmark = pytest.mark.slow


def test_ddp_two_ranks_train_and_only_rank0_writes(cli, tmp_path):
    result = cli(
        "train", "out=run", "devices=2", "strategy=ddp", "accelerator=cpu", "steps=6",
        "batch_size=8", "log_every_num_steps=2", "checkpoint_every_num_steps=3",
        "model_args.n_layers=1", "model_args.dim=32", "model_args.n_heads=2", "model_args.context_length=16",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "run"
    rows, _ = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 2, 4, 5], "one row per logged step: only rank 0 writes"
    progress = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(progress) == 4, "only rank 0 prints"
    settings = json.loads((out / "settings.json").read_text())
    assert settings["world_size"] == 2
    assert "microbatch 4 x 1 accumulation x 2 devices" in (out / "train.log").read_text()
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert len(state["rng"]) == 2 and state["step"] == 6
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "step_000003.ckpt"]


def test_ddp_image_task_logs_the_accuracy_over_both_ranks(cli, tmp_path):
    # 2 ranks x 4 samples per step, logged every 2 steps: 16 samples per window after step 0 (8 in it),
    # so the accuracy over both ranks is a multiple of 1/16 (1/8 at step 0).
    result = cli(
        "train", "out=run", "devices=2", "strategy=ddp", "accelerator=cpu", "steps=5", "model=cnn",
        "batch_size=8", "log_every_num_steps=2", "model_args.cnn_width=4", "model_args.warmup_steps=0",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    accuracy = {r["step"]: r["accuracy"] for r in rows}
    assert sorted(accuracy) == [0, 2, 4]
    for step, value in accuracy.items():
        window = 8 if step == 0 else 16
        assert 0 <= value <= 1 and abs(value * window - round(value * window)) < 1e-5, (step, value)
