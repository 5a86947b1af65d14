"""nancapture: detection (nan, inf, -inf; fp16 loss scaling), what a capture holds, safe
loading, the cost of one host sync per step, and the standalone monitor in a plain loop."""

from __future__ import annotations

import datetime
import math
from pathlib import Path

import pytest
import torch
from nan_models import PoisonData, PoisonNet, samples_of_step

import stabletrain
from conftest import tiny_lm
from stabletrain import NaNCaptureError, NaNCaptureMonitor, NaNDetectedError, load_nan_capture
from stabletrain.config import load_settings
from stabletrain.debug.nan_capture import FORMAT, UNSHARDED_VERSION, VERSION
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.training.loop import Trainer, train
from stabletrain.utils.rng import get_rng_state
from stabletrain.utils.sync import SyncsPerStep

NANCAPTURE = {"nancapture": {"enabled": True}}
POISON_RUN = dict(
    steps=8, batch_size=8, num_workers=0, log_every_num_steps=1, model_args={"lr": 0.01, "warmup_steps": 0}
)


class Recorder:
    """What the trainer did, from the outside: states at step start, microbatches, optimizer steps."""

    def __init__(self):
        self.start, self.after, self.batches, self.indices, self.rng, self.losses = {}, {}, {}, {}, {}, {}
        self.optimizer_steps = []

    def on_step_start(self, trainer, *, step):
        self.start[step] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        self.batches[step], self.indices[step], self.rng[step], self.losses[step] = [], [], [], []
        self.dataset = trainer.task.dataset

    def on_microbatch(self, trainer, *, step, micro_step, batch, indices):
        self.batches[step].append(torch.utils._pytree.tree_map(lambda t: t.clone(), batch))
        self.indices[step].append(indices.clone())
        self.rng[step].append(get_rng_state())

    def on_after_microbatch(self, trainer, *, step, micro_step, loss):
        self.losses[step].append(loss.detach().clone())
        # After the step's forward passes (on_after_backward would come after nancapture raised).
        self.after[step] = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    def on_before_optimizer_step(self, trainer, *, step):
        self.optimizer_steps.append(step)


# ----------------------------------------------------------------------------- detection


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite_gradient_stops_the_step_before_the_optimizer_and_is_captured(tmp_path, bad):
    step = 3
    victim = samples_of_step(step)[2]
    rec = Recorder()
    model = PoisonNet()
    with pytest.raises(NaNDetectedError) as info:
        train(
            out=tmp_path / "run", model=model, data=PoisonData(grad_poison={victim: bad}), callbacks=[rec],
            debug_args=NANCAPTURE, **POISON_RUN,
        )
    err = info.value
    assert isinstance(err, stabletrain.StabletrainError)
    assert (err.step, err.rank, err.reason) == (step, 0, "nonfinite_gradients")
    assert err.nan_param_names == ["fc2.weight"]
    assert err.capture_path == tmp_path / "run" / "debug" / "nan_capture" / "rank0" / "nan_capture.pt"
    assert err.capture_path.is_file()
    assert "fc2.weight" in str(err) and str(err.capture_path) in str(err)
    rows, events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    events = [e for e in events if e["event"] != "mechanism_signals"]  # the signals' row: docs/mechanisms.md
    assert events == [{"event": "nan_detected", "step": step, "reason": "nonfinite_gradients",
                       "nan_param_names": ["fc2.weight"], "capture": str(err.capture_path)}]
    # Stopped before clipping and the optimizer step: the weights are those the step started from.
    assert rec.optimizer_steps == [0, 1, 2]
    for name, value in model.state_dict().items():
        assert torch.equal(value, rec.start[step][name]), name
    # The replay reproduces the same kind of non-finite value in the same parameter.
    cap = load_nan_capture(err.capture_path, model=PoisonNet())
    res = cap.forward_backward()
    assert res.nonfinite_param_names == ["fc2.weight"]
    grad = res.model.fc2.weight.grad
    if math.isnan(bad):
        assert torch.isnan(grad).all()
    else:
        assert torch.all(grad == bad)
    assert torch.isfinite(res.model.fc1.weight.grad).all()


