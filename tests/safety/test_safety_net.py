"""The trainer's safety net (safety/net.py) as one rank of two, in one process: what each rank does
with what the collectives bring back from the other rank.

Real DDP runs (tests/distributed, the slow layer) show that the ranks stop together with one
message; they run in spawned processes. Here the collectives are replaced by the other rank's
values, so that each decision of the protocol is checked on its own, in-process: which step is
named, which rank's message leads, what is logged, what a refused checkpoint says, and which
reduction each exchange uses. The guard, the health tracker and the checks are the real ones.
"""

from __future__ import annotations

import math
import pickle
import types
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import stabletrain.safety.stop_messages as stop_messages
from stabletrain.config import load_settings
from stabletrain.debug.grad_norm import compute_grad_norm
from stabletrain.runfiles.checkpoint import SHARDED
from stabletrain.safety import net as net_mod
from stabletrain.safety.guard import NonFiniteStepError
from stabletrain.safety.net import NonFiniteCheckpointError, SafetyNet

_OPS = {"max": torch.maximum, "sum": torch.add, "mean": lambda a, b: (a + b) / 2}


class _Fabric:
    """Rank ``rank`` of two: ``all_reduce`` combines this rank's tensor with the other rank's,
    which ``other`` gives for each call (by its order), and records the reductions asked for."""

    device = torch.device("cpu")

    def __init__(self, other: list[Any]):
        self.other = list(other)
        self.ops: list[str] = []
        self.barriers = 0

    def all_reduce(self, t: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self.ops.append(reduce_op)
        theirs = torch.as_tensor(self.other.pop(0), dtype=t.dtype).reshape(t.shape)
        return _OPS[reduce_op](t, theirs)

    def barrier(self) -> None:
        self.barriers += 1


class _Trainer:
    """What SafetyNet reads of its trainer, for a small real model and optimizer."""

    def __init__(self, tmp_path, world_size: int = 2, rank: int = 0, other: list[Any] = (), **settings: Any):
        torch.manual_seed(0)
        self.settings = load_settings({"out": tmp_path / "run", **settings})
        self.out = tmp_path / "run"
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.optimizer.param_groups[0]["base_lr"] = 0.02  # the schedule's base, as the trainer's scheduler keeps it
        self.scaler = None
        self.rank, self.world_size, self.sharded = rank, world_size, False
        self.is_rank_zero = rank == 0
        self.callbacks = types.SimpleNamespace(callbacks=[])
        self.fabric = _Fabric(other)
        self.step = 0
        self.clock = types.SimpleNamespace(steps_at_last=0)
        self.events: list[dict] = []
        self.rows: list[tuple[int, dict]] = []
        self.loggers = [types.SimpleNamespace(log_metrics=lambda row, step: self.rows.append((step, row)))]
        self.settled = 0
        self.settle_checkpoints = self._settle  # an instance attribute: a trainer may lack it
        self.stop_requests: list[str] = []

    def log_event(self, event: dict) -> None:
        self.events.append(event)

    def lr_factor(self, step: int) -> float:
        return 0.5

    def _settle(self) -> None:
        self.settled += 1

    def request_stop(self, why: str) -> None:
        self.stop_requests.append(why)


def _step(trainer: _Trainer, net: SafetyNet, step: int, scale: float = 1.0) -> None:
    """One training step of the small model with the net's per-step checks; ``scale`` inf makes
    the loss and gradients non-finite."""
    x = torch.randn(8, 4)
    loss = (trainer.model(x * scale) ** 2).mean()
    loss.backward()
    gn = compute_grad_norm(trainer.model.named_parameters()).total
    net.check_gradients(step, [loss.detach()], gn)
    trainer.optimizer.step()
    net.check_update(step)
    trainer.optimizer.zero_grad()
    trainer.step = step + 1


@pytest.fixture
def messages(monkeypatch):
    """guard_message and leading_message recorded: each rank's own message names its rank and what
    it found; the leading rank is the other one when its level (given) is higher."""
    seen: dict[str, Any] = {"other_level": -1}

    def guard_message(t, failure, capture):
        seen["failure"], seen["capture"] = failure, capture
        if "names" in seen:  # a failure naming more than the event keeps
            failure.param_names, failure.state_entries = seen["names"], seen["names"]
        return f"rank {t.rank}: {failure.nonfinite} at step {failure.step}", seen.get("best"), f"command of rank {t.rank}"

    def leading_message(level, message, fabric):
        assert isinstance(fabric, _Fabric), "the trainer's fabric does the exchange"
        seen["level"] = level
        if seen["other_level"] > level:
            return "the other rank's message", 1
        return message, 0

    monkeypatch.setattr(stop_messages, "guard_message", guard_message)
    monkeypatch.setattr(net_mod, "leading_message", leading_message)
    return seen


def test_a_bad_step_on_this_rank_leads_with_its_own_loss_and_is_logged_once(tmp_path, messages):
    # Two exchanges of the verdict terms (any_rank's flag, then verdict_terms): the other rank is fine.
    t = _Trainer(tmp_path, other=[0.0, [0.0, -1e18]])
    net = SafetyNet(t)
    _step(t, net, 0)
    t.clock.steps_at_last = 1  # step 0 logged already
    _step(t, net, 1, scale=math.inf)
    with pytest.raises(NonFiniteStepError) as info:
        net.any_rank(False)
    err = info.value
    assert t.fabric.ops == ["max", "max"], "the flag, then the verdict's (bad, -step) pair"
    assert (err.step, err.failure.stopped_at, err.failure.other_rank_step) == (1, 2, None)
    assert messages["level"] == 2, "its own loss went non-finite: the highest level"
    assert str(err) == "rank 0: ['loss', 'gradient_norm'] at step 1" and not err.other_rank
    assert err.command == "command of rank 0" and err.checkpoint is None
    assert t.settled == 1 and t.fabric.barriers == 1, "an async checkpoint is committed first, on every rank"
    assert t.events == [{"event": "nonfinite_step", "step": 1, "origin": "forward_backward",
                         "nonfinite": ["loss", "gradient_norm"], "stopped_at": 2,
                         "param_names": err.failure.param_names[:20], "state_entries": []}]
    # The failing step's row is logged (step 0 was): its loss, the lr of the schedule, the samples.
    assert [(s, sorted(r)) for s, r in t.rows] == [(1, ["gradient_norm", "loss", "lr", "samples"])]
    row = t.rows[0][1]
    assert math.isinf(row["loss"]) or math.isnan(row["loss"])
    assert row["lr"] == 0.02 * 0.5 and row["samples"] == 2 * t.settings.batch_size, "the base lr at this step"


def test_a_bad_step_on_the_other_rank_stops_this_one_with_that_rank_s_step(tmp_path, messages):
    # The other rank's flag says "guard failed" (2); its verdict pair says step 3 went bad there.
    t = _Trainer(tmp_path, other=[2.0, [1.0, -3.0]])
    net = SafetyNet(t)
    for step in range(4):
        _step(t, net, step)
    messages["other_level"] = 2
    with pytest.raises(NonFiniteStepError) as info:
        net.any_rank(0.0)
    err = info.value
    assert err.failure.step == -1 and err.failure.other_rank_step == 3, "nothing bad here; step 3 elsewhere"
    assert messages["level"] == 0, "it only stopped with the others"
    assert str(err) == "the other rank's message" and err.other_rank
    assert t.events[0]["step"] == 3, "the event names the other rank's step"
    # This rank's last finite step (3, not logged yet) gets its row, so the plots show how it ended.
    assert [s for s, _ in t.rows] == [3] and math.isfinite(t.rows[0][1]["loss"])
    assert t.rows[0][1]["loss"] == err.failure.previous_loss


def test_no_rank_bad_reads_once_and_says_whether_any_rank_flagged(tmp_path, messages):
    t = _Trainer(tmp_path, other=[1.0, 0.0])
    net = SafetyNet(t)
    _step(t, net, 0)
    assert net.any_rank(torch.tensor(0.0)) is True, "the other rank's flag"
    assert net.any_rank(0) is False
    assert t.fabric.ops == ["max", "max"] and t.events == []


def test_the_ranks_agree_on_signals_write_failures_and_a_bad_step_at_the_end_of_a_step(tmp_path, messages,
                                                                                       monkeypatch):
    import torch.distributed as dist

    exchanged: list[list[int]] = []
    other = iter([[0, 0, -(2**62), 0], [1, 0, -(2**62), 1], [0, 1, -5, 0]])

    def all_reduce(t, op=None, group=None):
        assert op == dist.ReduceOp.MAX and group is net._group
        exchanged.append(t.tolist())
        t.copy_(torch.maximum(t, torch.tensor(next(other), dtype=t.dtype)))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    t = _Trainer(tmp_path)
    net = SafetyNet(t)
    _step(t, net, 0)
    net.end_of_step()  # nothing anywhere
    assert exchanged == [[0, 0, -(2**62), 0]] and not net.write_failed and t.stop_requests == []
    t.write_failure = OSError("disk full")
    _step(t, net, 1)
    net.end_of_step()  # a write failed here; a signal and a write failure on the other rank
    assert exchanged[1] == [0, 0, -(2**62), 1] and net.write_failed
    assert net.interrupted == "SIGTERM" and t.stop_requests == ["SIGTERM received"], "the other rank's signal"
    t.write_failure = None
    _step(t, net, 2)
    with pytest.raises(NonFiniteStepError) as info:
        net.end_of_step()  # the other rank found step 5 bad
    assert exchanged[2] == [0, 0, -(2**62), 0]
    assert info.value.failure.other_rank_step == 5 and info.value.failure.stopped_at == 2
    assert np.array_equal(net._agree, [0, 1, -5, 0])


def test_a_bad_step_here_is_sent_to_the_other_rank_at_the_end_of_a_step(tmp_path, messages, monkeypatch):
    import torch.distributed as dist

    exchanged: list[list[int]] = []

    def all_reduce(t, op=None, group=None):
        exchanged.append(t.tolist())

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    t = _Trainer(tmp_path)
    net = SafetyNet(t)
    _step(t, net, 0)
    _step(t, net, 1, scale=math.inf)
    with pytest.raises(NonFiniteStepError) as info:
        net.end_of_step()
    assert exchanged == [[0, 1, -1, 0]], "no signal, a bad step, -its step, no write failure"
    assert info.value.failure.step == 1 and info.value.failure.other_rank_step is None, "found here"


def _state(t: _Trainer, **more: Any) -> dict:
    return {"step": t.step, "model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(), **more}


def _squared_norm(model: nn.Module) -> float:
    """The model's squared L2 weight norm, in float64."""
    return float(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().pow(2).sum())


def _refuse_sharded(t: _Trainer) -> NonFiniteCheckpointError:
    """One step, then an Inf planted in ``0.bias``: the error that refuses the sharded checkpoint."""
    net = SafetyNet(t)
    _step(t, net, 0)
    with torch.no_grad():
        t.model[0].bias[0] = math.inf
    with pytest.raises(NonFiniteCheckpointError) as info:
        net.verify(_state(t, layout=SHARDED))
    return info.value


def test_a_checkpoint_is_judged_with_every_rank_s_flags_and_the_mean_loss(tmp_path, messages):
    # verify's exchanges: the flags (max), the loss (mean), the verdict pair (max).
    t = _Trainer(tmp_path, other=[[0.0, 0.0, 0.0, 0.0], 3.0, [0.0, -1e18]])
    net = SafetyNet(t)
    _step(t, net, 0)
    loss = float(net._last[0][0])
    net.health.observe(0, {"loss": 3.0, "gradient_norm": 1.0})  # a logged row: the medians to compare with
    health = net.verify(_state(t))
    assert t.fabric.ops == ["max", "mean", "max"]
    assert health["loss"] == pytest.approx((loss + 3.0) / 2, rel=1e-6), "the ranks' mean loss"
    assert (health["step"], health["last_step"], health["healthy"]) == (1, 0, True)
    assert " at step 0 within " in health["why"]
    whole = math.sqrt(_squared_norm(t.model))
    assert health["weight_norm"] == pytest.approx(whole, rel=1e-6), "each rank holds the whole model: its norm"


def test_a_checkpoint_before_any_step_or_without_losses_holds_no_step_s_values(tmp_path, messages):
    t = _Trainer(tmp_path, world_size=1)
    t.step = 5  # resumed at step 5: no step ran in this process yet
    net = SafetyNet(t)
    net.health.observe(4, {"loss": 3.0, "gradient_norm": 1.0})
    health = net.verify(_state(t))
    assert (health["loss"], health["gradient_norm"], health["last_step"]) == ("nan", "nan", -1)
    assert health["healthy"] is True and " at step " not in health["why"], "no step of this process to name"
    net.check_gradients(5, [], torch.tensor(1.0))  # a step that recorded no loss
    t.step = 6
    health = net.verify(_state(t))
    assert (health["loss"], health["gradient_norm"], health["last_step"]) == ("nan", "nan", 5)


def test_a_sharded_checkpoint_sums_the_ranks_squared_norms(tmp_path, messages):
    t = _Trainer(tmp_path, other=[[0.0, 0.0, 0.0, 9.0], 3.0, [0.0, -1e18]])
    net = SafetyNet(t)
    _step(t, net, 0)
    state = _state(t, layout=SHARDED)
    own = net_mod.verify_tensors(state, t.fabric.device, rank=0)
    health = net.verify(state)
    assert t.fabric.ops == ["sum", "mean", "max"], "shards: the flags and squared norms summed"
    assert health["weight_norm"] == pytest.approx(math.sqrt(float(own[3]) + 9.0), rel=1e-6)


def test_a_checkpoint_with_a_non_finite_entry_on_the_other_rank_is_refused(tmp_path, messages, monkeypatch):
    import stabletrain.utils.dist as dist_utils

    monkeypatch.setattr(dist_utils, "gather_names", lambda names: pytest.fail("each rank holds the whole state"))
    t = _Trainer(tmp_path, other=[[0.0, 1.0, 0.0, 0.0], 3.0, [0.0, -1e18]])
    net = SafetyNet(t)
    _step(t, net, 0)
    with pytest.raises(NonFiniteCheckpointError) as info:
        net.verify(_state(t))
    err = info.value
    assert err.step == 1 and err.entries == []
    text = str(err)
    assert text.startswith("Refused to write the checkpoint after step 0: the state holds NaN/Inf in a tensor. "
                           "The previous checkpoint stays (none yet); training stopped. ")
    assert "The guard is off" not in text
    assert t.events[-1] == {"event": "checkpoint_refused", "step": 1, "nonfinite": []}
    again = pickle.loads(pickle.dumps(err))  # crosses process boundaries (spawned ranks) whole
    assert (type(again), str(again), again.step, again.entries) == (NonFiniteCheckpointError, text, 1, [])


def test_a_refused_checkpoint_names_the_entries_and_the_kept_file(tmp_path, messages):
    t = _Trainer(tmp_path, world_size=1, **{"guard": {"enabled": False}})
    net = SafetyNet(t)
    _step(t, net, 0)
    kept = t.out / "checkpoints" / "last.ckpt"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"the previous checkpoint")
    with torch.no_grad():
        t.model[0].weight[0, 0] = math.nan
    state = _state(t, scaler={"scale": 1.0})
    with pytest.raises(NonFiniteCheckpointError) as info:
        net.verify(state)
    text = str(info.value)
    assert info.value.entries == ["model 0.weight"]
    assert f"NaN/Inf in model 0.weight. The previous checkpoint stays ({kept}); training stopped." in text
    # Where to go on from: no checkpoint before step 1, a command that changes what failed, and why.
    assert "No checkpoint was written before step 1 " in text and " overwrite=true model_args.lr=0.0001" in text
    assert "It carries model_args.lr=0.0001 instead of 0.001 (10x lower)" in text
    assert text.endswith(" The guard is off (guard.enabled=false): turn it on to stop at the step that went bad.")


def test_an_inf_loss_scale_alone_refuses_the_checkpoint(tmp_path, messages):
    t = _Trainer(tmp_path, world_size=1)
    net = SafetyNet(t)
    _step(t, net, 0)
    with pytest.raises(NonFiniteCheckpointError, match="the state holds NaN/Inf in scaler scale. "):
        net.verify(_state(t, scaler={"scale": math.inf, "growth_factor": 2.0}))
    assert net.verify(_state(t, scaler={"scale": 65536.0, "_growth_tracker": 3}))["healthy"] is True


def test_the_verdict_terms_carry_every_rank_s_first_bad_step(tmp_path, messages):
    t = _Trainer(tmp_path, other=[[1.0, -7.0], [0.0, -1e18]])
    net = SafetyNet(t)
    _step(t, net, 0)
    own = net.guard.pending().tolist()
    terms = net.verdict_terms().tolist()
    assert terms[:-2] == own and terms[-2:] == [1.0, -7.0], "the other rank's step 7 went bad"
    _step(t, net, 1)
    _step(t, net, 2, scale=math.inf)
    assert net.verdict_terms().tolist()[-2:] == [1.0, -2.0], "this rank's step 2 is the earlier one"
    assert t.fabric.ops == ["max", "max"]
    net.replaying = True  # a replay re-runs a step: its verdict is not the run's
    assert net.verdict_terms() is None
    single = SafetyNet(_Trainer(tmp_path, world_size=1))
    assert single.verdict_terms() is single.guard.pending(), "one rank: the guard's own vector, nothing added"


def test_absorbing_a_read_stops_on_the_other_rank_s_bad_step(tmp_path, messages):
    t = _Trainer(tmp_path, other=[[1.0, -4.0]])
    net = SafetyNet(t)
    _step(t, net, 0)
    host = net.verdict_terms().tolist()
    net.absorb(host[:-2] + [0.0, -1e18], stopped_at=1)  # no rank bad: nothing happens
    with pytest.raises(NonFiniteStepError) as info:
        net.absorb(host, stopped_at=1)
    assert info.value.failure.other_rank_step == 4 and info.value.failure.stopped_at == 1
    assert info.value.failure.step == -1


def test_the_start_weight_norm_of_a_sharded_model_adds_the_ranks_squares(tmp_path, messages, monkeypatch):
    import torch.distributed as dist

    groups = []
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda backend: groups.append(backend) or "gloo group")
    t = _Trainer(tmp_path, other=[16.0])
    t.sharded = True
    net = SafetyNet(t)
    own = _squared_norm(t.model)
    net.start()
    try:
        assert groups == ["gloo"] and net._group == "gloo group", "the host exchange gets a gloo group under NCCL"
        assert t.fabric.ops == ["sum"]
        assert net.health.initial_weight_norm == pytest.approx(math.sqrt(own + 16.0), rel=1e-6)
    finally:
        net.close()


