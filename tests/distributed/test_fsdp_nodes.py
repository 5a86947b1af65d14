"""``stabletrain train`` over 2 "nodes" of one process each on this machine (two torchrun agents with
a static rendezvous, as on two hosts), sharded with FSDP2 and nancapture on: a NaN planted by node 1
at a known step stops node 0 at the same step, every rank captures its shard under its global rank,
and the capture is replayed in one process from the folder of all ranks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from fsdp_common import free_port, node_command
from fsdp_train import FAULT_STEP

from stabletrain.debug.replay import load_nan_capture

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("fsdp_train.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import cli_env

    out = tmp_path_factory.mktemp("fsdp_nodes")
    env = cli_env()
    env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    nodes = [
        subprocess.Popen(node_command(node, port, SCRIPT, [str(out), "fault", "2"]), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)
    ]
    logs = [p.communicate(timeout=300) for p in nodes]
    for p, (stdout, stderr) in zip(nodes, logs):
        assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
    results = {r: json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)}
    return out, results


def test_a_fault_on_node_1_stops_both_nodes_at_that_step(run):
    out, results = run
    assert results[1]["planted"] and not results[0]["planted"], "only node 1 planted the NaN"
    for rank in (0, 1):
        assert results[rank]["ended"] == "NaNDetectedError"
        assert results[rank]["step"] == FAULT_STEP
        assert results[rank]["capture"] == str(out / "debug" / "nan_capture" / f"rank{rank}" / "nan_capture.pt")
    settings = json.loads((out / "settings.json").read_text())
    assert (settings["num_nodes"], settings["devices"], settings["world_size"]) == (2, 1, 2)
    # Nothing damaged was saved: the first checkpoint was due after the step that failed.
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps[:FAULT_STEP] == list(range(FAULT_STEP))


def test_each_rank_captured_its_shard_and_one_process_replays_the_step(run):
    out, results = run
    cap = load_nan_capture(out / "debug" / "nan_capture")  # the built-in model is rebuilt from settings
    assert [r.rank for r in cap.ranks] == [0, 1] and cap.sharded and cap.step == FAULT_STEP
    planted = results[1]["planted"]
    emb = cap.ranks[0].params["tok_emb.weight"]
    # The reassembled embedding holds the one NaN node 1 planted in its shard, at its global row.
    assert emb.isnan().nonzero().tolist() == [[planted["token"], 0]]
    assert planted["first_row"] == (emb.shape[0] + 1) // 2
    result = cap.replay()
    assert result.reproduced and result.losses_bitwise_equal is True
    assert "tok_emb.weight" in result.nan_param_names