def test_healthy_run_writes_nothing_and_holds_no_batches(tmp_path):
    seen = []

    class Probe:
        def on_after_optimizer_step(self, trainer, *, step):
            monitor = trainer.callbacks.callbacks[0].monitor
            seen.append((len(monitor._batches), len(monitor._losses)))

    result = train(out=tmp_path / "run", model=PoisonNet(), data=PoisonData(), callbacks=[Probe()], debug_args=NANCAPTURE,
                   gradient_accumulation_steps=2, **POISON_RUN)
    assert result.steps_done == 8
    assert not (tmp_path / "run" / "debug").exists()
    assert seen == [(0, 0)] * 8, "a healthy step's microbatches are released right after the check"


# ----------------------------------------------------------------------- capture content


class BreakGradientAt:
    """Overwrites one gradient element with NaN from outside the model (a 'cosmic ray'),
    after the last microbatch of ``step``: a failure that replay must NOT reproduce."""

    def __init__(self, step, accum):
        self.step, self.accum = step, accum

    def on_after_microbatch(self, trainer, *, step, micro_step, loss):
        if step == self.step and micro_step == self.accum - 1:
            trainer.model.head.bias.grad[1] = float("nan")


def test_capture_holds_the_state_before_the_step_batchnorm_buffers_indices_and_rng(tmp_path):
    rec = Recorder()
    settings = dict(
        model="cnn", model_args={"cnn_width": 4, "warmup_steps": 0, "dropout": 0.3}, transform_args={"image_size": 16},
        batch_size=8, gradient_accumulation_steps=2, steps=6, log_every_num_steps=1,
    )
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "run", callbacks=[rec, BreakGradientAt(2, 2)], debug_args=NANCAPTURE, **settings)
    err = info.value
    assert (err.step, err.nan_param_names) == (2, ["head.bias"])
    state = torch.load(err.capture_path, weights_only=True)
    assert (state["format"], state["version"]) == (FORMAT, UNSHARDED_VERSION)
    assert (state["step"], state["rank"], state["world_size"]) == (2, 0, 1)
    assert (state["precision"], state["loss_scale"], state["gradient_accumulation_steps"]) == ("32-true", None, 2)
    assert state["nan_param_names"] == ["head.bias"] and state["reason"] == "nonfinite_gradients"
    assert state["stabletrain_version"] == stabletrain.__version__ and state["torch_version"] == torch.__version__
    assert datetime.datetime.fromisoformat(state["timestamp"]).tzinfo is not None
    assert state["settings"]["model"] == "cnn" and state["settings"]["model_args"]["cnn_width"] == 4
    assert state["model_meta"]["num_classes"] == 4

    before, after = rec.start[2], rec.after[2]
    for name, value in state["params"].items():
        assert torch.equal(value, before[name]), name
    bn = [n for n in state["buffers"] if ".bn." in n]
    assert len(bn) == 9  # 3 BatchNorms x (running_mean, running_var, num_batches_tracked)
    for name in bn:
        assert torch.equal(state["buffers"][name], before[name]), f"{name} is from before the step"
    assert int(state["buffers"]["features.0.bn.num_batches_tracked"]) == 2 * 2  # 2 steps x 2 microbatches
    assert int(after["features.0.bn.num_batches_tracked"]) == 3 * 2
    assert not torch.equal(before["features.0.bn.running_mean"], after["features.0.bn.running_mean"])

    assert len(state["microbatches"]) == 2
    for m in range(2):
        images, labels = state["microbatches"][m]
        assert torch.equal(images, rec.batches[2][m][0]) and torch.equal(labels, rec.batches[2][m][1])
        assert torch.equal(state["indices"][m], rec.indices[2][m])
        for row, index in enumerate(state["indices"][m].tolist()):
            image, label = rec.dataset[index]
            assert torch.equal(images[row], image) and int(labels[row]) == int(label)
        assert torch.equal(state["rng"][m]["torch"], rec.rng[2][m]["torch"])
        assert state["rng"][m]["python"] == rec.rng[2][m]["python"]
        assert torch.equal(state["rng"][m]["numpy"]["keys"], rec.rng[2][m]["numpy"]["keys"])
        assert torch.equal(state["losses"][m], rec.losses[2][m])

    # The NaN came from outside the model: the replay computes the same losses bitwise
    # (dropout masks from the restored RNG) and finite gradients: not reproduced.
    result = load_nan_capture(err.capture_path.parent).replay()
    assert result.losses_bitwise_equal is True
    assert result.reproduced is False and result.nan_param_names == []
    assert result.captured_nan_param_names == ["head.bias"]
    assert result.sample_indices == [ix.tolist() for ix in rec.indices[2]]
    assert "reproduced: NO" in result.to_text()


