"""Checkpoint health on its own: the finite check of every part of a state (model, optimizer state,
scaler), the names of what is non-finite, and HealthTracker's verdict from the run's own history
(each rule of docs/checkpoints.md: the last step against the recent medians, weight growth, open
episodes, a recovered spike that has not settled)."""

from __future__ import annotations

import math

import pytest
import torch

from stabletrain.config import TrendAlertArgs
from stabletrain.safety.checkpoint_health import WEIGHT_GROWTH, HealthTracker, nonfinite_entries, verify_tensors

CPU = torch.device("cpu")


def _state(model=None, opt=None, scaler=None):
    return {"step": 3, "model": model if model is not None else {"w": torch.ones(3), "n": torch.tensor(4)},
            "optimizer": {"state": opt if opt is not None else {0: {"exp_avg": torch.ones(3)}}, "param_groups": []},
            "scaler": scaler}


def test_verify_tensors_flags_each_part_and_measures_the_model_norm():
    flags = verify_tensors(_state(model={"w": torch.tensor([3.0, 4.0]), "half": torch.tensor([12.0]).half()}), CPU)
    assert flags.dtype == torch.float64 and flags.tolist() == [0.0, 0.0, 0.0, 13.0]
    assert verify_tensors(_state(model={"w": torch.tensor([math.nan])}), CPU).tolist()[:3] == [1.0, 0.0, 0.0]
    nested = {0: {"exp_avg": [torch.ones(2), (torch.tensor([math.inf]),)]}}
    assert verify_tensors(_state(opt=nested), CPU).tolist()[:3] == [0.0, 1.0, 0.0]
    assert verify_tensors(_state(scaler={"scale": torch.tensor([math.inf])}), CPU).tolist()[:3] == [0.0, 0.0, 1.0]
    # Integer tensors, empty tensors and non-tensors are not checked; a state without an optimizer is fine.
    ints = {"w": torch.ones(2), "i": torch.tensor([2**62]), "e": torch.empty(0), "s": "text", "f": 1.5}
    assert verify_tensors({"model": ints, "optimizer": None}, CPU).tolist() == [0.0, 0.0, 0.0, pytest.approx(2**0.5)]
    assert verify_tensors({}, CPU).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_nonfinite_entries_names_parameters_state_and_scaler():
    state = _state(model={"a": torch.tensor([math.nan]), "b": torch.ones(1), "steps": torch.tensor([3])},
                   opt={0: {"exp_avg": torch.ones(1), "exp_avg_sq": torch.tensor([math.inf])},
                        5: {"exp_avg": torch.tensor([math.nan])}},
                   scaler={"scale": math.inf, "growth_factor": 2.0, "_growth_tracker": 3})
    assert nonfinite_entries(state, ["a", "b"]) == [
        "model a", "optimizer state exp_avg_sq of a", "optimizer state exp_avg of 5", "scaler scale"]
    assert nonfinite_entries(state) == ["model a", "optimizer state exp_avg_sq of 0", "optimizer state exp_avg of 5",
                                        "scaler scale"]
    assert nonfinite_entries({"model": {"w": torch.ones(2)}}) == []


def test_nonfinite_entries_are_limited_with_a_count():
    state = {"model": {f"p{i}": torch.tensor([math.nan]) for i in range(11)}}
    found = nonfinite_entries(state)
    assert found == [f"model p{i}" for i in range(8)] + ["... (3 more)"]
    assert nonfinite_entries(state, limit=11) == [f"model p{i}" for i in range(11)]


def _tracker(losses=(2.0, 1.9, 2.1, 1.8, 2.0), gns=(1.0, 1.1, 0.9, 1.0, 1.2), **settings) -> HealthTracker:
    tracker = HealthTracker(TrendAlertArgs(**settings) if settings else None)
    for step, (loss, gn) in enumerate(zip(losses, gns)):
        tracker.observe(step, {"loss": loss, "gradient_norm": gn})
    return tracker


def test_a_healthy_checkpoint_records_why_with_its_numbers():
    tracker = _tracker()
    h = tracker.assess(5, last_step=4, loss=2.0, gradient_norm=1.2, weight_norm=10.0)
    assert h["healthy"] is True and h["finite"] is True and h["problems"] == []
    assert h["why"] == ("every tensor finite; loss 2 and gradient_norm 1.2 at step 4 within 4x / 10x of the recent "
                        "logged medians; no exploding or non-finite episode open")
    assert (h["step"], h["last_step"], h["loss"], h["gradient_norm"], h["weight_norm"]) == (5, 4, 2.0, 1.2, 10.0)
    assert h["initial_weight_norm"] == 10.0, "the first checkpoint's weight norm is the start's"
    assert h["reference"] == {"loss": 2.0, "gradient_norm": 1.0}, "the medians of the logged values"
    # Before any logged step: no reference to hold the values against.
    fresh = HealthTracker().assess(0, last_step=-1, loss=math.nan, gradient_norm=math.nan, weight_norm=3.0)
    assert fresh["healthy"] and fresh["why"] == "every tensor finite; no exploding or non-finite episode open"
    assert fresh["loss"] == "nan" and fresh["reference"] == {"loss": None, "gradient_norm": None}


