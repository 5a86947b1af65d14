"""fp16 loss scaling under FSDP2 on 2 CPU processes: an Inf in one element of rank 1's gradient shard makes
the GradScaler skip that step on both ranks (its found-inf check of DTensor gradients is agreed over the
mesh), exactly as the unsharded run with the same Inf skips it; nothing is captured or stopped, the scale
halves, and the runs go on alike. The in-process code path: tests/training/test_fsdp_fp16_one_process.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from fsdp_fp16 import PLANT_STEP, run

from stabletrain.runfiles.history import read_run

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("fsdp_fp16.py")


def _launch(out: Path, mode: str, ranks: int) -> dict[int, dict]:
    from conftest import cli_env

    env = cli_env()
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), mode], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r: json.loads((out / f"result_rank{r}.json").read_text()) for r in range(ranks)}


def test_an_overflow_in_one_rank_s_shard_is_skipped_on_every_rank_as_unsharded(tmp_path):
    sharded = _launch(tmp_path / "sharded", "sharded", 2)
    unsharded = run(str(tmp_path / "unsharded"), sharded=False)  # one process, no process group: this one
    assert [sharded[r]["ended"] for r in (0, 1)] == ["done", "done"] and unsharded["ended"] == "done"
    a = read_run(tmp_path / "sharded" / "metrics.jsonl").rows
    b = read_run(tmp_path / "unsharded" / "metrics.jsonl").rows
    assert [r["skipped_steps"] for r in a] == [r["skipped_steps"] for r in b] == [0, 0, 0, 1, 1, 1]
    assert [r["loss_scale"] for r in a] == [r["loss_scale"] for r in b]
    assert a[PLANT_STEP]["loss_scale"] == a[PLANT_STEP - 1]["loss_scale"] / 2, "halved by the skipped step"
    assert math.isinf(a[PLANT_STEP]["gradient_norm"]) and math.isinf(b[PLANT_STEP]["gradient_norm"])
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-3), x["step"]
    assert not (tmp_path / "sharded" / "debug").exists(), "a skipped step is normal: no capture"