def test_a_first_step_that_goes_bad_is_named_logged_and_leads(tmp_path, messages):
    t = _Trainer(tmp_path, other=[0.0, [0.0, -1e18]])
    net = SafetyNet(t)
    _step(t, net, 0, scale=math.inf)
    with pytest.raises(NonFiniteStepError) as info:
        net.any_rank(False)
    err = info.value
    assert (err.step, err.failure.other_rank_step, messages["level"]) == (0, None, 2)
    assert t.events[0]["step"] == 0 and [s for s, _ in t.rows] == [0], "step 0 is a step: its row is logged"


def test_a_failure_found_here_without_a_bad_loss_leads_at_level_1_and_is_captured(tmp_path, messages, monkeypatch):
    import stabletrain.safety.optimizer_capture as optimizer_capture

    captured = []
    monkeypatch.setattr(optimizer_capture, "capture_optimizer_step",
                        lambda t, failure: captured.append(failure.step) or tmp_path / "capture")
    t = _Trainer(tmp_path, other=[0.0, [0.0, -1e18]], debug_args={"nancapture": {"enabled": True}})
    net = SafetyNet(t)
    x = torch.randn(8, 4)
    (t.model(x) ** 2).mean().backward()  # step 0: finite loss and gradients, then the update breaks a weight
    net.check_gradients(0, [torch.tensor(1.0)], compute_grad_norm(t.model.named_parameters()).total)
    with torch.no_grad():
        t.model[2].bias.fill_(math.nan)
    net.check_update(0)
    t.step = 1
    messages["best"] = types.SimpleNamespace(path=tmp_path / "step_000000.ckpt")
    messages["names"] = [f"p{i}" for i in range(25)]
    with pytest.raises(NonFiniteStepError) as info:
        net.any_rank(False)
    err = info.value
    assert err.origin == "optimizer_step" and err.step == 0 and messages["level"] == 1, "found here, loss finite"
    assert captured == [0] and messages["capture"] == tmp_path / "capture" == err.capture_path
    assert err.checkpoint == tmp_path / "step_000000.ckpt"
    assert t.events[0]["param_names"] == t.events[0]["state_entries"] == [f"p{i}" for i in range(20)]


