"""A stop's continue command never repeats the failure unchanged, and its advice follows the
evidence: a bad sample is not blamed on the learning rate, nor a high lr on the data (issue 25)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import LinearData, tiny_lm
from conftest import Regression as _Regression
from stabletrain.debug.nan_capture import NaNDetectedError
from stabletrain.safety.guard import NonFiniteStepError
from stabletrain.training.loop import train

#: SGD at lr=20 on the tiny LM: the loss grows for three steps, then goes NaN at step 5.
SGD_BOOM = tiny_lm(steps=40, checkpoint_every_num_steps=5, model_args={"lr": 20, "optimizer": "sgd"})


class _Poisoned(LinearData):
    """64 samples; sample 37 holds a NaN."""

    def __init__(self):
        super().__init__(n=64)
        self.x[37, 2] = math.nan


def test_a_high_lr_stop_carries_a_lower_lr_on_the_optimizers_own_scale(tmp_path):
    with pytest.raises(NonFiniteStepError) as info:
        train(out=tmp_path / "sgd", **SGD_BOOM)
    err = info.value
    text = str(err)
    assert err.origin == "forward_backward" and err.step == 5
    # The pasted command changes the lr (a tenth of SGD's own, not AdamW's default) and says it is not verified.
    assert "model_args.lr=2" in err.command and "model_args.lr=20" not in err.command, err.command
    assert "It carries model_args.lr=2 instead of 20" in text and "not verified" in text
    assert "0.001" not in text
    assert "clip gradients: gradient_clip_val=1.0" in text, "SGD's update is lr x the gradient: clipping bounds it"
    assert "check the data" not in text and "skip_step" not in text, "the loss grew for steps: not the data"


def test_the_nancapture_stop_carries_the_lower_lr_too(tmp_path):
    """The README's boom run pasted as printed went NaN again at the same step: the command must change."""
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "sgd", debug_args={"nancapture": {"enabled": True}}, **SGD_BOOM)
    text = str(info.value)
    line = next(x for x in text.splitlines() if "stabletrain train " in x)
    assert "model_args.lr=2" in line and "model_args.lr=20" not in line, line
    assert "It carries model_args.lr=2 instead of 20" in text


def test_a_nan_sample_is_named_and_the_lr_is_not_blamed(tmp_path):
    with pytest.raises(NonFiniteStepError) as info:
        train(out=tmp_path / "data", model=_Regression(), data=_Poisoned(), steps=20, batch_size=8,
              log_every_num_steps=5, checkpoint_every_num_steps=2, model_args={"lr": 0.01, "warmup_steps": 0})
    err = info.value
    text = str(err)
    assert err.origin == "forward_backward" and "loss" in err.nonfinite
    assert "model_args.lr" not in err.command and "on_instability.policy='skip_step'" in err.command, err.command
    assert "lower the learning rate" not in text
    assert "check the data: sample(s) 37 give a non-finite loss alone" in text, text
    assert "the microbatch held 37, " in text
    assert "turn on debug_args.nancapture.enabled=true to isolate the culprit sample" in text


class _LogScale(_Regression):
    """loss = log(a) + mse: d loss / d a = 1/a = 1 at a=1, so one SGD step at lr=2 takes a to -1
    and every sample's loss is NaN at step 1, from a normal loss at step 0: the lr, not the data."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(()))

    def training_step(self, batch):
        return torch.log(self.a) + super().training_step(batch)


def test_a_sudden_nan_that_every_sample_gives_alone_is_not_blamed_on_the_data(tmp_path):
    with pytest.raises(NonFiniteStepError) as info:
        train(out=tmp_path / "lr", model=_LogScale(), data=LinearData(), steps=20, batch_size=8, log_every_num_steps=1,
              checkpoint_every_num_steps=2, model_args={"lr": 2.0, "warmup_steps": 0, "optimizer": "sgd"})
    err = info.value
    text = str(err)
    assert (err.step, err.origin) == (1, "forward_backward") and "loss" in err.nonfinite
    assert "check the data" not in text and "skip_step" not in err.command, text
    assert "model_args.lr=0.2" in err.command and "It carries model_args.lr=0.2 instead of 2" in text


def test_with_the_guard_off_a_loss_that_was_normal_before_a_huge_update_is_not_blamed_on_the_data(tmp_path):
    """lr 1e20 with the guard off: step 0 logs a normal loss, then its update makes the weights overflow
    their RMS, and step 1's loss is NaN. Nothing measured each sample alone; the update logged at step 0
    is the evidence, so the advice is the lr, not the data (it said "a sample is likelier to blame")."""
    settings = tiny_lm(steps=5, log_every_num_steps=1, guard={"enabled": False},
                       model_args={"lr": 1e20, "warmup_steps": 0}, debug_args={"nancapture": {"enabled": True}})
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "huge", **settings)
    text = str(info.value)
    assert info.value.step == 1
    assert "skip_step" not in text and "likelier to blame" not in text, text
    assert "It carries model_args.lr=" in text and "instead of 1e+20" in text, text


def test_with_the_guard_off_a_nan_sample_after_normal_updates_is_still_the_datas(tmp_path):
    """The counter-case: the same stop after small logged updates keeps the data advice."""
    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "data", model=_Regression(), data=_Poisoned(), steps=20, batch_size=8,
              log_every_num_steps=1, checkpoint_every_num_steps=2, guard={"enabled": False},
              model_args={"lr": 0.01, "warmup_steps": 0}, debug_args={"nancapture": {"enabled": True}})
    text = str(info.value)
    assert "It carries on_instability.policy=skip_step" in text and "likelier to blame" in text, text
