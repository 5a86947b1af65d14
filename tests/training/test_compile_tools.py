"""The debugging and protecting tools on a compiled training step (``torch_compile_args.disable=false``), with
and without FSDP2 (one process: the trainer's FSDP2 code path at world size 1). Each run trains compiled,
meets a fault planted at a known step and sample, and the tool reports it as it does in eager mode.

The backend is ``aot_eager``: AOTAutograd's forward and backward graphs (what inductor compiles), run by
PyTorch's eager kernels, so the numbers are an eager run's and each test compiles in seconds on the CPU.
``benchmarks/compile_tools.py`` times inductor with each tool on."""

from __future__ import annotations

import math

import pytest
import torch
from nan_models import PoisonData, PoisonNet, samples_of_step

import stabletrain
from stabletrain import NaNDetectedError, NonFiniteStepError, load_nan_capture
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.runfiles.checkpoint import list_checkpoints, load_checkpoint
from stabletrain.safety.net import NonFiniteCheckpointError

N, NAN_STEP, SPIKE_STEP, STEPS = 128, 6, 10, 12
#: Graphs handed to the "stabletrain_test_aot" backend: proof that the step was compiled.
GRAPHS: list = []


def _aot_counting(gm, example_inputs):
    GRAPHS.append(gm)
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend("aot_eager")(gm, example_inputs)


torch._dynamo.register_backend(_aot_counting, name="stabletrain_test_aot")
COMPILED = {"disable": False, "backend": "stabletrain_test_aot"}


@pytest.fixture(scope="module", autouse=True)
def _process_group(fsdp_in_process):
    yield


@pytest.fixture(autouse=True)
def _fresh_graphs():
    torch._dynamo.reset()
    GRAPHS.clear()
    yield


def _nan_sample() -> int:
    return samples_of_step(NAN_STEP, n=N)[-1]


def _data(nan: bool = True, spike: bool = False) -> PoisonData:
    data = PoisonData(n=N, input_poison={_nan_sample(): float("nan")} if nan else {})
    if spike:
        data.y[samples_of_step(SPIKE_STEP, n=N)[-1]] = 1e4
    return data


def _model() -> PoisonNet:
    """PoisonNet with the same weights in every run, and no dropout: a compiled graph draws its dropout masks
    otherwise than eager kernels do, and the runs are compared value for value."""
    torch.manual_seed(0)
    model = PoisonNet()
    model.drop.p = 0.0
    return model


def _settings(out, fsdp: bool, compiled: bool = True, data=None, **more):
    s = dict(out=out, model=_model(), data=data if data is not None else _data(), steps=STEPS, batch_size=8,
             num_workers=0, log_every_num_steps=1, checkpoint_every_num_steps=4,
             model_args={"lr": 0.01, "warmup_steps": 0}, trend_alerts={"enabled": False},
             torch_compile_args=COMPILED if compiled else {"disable": True},
             # Every step logged, every step compiled: the probes (which run a logged step eagerly) are off.
             debug_args={"mechanisms": {"probes": False}})
    if fsdp:
        s.update(strategy="fsdp", accelerator="cpu", devices=1)
    return {**s, **more}


FSDP = pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])


@FSDP
def test_the_guard_stops_a_compiled_step_and_its_gradient_norms_are_the_eager_ones(tmp_path, fsdp):
    with pytest.raises(NonFiniteStepError) as info:
        stabletrain.train(**_settings(tmp_path / "compiled", fsdp))
    assert GRAPHS, "the training step was compiled"
    err = info.value
    assert (err.step, err.origin) == (NAN_STEP, "forward_backward")
    assert str(err).startswith(f"Non-finite loss and gradient norm at step {NAN_STEP}")
    assert [c.step for c in list_checkpoints(tmp_path / "compiled" / "checkpoints")] == [4]
    assert all(torch.isfinite(t).all() for t in load_checkpoint(tmp_path / "compiled" / "checkpoints" /
                                                                 "last.ckpt")["model"].values())
    with pytest.raises(NonFiniteStepError):
        stabletrain.train(**_settings(tmp_path / "eager", fsdp, compiled=False))
    compiled = read_metrics(tmp_path / "compiled" / "metrics.jsonl")[0]
    eager = read_metrics(tmp_path / "eager" / "metrics.jsonl")[0]
    assert [r["step"] for r in compiled][:NAN_STEP] == list(range(NAN_STEP))
    for a, b in zip(compiled[:NAN_STEP], eager[:NAN_STEP]):
        assert a["gradient_norm"] == pytest.approx(b["gradient_norm"], rel=1e-6)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