def test_a_forward_failure_is_not_captured_as_an_optimizer_step(tmp_path, messages, monkeypatch):
    import stabletrain.safety.optimizer_capture as optimizer_capture

    monkeypatch.setattr(optimizer_capture, "capture_optimizer_step",
                        lambda t, failure: pytest.fail("not an optimizer step"))
    t = _Trainer(tmp_path, world_size=1, debug_args={"nancapture": {"enabled": True}})
    del t.settle_checkpoints  # a trainer without asynchronous checkpoints
    net = SafetyNet(t)
    _step(t, net, 0)
    with pytest.raises(NonFiniteStepError) as first:
        _step(t, net, 1, scale=math.inf)  # one rank: the verdict is on the host at once
    assert first.value.step == 1 and first.value.failure.stopped_at == 1
    with pytest.raises(NonFiniteStepError) as info:
        net.fail(None, stopped_at=2)  # no verdict given: read here
    err = info.value
    assert err.step == 1 and err.failure.stopped_at == 2
    assert err.capture_path is None and messages["capture"] is None
    assert not err.other_rank and t.fabric.barriers == 0 and "level" not in messages, "one rank: no exchange"


def test_under_fsdp_every_rank_names_all_ranks_tensors(tmp_path, messages, monkeypatch):
    joined = []

    def join(failure):
        joined.append(failure.step)
        failure.param_names = ["0.weight (rank 0)", "0.weight (rank 1)"]
        return failure

    monkeypatch.setattr(net_mod, "join_rank_failures", join)
    t = _Trainer(tmp_path, other=[0.0, [0.0, -1e18]])
    t.sharded = True
    net = SafetyNet(t)
    _step(t, net, 0, scale=math.inf)
    with pytest.raises(NonFiniteStepError) as info:
        net.any_rank(False)
    assert joined == [0] and info.value.failure.param_names == ["0.weight (rank 0)", "0.weight (rank 1)"]
    t2 = _Trainer(tmp_path / "two", other=[0.0, [0.0, -1e18]])  # not sharded: each rank names its own
    net2 = SafetyNet(t2)
    _step(t2, net2, 0, scale=math.inf)
    with pytest.raises(NonFiniteStepError):
        net2.any_rank(False)
    assert joined == [0]


