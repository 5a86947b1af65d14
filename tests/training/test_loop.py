"""The training loop: outputs, events, custom models, out/ handling."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import LinearData, tiny_lm
from stabletrain.errors import ConfigError, StabletrainError
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.training.loop import train


def test_outputs_metrics_log_settings_and_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    result = train(out=out, **tiny_lm(steps=7, log_every_num_steps=3, checkpoint_every_num_steps=2, max_checkpoints_to_keep=2))
    assert result.steps_done == 7

    rows, events = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 3, 6]  # every 3 steps and the last one
    for r in rows:
        for key in ("loss", "gradient_norm", "lr", "elapsed_s", "steps_per_s", "eta_s", "epoch", "samples"):
            assert isinstance(r[key], float | int), key
        assert r["gradient_norm"] > 0 and r["loss"] > 0
    assert rows[-1]["samples"] == 7 * 8

    console = capsys.readouterr().out
    progress = [line for line in console.splitlines() if line.startswith("step")]
    assert len(progress) == 3
    assert progress[0].startswith("step 0/7 | loss ") and "| grad_norm " in progress[0]
    assert "| lr " in progress[0] and "steps/s | ETA 0:00:" in progress[0]

    log = (out / "train.log").read_text()
    for line in progress:
        assert line in log, "train.log holds what the console showed"
    assert '"gradient_clip_val": 0.0' in log, "train.log holds the resolved settings"

    settings = json.loads((out / "settings.json").read_text())
    assert settings["precision"] == "32-true"  # auto on a CPU
    assert settings["task"] == "language_model" and settings["model_meta"]["vocab_size"] == 256
    assert settings["model_args"]["dim"] == 32

    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["last.ckpt", "step_000004.ckpt", "step_000006.ckpt"]  # step_000002 pruned (keep 2)
    last = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["step"] == 7 and last["data"]["microbatches_consumed"] == 7
    for key in ("model", "optimizer", "rng", "settings", "torch_version"):
        assert key in last


class _Regression(nn.Module):
    """A user's own model: nothing stabletrain-specific but training_step."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch):
        return nn.functional.mse_loss(self(batch["x"]), batch["y"])




def test_custom_model_trains_and_loss_falls(tmp_path):
    model = _Regression()
    result = train(
        out=tmp_path / "run",
        model=model,
        data=LinearData(),
        steps=60,
        batch_size=16,
        log_every_num_steps=1,
        model_args={"lr": 0.02, "warmup_steps": 0},
    )
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["loss"] < 0.1 * rows[0]["loss"]
    assert result.last_metrics["gradient_norm"] == rows[-1]["gradient_norm"]
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert settings["task"] == "custom" and settings["model"].endswith("_Regression>")


def test_custom_model_mistakes(tmp_path):
    with pytest.raises(ConfigError, match="has no training_step"):
        train(out=tmp_path / "a", model=nn.Linear(2, 2), data=LinearData())
    with pytest.raises(ConfigError, match="needs a map-style torch Dataset"):
        train(out=tmp_path / "b", model=_Regression())
    with pytest.raises(ConfigError, match="the dataset is empty"):
        train(out=tmp_path / "c", model=_Regression(), data=LinearData(0))

    class Vector(_Regression):
        def training_step(self, batch):
            return (self(batch["x"]) - batch["y"]) ** 2  # forgot the mean

    with pytest.raises(StabletrainError, match=r"scalar loss tensor, got Tensor of shape \(16, 1\)"):
        train(out=tmp_path / "d", model=Vector(), data=LinearData(), batch_size=16, steps=1)


def test_events_fire_in_order_with_accumulation(tmp_path):
    calls = []

    class Recorder:
        def __getattr__(self, name):
            if not name.startswith("on_"):
                raise AttributeError(name)
            return lambda trainer, **kw: calls.append((name, kw.get("step"), kw.get("micro_step")))

    train(out=tmp_path / "run", callbacks=[Recorder()], **tiny_lm(steps=2, gradient_accumulation_steps=2))
    names = [c[0] for c in calls]
    step0 = [c for c in calls if c[1] == 0]
    assert [c[0] for c in step0] == [
        "on_step_start",
        "on_microbatch", "on_before_backward", "on_after_microbatch",
        "on_microbatch", "on_before_backward", "on_after_microbatch",
        "on_after_backward", "on_before_optimizer_step", "on_after_optimizer_step",
        "on_log_values", "on_log",  # step 0 is logged: values to add to the one read, then the row
    ]
    assert [c[2] for c in step0 if c[0] == "on_microbatch"] == [0, 1]
    assert names[0] == "on_train_start" and names[-1] == "on_train_end"
    assert "on_checkpoint_save" in names


def test_microbatches_carry_dataset_indices(tmp_path):
    seen = []

    class Indices:
        def on_microbatch(self, trainer, *, step, micro_step, batch, indices):
            seen.append(indices.tolist())
            expected = torch.stack([trainer.task.dataset[i]["input_ids"] for i in indices.tolist()])
            assert torch.equal(batch["input_ids"], expected)

    train(out=tmp_path / "run", callbacks=[Indices()], **tiny_lm(steps=3, gradient_accumulation_steps=2))
    assert len(seen) == 6 and all(len(b) == 4 for b in seen)
    flat = [i for b in seen for i in b]
    assert len(set(flat)) == len(flat), "no sample repeats within an epoch"