# -------------------------------------------------------------------------- safe format


def _capture_file(tmp_path) -> Path:
    victim = samples_of_step(1)[0]
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "run", model=PoisonNet(), data=PoisonData(grad_poison={victim: float("nan")}),
              debug_args=NANCAPTURE, **POISON_RUN)
    return info.value.capture_path


def test_capture_loads_safely_and_bad_files_fail_clearly(tmp_path):
    path = _capture_file(tmp_path)
    torch.load(path, weights_only=True)  # only tensors, numbers, strings, lists, dicts

    marker = tmp_path / "code_ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    evil = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "version": 1, "x": Evil()}, evil)
    with pytest.raises(NaNCaptureError, match="refused to load .*run code") as info:
        load_nan_capture(evil)
    assert info.value.path == evil
    assert not marker.exists(), "the pickled object's code did not run"

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(NaNCaptureError, match="truncated or corrupt"):
        load_nan_capture(truncated)

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a zip at all" * 100)
    with pytest.raises(NaNCaptureError, match="truncated or corrupt"):
        load_nan_capture(garbage)

    state = torch.load(path, weights_only=True)
    newer = tmp_path / "newer.pt"
    torch.save({**state, "version": VERSION + 1}, newer)
    with pytest.raises(NaNCaptureError, match=f"newer stabletrain .*version {VERSION + 1}.*upgrade"):
        load_nan_capture(newer)

    for i, other in enumerate(({"format": "stabletrain.runfiles.checkpoint", "version": 1}, {"weights": torch.ones(2)}, [1, 2])):
        torch.save(other, tmp_path / f"other{i}.pt")
        with pytest.raises(NaNCaptureError, match="not a stabletrain NaN capture"):
            load_nan_capture(tmp_path / f"other{i}.pt")

    damaged = tmp_path / "damaged.pt"
    torch.save({**state, "rng": state["rng"][:0]}, damaged)
    with pytest.raises(NaNCaptureError, match="damaged NaN capture.*1 microbatches, 0 RNG states"):
        load_nan_capture(damaged)

    with pytest.raises(NaNCaptureError, match="no such file or folder"):
        load_nan_capture(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NaNCaptureError, match="no NaN capture in"):
        load_nan_capture(tmp_path / "empty")
    # The run folder, the rank folder and the file all find the capture.
    for where in (tmp_path / "run", path.parent, path):
        assert load_nan_capture(where, model=PoisonNet()).step == 1


# --------------------------------------------------------------------------------- cost




@pytest.mark.parametrize("accum", [1, 4])
def test_one_added_host_sync_per_optimizer_step(tmp_path, accum):
    def counts(name, **extra):
        counter = SyncsPerStep()
        train(out=tmp_path / name, callbacks=[counter],
              **tiny_lm(steps=5, log_every_num_steps=4, gradient_accumulation_steps=accum, **extra))
        return counter.counts

    off, on = counts("off"), counts("on", debug_args=NANCAPTURE)
    quiet = [1, 2, 3]  # not logged (0 and 4 are)
    assert all(on[s] == off[s] + 1 for s in quiet), (on, off)


# ------------------------------------------------------------------ fp16 loss scaling


def _fp16_trainer(tmp_path, init_scale, **settings):
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    base = dict(out=tmp_path / "run", model=PoisonNet(), **{**POISON_RUN, "steps": 10})
    return Trainer(load_settings({**base, **settings}), fabric=fabric)


def test_fp16_skipped_steps_do_not_abort(tmp_path):
    # At scale 2**16 the scaled fp16 gradients overflow: the scaler skips 3 steps, halving its scale.
    _fp16_trainer(tmp_path, 2.0**16, data=PoisonData(), debug_args=NANCAPTURE).fit()
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(10))
    assert not all(math.isfinite(r["gradient_norm"]) for r in rows[:2]), "the first steps were skipped"
    assert rows[-1]["loss_scale"] < 2.0**16 and math.isfinite(rows[-1]["gradient_norm"])
    assert not (tmp_path / "run" / "debug").exists()