def test_a_refused_sharded_checkpoint_joins_the_ranks_entries(tmp_path, messages, monkeypatch):
    import stabletrain.utils.dist as dist_utils

    monkeypatch.setattr(dist_utils, "gather_names", lambda names: [*names, "model 2.weight (rank 1)"])
    err = _refuse_sharded(_Trainer(tmp_path, other=[[0.0, 0.0, 0.0, 1.0], 3.0, [0.0, -1e18]]))
    assert err.entries == ["model 0.bias", "model 2.weight (rank 1)"]
    assert "NaN/Inf in model 0.bias, model 2.weight (rank 1). " in str(err)


def test_one_rank_reads_its_own_flag_and_verdict_without_an_exchange(tmp_path, messages, monkeypatch):
    t = _Trainer(tmp_path, world_size=1)
    net = SafetyNet(t)
    _step(t, net, 0)
    assert net.any_rank(False) is False and net.any_rank(True) is True and t.fabric.ops == []
    t.sharded = True  # one rank's shards are the whole model: nothing to join
    monkeypatch.setattr(net_mod, "join_rank_failures", lambda failure: pytest.fail("one rank: nothing to join"))
    net.guard._state[0] = 0.0  # the verdict says step 0 went bad (as its device vector would)
    with pytest.raises(NonFiniteStepError) as info:
        net.any_rank(False)
    assert info.value.failure.other_rank_step is None and not info.value.other_rank


