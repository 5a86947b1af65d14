"""The Healer's life in the trainer (docs/self_healing.md): what it sets up at the start of training
(the capture monitor, the detector's thresholds, the exchanges under DDP), what it puts into and takes
out of a checkpoint (the detector's window, the recoveries made, the quarantine), the rollback snapshot
taken at a checkpoint, and what it lets go of at the end.

The Healer runs in-process against a small stub of the trainer (a real model, optimizer, guard, capture
monitor and the trainer's own ``checkpoint_state``; the console, the event rows, the loader rebuilds and,
for a rank of two, the collectives are stubs), each test in well under a second.
"""

from __future__ import annotations

import gc
import math
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from healer_steps import Net, train_step

from stabletrain.config import load_settings
from stabletrain.safety.healing import Healer, snapshot_bytes
from stabletrain.safety.quarantine import Quarantine
from stabletrain.training import state as trainer_state
from stabletrain.utils.sync import CountSyncs


class _Fabric:
    """This rank's Fabric: ``all_reduce`` (Lightning's signature and default) averages this rank's tensor
    with the other rank's value for that call (``other``, in call order) and records the reduction asked."""

    def __init__(self, device: str, other: list[Any]):
        self.device = torch.device(device)
        self.other = list(other)
        self.ops: list[Any] = []

    def all_reduce(self, t: torch.Tensor, group: Any = None, reduce_op: Any = "mean") -> torch.Tensor:
        self.ops.append(reduce_op)
        theirs = torch.as_tensor(self.other.pop(0), dtype=t.dtype).reshape(t.shape)
        return {"mean": lambda a, b: (a + b) / 2}[reduce_op](t, theirs)

    def barrier(self) -> None:
        pass


class _Trainer:
    """What the Healer reads of its trainer. ``checkpoint_state`` is the trainer's own function."""

    def __init__(self, out: Path, policy: str = "skip_step", *, rank: int = 0, world_size: int = 1,
                 device: str = "cpu", other: list[Any] = (), precision: str = "32-true", scaler: Any = None,
                 **on_instability: Any):
        torch.manual_seed(0)
        self.out = out
        self.settings = load_settings({"out": out, "on_instability": {"policy": policy, "diagnose": False,
                                                                        **on_instability}})
        self.task = types.SimpleNamespace(model_meta={"vocab_size": 11})
        self.model = Net()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scaler = scaler
        self.precision = precision
        self.rank, self.world_size, self.sharded = rank, world_size, False
        self.is_rank_zero = rank == 0
        self.fabric = _Fabric(device, list(other))
        self.step = 0
        self.microbatches_consumed = 0
        self.lines: list[str] = []
        self.console = types.SimpleNamespace(info=self.lines.append)
        self.events: list[dict] = []
        self.safety = types.SimpleNamespace(health=types.SimpleNamespace(
            note_recovery=lambda step, trigger: None, spike_open=False))
        self.quarantined: frozenset = frozenset()
        self.loaders_built = 0

    def resolved_settings(self) -> dict[str, Any]:
        return {"task": "custom", "precision": self.precision, "world_size": self.world_size, "steps": 40}

    def log_event(self, row: dict) -> None:
        self.events.append(row)

    def build_loader(self) -> None:
        self.loaders_built += 1

    def checkpoint_state(self, on_cpu: bool = False, layout: Any = None) -> dict[str, Any]:
        return trainer_state.checkpoint_state(self, on_cpu, layout)

    def recoveries(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "recovery"]


