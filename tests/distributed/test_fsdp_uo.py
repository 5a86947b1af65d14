"""underflow_overflow on the built-in LM sharded with FSDP2 (Lightning Fabric, 2 CPU processes):
module names without wrapper prefixes, per-module statistics equal to a single-process run of the
same model and rows, weight gradients from each rank's shard, and a fault planted on one rank
that stops both ranks at the same step, each naming the module in its own file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_common import ACCUM, build_lm, free_port, global_batch, microbatches
from fsdp_uo_worker import (
    ACTIVATION_FAULT_STEP,
    FAULTY_RANK,
    GRAD_FAULT_STEP,
    LR,
    STEPS,
    TRACED,
    WEIGHT_FAULT_STEP,
)

from stabletrain.debug.underflow_overflow import UnderflowOverflowMonitor

pytestmark = pytest.mark.slow

WORLD = 2
WORKER = Path(__file__).with_name("fsdp_uo_worker.py")
FRAME = re.compile(r"^\[(forward|backward)\] step (\d+)(?:\.(\d+))?  (\S+) \((\w+)\)")
ROW = re.compile(r"^\s+(\S+)\s+(\S+)  (.*\S)\s+(\w+\[[^\]]*\])(?:\s+<--.*)?$")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One torchrun of the worker (four runs in it); every test below reads its files."""
    from conftest import cli_env

    out = tmp_path_factory.mktemp("fsdp_uo")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(WORKER), str(out)]
    env = cli_env()
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = {name: [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(WORLD)]
            for name in ("trace", "weight", "activation", "shard_grad")}
    return out, seen


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The traced steps in one process: rank r's rows traced by a monitor of their own (logs
    ``ref{step}/underflow_overflow_rank{r}.log``), then SGD on the mean of the ranks' gradients,
    which is what FSDP's averaging reduce-scatter gives every rank."""
    out = tmp_path_factory.mktemp("fsdp_uo_ref")
    model = build_lm(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = {}
    for step in TRACED:
        for rank in range(WORLD):
            with UnderflowOverflowMonitor(model, out_dir=out / f"ref{step}", rank=rank, trace_batch_nums=[step]) as mon:
                mon.set_step(step)
                for i, mb in enumerate(microbatches(global_batch(step), rank, WORLD, ACCUM)):
                    mon.micro_step = i
                    loss = model.training_step(mb)
                    mon.record_loss(loss)
                    (loss / ACCUM).backward()
        for p in model.parameters():
            p.grad /= WORLD
        grads[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    logs = {(step, r): (out / f"ref{step}" / f"underflow_overflow_rank{r}.log").read_text()
            for step in TRACED for r in range(WORLD)}
    return logs, grads


def rows(log: str) -> list[tuple]:
    """(phase, step, micro, module, class, label, abs min, abs max, dtype[shape]) of every row of a log."""
    out, frame = [], None
    for line in log.splitlines():
        if m := FRAME.match(line):
            frame = (m[1], int(m[2]), int(m[3] or 0), m[4], m[5])
        elif frame is not None and (m := ROW.match(line)):
            out.append((*frame, m[3], m[1], m[2], m[4]))
    return out


def log_of(out: Path, run_name: str, rank: int) -> str:
    return (out / run_name / "debug" / f"underflow_overflow_rank{rank}.log").read_text()


def close(a: str, b: str, rel: float = 2e-3) -> bool:
    """Two 4-digit numbers of the log equal within rounding (both read from text)."""
    x, y = float(a), float(b)
    return x == y or abs(x - y) <= rel * max(abs(x), abs(y))


def test_names_have_no_wrapper_prefix_and_classes_are_the_users(run):
    out, seen = run
    plain = build_lm(0)
    for r, s in enumerate(seen["trace"]):
        assert s["param_types"] == ["DTensor"] and s["sharded"] is True
        # FSDP2 keeps the unsharded model's names: no _fsdp_wrapped_module. or module. prefix.
        assert s["module_names"] == [n for n, _ in plain.named_modules()]
        assert s["param_names"] == [n for n, _ in plain.named_parameters()]
        table = rows(log_of(out, "trace", r))
        modules = {row[3] for row in table}
        assert modules <= {n for n, _ in plain.named_modules()} | {"<model>"}
        assert {"blocks.0", "blocks.1.mlp.fc1", "head", "<model>"} <= modules
        # fully_shard turns Block into FSDPBlock; the log names the user's class.
        classes = {(row[3], row[4]) for row in table}
        assert ("blocks.0", "Block") in classes and not any(c.startswith("FSDP") for _, c in classes)
        assert "FSDP2: weights are measured whole" in log_of(out, "trace", r)


def test_created_before_sharding_is_refused(run):
    _, seen = run
    for s in seen["trace"]:
        assert "parameters became DTensors after the monitor was created" in s["too_late"]
        assert "Create the monitor after sharding" in s["too_late"]


def test_traced_steps_ran_through_and_nothing_stopped(run):
    _, seen = run
    for s in seen["trace"]:
        assert s["steps_done"] == list(range(STEPS)) and s["error"] is None


def test_forward_statistics_equal_single_process_on_the_same_rows(run, reference):
    out, _ = run
    ref_logs, _ = reference
    for r in range(WORLD):
        fsdp = [row for row in rows(log_of(out, "trace", r)) if row[0] == "forward"]
        for step in TRACED:
            got = [row for row in fsdp if row[1] == step]
            want = [row for row in rows(ref_logs[step, r]) if row[0] == "forward"]
            assert len(got) == len(want) > 100
            weights = [row for row in got if row[5] in ("weight", "bias")]
            n_params = len(list(build_lm(0).parameters()))
            assert len(weights) == ACCUM * n_params, "every weight of every call, at every microbatch"
            if step == 0:  # the same weights and rows: the same numbers, to the printed digit
                assert got == want
                continue
            # After one step the weights differ in rounding (the gradient was summed in another order):
            # the abs max within rounding; the abs min (a value near 0, whose relative error is large
            # however small the absolute one) within rounding of the abs max.
            for g, w in zip(got, want, strict=True):
                assert g[:6] == w[:6] and g[8] == w[8]
                assert close(g[7], w[7]), (g, w)
                assert abs(float(g[6]) - float(w[6])) <= 2e-3 * abs(float(w[7])), (g, w)


def test_weights_are_read_unsharded_and_fresh_after_the_step(run):
    """Rows of the full weight (not the shard), and step 1's are not step 0's: FSDP2 keeps the
    version counter of its unsharded weights, which a per-version cache would be fooled by."""
    out, _ = run
    full_shapes = {n: list(p.shape) for n, p in build_lm(0).named_parameters()}
    for r in range(WORLD):
        table = [row for row in rows(log_of(out, "trace", r)) if row[0] == "forward" and row[5] in ("weight", "bias")]
        for row in table:
            assert row[8] == f"float32{full_shapes[f'{row[3]}.{row[5]}']}", row
        qkv = {step: [row[6:8] for row in table if row[3] == "blocks.0.attn.qkv" and row[1] == step]
               for step in TRACED}
        assert qkv[0] != qkv[1], "the weights after the optimizer step are measured again"


def test_activation_gradients_equal_single_process(run, reference):
    """The same gradients flow back through the same rows. Only their grouping differs: FSDP2
    passes each unit's inputs through an autograd function of its own, a new tensor, so a
    gradient the unsharded model shows once under blocks.1.ln1 (= blocks.0 output[0], blocks.1
    input[0]) is shown under blocks.0 as well."""
    out, _ = run
    ref_logs, _ = reference
    step = 0
    for r in range(WORLD):
        got = [row for row in rows(log_of(out, "trace", r))
               if row[0] == "backward" and row[1] == step and "[shard]" not in row[5]]
        want = [row for row in rows(ref_logs[step, r])
                if row[0] == "backward" and re.match(r"grad of (input|output)", row[5])]
        assert len(want) > 50

        def values(table):
            return {(row[2], row[6], row[7], row[8]) for row in table}  # microbatch, abs min, abs max, shape

        assert values(got) == values(want)
        # Inside a unit nothing changes: the rows of blocks.0's children are the same rows.
        inner = [row for row in want if row[3].startswith("blocks.0.") and row[3] != "blocks.0.ln1"]
        assert len(inner) > 10 and all(row in got for row in inner)
        assert len(got) - len(want) == 2 * ACCUM, "one more row per unit boundary and microbatch"


def test_weight_gradient_shards_combine_to_the_full_gradient(run, reference):
    """Each rank logs its shard of each reduced gradient once per step; the min of the abs mins
    and the max of the abs maxes over the ranks are the full gradient's."""
    out, _ = run
    _, grads = reference
    shard_rows = [row for r in range(WORLD) for row in rows(log_of(out, "trace", r)) if "[shard]" in row[5]]
    for step in TRACED:
        found: dict[str, list[tuple]] = {}
        for row in shard_rows:
            if row[1] == step:
                assert row[0] == "backward" and row[2] == ACCUM - 1, "after the last microbatch's reduce-scatter"
                name = row[5].removeprefix("grad of ").removesuffix(" [shard]")
                found.setdefault(f"{row[3]}.{name}" if row[3] != "<model>" else name, []).append(row)
        assert sorted(found) == sorted(grads[step])
        for name, full in grads[step].items():
            parts = found[name]
            assert len(parts) == WORLD, name
            dim0 = sum(int(re.search(r"\[(\d+)", p[8])[1]) for p in parts)
            assert dim0 == full.shape[0], name
            a = full.abs()
            lo, hi = min(float(p[6]) for p in parts), max(float(p[7]) for p in parts)
            assert close(f"{hi:.3e}", f"{float(a.max()):.3e}", 1e-3), (name, step)
            # An abs min far below float32's resolution at the tensor's scale is rounding noise
            # (the key bias's gradient is zero in exact arithmetic): compare it on that scale.
            assert abs(lo - float(a.min())) <= 1e-3 * float(a.min()) + 1e-6 * hi, (name, step)


def _last_frame(log: str) -> str:
    return re.split(r"\n(?=\[(?:forward|backward)\])", log.strip())[-1]


def test_inf_in_one_ranks_weight_shard_stops_both_at_that_step(run):
    out, seen = run
    for r, s in enumerate(seen["weight"]):
        e = s["error"]
        # All-gathered into the unsharded weight, the Inf is seen by every rank in the same place.
        assert (e["rank"], e["step"], e["phase"], e["module"], e["tensor"], e["value"]) == (
            r, WEIGHT_FAULT_STEP, "forward", "blocks.1.mlp.fc1", "weight", "inf")
        assert e["detected_by"] == [0, 1]
        assert s["steps_done"] == list(range(WEIGHT_FAULT_STEP))
        assert Path(e["log_path"]) == out / "weight" / "debug" / f"underflow_overflow_rank{r}.log"
        frame = _last_frame(log_of(out, "weight", r))
        assert frame.startswith(f"[forward] step {WEIGHT_FAULT_STEP}  blocks.1.mlp.fc1 (Linear)")
        assert re.search(r"inf  weight .*float32\[128, 32\]\s+<-- first non-finite \(inf\)", frame)
        assert [ev["module"] for ev in s["events"]] == ["blocks.1.mlp.fc1"]


def test_inf_in_one_ranks_activation_stops_both_each_file_says_who(run):
    out, seen = run
    bad, good = seen["activation"][FAULTY_RANK], seen["activation"][1 - FAULTY_RANK]
    e = bad["error"]
    assert (e["rank"], e["step"], e["phase"], e["module"], e["tensor"], e["value"], e["detected_by"]) == (
        FAULTY_RANK, ACTIVATION_FAULT_STEP, "forward", "blocks.0.mlp.fc2", "output[0]", "inf", [FAULTY_RANK])
    # The fault is in both microbatches; the forward decision comes after the last one, and the
    # culprit frame is the first microbatch's.
    assert _last_frame(log_of(out, "activation", FAULTY_RANK)).startswith(
        f"[forward] step {ACTIVATION_FAULT_STEP}  blocks.0.mlp.fc2 (Linear)")
    g = good["error"]
    assert (g["rank"], g["step"], g["module"], g["detected_by"]) == (
        1 - FAULTY_RANK, ACTIVATION_FAULT_STEP, None, [FAULTY_RANK])
    assert f"rank {FAULTY_RANK} found a non-finite value in the forward pass" in g["message"]
    good_log = log_of(out, "activation", 1 - FAULTY_RANK)
    assert f"rank {FAULTY_RANK} found a non-finite value (forward); none on this rank (rank {1 - FAULTY_RANK})" in good_log
    assert "inf" not in good_log.split("===")[-1], "the healthy rank's own frames are finite"
    for s in (bad, good):
        assert s["steps_done"] == list(range(ACTIVATION_FAULT_STEP))


def test_inf_in_one_ranks_gradient_shard_stops_both_in_a_plain_loop(run):
    out, seen = run
    bad, good = seen["shard_grad"][FAULTY_RANK], seen["shard_grad"][1 - FAULTY_RANK]
    assert bad["sharded"] is True
    e = bad["error"]
    assert (e["rank"], e["step"], e["phase"], e["module"], e["tensor"], e["value"], e["detected_by"]) == (
        FAULTY_RANK, GRAD_FAULT_STEP, "backward", "head", "grad of weight [shard]", "inf", [FAULTY_RANK])
    frame = _last_frame(log_of(out, "shard_grad", FAULTY_RANK))
    assert frame.startswith(f"[backward] step {GRAD_FAULT_STEP}.{ACCUM - 1}  head (Linear)")
    assert re.search(r"grad of weight \[shard\]\s+float32\[32, 32\]\s+<-- first non-finite \(inf\)", frame)
    g = good["error"]
    assert (g["step"], g["phase"], g["module"], g["detected_by"]) == (GRAD_FAULT_STEP, "backward", None, [FAULTY_RANK])
    for s in (bad, good):
        assert s["steps_done"] == list(range(GRAD_FAULT_STEP))
