"""The lr / clipping / precision advice: one rounding, shared by trend alerts and diagnose."""

from __future__ import annotations

import pytest

from stabletrain.debug import advice
from stabletrain.debug.diagnose.actions import lr_text
from stabletrain.debug.trends import AlertContext, Episode, next_actions


@pytest.mark.parametrize(
    "lr,lower,higher",
    [
        (3e-3, "model_args.lr=0.0003", "model_args.lr=0.009"),
        (1000, "model_args.lr=100", "model_args.lr=3000"),
        (1.2345e-3, "model_args.lr=0.000123", "model_args.lr=0.0037"),
        (1e20, "model_args.lr=1e+19", "model_args.lr=3e+20"),
    ],
)
def test_learning_rate_proposals(lr, lower, higher):
    assert advice.lower_lr(lr) == lower
    assert advice.raise_lr(lr) == higher


@pytest.mark.parametrize(
    "current,known,text",
    [(0.0, True, "gradient_clip_val=1.0 (clipping is off)"), (None, True, "gradient_clip_val=1.0 (clipping is off)"),
     (None, False, "gradient_clip_val=1.0 (clip the gradient norm)"), (1.0, True, "gradient_clip_val=0.5 (was 1)"),
     (0.3, True, "gradient_clip_val=0.15 (was 0.3)")],
)
def test_clipping_proposals(current, known, text):
    assert advice.clip(current, known=known) == text


@pytest.mark.parametrize(
    "precision,stabler",
    [("16-mixed", ["bf16-mixed", "32-true"]), ("16-true", ["bf16-mixed", "32-true"]), ("bf16-mixed", ["32-true"]),
     ("bf16-true", ["32-true"]), ("32-true", []), ("64-true", []), (None, ["bf16-mixed", "32-true"])],
)
def test_stabler_precisions(precision, stabler):
    assert advice.stabler_precisions(precision) == stabler
    assert advice.switch_precision(precision) == (" or ".join(f"precision={p}" for p in stabler) or None)


def test_setting_values_read_as_typed():
    values = [1000, 1e20, 3e-4, 3e-5, 1 / 3, 123456, 1.0]
    assert [advice.setting_value(v) for v in values] == ["1000", "1e+20", "0.0003", "3e-05", "0.333", "123000", "1"]


def test_positive_takes_only_usable_numbers():
    values = (0.1, 3, 0, -1.0, None, "0.1", True)
    assert [advice.positive(v) for v in values] == [0.1, 3.0, None, None, None, None, None]


def test_trends_and_diagnose_round_the_same_way():
    """1.2345e-3 once became 0.00012 in diagnose and 0.000123 in trend alerts."""
    lr = 1.2345e-3
    alert = next_actions(Episode("exploding", "loss", 1, 2, 2, 9.0, 1.0), AlertContext(lr=lr, precision="32-true"))
    assert alert[0] == "lower the learning rate: model_args.lr=0.000123 (now 0.00123)"
    assert lr_text({"model_args": {"lr": lr}}) == "model_args.lr=0.000123 or lower (was 0.00123)"
    assert lr_text({"model_args": {}}) == lr_text(None) == "a 10x lower learning rate (model_args.lr)"
