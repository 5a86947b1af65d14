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
    # A resumed run's checkpoint before its first step: references from the rows logged before, no step's
    # values of its own to quote.
    resumed = _tracker().assess(5, last_step=-1, loss=math.nan, gradient_norm=math.nan, weight_norm=10.0)
    assert resumed["healthy"] and resumed["why"] == "every tensor finite; no exploding or non-finite episode open"


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


def test_a_step_the_fp16_grad_scaler_skipped_does_not_make_the_checkpoint_unhealthy():
    """Its gradient norm is inf by the scaler's rule (no update was made); before, such a checkpoint
    was recorded "not healthy: gradient_norm at step 4 is inf"."""
    tracker = _tracker()
    h = tracker.assess(5, last_step=4, loss=2.0, gradient_norm=math.inf, weight_norm=1.0, scaler_skipped=True)
    assert h["healthy"] and h["problems"] == []
    assert h["why"] == ("every tensor finite; loss 2 at step 4 within 4x of the recent logged median; the fp16 "
                        "GradScaler skipped that step (its scaled gradients overflowed: no update); no exploding or "
                        "non-finite episode open")
    # Not skipped by the scaler, or skipped with a non-finite loss: not healthy, as before.
    assert tracker.assess(5, last_step=4, loss=2.0, gradient_norm=math.inf, weight_norm=1.0)["problems"] == [
        "gradient_norm at step 4 is inf"]
    bad_loss = tracker.assess(5, last_step=4, loss=math.inf, gradient_norm=math.inf, weight_norm=1.0,
                              scaler_skipped=True)
    assert bad_loss["problems"] == ["loss at step 4 is inf", "gradient_norm at step 4 is inf"]


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