def test_without_the_guard_the_flag_alone_is_exchanged(tmp_path, messages):
    t = _Trainer(tmp_path, other=[0.0, 1.0], guard={"enabled": False})
    net = SafetyNet(t)
    assert net.guard is None
    _step(t, net, 0)
    assert net.any_rank(True) is True and net.any_rank(False) is True, "the other rank's flag"
    assert t.fabric.ops == ["max", "max"]


class _Healer:
    is_healer = True

    def __init__(self):
        self.calls: list[str] = []

    def check(self, step, losses, grad_norm):
        self.calls.append(f"check {step}")
        return None

    def after_step(self):
        self.calls.append("after_step")

    def end_of_step(self):
        self.calls.append("end_of_step")


def test_a_new_net_holds_this_run_s_settings_and_nothing_yet(tmp_path, messages):
    t = _Trainer(tmp_path, rank=1, trend_alerts={"window": 7}, model_args={"warmup_steps": 9})
    t.precision = "bf16-mixed"
    healer = _Healer()
    t.callbacks.callbacks.append(healer)
    net = SafetyNet(t)
    assert (net.guard.rank, net.guard.world_size) == (1, 2)
    assert net.health.args is t.settings.trend_alerts and net.health.detector.warmup_steps == 9
    mechanisms = net.health.mechanisms
    assert mechanisms.args is t.settings.debug_args.mechanisms and mechanisms.context.precision == "bf16-mixed"
    assert net.healer is healer
    assert (net.write_failed, net._last, net.step_batches, net.start_state) == (False, None, None, None)
    assert net._agree.dtype == np.int64, "steps exchanged as integers"
    batches = [([0, 1], {"x": torch.zeros(2)})]
    _step(t, net, 0)
    net.check_gradients(1, [torch.tensor(1.0)], torch.tensor(1.0), batches=batches)
    assert net.step_batches[0] == 1 and net.step_batches[1] is batches
    net.check_update(1)
    assert healer.calls == ["check 0", "after_step", "check 1", "after_step"]
    net.replaying = True  # a replay re-runs a step: the healer neither judges nor undoes it
    net.check_gradients(2, [torch.tensor(1.0)], torch.tensor(1.0))
    net.check_update(2)
    assert healer.calls[-1] == "after_step" and len(healer.calls) == 4
    off = SafetyNet(_Trainer(tmp_path / "off", debug_args={"mechanisms": {"enabled": False}}))
    assert off.health.mechanisms is None