def _batch(indices: list[int], nan: tuple[int, ...] = (), spike: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Samples ``indices`` of y = sum(x); those in ``nan`` hold a NaN in their input, those in ``spike`` a
    target of 1e4 (a loss spike)."""
    g = torch.Generator().manual_seed(sum(indices))
    x = torch.randn(len(indices), 4, generator=g)
    y = x.sum(1, keepdim=True)
    for i in nan:
        x[indices.index(i), 1] = math.nan
    for i in spike:
        y[indices.index(i)] = 1e4
    return {"x": x, "y": y}


def _step(t: _Trainer, h: Healer, indices: list[int], nan: tuple[int, ...] = (), spike: tuple[int, ...] = ()) -> None:
    """Training step ``t.step`` through the healer's hooks, in the trainer's order (one microbatch)."""
    train_step(t, h, t.step, _batch(indices, nan, spike), indices, t.model.training_step)


def _started(t: _Trainer) -> Healer:
    h = Healer(t)
    h.on_train_start(t)
    return h


def _samples(step: int) -> list[int]:
    return list(range(4 * step, 4 * step + 4))


# ---------------------------------------------------------------------------------- snapshot_bytes


def test_snapshot_bytes_counts_every_tensor_of_a_nested_state_and_nothing_else():
    state = {
        "step": 3, "layout": "full",
        "model": {"w": torch.zeros(2, 3), "b": torch.zeros(5, dtype=torch.float16)},  # 24 + 10
        "rng": [torch.zeros(7, dtype=torch.uint8)],  # 7
        "pair": (torch.zeros(2, dtype=torch.int64), None, 1.5),  # 16
    }
    assert snapshot_bytes(state) == 24 + 10 + 7 + 16
    assert snapshot_bytes(torch.zeros(3, 2, dtype=torch.float64)) == 48
    assert snapshot_bytes(5) == snapshot_bytes("x") == snapshot_bytes(None) == snapshot_bytes({}) == 0


def test_snapshot_bytes_of_a_dtensor_is_this_rank_s_shard(gloo_group_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    d = distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)])
    assert snapshot_bytes({"model": {"w": d}}) == d.to_local().numel() * 4 == 48


# ---------------------------------------------------------------------------------- at the start


def test_the_on_instability_thresholds_are_the_detector_s(tmp_path):
    t = _Trainer(tmp_path / "run", window=7, zscore=3.5, warmup=4, max_ratio=5.0, min_std=0.2)
    d = Healer(t).guard.detector
    assert (d.window, d.zscore, d.warmup, d.max_ratio, d.min_std) == (7, 3.5, 4, 5.0, 0.2)


def test_one_process_judges_its_own_loss_with_no_exchange(tmp_path):
    t = _Trainer(tmp_path / "run")  # no other rank: an all_reduce would find no value to combine
    h = _started(t)
    _step(t, h, _samples(0))
    _step(t, h, _samples(1), nan=(5,))
    assert t.fabric.ops == []
    assert [(r["step"], r["trigger"]) for r in t.recoveries()] == [(1, "nonfinite_loss")]


def _collectives(monkeypatch) -> list[dict]:
    """The collectives as the other rank (of two) answers them: all_gather_object puts the other rank's
    object (an empty list: no samples, no culprits) first; the process groups made are recorded."""
    calls: list[dict] = []

    def all_gather_object(out, obj, group=None):
        out[0], out[1] = [], obj

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "new_group", lambda **kw: calls.append({"new_group": kw}) or "gloo group")
    return calls


def test_under_ddp_the_loss_judged_is_the_mean_over_ranks_and_the_capture_is_this_rank_s(tmp_path, monkeypatch):
    _collectives(monkeypatch)
    # Rank 1 of 2; the other rank's losses: finite, then NaN at step 1 (this rank's data is clean).
    t = _Trainer(tmp_path / "run", rank=1, world_size=2, other=[0.5, math.nan])
    h = _started(t)
    _step(t, h, _samples(0))
    _step(t, h, _samples(1))
    assert t.fabric.ops == ["mean", "mean"], "one mean over the ranks per step"
    (row,) = t.recoveries()
    assert (row["step"], row["trigger"], row["loss"], row["action"]) == (1, "nonfinite_loss", "nan", "skip_step")
    # Every rank writes its capture: this one under rank1 of the step's folder, saying which rank it is.
    path = Path(row["capture"])
    assert path == t.out / "debug" / "recoveries" / "step1" / "rank1" / "nan_capture.pt"
    capture = torch.load(path, weights_only=False)
    assert (capture["rank"], capture["world_size"]) == (1, 2)


def test_under_ddp_on_a_gpu_the_ranks_agree_on_how_many_verdicts_to_read(tmp_path, monkeypatch):
    calls = _collectives(monkeypatch)
    other_ready = [0, 1]  # the other rank's verdict of step 0 reaches its host one step late

    def all_reduce(t, op=None, group=None):
        calls.append({"all_reduce": (int(t[0]), op, group)})
        t[0] = min(int(t[0]), other_ready.pop(0))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    # The "GPU" is only the Fabric's device: the model, and so the verdicts, stay on the CPU.
    t = _Trainer(tmp_path / "run", world_size=2, device="cuda", other=[1.0, 1.0])
    h = _started(t)
    assert calls == [{"new_group": {"backend": "gloo"}}], "host integers go through a gloo group"
    _step(t, h, _samples(0), nan=(1,))
    assert t.recoveries() == [], "read by this rank only: it waits for the other"
    _step(t, h, _samples(1))
    (row,) = t.recoveries()
    assert row["step"] == 0 and row["capture"] is None, "read a step late: the step's batches are gone"
    assert [c["all_reduce"][0] for c in calls[1:]] == [1, 2]
    assert all(c["all_reduce"][1:] == (dist.ReduceOp.MIN, "gloo group") for c in calls[1:])


def test_one_process_on_a_gpu_makes_no_process_group(tmp_path, monkeypatch):
    calls = _collectives(monkeypatch)
    t = _Trainer(tmp_path / "run", device="cuda")
    _started(t)
    assert calls == []


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_a_recovery_capture_holds_the_run_s_precision_scale_settings_and_losses(tmp_path, precision):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if precision == "16-mixed" else None
    t = _Trainer(tmp_path / "run", precision=precision, scaler=scaler)
    h = _started(t)
    _step(t, h, _samples(0))
    _step(t, h, _samples(1), nan=(6,))
    (row,) = t.recoveries()
    capture = torch.load(row["capture"], weights_only=False)
    assert capture["precision"] == precision  # not what the float32 model alone would suggest
    assert capture["loss_scale"] == (1024.0 if scaler is not None else None)
    assert capture["settings"] == t.resolved_settings() and capture["model_meta"] == {"vocab_size": 11}
    assert (capture["rank"], capture["world_size"], capture["step"]) == (0, 1, 1)
    (loss,) = capture["losses"]
    assert math.isnan(float(loss)), "the step's microbatch loss, for replay to compare with"


# ---------------------------------------------------------------------------------- the end


def _stepped_batch(t: _Trainer, h: Healer) -> weakref.ref:
    """A step whose batch only the healer can still hold; a weak reference to its input."""
    batch = _batch(_samples(0))
    ref = weakref.ref(batch["x"])
    h.on_step_start(t, step=0)
    h.on_microbatch(t, step=0, micro_step=0, batch=batch, indices=torch.tensor(_samples(0)))
    loss = t.model.training_step(batch)
    h.on_after_microbatch(t, step=0, micro_step=0, loss=loss.detach())
    loss.backward()
    return ref


@pytest.mark.parametrize("end", ["on_train_end", "on_exception"])
def test_the_last_step_s_batch_is_let_go_when_training_ends(tmp_path, end):
    t = _Trainer(tmp_path / "run")
    h = _started(t)
    ref = _stepped_batch(t, h)
    gc.collect()
    assert ref() is not None, "held for a capture until the step's verdict is read"
    if end == "on_train_end":
        h.on_train_end(t)
    else:
        h.on_exception(t, exception=RuntimeError("boom"))
    gc.collect()
    assert ref() is None


def test_an_exception_before_training_starts_leaves_the_healer_quiet(tmp_path):
    t = _Trainer(tmp_path / "run")
    Healer(t).on_exception(t, exception=RuntimeError("a setup failure"))  # no monitor yet: nothing to close


# ---------------------------------------------------------------------------------- checkpoints


def test_a_resume_continues_the_recovery_count_the_quarantine_and_the_detector_s_window(tmp_path):
    t = _Trainer(tmp_path / "run")
    h = _started(t)
    for s in range(3):
        _step(t, h, _samples(s), nan=(9,) if s == 2 else ())
    assert [r["culprits"] for r in t.recoveries()] == [[9]]
    state = t.checkpoint_state()
    h.on_checkpoint_save(t, step=t.step, state=state)

    # Resumed into another folder (no quarantine.json there): all of it comes from the checkpoint.
    r = _Trainer(tmp_path / "resumed")
    r.step = 3
    h2 = Healer(r)
    h2.on_checkpoint_load(r, state=state)
    h2.on_train_start(r)
    assert r.quarantined == {9} and r.loaders_built == 1, "the loader skips the quarantined sample"
    saved, loaded = h.guard.state_dict()["detector"], h2.guard.state_dict()["detector"]
    assert all(torch.equal(saved[k], loaded[k]) for k in saved), "the re-run judges with the same window"
    _step(r, h2, _samples(3), nan=(13,))
    (row,) = r.recoveries()
    assert (row["step"], row["recovery"], row["culprits"]) == (3, 2, [13]), "the second recovery of the run"
    assert sorted(h2.quarantine.indices()) == [9, 13]


def test_a_checkpoint_without_recoveries_or_quarantine_loads_as_none_made(tmp_path):
    """A checkpoint's on_instability without the recoveries and quarantine entries (an older stabletrain's),
    and one of a run without a healing policy (no on_instability): nothing to continue from."""
    t = _Trainer(tmp_path / "run")
    detector = Healer(t).guard.state_dict()["detector"]
    for state in ({"callbacks": {"on_instability": {"detector": detector}}}, {"callbacks": {}}, {}):
        h = Healer(t)
        h.on_checkpoint_load(t, state=state)
        h.on_train_start(t)
        assert h.recoveries == [] and h.quarantine.state_dict() == []
        assert t.loaders_built == 0


def test_a_resume_reads_the_quarantine_found_after_its_checkpoint(tmp_path):
    t = _Trainer(tmp_path / "run")
    q = Quarantine(t.out)
    q.add([{"index": 21, "step": 30, "evidence": "batch['x'] holds 1 non-finite value(s)"}])
    q.save()
    h = Healer(t)
    h.on_checkpoint_load(t, state={"callbacks": {"on_instability": {"detector": h.guard.state_dict()["detector"],
                                                                    "recoveries": [], "quarantine": []}}})
    h.on_train_start(t)
    assert t.quarantined == {21}


def test_a_rollback_returns_to_the_state_of_the_checkpoint_not_a_later_one(tmp_path):
    """The snapshot taken at a checkpoint is that checkpoint's state, the one a resume from it starts
    from: its weights (not the live ones they referenced) and its RNG states (not those after a callback
    that saw the checkpoint drew random numbers)."""
    # Only the ratio rule judges (a z-score of 1000 is never reached): the spike of step 4, 1e4 x the loss.
    t = _Trainer(tmp_path / "run", "rollback", warmup=2, zscore=1000.0, rollback_steps=100)
    h = _started(t)
    for s in range(3):
        _step(t, h, _samples(s))
    state = t.checkpoint_state()  # references to the live weights, as the trainer writes them
    at_checkpoint = {k: v.clone() for k, v in t.model.state_dict().items()}
    torch.rand(5)  # an earlier callback's on_checkpoint_save draws from the RNG
    h.on_checkpoint_save(t, step=3, state=state)
    _step(t, h, _samples(3))  # updates the weights in place
    assert not torch.equal(t.model.body.weight, at_checkpoint["body.weight"])
    _step(t, h, _samples(4), spike=(17,))
    (row,) = t.recoveries()
    assert (row["step"], row["trigger"], row["rolled_back_to"], row["skipped_steps"]) == (4, "loss_spike", 3, [3, 4])
    assert t.step == 3
    for k, v in t.model.state_dict().items():
        assert torch.equal(v, at_checkpoint[k]), k
    assert torch.equal(torch.get_rng_state(), state["rng"][0]["torch"])


def test_a_checkpoint_at_the_snapshot_s_step_copies_nothing_more_to_the_host(tmp_path):
    """Rollback copies the state to the host at a snapshot: a checkpoint of the step the snapshot is
    of already keeps that one; a checkpoint of a later step is the new snapshot (one copy per tensor)."""
    t = _Trainer(tmp_path / "run", "rollback", rollback_steps=100)
    h = _started(t)  # the snapshot of step 0
    state = t.checkpoint_state()
    with CountSyncs() as same:
        h.on_checkpoint_save(t, step=0, state=state)
    _step(t, h, _samples(0))
    state = t.checkpoint_state()
    with CountSyncs() as later:
        h.on_checkpoint_save(t, step=1, state=state)
    assert same.count == 0
    assert later.by_op["to_cpu"] == sum(1 for leaf in _leaves(state) if isinstance(leaf, torch.Tensor))


def _leaves(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in _leaves(v)]
    if isinstance(x, (list, tuple)):
        return [leaf for v in x for leaf in _leaves(v)]
    return [x]


# ---------------------------------------------------------------------------------- under FSDP2


def _sharded(tmp_path: Path) -> _Trainer:
    """A trainer under FSDP2 at world size 1 (its model's parameters DTensors), writing full checkpoints."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    t = _Trainer(tmp_path / "run", "rollback", warmup=2, zscore=1000.0, rollback_steps=100)
    fully_shard(t.model, mesh=init_device_mesh("cpu", (1,)))
    t.optimizer = torch.optim.AdamW(t.model.parameters(), lr=0.1)
    t.sharded, t.checkpoint_layout = True, "full"
    return t


def _shards(snapshot: dict[str, Any]) -> bool:
    from torch.distributed.tensor import DTensor

    return snapshot.get("layout") == "sharded" and all(isinstance(v, DTensor) for v in snapshot["model"].values())


def test_under_fsdp2_each_snapshot_holds_this_rank_s_shards_at_full_and_sharded_checkpoints(tmp_path,
                                                                                          gloo_group_of_one):
    t = _sharded(tmp_path)
    h = _started(t)
    assert h.snapshot["step"] == 0 and _shards(h.snapshot)
    for s in range(3):
        _step(t, h, _samples(s))
    state = t.checkpoint_state()  # full: the whole model on rank 0, plain tensors
    assert "layout" not in state
    h.on_checkpoint_save(t, step=3, state=state)
    assert h.snapshot["step"] == 3 and _shards(h.snapshot)
    full = sum(v.numel() * 4 for v in t.model.state_dict().values())
    assert snapshot_bytes(h.snapshot["model"]) == full, "one rank of one: its shards are the whole model"
    _step(t, h, _samples(3))
    # A sharded checkpoint (checkpoint_format=sharded): its state is the snapshot, as a resume would load it.
    state = t.checkpoint_state(layout="sharded")
    at_checkpoint = {k: v.full_tensor().clone() for k, v in t.model.state_dict().items()}
    torch.rand(5)  # an earlier callback's on_checkpoint_save draws from the RNG
    h.on_checkpoint_save(t, step=4, state=state)
    assert h.snapshot["step"] == 4 and _shards(h.snapshot)
    _step(t, h, _samples(4))  # updates the shards in place
    _step(t, h, _samples(5), spike=(21,))
    assert [(r["step"], r["rolled_back_to"]) for r in t.recoveries()] == [(5, 4)]
    for k, v in t.model.state_dict().items():
        assert torch.equal(v.full_tensor(), at_checkpoint[k]), k
    assert torch.equal(torch.get_rng_state(), state["rng"][0]["torch"])