def test_verify_tensors_of_a_sharded_state_gives_each_rank_its_share_of_the_squared_norm(gloo_group_of_one):
    """FSDP2 checkpoints hold DTensor shards: each rank's last entry is its shards' squared norm,
    plus the unsharded tensors' on rank 0 only, so that the sum over ranks is the whole model's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shard = distribute_tensor(torch.tensor([3.0, 4.0]), mesh, [Shard(0)])  # squared norm 25
    model = {"w": shard, "b": torch.tensor([12.0]), "n": torch.tensor([7])}  # b whole: 144
    on0 = verify_tensors({"model": model}, CPU, rank=0)
    on1 = verify_tensors({"model": model}, CPU, rank=1)
    assert on0.tolist() == [0.0, 0.0, 0.0, 169.0] and on1.tolist() == [0.0, 0.0, 0.0, 25.0]
    assert verify_tensors({"model": model}, CPU).tolist() == [0.0, 0.0, 0.0, 13.0], "not sharded: the norm"
    bad = {"w": distribute_tensor(torch.tensor([math.nan, 1.0]), mesh, [Shard(0)]), "b": torch.ones(1)}
    assert verify_tensors({"model": bad}, CPU, rank=1).tolist()[:3] == [1.0, 0.0, 0.0]


def test_a_state_entry_of_a_parameter_without_a_name_is_named_by_its_index():
    state = _state(opt={0: {"exp_avg": torch.ones(1)}, 1: {"exp_avg": torch.tensor([math.nan])}})
    assert nonfinite_entries(state, param_names=["a"]) == ["optimizer state exp_avg of 1"]
    assert nonfinite_entries(state, param_names=["a", "b"]) == ["optimizer state exp_avg of b"]


# ------------------------------------------------------------------------------------------------
# The rules at their edges (each test kills what mutation testing found unchecked)
# ------------------------------------------------------------------------------------------------


def test_an_open_non_finite_or_untolerated_spike_episode_is_not_healthy_a_tolerated_one_is():
    nonfinite = _tracker(losses=(2.0, 2.1, 1.9, 2.0, math.nan), gns=(1.0, 1.0, 1.0, 1.0, math.nan))
    h = nonfinite.assess(5, last_step=4, loss=math.nan, gradient_norm=math.nan, weight_norm=1.0)
    assert not h["healthy"] and any("still open at step 4" in p for p in h["problems"]), h["problems"]
    kinds = {e.kind for e in nonfinite.detector.open_episodes()}
    assert "nonfinite" in kinds
    gns = [1.0, 1.1, 0.9, 1.0, 1.05, 1.0, 0.95, 1.0, 12.0]  # one point 12x the band: a gradient-norm spike
    for warmup, healthy in ((0, False), (100, True)):  # inside the lr warmup a spike is tolerated
        tracker = HealthTracker(warmup_steps=warmup)
        for step, gn in enumerate(gns):
            tracker.observe(step, {"loss": 2.0, "gradient_norm": gn})
        spikes = [e for e in tracker.detector.open_episodes() if e.kind == "spike"]
        assert spikes and all(e.tolerated == (warmup > 0) for e in spikes)
        h = tracker.assess(9, last_step=8, loss=2.0, gradient_norm=math.nan, weight_norm=1.0)
        assert h["healthy"] is healthy, h["problems"]


def test_the_trend_settings_given_are_the_ones_judged_by():
    losses = [1.0] * 5 + [3.0]  # 3x the band: a spike for loss_spike_factor 2 (the default), not for 5
    for factor, healthy in ((2.0, False), (5.0, True)):
        tracker = HealthTracker(TrendAlertArgs(loss_spike_factor=factor))
        for step, loss in enumerate(losses):
            tracker.observe(step, {"loss": loss, "gradient_norm": 1.0})
        assert tracker.assess(6, last_step=5, loss=math.nan, gradient_norm=1.0, weight_norm=1.0)["healthy"] is healthy


def test_the_reference_is_the_median_of_the_last_window_of_logged_values():
    tracker = _tracker(losses=(10.0, 10.0, 10.0, 1.0, 1.0, 1.0), gns=(1.0,) * 6, window=3)
    h = tracker.assess(6, last_step=5, loss=4.5, gradient_norm=1.0, weight_norm=1.0)
    assert h["reference"]["loss"] == 1.0 and not h["healthy"], "4.5 is above 4x the last 3 losses' median"


def test_rows_without_a_signal_or_with_a_non_finite_one_are_not_part_of_the_reference():
    tracker = HealthTracker()
    tracker.observe(0, {"loss": 2.0})  # no gradient_norm in this row
    tracker.observe(1, {"loss": math.nan, "gradient_norm": math.inf})
    tracker.observe(2, {"loss": 3.0, "gradient_norm": 1.0})
    h = tracker.assess(3, last_step=2, loss=3.0, gradient_norm=1.0, weight_norm=1.0)
    assert h["reference"] == {"loss": 2.5, "gradient_norm": 1.0}


def test_step_0_is_judged_and_the_healthy_why_names_step_0():
    tracker = HealthTracker()
    tracker.observe(0, {"loss": 2.0, "gradient_norm": 1.0})
    h = tracker.assess(1, last_step=0, loss=2.0, gradient_norm=1.0, weight_norm=1.0)
    assert h["why"] == ("every tensor finite; loss 2 and gradient_norm 1 at step 0 within 4x / 10x of the recent "
                        "logged medians; no exploding or non-finite episode open")
    bad = HealthTracker().assess(1, last_step=0, loss=math.inf, gradient_norm=1.0, weight_norm=1.0)
    assert bad["problems"] == ["loss at step 0 is inf"]
    # A step ran, but nothing was logged yet: no medians to name.
    unlogged = HealthTracker().assess(1, last_step=0, loss=2.0, gradient_norm=1.0, weight_norm=1.0)
    assert unlogged["why"] == "every tensor finite; no exploding or non-finite episode open"


def test_a_zero_median_or_a_zero_start_weight_norm_is_no_reference():
    zeros = _tracker(losses=(0.0, 0.0, 0.0), gns=(0.0, 0.0, 0.0))
    assert zeros.assess(3, last_step=2, loss=0.5, gradient_norm=0.5, weight_norm=1.0)["healthy"]
    zero_start = HealthTracker()
    assert zero_start.assess(1, last_step=-1, loss=math.nan, gradient_norm=math.nan, weight_norm=0.0)["healthy"]
    assert zero_start.assess(2, last_step=-1, loss=math.nan, gradient_norm=math.nan, weight_norm=5.0)["healthy"]
    small_start = HealthTracker()
    small_start.assess(1, last_step=-1, loss=math.nan, gradient_norm=math.nan, weight_norm=0.5)
    h = small_start.assess(2, last_step=-1, loss=math.nan, gradient_norm=math.nan, weight_norm=60.0)
    assert h["problems"] == ["the weight norm is 60, 120x its 0.5 at the start of the run (limit 100x)"]


def test_two_problems_are_both_told():
    tracker = _tracker()
    tracker.assess(1, last_step=0, loss=2.0, gradient_norm=1.0, weight_norm=1.0)
    h = tracker.assess(5, last_step=4, loss=math.inf, gradient_norm=1.0, weight_norm=500.0)
    assert h["why"] == "loss at step 4 is inf; the weight norm is 500, 500x its 1 at the start of the run (limit 100x)"


def test_a_resume_carries_the_start_weight_norm_and_an_open_spike_or_none():
    tracker = HealthTracker()
    tracker.resume({"initial_weight_norm": 2.0, "open_spike": None})
    assert tracker.initial_weight_norm == 2.0 and tracker.spike is None and not tracker.spike_open
    h = tracker.assess(10, last_step=-1, loss=math.nan, gradient_norm=math.nan, weight_norm=300.0)
    assert h["problems"] == ["the weight norm is 300, 150x its 2 at the start of the run (limit 100x)"]
    spike = {"step": 3, "trigger": "loss_spike", "reference": 2.2, "calm": 0, "first": 3, "window": 3}
    resumed = HealthTracker()
    resumed.resume({"open_spike": spike})
    assert resumed.spike == spike and resumed.spike is not spike


def test_a_recovery_whose_loss_went_non_finite_says_so():
    tracker = _tracker(losses=(2.0, 2.2, 1.9), gns=(1.0, 1.0, 1.0))
    tracker.note_recovery(3, "loss_spike")
    tracker.observe(4, {"loss": math.nan, "gradient_norm": 1.0})
    h = tracker.assess(5, last_step=4, loss=math.nan, gradient_norm=1.0, weight_norm=1.0)
    assert h["problems"][0] == "loss is not finite (step 4): nan (still open at step 4)"
    assert h["problems"][1].endswith("for 3 logged steps in a row (now nan)")


class _Mechanisms:
    """The part of MechanismDetector that assess reads: what it named, and a step still pending."""

    def __init__(self, found, pending=None):
        self.found, self._pending = found, pending

    def update(self, step, metrics):
        pass

    def pending_since(self):
        return self._pending


def _mechanism(start, end=None, where="blocks.0.attn"):
    from stabletrain.debug.mechanisms.rules import Mechanism

    return Mechanism("attention_logit_growth", where, start_step=start, detected_step=start + 10,
                     evidence="max attention logit 80", end_step=end)


def test_a_mechanism_open_at_the_checkpoint_or_closed_within_its_last_step_makes_it_unhealthy():
    def judged(m, step=20, pending=None):
        tracker = HealthTracker(mechanisms=_Mechanisms([m], pending))
        return tracker.assess(step, last_step=step - 1, loss=math.nan, gradient_norm=math.nan, weight_norm=1.0)

    open_one = judged(_mechanism(10))
    assert open_one["problems"] == ["attention-logit growth in blocks.0.attn began at step 10 (named at step 20): "
                                    "max attention logit 80"], open_one["problems"]
    assert judged(_mechanism(10, where=""))["problems"][0].startswith("attention-logit growth began at step 10")
    assert not judged(_mechanism(19, end=19))["healthy"], "it held at the checkpoint's last step"
    assert judged(_mechanism(10, end=18))["healthy"], "it had stopped before the last step"
    assert judged(_mechanism(20))["healthy"], "it began at the checkpoint's step: after the steps it holds"
    healthy = judged(_mechanism(10, end=5), pending=15)
    assert healthy["why"] == ("every tensor finite; no exploding or non-finite episode open; no mechanism named in "
                              "the signals") and healthy["pending_since"] == 15
    assert judged(_mechanism(10), pending=15)["pending_since"] is None, "only a healthy checkpoint waits"