def test_starting_keeps_the_start_state_for_a_capture_and_measures_the_weights(tmp_path, messages, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "new_group", lambda backend: pytest.fail("gloo already: no second group"))
    t = _Trainer(tmp_path, world_size=1, debug_args={"nancapture": {"enabled": True}})
    asked = []
    t.checkpoint_state = lambda on_cpu, layout: asked.append((on_cpu, layout)) or {"step": t.step}
    net = SafetyNet(t)
    net.start()
    net.close()
    whole = math.sqrt(_squared_norm(t.model))
    assert net.health.initial_weight_norm == pytest.approx(whole, rel=1e-6)
    assert asked == [(True, None)] and net.start_state == {"step": 0}, "a fresh run keeps its start on the CPU"
    t.sharded = True  # one rank's shards: the whole model, no exchange
    net = SafetyNet(t)
    net.start()
    net.close()
    assert asked[-1] == (True, "sharded") and t.fabric.ops == []
    assert net.health.initial_weight_norm == pytest.approx(whole, rel=1e-6)
    t.step = 5  # resumed: the checkpoint is the start to go back to
    net = SafetyNet(t)
    net.start()
    net.close()
    assert len(asked) == 2 and net.start_state is None
    two = _Trainer(tmp_path / "two", other=[])
    net = SafetyNet(two)
    net.health.initial_weight_norm = 1.0  # a resumed run's: not measured again
    net.start()
    net.close()
    assert net._group is None and two.fabric.ops == []


