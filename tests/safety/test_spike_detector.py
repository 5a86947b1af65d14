"""SpikeDetector on its own: its defaults are the trainer's, its verdict's names and descriptions,
and a saved state loaded onto the detector's own device and dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from stabletrain.config import OnInstabilityArgs
from stabletrain.safety.spike_detector import TRIGGERS, SpikeDetector, describe_trigger, trigger_name


def test_the_plain_loop_defaults_are_the_trainer_s():
    """docs/self_healing.md: ``InstabilityGuard(optimizer)  # same defaults as the trainer``."""
    d, args = SpikeDetector(), OnInstabilityArgs()
    assert (d.window, d.zscore, d.warmup, d.max_ratio, d.min_std) == (
        args.window, args.zscore, args.warmup, args.max_ratio, args.min_std)
    assert d.device == torch.device("cpu") and d.buffer.device == torch.device("cpu")


@pytest.mark.parametrize("window, warmup", [(1, 20), (50, 1)])
def test_window_and_warmup_below_2_are_refused(window, warmup):
    with pytest.raises(ValueError, match=f"window and warmup must be >= 2, got window={window}, warmup={warmup}"):
        SpikeDetector(window=window, warmup=warmup)


def test_trigger_names_by_code():
    assert [trigger_name(c) for c in range(len(TRIGGERS))] == list(TRIGGERS)
    assert trigger_name(0.0) == "none" and trigger_name(3.0) == "loss_spike"
    assert trigger_name(5) == "unknown(5)" and trigger_name(-1) == "unknown(-1)"


@pytest.mark.parametrize("code, zscore, ratio, expected", [
    (3, 8.14, 12.34, "loss_spike (12.3x the largest loss seen)"),  # over max_ratio: the ratio says it
    (3, 8.14, 10.0, "loss_spike (z=8.1)"),                          # at max_ratio: not over it
    (3, 8.14, 2.0, "loss_spike (z=8.1)"),
    (3, math.nan, math.nan, "loss_spike"),
    (4, 7.04, 50.0, "grad_spike (z=7.0)"),                          # a gradient spike: never the loss ratio
    (4, math.nan, 1.0, "grad_spike"),
    (1, 3.0, 50.0, "nonfinite_loss"),                               # non-finite: no score, no ratio
    (2, 3.0, 0.5, "nonfinite_grad"),
    (0, 3.0, 0.5, "none"),
])
def test_describe_trigger(code, zscore, ratio, expected):
    assert describe_trigger(code, zscore, ratio, 10.0) == expected


def _trained(device="cpu") -> SpikeDetector:
    d = SpikeDetector(window=4, warmup=2, device=device)
    for loss, gn in ((2.0, 1.0), (1.9, 1.1), (1.8, 0.9), (1.85, 1.0), (1.7, 1.05)):
        d.observe(torch.tensor(loss), torch.tensor(gn))
    return d


def test_a_state_saved_elsewhere_loads_onto_the_detector_s_device_and_dtypes():
    saved = _trained().state_dict()
    # As read back from a file by other code: float32 values, int32 count, 1-element tensors.
    foreign = {"buffer": saved["buffer"].float(), "count": saved["count"].int().reshape(1),
               "max_loss": saved["max_loss"].float().reshape(1)}
    d = SpikeDetector(window=4, warmup=2, device="meta")  # a device other than the state's
    d.load_state_dict(foreign)
    assert d.buffer.device.type == d.count.device.type == d.max_loss.device.type == "meta"
    assert (d.buffer.dtype, d.count.dtype, d.max_loss.dtype) == (torch.float64, torch.int64, torch.float64)
    assert d.count.shape == d.max_loss.shape == ()
    on_cpu = SpikeDetector(window=4, warmup=2)
    on_cpu.load_state_dict(foreign)
    assert int(on_cpu.count) == 5 and float(on_cpu.max_loss) == pytest.approx(2.0)
    assert torch.equal(on_cpu.buffer, saved["buffer"].float().double())


def test_a_state_of_another_window_is_refused_with_the_setting_to_keep():
    saved = _trained().state_dict()
    with pytest.raises(ValueError, match=r"^the saved detector window holds 4 steps, this one 6: resume with the same "
                                         r"on_instability.window$"):
        SpikeDetector(window=6).load_state_dict(saved)
