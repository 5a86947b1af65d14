"""fp16 loss scaling under FSDP2 (``precision=16-mixed strategy=fsdp``) in one process: Fabric's
``MixedPrecision`` plugin with ``torch.amp.GradScaler("cpu")`` (ModelParallelStrategy refuses the precision
string). The scaler's rules hold sharded as unsharded: the same steps skipped with the same scales, the guard
and nancapture treating skipped steps alike. The 2-process run, with an overflow in one rank's shard only, is
tests/distributed/test_fsdp_fp16.py."""

from __future__ import annotations

import pytest
import torch
from nan_models import PoisonData, PoisonNet, samples_of_step

from conftest import tiny_lm
from stabletrain import NaNDetectedError, NonFiniteStepError
from stabletrain.config import load_settings
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.training.loop import Trainer, train
from stabletrain.training.setup import fp16_plugin

RUN = dict(steps=10, batch_size=8, num_workers=0, log_every_num_steps=1, model_args={"lr": 0.01, "warmup_steps": 0})


@pytest.fixture(scope="module", autouse=True)
def _process_group(fsdp_in_process):
    yield


def _trainer(out, sharded: bool, init_scale: float, **settings) -> Trainer:
    from lightning_fabric import Fabric

    from stabletrain.distributed import FSDP2Strategy

    strategy = FSDP2Strategy() if sharded else "auto"
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[fp16_plugin("cpu", init_scale)])
    torch.manual_seed(0)
    base = dict(out=out, model=PoisonNet(), **RUN, **({"strategy": "fsdp"} if sharded else {}))
    return Trainer(load_settings({**base, **settings}), fabric=fabric)


def test_16_mixed_under_fsdp_trains_with_a_grad_scaler(tmp_path):
    out = tmp_path / "run"
    train(out=out, strategy="fsdp", accelerator="cpu", devices=1, precision="16-mixed", **tiny_lm(steps=3))
    rows = read_metrics(out / "metrics.jsonl")[0]
    assert [r["loss_scale"] for r in rows] == [2.0**16] * 3 and all(r["skipped_steps"] == 0 for r in rows)
    assert "precision 16-mixed" in (out / "train.log").read_text()


def test_the_scaler_skips_the_same_steps_sharded_as_unsharded(tmp_path):
    """At scale 2**16 the scaled fp16 gradients overflow: the scaler skips steps and halves its scale until
    they fit. Sharded, each rank's found-inf check of its DTensor shards is agreed over the mesh."""
    rows = {}
    for sharded in (False, True):
        out = tmp_path / f"sharded{sharded}"
        trainer = _trainer(out, sharded, 2.0**16, data=PoisonData(), debug_args={"nancapture": {"enabled": True}})
        trainer.fit()
        assert trainer.sharded is sharded and isinstance(trainer.scaler, torch.amp.GradScaler)
        rows[sharded] = read_metrics(out / "metrics.jsonl")[0]
        assert not (out / "debug").exists(), "skipped steps are normal: nothing captured"
    assert [r["skipped_steps"] for r in rows[True]] == [r["skipped_steps"] for r in rows[False]]
    assert [r["loss_scale"] for r in rows[True]] == [r["loss_scale"] for r in rows[False]]
    assert rows[True][0]["skipped_steps"] >= 1 and rows[True][-1]["loss_scale"] < 2.0**16
    for a, b in zip(rows[True], rows[False]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


@pytest.mark.parametrize("tool", ["guard", "nancapture"])
def test_too_many_skipped_steps_stop_a_sharded_run_as_an_unsharded_one(tmp_path, tool):
    found = {}
    for sharded in (False, True):
        debug = {"nancapture": {"enabled": tool == "nancapture", "max_skipped_steps": 2}}
        error = NaNDetectedError if tool == "nancapture" else NonFiniteStepError
        with pytest.raises(error) as info:
            _trainer(tmp_path / f"{tool}{sharded}", sharded, 2.0**16, data=PoisonData(), debug_args=debug).fit()
        found[sharded] = (info.value.step, getattr(info.value, "reason", getattr(info.value, "origin", None)))
        assert "skipped 2 steps in a row" in str(info.value)
    assert found[True] == found[False] == (1, "skipped_steps")


def test_a_nonfinite_loss_under_sharded_fp16_is_captured_at_once(tmp_path):
    victim = samples_of_step(2)[5]
    with pytest.raises(NaNDetectedError) as info:
        _trainer(tmp_path / "run", True, 2.0**8, data=PoisonData(input_poison={victim: float("nan")}),
                 debug_args={"nancapture": {"enabled": True}}).fit()
    assert (info.value.step, info.value.reason) == (2, "nonfinite_loss")
    assert "Microbatch losses: nan" in str(info.value)