@pytest.mark.parametrize("signal, value, factor", [("loss", 8.5, 4), ("gradient_norm", 10.5, 10)])
def test_a_last_step_above_its_limit_times_the_recent_median_is_not_healthy(signal, value, factor):
    tracker = _tracker()
    values = {"loss": 2.0, "gradient_norm": 1.0}
    ok = tracker.assess(5, last_step=4, **{**values, signal: factor * values[signal]}, weight_norm=1.0)
    assert ok["healthy"], "exactly at the limit is still healthy"
    h = tracker.assess(5, last_step=4, **{**values, signal: value}, weight_norm=1.0)
    ref = values[signal] if signal == "loss" else 1.0
    assert not h["healthy"] and h["problems"] == [
        f"{signal} at step 4 is {value:.3g}, {value / ref:.3g}x the median {ref:.3g} of the last 5 logged values "
        f"(limit {factor}x)"]
    assert h["why"] == h["problems"][0]


@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_a_non_finite_last_step_is_not_healthy_but_nan_means_not_measured(bad):
    tracker = _tracker()
    h = tracker.assess(5, last_step=4, loss=bad, gradient_norm=1.0, weight_norm=1.0)
    assert not h["healthy"] and h["problems"] == [f"loss at step 4 is {bad}"] and h["loss"] == str(bad)
    assert tracker.assess(5, last_step=4, loss=math.nan, gradient_norm=1.0, weight_norm=1.0)["healthy"]


def test_weights_grown_past_the_limit_are_not_healthy():
    tracker = _tracker()
    assert tracker.assess(1, last_step=0, loss=2.0, gradient_norm=1.0, weight_norm=2.0)["healthy"]
    at_limit = tracker.assess(2, last_step=1, loss=2.0, gradient_norm=1.0, weight_norm=2.0 * WEIGHT_GROWTH)
    assert at_limit["healthy"]
    h = tracker.assess(3, last_step=2, loss=2.0, gradient_norm=1.0, weight_norm=250.0)
    assert not h["healthy"] and h["problems"] == [
        "the weight norm is 250, 125x its 2 at the start of the run (limit 100x)"]
    assert h["initial_weight_norm"] == 2.0
    # A non-finite first norm is not a start.
    other = HealthTracker()
    other.assess(0, last_step=-1, loss=math.nan, gradient_norm=math.nan, weight_norm=math.inf)
    assert other.initial_weight_norm is None


def test_an_open_exploding_episode_is_not_healthy():
    losses = [2.0] * 6 + [20.0, 40.0, 80.0, 160.0]
    tracker = _tracker(losses=losses, gns=[1.0] * len(losses), window=5)
    h = tracker.assess(10, last_step=9, loss=math.nan, gradient_norm=math.nan, weight_norm=1.0)
    assert not h["healthy"]
    assert len(h["problems"]) == 1 and h["problems"][0].startswith("loss is exploding")
    assert h["problems"][0].endswith(f"(still open at step {tracker.detector.last_step})")


def test_a_recovered_spike_keeps_checkpoints_unhealthy_until_the_loss_settles():
    tracker = _tracker(losses=(2.0, 2.2, 1.9), gns=(1.0, 1.0, 1.0))
    tracker.note_recovery(3, "loss_spike")
    assert tracker.spike_open
    h = tracker.assess(4, last_step=3, loss=math.nan, gradient_norm=math.nan, weight_norm=1.0)
    assert not h["healthy"] and h["problems"] == [
        "the loss_spike episode the self-healing recovered from at step 3 is still open: the loss has not been at or "
        "below 2.2, the highest of the 3 logged losses before it, for 3 logged steps in a row"]
    tracker.note_recovery(5, "nonfinite_loss")  # the same episode: its reference stays the one from before it
    tracker.observe(6, {"loss": 2.1, "gradient_norm": 1.0})
    tracker.observe(7, {"loss": 2.3, "gradient_norm": 1.0})  # above the reference: the count starts again
    h = tracker.assess(8, last_step=7, loss=2.3, gradient_norm=1.0, weight_norm=1.0)
    assert h["problems"] == [
        "the nonfinite_loss episode the self-healing recovered from at step 3 (the latest at step 5) is still open: "
        "the loss has not been at or below 2.2, the highest of the 3 logged losses before it, for 3 logged steps in "
        "a row (now 2.3)"]
    tracker.observe(5, {"loss": 1.0, "gradient_norm": 1.0})  # not after the recovery: does not count
    for step in (8, 9):
        tracker.observe(step, {"loss": 2.2, "gradient_norm": 1.0})
        assert tracker.spike_open
    tracker.observe(10, {"loss": 2.0, "gradient_norm": 1.0})
    assert not tracker.spike_open
    assert tracker.assess(11, last_step=10, loss=2.0, gradient_norm=1.0, weight_norm=1.0)["healthy"]


def test_a_spike_before_any_logged_loss_needs_finite_losses_to_settle():
    tracker = HealthTracker(TrendAlertArgs(persist=2))
    tracker.note_recovery(0, "nonfinite_grad")
    h = tracker.assess(1, last_step=0, loss=math.nan, gradient_norm=math.nan, weight_norm=1.0)
    assert h["problems"] == ["the nonfinite_grad episode the self-healing recovered from at step 0 is still open: the "
                             "loss has not been finite for 2 logged steps in a row"]
    tracker.observe(1, {"loss": math.inf, "gradient_norm": 1.0})
    tracker.observe(2, {"loss": 50.0, "gradient_norm": 1.0})
    assert tracker.spike_open
    tracker.observe(3, {"loss": 60.0, "gradient_norm": 1.0})
    assert not tracker.spike_open
