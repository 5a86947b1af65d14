"""The self-healing's recovery path (safety/healing.py), in process: what one recovery writes (row,
console line, quarantine.json), where the sample search runs, what a rollback restores, and what
one rank of two does with what the collectives bring back from the other rank.

The end-to-end runs are in test_self_healing.py. Here the Healer is the real one, with a small real
model, optimizer, guard and health tracker; the trainer around it, the capture writer, the sample
search and torch.distributed's collectives are stand-ins, so that each decision is checked on its own
(docs/self_healing.md).
"""

from __future__ import annotations

import copy
import json
import math
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from healer_steps import train_step
from torch import nn

import stabletrain.debug.diagnose as diagnose_mod
import stabletrain.distributed.dcp as dcp
from stabletrain.config import load_settings
from stabletrain.safety import healing
from stabletrain.safety.checkpoint_health import HealthTracker
from stabletrain.safety.healing import Healer, RecoveryLimitError, _replay_model
from stabletrain.safety.instability_guard import Recovery
from stabletrain.training import state as trainer_state

NAN = float("nan")


class _Fabric:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.barriers = 0

    def all_reduce(self, t: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "mean"
        return t  # the other rank's loss is the same: the mean is this rank's

    def barrier(self) -> None:
        self.barriers += 1


class _Trainer:
    """What the Healer reads of its trainer, for a small real model and optimizer."""

    def __init__(self, tmp_path: Path, policy: str = "skip_step", *, world_size: int = 1, rank: int = 0,
                 sharded: bool = False, task: str = "lm", **on_instability: Any):
        torch.manual_seed(0)
        self.out = tmp_path / "run"
        self.settings = load_settings({"out": self.out, "on_instability": {"policy": policy, **on_instability}})
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scaler = None
        self.precision = "32-true"
        self.rank, self.world_size, self.sharded = rank, world_size, sharded
        self.is_rank_zero = rank == 0
        self.fabric = _Fabric()
        self.step = 0
        self.microbatches_consumed = 0
        self.task = types.SimpleNamespace(model_meta={})
        self._task = task
        self.safety = types.SimpleNamespace(health=HealthTracker(self.settings.trend_alerts))
        self.lines: list[str] = []
        self.console = types.SimpleNamespace(info=self.lines.append)
        self.events: list[dict[str, Any]] = []
        self.quarantined: frozenset[int] = frozenset()
        self.loaders_built = 0
        self.cpu_copies = 0  # checkpoint states copied to the CPU: each a host copy of every state tensor
        self.unsharded = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def resolved_settings(self) -> dict[str, Any]:
        return {"task": self._task}

    def log_event(self, row: dict[str, Any]) -> None:
        self.events.append(copy.deepcopy(row))

    def build_loader(self) -> None:
        self.loaders_built += 1

    def checkpoint_state(self, on_cpu: bool = False, layout: Any = None) -> dict[str, Any]:
        self.cpu_copies += on_cpu
        return trainer_state.checkpoint_state(self, on_cpu, layout)

    def unsharded_model(self) -> nn.Module:
        return self.unsharded


class _Monitor:
    """The capture writer holding the batches of step ``step``: writes a file where the healer says."""

    def __init__(self, step: int, bad: tuple[int, ...] = ()):
        self.step, self.bad = step, list(bad)
        self.out_dir: Path | None = None
        self.replay_command = ""
        self.reasons: list[str] = []

    def write_capture(self, reason: str, extra: dict[str, Any]) -> Path:
        assert self.out_dir is not None
        path = self.out_dir / "rank0" / "nan_capture.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"capture")
        self.reasons.append(reason)
        return path

    def nonfinite_samples(self) -> list[int]:
        return list(self.bad)


class _Search:
    """isolate_samples: records the capture folders and models it was given, returns ``found``."""

    def __init__(self, monkeypatch, found: list[dict[str, Any]] = (), error: Exception | None = None):
        self.found, self.error = list(found), error
        self.calls: list[tuple[Path, Any]] = []
        monkeypatch.setattr(healing, "isolate_samples", self)

    def __call__(self, capture, model=None):
        self.calls.append((Path(capture), model))
        if self.error is not None:
            raise self.error
        return [dict(e) for e in self.found]


class _OtherRank:
    """torch.distributed's all_gather_object as rank ``rank`` of two: the other rank's object is the
    next of ``theirs`` (the RNG states a snapshot gathers are alike on both)."""

    def __init__(self, monkeypatch, rank: int, theirs: list[Any]):
        self.rank, self.theirs = rank, list(theirs)
        self.sent: list[Any] = []
        monkeypatch.setattr(dist, "all_gather_object", self.all_gather_object)

    def all_gather_object(self, out: list[Any], obj: Any) -> None:
        if isinstance(obj, dict):  # a snapshot's RNG states
            other = copy.deepcopy(obj)
        else:
            self.sent.append(obj)
            other = self.theirs.pop(0)
        out[self.rank], out[1 - self.rank] = obj, other


def _rec(t: _Trainer, step: int, trigger: str = "nonfinite_loss", samples: tuple[int, ...] = (1, 2, 3, 4),
         loss: float = NAN, gradient_norm: float = 2.5) -> Recovery:
    spike = trigger.endswith("spike")
    return Recovery(step=step, trigger=trigger, zscore=9.0 if spike else NAN, ratio=NAN, loss=loss,
                    gradient_norm=gradient_norm, action=t.settings.on_instability.policy, samples=list(samples),
                    description=f"{trigger} (z=9.0)" if spike else trigger)


def _step(t: _Trainer, healer: Healer, step: int, indices: list[int], scale: float = 1.0) -> None:
    """One training step with the healer's calls; ``scale`` inf makes the loss non-finite."""
    train_step(t, healer, step, {"x": torch.randn(len(indices), 4)}, indices,
               lambda batch: (t.model(batch["x"] * scale) ** 2).mean())


def _recovered(t: _Trainer) -> list[dict[str, Any]]:
    return [e for e in t.events if e.get("event") == "recovery"]


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ one recovery: row and console line


def test_each_recovery_is_numbered_and_without_a_capture_its_row_says_null(tmp_path):
    t = _Trainer(tmp_path)
    healer = Healer(t)
    healer._handle([_rec(t, 3, samples=(5, 6)), _rec(t, 7, "loss_spike", samples=(8, 9), loss=40.0)])
    rows = _recovered(t)
    assert [(r["step"], r["recovery"]) for r in rows] == [(3, 1), (7, 2)]
    assert [r["capture"] for r in rows] == [None, None], "no batches held: capture null, not the string 'None'"
    assert [r["samples"] for r in rows] == [r["skipped_samples"] for r in rows] == [[5, 6], [8, 9]]
    assert t.lines == ["Recovered step 3: nonfinite_loss; update skipped; samples [5, 6]",
                       "Recovered step 7: loss_spike (z=9.0); update skipped; samples [8, 9]"]


def test_a_captured_recovery_names_its_capture_in_the_row_and_the_line(tmp_path, monkeypatch):
    search = _Search(monkeypatch)
    t = _Trainer(tmp_path)
    healer = Healer(t)
    healer.monitor = _Monitor(4)
    healer._handle([_rec(t, 4)])
    capture = t.out / "debug" / "recoveries" / "step4" / "rank0" / "nan_capture.pt"
    (row,) = _recovered(t)
    assert row["capture"] == str(capture) and capture.is_file()
    assert search.calls == [(capture.parent, None)], "a non-finite step with a capture is searched"
    assert (row["culprits"], row["quarantined"]) == ([], [])
    assert t.lines == [f"Recovered step 4: nonfinite_loss; update skipped; samples [1, 2, 3, 4]; capture: {capture}"]


def test_a_culprit_is_named_first_with_its_evidence_and_quarantined(tmp_path, monkeypatch):
    evidence = "batch['x'] holds 1 non-finite value(s)"
    _Search(monkeypatch, [{"index": 4, "how": "input", "field": "batch['x']", "count": 1, "evidence": evidence}])
    t = _Trainer(tmp_path)
    healer = Healer(t)
    healer.monitor = _Monitor(6)
    healer._handle([_rec(t, 6, gradient_norm=math.inf)])
    (row,) = _recovered(t)
    assert (row["culprits"], row["quarantined"], row["action"]) == ([4], [4], "skip_step")
    # The isolated culprit leads the samples (there is no NaN/Inf in the captured data here: none marked).
    assert t.lines == [f"Recovered step 6: nonfinite_loss; update skipped; culprit sample(s) 4: {evidence}; "
                       f"quarantined; samples [4, 1, 2, 3]; capture: {row['capture']}"]
    # quarantine.json: the index, the step, the trigger, the step's loss and gradient norm, the evidence, the capture.
    saved = json.loads((t.out / "quarantine.json").read_text())["samples"]
    assert saved == [{"index": 4, "how": "input", "field": "batch['x']", "count": 1, "evidence": evidence,
                      "step": 6, "trigger": "nonfinite_loss", "step_loss": "nan", "step_gradient_norm": "inf",
                      "capture": row["capture"]}]
    assert t.quarantined == {4} and t.loaders_built == 1, "the loader skips it from the next step on"
    # Found again later: already quarantined, not written or applied again.
    healer.monitor = _Monitor(9)
    healer._handle([_rec(t, 9, samples=(4, 7))])
    assert _recovered(t)[-1]["quarantined"] == [] and t.loaders_built == 1
    assert "; already quarantined; samples [4, 7]" in t.lines[-1]


def test_a_recovery_opens_the_spike_episode_of_its_trigger(tmp_path):
    t = _Trainer(tmp_path)
    healer = Healer(t)
    healer._handle([_rec(t, 12, "grad_spike")])
    why = t.safety.health.assess(13, last_step=12, loss=1.0, gradient_norm=1.0, weight_norm=1.0)["why"]
    assert "the grad_spike episode the self-healing recovered from at step 12 is still open" in why


# ------------------------------------------------------------------ the sample search


def test_only_a_captured_non_finite_step_is_searched(tmp_path, monkeypatch):
    search = _Search(monkeypatch, [{"index": 1, "how": "input", "evidence": "x"}])
    t = _Trainer(tmp_path)
    healer = Healer(t)
    healer.monitor = _Monitor(5)
    healer._handle([_rec(t, 5, "loss_spike", loss=50.0)])  # captured, but a spike: finite values, nothing to search
    healer._handle([_rec(t, 8)])  # non-finite, but its batches are gone: no capture to search
    assert search.calls == [] and [r["culprits"] for r in _recovered(t)] == [[], []]
    assert not any("Could not search" in line for line in t.lines)
    assert _recovered(t)[0]["capture"] is not None


def test_the_search_replays_your_own_model_but_rebuilds_a_built_in_one(tmp_path, monkeypatch):
    search = _Search(monkeypatch)
    t = _Trainer(tmp_path / "custom", task="custom")
    healer = Healer(t)
    healer.monitor = _Monitor(2)
    healer._handle([_rec(t, 2)])
    # The trainer's model itself: the search copies what it replays into (no second copy of the model here).
    assert search.calls[-1][1] is t.model
    builtin = _Trainer(tmp_path / "lm", task="lm")
    healer = Healer(builtin)
    healer.monitor = _Monitor(2)
    healer._handle([_rec(builtin, 2)])
    assert search.calls[-1][1] is None, "a built-in model is rebuilt from the capture's settings"


def test_a_search_that_fails_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    _Search(monkeypatch, error=ValueError("the capture holds no batches"))
    t = _Trainer(tmp_path)
    healer = Healer(t)
    healer.monitor = _Monitor(5)
    healer._handle([_rec(t, 5)])
    assert t.lines[0] == "Could not search the samples of step 5: ValueError: the capture holds no batches"
    assert _recovered(t)[0]["culprits"] == [] and t.lines[1].startswith("Recovered step 5: nonfinite_loss;")


# ------------------------------------------------------------------ two ranks


def test_two_ranks_record_every_rank_s_samples_in_rank_order(tmp_path, monkeypatch):
    search = _Search(monkeypatch)
    # Rank 1 of two: the other rank (0) found no culprit and held samples 10, 11 of the step.
    ranks = _OtherRank(monkeypatch, rank=1, theirs=[[], [10, 11]])
    t = _Trainer(tmp_path, world_size=2, rank=1)
    healer = Healer(t)
    healer._handle([_rec(t, 3, samples=(20, 21))])
    (row,) = _recovered(t)
    assert row["samples"] == row["skipped_samples"] == [10, 11, 20, 21]
    assert ranks.sent == [[], [20, 21]] and ranks.theirs == []
    assert t.fabric.barriers == 0, "DDP: each rank writes and reads its own capture, no barrier"
    assert search.calls == []
    assert t.lines == ["Recovered step 3: nonfinite_loss; update skipped; samples [10, 11, 20, 21]"]


def test_under_ddp_each_rank_searches_its_own_capture_and_the_culprits_are_joined(tmp_path, monkeypatch):
    mine = {"index": 21, "how": "input", "evidence": "batch['x'] holds 2 non-finite value(s)"}
    theirs = {"index": 10, "how": "replay", "evidence": "replayed alone its loss is nan"}
    search = _Search(monkeypatch, [mine])
    _OtherRank(monkeypatch, rank=1, theirs=[[theirs], [10, 11], []])
    t = _Trainer(tmp_path, world_size=2, rank=1)
    healer = Healer(t)
    healer.monitor = _Monitor(3)
    healer._handle([_rec(t, 3, samples=(20, 21))])
    assert len(search.calls) == 1, "rank 1 of a DDP run searches its own microbatches"
    (row,) = _recovered(t)
    assert row["culprits"] == [10, 21] and row["quarantined"] == [10, 21]
    assert t.quarantined == {10, 21}
    assert not (t.out / "quarantine.json").exists(), "rank 0 writes quarantine.json"


@pytest.mark.parametrize("rank", [0, 1])
def test_under_fsdp_rank_0_alone_searches_the_joined_capture_after_a_barrier(tmp_path, monkeypatch, rank):
    found = {"index": 9, "how": "input", "evidence": "batch['x'] holds 1 non-finite value(s)"}
    search = _Search(monkeypatch, [found])
    # The gathers: the culprits found (rank 0's, or none from rank 1), the samples, the samples with NaN/Inf data.
    _OtherRank(monkeypatch, rank=rank, theirs=[[] if rank == 0 else [found], [30, 31], []])
    t = _Trainer(tmp_path, world_size=2, rank=rank, sharded=True, task="custom")
    healer = Healer(t)
    healer.monitor = _Monitor(4)
    healer._handle([_rec(t, 4, samples=(20, 21))])
    assert t.fabric.barriers == 1, "every rank's capture files are written before any is read"
    # Under FSDP2 the search replays into the unsharded model (DTensors do not run outside the mesh).
    assert [m for _, m in search.calls] == ([t.unsharded] if rank == 0 else [])
    (row,) = _recovered(t)
    assert row["culprits"] == [9] and t.quarantined == {9}
    assert row["samples"] == ([20, 21, 30, 31] if rank == 0 else [30, 31, 20, 21])


def test_one_rank_s_shards_need_no_barrier(tmp_path, monkeypatch):
    _Search(monkeypatch)
    t = _Trainer(tmp_path, sharded=True)
    healer = Healer(t)
    healer.monitor = _Monitor(4)
    healer._handle([_rec(t, 4)])
    assert t.fabric.barriers == 0 and _recovered(t)[0]["capture"] is not None


def test_on_a_gpu_under_ddp_the_ranks_agree_on_how_many_verdicts_to_read(tmp_path, monkeypatch):
    theirs = iter([0, 2])  # the other rank's ready verdicts at each end of step
    exchanged: list[list[int]] = []

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        assert group is healer._group, "host integers over the gloo group"
        exchanged.append(t.tolist())
        other = next(theirs)
        if op == dist.ReduceOp.MIN:
            t.copy_(torch.minimum(t, torch.tensor(other)))
        elif op == dist.ReduceOp.SUM:
            t.add_(other)
        else:
            raise ValueError(f"unexpected reduction {op}")

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    _OtherRank(monkeypatch, rank=0, theirs=[[], [40, 41]])
    t = _Trainer(tmp_path, world_size=2)
    healer = Healer(t)
    healer._group = "gloo group"  # what on_train_start makes under NCCL
    _step(t, healer, 0, [0, 1])
    # This rank has step 0's verdict, the other rank none yet: nothing is read, the verdict waits.
    assert exchanged == [[1]] and healer.guard.ready_count() == 1 and _recovered(t) == []
    _step(t, healer, 1, [2, 3], scale=math.inf)
    assert exchanged == [[1], [2]] and healer.guard.ready_count() == 0
    (row,) = _recovered(t)
    assert (row["step"], row["trigger"], row["samples"]) == (1, "nonfinite_loss", [2, 3, 40, 41])


# ------------------------------------------------------------------ rollback


def test_rollback_restores_the_snapshot_and_skips_the_data_since(tmp_path):
    t = _Trainer(tmp_path, "rollback", rollback_steps=2)
    healer = Healer(t)
    healer._take_snapshot()  # on_train_start's
    _step(t, healer, 0, [0, 1])
    _step(t, healer, 1, [2, 3])  # t.step 2: the periodic snapshot
    assert healer.snapshot["step"] == 2
    weights, moments = _weights(t.model), copy.deepcopy(t.optimizer.state_dict()["state"])
    rng = torch.get_rng_state()
    _step(t, healer, 2, [4, 5])
    t.optimizer.param_groups[0]["weight_decay"] = 0.3  # a hyperparameter changed since (a callback)
    t.optimizer.param_groups[0]["lr"] = 0.004
    _step(t, healer, 3, [6, 7], scale=math.inf)  # non-finite, no capture, no culprit: rolled back
    (row,) = _recovered(t)
    assert (row["action"], row["rolled_back_to"], row["skipped_steps"], row["skipped_samples"]) == (
        "rollback", 2, [2, 3], [4, 5, 6, 7])
    assert t.step == 2
    after = _weights(t.model)
    assert all(torch.equal(weights[k], after[k]) for k in weights)
    state = t.optimizer.state_dict()["state"]
    assert all(torch.equal(moments[p][k], state[p][k]) for p in moments for k in moments[p])
    # Only the state comes back: the optimizer keeps its hyperparameters, as every resume does.
    assert (t.optimizer.param_groups[0]["weight_decay"], t.optimizer.param_groups[0]["lr"]) == (0.3, 0.004)
    assert torch.equal(torch.get_rng_state(), rng)
    # The rows of the abandoned steps are superseded: a resume row before the re-run, then the recovery.
    assert t.events[0] == {"event": "resume", "step": 2, "reason": "rollback after step 3"}
    assert t.lines == ["Recovered step 3: nonfinite_loss; rolled back to step 2, 2 step(s) of data skipped; "
                       "samples [6, 7]"]


def test_rollback_restores_the_fp16_loss_scale(tmp_path):
    t = _Trainer(tmp_path, "rollback")
    t.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    t.scaler.scale(torch.tensor(1.0))  # a first scaled loss: the scale exists
    healer = Healer(t)
    healer._take_snapshot()
    t.scaler.update(new_scale=64.0)  # backed off since
    healer._handle([_rec(t, 5, "loss_spike", loss=30.0)])
    assert t.scaler.get_scale() == 1024.0 and _recovered(t)[0]["rolled_back_to"] == 0


@pytest.mark.parametrize("layout", ["sharded", None])
def test_a_sharded_snapshot_puts_back_each_rank_s_shards(tmp_path, monkeypatch, layout):
    put_back = []

    def set_sharded_state(model, optimizer, state):
        put_back.append((model, optimizer, state))
        real(model, optimizer, state)

    real = dcp.set_sharded_state
    monkeypatch.setattr(dcp, "set_sharded_state", set_sharded_state)
    t = _Trainer(tmp_path, "rollback", sharded=layout is not None)
    healer = Healer(t)
    _step(t, healer, 0, [0, 1])
    snap = t.checkpoint_state(on_cpu=True)
    snap["callbacks"]["on_instability"] = healer.guard.state_dict()
    if layout is not None:
        snap["layout"] = layout  # the shards of this rank (one rank: the whole model)
    healer._set_snapshot(snap)
    weights = _weights(t.model)
    _step(t, healer, 1, [2, 3])
    healer._handle([_rec(t, 1, "loss_spike", loss=30.0)])
    assert put_back == ([(t.model, t.optimizer, snap)] if layout else [])
    after = _weights(t.model)
    assert all(torch.equal(weights[k], after[k]) for k in weights) and t.step == 1


def test_a_rollback_without_a_snapshot_fails_loudly(tmp_path):
    t = _Trainer(tmp_path, "rollback")
    healer = Healer(t)
    with pytest.raises(AssertionError, match="^rollback without a snapshot$"):
        healer._rollback(_rec(t, 3, "loss_spike"))


def test_two_ranks_rollback_skips_every_rank_s_samples(tmp_path, monkeypatch):
    # The gathers at the recovery: culprits (none), the step's samples, the skipped samples since the snapshot.
    _OtherRank(monkeypatch, rank=0, theirs=[[], [50, 51], [48, 49, 50, 51]])
    t = _Trainer(tmp_path, "rollback", world_size=2)
    healer = Healer(t)
    healer._take_snapshot()
    _step(t, healer, 0, [0, 1])
    _step(t, healer, 1, [2, 3], scale=math.inf)
    (row,) = _recovered(t)
    assert row["samples"] == [2, 3, 50, 51]
    assert row["skipped_samples"] == [0, 1, 2, 3, 48, 49, 50, 51] and row["skipped_steps"] == [0, 1]


def test_snapshots_every_rollback_steps_but_not_inside_an_open_spike(tmp_path):
    t = _Trainer(tmp_path, "rollback", rollback_steps=2)
    healer = Healer(t)
    _step(t, healer, 0, [0, 1])
    assert healer.snapshot is None and t.cpu_copies == 0
    _step(t, healer, 1, [2, 3])
    assert healer.snapshot["step"] == 2 and t.cpu_copies == 1, "every rollback_steps steps"
    _step(t, healer, 2, [4, 5], scale=math.inf)  # rolled back to 2: the spike episode is open
    assert t.step == 2 and t.safety.health.spike_open
    _step(t, healer, 2, [6, 7])
    _step(t, healer, 3, [8, 9])  # t.step 4, still inside the spike: the older snapshot stays the one to return to
    assert healer.snapshot["step"] == 2 and t.cpu_copies == 1
    _step(t, healer, 4, [10, 11], scale=math.inf)
    last = _recovered(t)[-1]
    assert (last["rolled_back_to"], last["skipped_steps"], last["skipped_samples"]) == (2, [2, 3, 4], [6, 7, 8, 9, 10, 11])
    assert "rolled back to step 2 for the 2nd time" in t.lines[-1]


# ------------------------------------------------------------------ over max_recoveries


def _over_the_limit(tmp_path, monkeypatch, diagnose: bool) -> tuple[_Trainer, RecoveryLimitError, list[Path]]:
    diagnosed: list[Path] = []

    def fake_diagnose(folder, model=None):
        diagnosed.append(Path(folder))
        return types.SimpleNamespace(verdict=f"verdict of {Path(folder).parent.name}")

    monkeypatch.setattr(diagnose_mod, "diagnose", fake_diagnose)
    _Search(monkeypatch)
    t = _Trainer(tmp_path, max_recoveries=5, diagnose=diagnose)
    healer = Healer(t)
    with pytest.raises(RecoveryLimitError) as info:
        for step in range(10, 80, 10):
            healer.monitor = _Monitor(step)
            healer._handle([_rec(t, step)])
    return t, info.value, diagnosed


def test_over_max_recoveries_the_stop_diagnoses_the_last_capture_too(tmp_path, monkeypatch):
    t, err, diagnosed = _over_the_limit(tmp_path, monkeypatch, diagnose=True)
    capture = t.out / "debug" / "recoveries" / "step60" / "rank0" / "nan_capture.pt"
    assert (err.step, err.recoveries, err.capture_path) == (60, 5, capture)
    rows = _recovered(t)
    assert [r["action"] for r in rows] == ["skip_step"] * 5 + ["stop"] and rows[-1]["recovery"] == 6
    # The first 5 captures and the last one, diagnosed now that training has stopped.
    assert [d.parent.name for d in diagnosed] == ["step10", "step20", "step30", "step40", "step50", "step60"]
    text = str(err)
    assert text.startswith("Step 60: nonfinite_loss, after 5 recoveries (on_instability.max_recoveries): "
                           f"stopping; capture: {capture}.\n")
    assert text.endswith("Diagnosis of the captures (diagnosis.json next to each):\n"
                         "  recovery 4: verdict of step40\n  recovery 5: verdict of step50\n"
                         "  recovery 6: verdict of step60")
    assert "Recovered step 60" not in "\n".join(t.lines), "the error says it: no recovery line"


def test_over_max_recoveries_without_diagnose_nothing_is_diagnosed(tmp_path, monkeypatch):
    t, err, diagnosed = _over_the_limit(tmp_path, monkeypatch, diagnose=False)
    assert diagnosed == [] and "Diagnosis" not in str(err), "on_instability.diagnose=false: nothing is diagnosed"
    assert not any("diagnos" in line for line in t.lines)
    assert str(err).startswith("Step 60: nonfinite_loss, after 5 recoveries")


# ------------------------------------------------------------------ the model a capture is replayed into


def test_the_replay_model_is_a_deep_copy_or_under_fsdp_the_unsharded_one(tmp_path):
    t = _Trainer(tmp_path)
    model = _replay_model(t)
    assert model is not t.model
    for (name, p), q in zip(t.model.named_parameters(), model.parameters()):
        assert q is not p and torch.equal(p, q), name
    with torch.no_grad():
        next(model.parameters()).fill_(7.0)
    assert not torch.equal(next(t.model.parameters()), next(model.parameters())), "the trainer's weights untouched"
    plain = types.SimpleNamespace(model=t.model)  # a trainer that knows nothing of sharding
    assert isinstance(_replay_model(plain), nn.Sequential) and _replay_model(plain) is not t.model
    t.sharded = True
    assert _replay_model(t) is t.unsharded
