"""on_instability under FSDP2 in one process (the trainer's FSDP2 code path at world size 1): skip_step
restores each rank's shards on the device, rollback snapshots each rank's shards; the planted NaN and spike
steps are recovered exactly and every kept step is bitwise the unsharded run's. The 2-process runs (against
DDP) are in tests/safety/test_self_healing.py (slow)."""

from __future__ import annotations

import pytest
import torch
from heal_faults import NAN_STEP, SPIKE_STEP, settings

import stabletrain
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.runfiles.checkpoint import load_checkpoint
from stabletrain.safety.healing import Healer, snapshot_bytes

FSDP = dict(strategy="fsdp", accelerator="cpu", devices=1)


@pytest.fixture(scope="module", autouse=True)
def _process_group(fsdp_in_process):
    yield


class _Snapshots:
    """The rollback snapshot's bytes, each time the healer's snapshot changes."""

    def __init__(self):
        self.sizes: list[tuple[int, int, bool]] = []

    def on_step_start(self, trainer, *, step):
        healer = next(c for c in trainer.callbacks.callbacks if isinstance(c, Healer))
        snap = healer.snapshot
        if snap is not None and (not self.sizes or self.sizes[-1][0] != snap["step"]):
            self.sizes.append((snap["step"], snapshot_bytes({"model": snap["model"], "optimizer": snap["optimizer"]}),
                               snap.get("layout") == "sharded"))


@pytest.mark.parametrize("policy", ["skip_step", "rollback"])
def test_the_planted_steps_are_recovered_exactly_and_kept_steps_bitwise_the_unsharded_run(tmp_path, policy):
    runs = {}
    for sharded in (False, True):
        out = tmp_path / f"sharded{sharded}"
        torch.manual_seed(0)  # PoisonNet's weights: the same in both runs
        snaps = _Snapshots()
        result = stabletrain.train(**settings(out, policy, callbacks=[snaps], **(FSDP if sharded else {})))
        assert result.steps_done == 40
        events = read_metrics(out / "metrics.jsonl")[1]
        recoveries = [(e["step"], e["trigger"], e["action"]) for e in events if e["event"] == "recovery"]
        runs[sharded] = (read_metrics(out / "metrics.jsonl")[0], recoveries, load_checkpoint(out / "checkpoints" /
                                                                                              "last.ckpt"), snaps)
    expected = [(NAN_STEP, "nonfinite_loss", "skip_step"), (SPIKE_STEP, "loss_spike", policy)]
    assert runs[True][1] == runs[False][1] == expected
    rows = {s: [(r["step"], r["loss"], r["gradient_norm"]) for r in runs[s][0]] for s in runs}
    assert rows[True] == rows[False], "every kept step bitwise the unsharded run's"
    for name, value in runs[False][2]["model"].items():
        assert torch.equal(runs[True][2]["model"][name], value), name
    if policy == "rollback":
        # Each rank's snapshot holds its own shards (here all of them: one rank), as many bytes as unsharded.
        sharded, plain = runs[True][3].sizes, runs[False][3].sizes
        assert [s for s, _, _ in sharded] == [s for s, _, _ in plain] and all(flag for _, _, flag in sharded)
        assert [b for _, b, _ in sharded] == [b for _, b, _ in plain]