def test_fp16_too_many_skipped_steps_in_a_row_are_captured_and_replay(tmp_path):
    with pytest.raises(NaNDetectedError) as info:
        _fp16_trainer(tmp_path, 2.0**16, data=PoisonData(),
                      debug_args={"nancapture": {"enabled": True, "max_skipped_steps": 2}}).fit()
    err = info.value
    assert (err.step, err.reason) == (1, "skipped_steps")
    assert "skipped 2 steps in a row" in str(err)
    cap = load_nan_capture(err.capture_path)  # a custom model: needs model=
    assert cap.precision == "16-mixed" and cap.loss_scale == 2.0**15
    with pytest.raises(NaNCaptureError, match="pass it"):
        cap.replay()
    result = load_nan_capture(err.capture_path, model=PoisonNet()).replay()  # fp16 on the CPU, scale 2**15
    assert result.precision == "16-mixed" and result.reproduced and result.losses_bitwise_equal
    assert not load_nan_capture(err.capture_path, model=PoisonNet()).replay(precision="32-true").reproduced


def test_fp16_nonfinite_loss_is_captured_at_once(tmp_path):
    victim = samples_of_step(2)[5]
    with pytest.raises(NaNDetectedError) as info:
        _fp16_trainer(tmp_path, 2.0**8, data=PoisonData(input_poison={victim: float("nan")}), debug_args=NANCAPTURE).fit()
    assert (info.value.step, info.value.reason) == (2, "nonfinite_loss")
    assert "Microbatch losses: nan" in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU tests above use GradScaler('cpu'))")
def test_fp16_on_a_gpu_skipped_steps_pass_and_a_nan_loss_is_captured(tmp_path):
    victim = samples_of_step(6)[1]
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "run", model=PoisonNet(), data=PoisonData(input_poison={victim: float("nan")}),
              accelerator="cuda", devices=1, precision="16-mixed", debug_args=NANCAPTURE, **POISON_RUN)
    assert (info.value.step, info.value.reason) == (6, "nonfinite_loss")
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    assert min(r["loss_scale"] for r in rows) < 2.0**16, "the scaler skipped steps and training went on"
    result = load_nan_capture(info.value.capture_path, model=PoisonNet()).replay()
    assert result.device.startswith("cuda") and result.precision == "16-mixed" and result.reproduced


def _fp16_plain_loop(model, data, optimizer, scaler, out_dir, steps):
    """A plain fp16 loop (autocast, GradScaler, batches of 8 in order) under NaNCaptureMonitor
    that must end in NaNDetectedError; returns pytest's ExceptionInfo and the loss scale
    after each completed step."""
    scales = []
    with NaNCaptureMonitor(model, out_dir=out_dir, scaler=scaler) as monitor:
        with pytest.raises(NaNDetectedError) as info:
            for step in range(steps):
                batch = torch.utils.data.default_collate([data[i] for i in range(step * 8, step * 8 + 8)])
                monitor.begin_step(step)
                monitor.collect_batch(batch)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model.training_step(batch)
                monitor.collect_loss(loss)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                monitor.check_and_capture()
                scaler.step(optimizer)
                scaler.update()
                scales.append(scaler.get_scale())
                optimizer.zero_grad()
    return info, scales


def test_standalone_monitor_with_a_cpu_grad_scaler(tmp_path):
    """A plain fp16 loop: skipped steps pass, a NaN loss raises at once."""
    torch.manual_seed(0)
    model, data = PoisonNet(), PoisonData(input_poison={50: float("nan")})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    info, scales = _fp16_plain_loop(model, data, optimizer, scaler, tmp_path / "caps", steps=8)
    assert scales[:3] == [2.0**15, 2.0**14, 2.0**14], "two skipped steps did not stop the loop"
    assert (info.value.step, info.value.reason) == (6, "nonfinite_loss")  # sample 50 is in step 6
    cap = load_nan_capture(info.value.capture_path, model=PoisonNet())
    assert (cap.precision, cap.loss_scale) == ("16-mixed", scales[5])
    result = cap.replay()
    assert result.reproduced and result.losses_bitwise_equal