def test_one_rank_stops_at_a_bad_first_step_at_once(tmp_path, messages):
    t = _Trainer(tmp_path, world_size=1)
    net = SafetyNet(t)
    with pytest.raises(NonFiniteStepError) as info:
        _step(t, net, 0, scale=math.inf)
    assert (info.value.step, info.value.failure.stopped_at) == (0, 0), "before the optimizer step"
    assert t.settled == 1 and t.fabric.barriers == 0, "checkpoints settled; one rank waits for no other"
    t2 = _Trainer(tmp_path / "read", world_size=1)
    net2 = SafetyNet(t2)
    net2.absorb([], stopped_at=0)  # nothing read: nothing to take
    state = net2.guard.pending().clone()
    state[0] = 0.0  # a read that says step 0 went bad
    with pytest.raises(NonFiniteStepError) as info:
        net2.absorb(state.tolist(), stopped_at=1)
    assert info.value.step == 0 and info.value.failure.stopped_at == 1
    off = SafetyNet(_Trainer(tmp_path / "off", world_size=1, guard={"enabled": False}))
    off.absorb(state.tolist(), stopped_at=1)  # no guard: nothing to take, nothing to stop


def test_the_verdict_terms_of_a_bad_first_step(tmp_path, messages):
    t = _Trainer(tmp_path, other=[[0.0, -1e18]])
    net = SafetyNet(t)
    _step(t, net, 0, scale=math.inf)
    assert net.verdict_terms().tolist()[-2:] == [1.0, 0.0], "step 0 went bad here"


def test_one_rank_s_refused_sharded_checkpoint_names_its_own_entries(tmp_path, messages, monkeypatch):
    import stabletrain.utils.dist as dist_utils

    monkeypatch.setattr(dist_utils, "gather_names", lambda names: pytest.fail("one rank: nothing to join"))
    assert _refuse_sharded(_Trainer(tmp_path, world_size=1)).entries == ["model 0.bias"]