@FSDP
def test_nancapture_captures_a_compiled_step_and_replay_and_diagnose_find_the_sample(tmp_path, fsdp):
    out = tmp_path / "run"
    with pytest.raises(NaNDetectedError) as info:
        stabletrain.train(**_settings(out, fsdp, debug_args={"nancapture": {"enabled": True},
                                                             "mechanisms": {"probes": False}}))
    assert GRAPHS and info.value.step == NAN_STEP
    cap = load_nan_capture(info.value.capture_path, model=PoisonNet())
    assert cap.ranks[0].indices[0].tolist() == samples_of_step(NAN_STEP, n=N)
    assert cap.replay().reproduced, "replayed eagerly from the compiled run's capture"
    d = stabletrain.diagnose(info.value.capture_path, model=PoisonNet(), write=False)
    assert "bad data" in d.verdict, d.verdict
    assert [e["index"] for e in d.data.nonfinite_inputs] == [_nan_sample()]


@FSDP
def test_a_trend_alert_reports_the_compiled_step_that_went_nonfinite(tmp_path, fsdp):
    out = tmp_path / "run"
    with pytest.raises(NonFiniteCheckpointError):  # guard off: the NaN reaches the end; its checkpoint is refused
        stabletrain.train(**_settings(out, fsdp, guard={"enabled": False}, trend_alerts={"enabled": True}))
    assert GRAPHS
    rows, events = read_metrics(out / "metrics.jsonl")
    alerts = [(e["signal"], e["kind"], e["step"]) for e in events if e["event"] == "trend_alert"]
    assert alerts[0] == ("loss", "nonfinite", NAN_STEP), alerts
    assert math.isnan({r["step"]: r for r in rows}[NAN_STEP]["loss"])


@FSDP
def test_skip_step_recovers_the_planted_compiled_steps_exactly(tmp_path, fsdp):
    out = tmp_path / "run"
    result = stabletrain.train(**_settings(out, fsdp, data=_data(spike=True),
                                           on_instability={"policy": "skip_step", "warmup": 4}))
    assert GRAPHS and result.steps_done == STEPS
    events = read_metrics(out / "metrics.jsonl")[1]
    rows = [e for e in events if e["event"] == "recovery"]
    assert [(r["step"], r["trigger"]) for r in rows] == [(NAN_STEP, "nonfinite_loss"), (SPIKE_STEP, "loss_spike")]
    assert rows[0]["skipped_samples"] == samples_of_step(NAN_STEP, n=N)


def test_the_mechanism_signals_of_a_compiled_fsdp_language_model(tmp_path):
    from conftest import tiny_lm

    out = tmp_path / "lm"
    stabletrain.train(out=out, strategy="fsdp", accelerator="cpu", devices=1, torch_compile_args=COMPILED,
                      **tiny_lm(steps=3, log_every_num_steps=2))
    assert GRAPHS
    rows = read_metrics(out / "metrics.jsonl")[0]
    assert [r["step"] for r in rows] == [0, 2]
    for row in rows:
        assert row["signals/attn_logit_max"] > 0 and row["signals/output_logsumexp"] > 0
        assert row["signals/weight_rms/decay"] > 0 and row["signals/update_rms_max"] > 0