def test_non_empty_out_refuses_unless_overwrite_or_resume(tmp_path):
    out = tmp_path / "run"
    train(out=out, **tiny_lm(steps=2))
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty; pass overwrite=true"):
        train(out=out, **tiny_lm(steps=2))
    train(out=out, overwrite=True, **tiny_lm(steps=3))
    rows, _ = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2], "overwrite starts a fresh metrics.jsonl"
    assert (out / "notes.txt").read_text() == "mine", "overwrite removes only stabletrain's outputs"
    with pytest.raises(ConfigError, match="resume_interrupted: no checkpoint"):
        train(out=tmp_path / "fresh", resume_interrupted=True, **tiny_lm())


def test_request_stop_finishes_the_step_and_checkpoints(tmp_path):
    class StopAt2:
        def on_after_optimizer_step(self, trainer, *, step):
            if step == 2:
                trainer.request_stop("enough")

    result = train(out=tmp_path / "run", callbacks=[StopAt2()], **tiny_lm(steps=10, log_every_num_steps=5))
    assert result.steps_done == 3 and result.stop_reason == "enough"
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["step"] == 2, "the last step is logged"
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["step"] == 3


def test_lr_schedule_warmup_then_cosine(tmp_path):
    train(
        out=tmp_path / "run",
        **tiny_lm(steps=12, model_args={"lr": 0.01, "warmup_steps": 4, "min_lr_ratio": 0.1}),
    )
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")[0]]
    assert lrs[:4] == pytest.approx([0.0025, 0.005, 0.0075, 0.01])
    assert lrs[4] == pytest.approx(0.01)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[-1] == pytest.approx(0.001 + 0.009 * 0.5 * (1 + __import__("math").cos(__import__("math").pi * 7 / 8)))


#: Graphs handed to the "stabletrain_test_counting" torch.compile backend (registered below).
_COMPILED_GRAPHS: list = []


def _counting_backend(gm, example_inputs):
    # Runs the captured graph as is (fast on the CPU), after recording that it was compiled.
    _COMPILED_GRAPHS.append(gm)
    return gm.forward


def test_torch_compile_compiles_the_training_step(tmp_path):
    import torch._dynamo

    if "stabletrain_test_counting" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(name="stabletrain_test_counting")(_counting_backend)
    torch._dynamo.reset()  # no cached graphs from other tests' compiles
    _COMPILED_GRAPHS.clear()
    # Probes off: with them, a logged step's forward runs eagerly, and tiny_lm logs every step.
    result = train(
        out=tmp_path / "run",
        torch_compile_args={"disable": False, "backend": "stabletrain_test_counting"},
        **tiny_lm(steps=3, debug_args={"mechanisms": {"probes": False}}),
    )
    assert result.steps_done == 3
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert settings["torch_compile_args"]["disable"] is False
    assert _COMPILED_GRAPHS, "torch.compile never handed a graph to the backend"
    # The whole training_step was captured: the model's layers and the loss.
    targets = {n.target for gm in _COMPILED_GRAPHS for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.nn.functional.cross_entropy in targets and torch.nn.functional.layer_norm in targets
    # The compiled step computes what the eager one does.
    train(out=tmp_path / "eager", **tiny_lm(steps=3))
    compiled = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")[0]]
    eager = [r["loss"] for r in read_metrics(tmp_path / "eager" / "metrics.jsonl")[0]]
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_callbacks_receive_what_trainer_like_promises(tmp_path):
    """The Protocol callbacks are typed with matches the trainer they are given."""
    import typing
    from pathlib import Path

    from stabletrain.events import Callback, TrainerLike

    seen = {}

    class Probe:
        def on_train_start(self, trainer):
            seen["is_trainer_like"] = isinstance(trainer, TrainerLike)
            seen["facts"] = (isinstance(trainer.out, Path), trainer.task.name, trainer.rank, trainer.world_size,
                             trainer.precision, trainer.scaler, isinstance(trainer.optimizer, torch.optim.Optimizer))
            seen["max"] = trainer.max_over_ranks(torch.tensor(3.0))
            seen["any"] = (trainer.any_rank(torch.tensor(False)), trainer.any_rank(True))
            seen["resolved"] = trainer.resolved_settings()["task"]

    train(out=tmp_path / "run", callbacks=[Probe()], **tiny_lm(steps=1))
    assert seen["is_trainer_like"]
    assert seen["facts"] == (True, "language_model", 0, 1, "32-true", None, True)
    assert seen["max"] == 3.0 and seen["any"] == (False, True) and seen["resolved"] == "language_model"
    assert not isinstance(object(), TrainerLike), "a negative control: the check can fail"
    assert typing.get_type_hints(Callback.on_step_start)["trainer"] is TrainerLike