# ----------------------------------------------------------------- a plain PyTorch loop


def _plain_loop(out_dir, poison_step, accum=2, copy_batches=False, mutate=False):
    """A hand-written loop over PlainNet with NaNCaptureMonitor; the target of one sample of
    ``poison_step`` is +Inf, so that step's loss and gradients are non-finite."""
    from nan_models import PlainNet, plain_step_fn

    torch.manual_seed(0)
    model = PlainNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    poisoned = poison_step * accum * 4 + 5  # second microbatch of the step, row 1
    y[poisoned] = float("inf")
    monitor = NaNCaptureMonitor(model, out_dir=out_dir, step_fn=plain_step_fn, copy_batches=copy_batches)
    for step in range(8):
        monitor.begin_step(step)
        for micro in range(accum):
            rows = slice((step * accum + micro) * 4, (step * accum + micro + 1) * 4)
            batch = (x[rows].clone(), y[rows].clone())
            monitor.collect_batch(batch, indices=list(range(64))[rows])
            loss = plain_step_fn(model, batch)
            monitor.collect_loss(loss)
            (loss / accum).backward()
            if mutate:
                batch[0].zero_()  # e.g. a prefetcher reusing its buffers in place
        monitor.check_and_capture()
        optimizer.step()
        optimizer.zero_grad()
    raise AssertionError("no NaN was detected")


def test_standalone_monitor_in_a_plain_loop_replays_with_model_and_step_fn(tmp_path):
    from nan_models import PlainNet, plain_step_fn

    with pytest.raises(NaNDetectedError) as info:
        _plain_loop(tmp_path / "caps", poison_step=3)
    err = info.value
    assert (err.step, err.rank, err.reason) == (3, 0, "nonfinite_loss")
    assert err.capture_path == tmp_path / "caps" / "rank0" / "nan_capture.pt"
    assert set(err.nan_param_names) == {"body.0.weight", "body.0.bias", "body.3.weight", "body.3.bias"}

    cap = load_nan_capture(err.capture_path.parent, model=PlainNet(), step_fn=plain_step_fn)
    result = cap.replay()
    assert result.reproduced and result.losses_bitwise_equal
    assert result.nan_param_names == err.nan_param_names
    assert math.isfinite(result.losses[0]) and result.losses[1] == math.inf
    assert result.sample_indices == [list(range(24, 28)), list(range(28, 32))]
    with pytest.raises(NaNCaptureError, match="has no training_step.*step_fn"):
        load_nan_capture(err.capture_path, model=PlainNet()).replay()

    # The error's command names the model class and the step function by file (run as pasted
    # in test_readme_plain_loop_example_runs_and_replays).
    assert err.replay_command.startswith(f"stabletrain replay {err.capture_path.parent} --model ")
    assert "nan_models.py:PlainNet --step-fn " in err.replay_command and "nan_models.py:plain_step_fn" in err.replay_command


def test_copy_batches_protects_against_a_loop_that_mutates_batches(tmp_path):
    from nan_models import PlainNet, plain_step_fn

    for copy_batches, bitwise in ((False, False), (True, True)):
        with pytest.raises(NaNDetectedError) as info:
            _plain_loop(tmp_path / str(copy_batches), poison_step=2, copy_batches=copy_batches, mutate=True)
        result = load_nan_capture(info.value.capture_path, model=PlainNet(), step_fn=plain_step_fn).replay()
        assert result.losses_bitwise_equal is bitwise, copy_batches



# ------------------------------------------------------------ with gradient clipping on


