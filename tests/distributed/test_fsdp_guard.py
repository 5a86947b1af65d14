"""The guard under FSDP2 on 2 CPU processes, with an optimizer that writes Inf into rank 1's shard only:
rank 0, whose shards stay finite, names the damaged parameter too; both ranks re-run the step from the
sharded checkpoint (each loading its part) and capture their shards of it; diagnose puts them together in
one process. The in-process code path: tests/safety/test_guard_sharded.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_optimizer_fault import DAMAGED, FAULT_STEP, Regression

import stabletrain

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("fsdp_optimizer_fault.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import cli_env

    out = tmp_path_factory.mktemp("fsdp_guard")
    env = cli_env()
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, {r: json.loads((out / f"result_rank{r}.json").read_text()) for r in range(2)}


def test_every_rank_names_the_parameter_only_rank_1_holds_damaged(run):
    _, results = run
    for rank in (0, 1):
        r = results[rank]
        assert (r["ended"], r["step"], r["origin"]) == ("NonFiniteStepError", FAULT_STEP, "optimizer_step")
        assert r["param_names"] == [DAMAGED] and r["state_entries"] == [f"{DAMAGED}: exp_avg"]
        # Every rank gives the same message: that of rank 1, whose own shard the step damaged.
        assert r["message"].startswith(f"The optimizer step of step {FAULT_STEP} (rank 1 of 2) wrote non-finite")
        assert f"Parameters with NaN/Inf: 1: {DAMAGED} (1)." in r["message"]


def test_every_rank_trains_rank_0_s_weights(run):
    """Rank 1 built its model with other weights; the step-0 loss is the mean of both ranks' losses of rank
    0's weights on their own samples (computed here in one process)."""
    from fsdp_optimizer_fault import LinearData
    from nan_models import samples_of_step

    from stabletrain.runfiles.history import read_run

    out, _ = run
    data, model = LinearData(), Regression()
    losses = []
    for rank in (0, 1):
        idx = samples_of_step(0, n=64, batch_size=16, world_size=2, rank=rank)
        batch = {"x": data.x[idx], "y": data.y[idx]}
        losses.append(float(model.training_step(batch)))
    row = read_run(out / "metrics.jsonl").rows[0]
    assert row["step"] == 0 and row["loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)


def test_each_rank_captures_its_shards_of_the_rerun_from_the_sharded_checkpoint(run):
    out, results = run
    for rank in (0, 1):
        raw = torch.load(out / "debug" / "nan_capture" / f"rank{rank}" / "nan_capture.pt", weights_only=True)
        entry = raw["optimizer_step"]
        assert entry["source"] == {"path": str(out / "checkpoints" / "step_000002.ckpt"), "step": 2}
        assert (out / "checkpoints" / "step_000002.ckpt" / "meta.pt").is_file(), "a sharded checkpoint"
        layout = entry["state_shards"]["layout"]
        assert layout["0/exp_avg"] == {"shape": [16, 4], "offset": [8 * rank, 0], "sharded": True}
        # The re-run did it again, on rank 1 only.
        assert entry["after"]["nonfinite_params"] == ({DAMAGED: 1} if rank == 1 else {})
    d = stabletrain.diagnose(out / "debug" / "nan_capture", model=Regression(), write=False)
    assert d.cause == "optimizer_step" and d.source["step"] == 2
    assert "RankOneBrokenAdamW is not a torch.optim optimizer" in d.explanation
    cap = stabletrain.load_nan_capture(out / "debug" / "nan_capture" / "rank0", model=Regression())
    entry = cap.ranks[0].raw["optimizer_step"]
    assert entry["after"] == {"nonfinite_params": {DAMAGED: 1}, "nonfinite_state": [f"{DAMAGED}: exp_avg"]}
    assert entry["grads"]["body.0.weight"].shape == (16, 4), "every rank's gradient rows, put together"
    assert entry["state_dict"]["state"][0]["exp_avg"].shape == (16, 4)