def test_with_gradient_clipping_the_check_sees_the_gradients_before_clipping(tmp_path):
    """gradient_clip_val > 0: the NaN is still caught, the gradients the check saw are the
    unclipped ones, and the weights are those the step started from."""
    from nan_models import L1Net

    clip, step = 1e-3, 3
    victim = samples_of_step(step)[2]
    rec, model = Recorder(), PoisonNet()
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "run", model=model, data=PoisonData(grad_poison={victim: float("nan")}), callbacks=[rec],
              gradient_clip_val=clip, debug_args=NANCAPTURE, **POISON_RUN)
    err = info.value
    assert (err.step, err.reason, err.nan_param_names) == (step, "nonfinite_gradients", ["fc2.weight"])
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["gradient_norm"] > clip for r in rows), "clipping was on"
    assert rec.optimizer_steps == [0, 1, 2]
    for name, value in model.state_dict().items():
        assert torch.equal(value, rec.start[step][name]), name
    assert torch.load(err.capture_path, weights_only=True)["settings"]["gradient_clip_val"] == clip
    # The gradients left in the model are bitwise those the replay computes (no clipping in either).
    replayed = load_nan_capture(err.capture_path, model=PoisonNet()).forward_backward().model
    for name in ("fc1.weight", "fc1.bias", "fc2.bias"):
        seen, fresh = model.get_parameter(name).grad, replayed.get_parameter(name).grad
        assert torch.equal(seen, fresh), f"{name}: the pre-clipping gradient"
    assert float(model.fc1.weight.grad.norm()) > clip, "clipping would have scaled it"
    assert torch.isnan(model.fc2.weight.grad).all()

    # Finite gradients whose norm overflows: clipping would zero them (it divides by an
    # infinite norm), so only a check before clipping sees them.
    model = L1Net()
    victim = samples_of_step(2, batch_size=4)[0]
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "l1", model=model, data=PoisonData(input_poison={victim: 1e20}), steps=6, batch_size=4,
              num_workers=0, gradient_clip_val=1.0, model_args={"lr": 0.01, "warmup_steps": 0}, debug_args=NANCAPTURE)
    assert (info.value.step, info.value.reason) == (2, "gradient_norm_overflow")
    assert float(model.fc.weight.grad.abs().max()) == pytest.approx(2.5e19, rel=1e-6), "not clipped to 0"


# ------------------------------------------------- fp16: default limit, finite overflow


def test_fp16_default_max_skipped_steps_captures_the_10th_skipped_step_in_a_row(tmp_path):
    """At loss scale 2**40 every step's fp16 gradients overflow: 9 skipped steps in a row go
    on, the 10th (the default max_skipped_steps) is captured."""
    assert load_settings({"out": str(tmp_path)}).debug_args.nancapture.max_skipped_steps == 10
    with pytest.raises(NaNDetectedError) as info:
        _fp16_trainer(tmp_path, 2.0**40, data=PoisonData(), steps=14, debug_args=NANCAPTURE).fit()
    err = info.value
    assert (err.step, err.reason) == (9, "skipped_steps")
    assert "skipped 10 steps in a row (max_skipped_steps=10)" in str(err)
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(9)), "the 9th skipped step in a row did not stop training"
    assert not any(math.isfinite(r["gradient_norm"]) for r in rows), "each of them was skipped"
    state = torch.load(err.capture_path, weights_only=True)
    assert state["consecutive_skipped_steps"] == 10 and state["loss_scale"] == 2.0 ** (40 - 9)


def test_fp16_finite_gradients_whose_norm_overflows_are_captured_at_once(tmp_path):
    """Under loss scaling a non-finite norm is not always a skipped step: finite gradients of
    1.25e20 pass the GradScaler's own check (it would apply them), so they are captured at
    once as gradient_norm_overflow, not counted as a skipped step. (A plain loop: Fabric
    converts inputs to float16, where 1e21 cannot be fed.)"""
    from nan_models import SpikeNet

    torch.manual_seed(0)
    model, data = SpikeNet(), PoisonData(spikes={16: 1e21})  # sample 16 is in step 2
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    info, _ = _fp16_plain_loop(model, data, optimizer, scaler, tmp_path / "caps", steps=6)
    err = info.value
    assert (err.step, err.reason, err.nan_param_names) == (2, "gradient_norm_overflow", [])
    assert "Largest |gradient|: s 1.25e+20" in str(err)
    assert scaler.get_scale() == 2.0**8, "no step was skipped before"
    assert float(model.s.detach()) > 0, "the huge update never happened"
    # In float32 (a 16-mixed replay converts inputs to float16 as Fabric does, which this loop did not).
    result = load_nan_capture(err.capture_path, model=SpikeNet()).replay(precision="32-true")
    assert result.reproduced and result.gradient_norm_overflow and result.nan_param_names == []
