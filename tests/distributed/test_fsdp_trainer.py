"""``stabletrain.train(strategy="fsdp")`` on 2 CPU processes: the built-in language model trains
sharded with FSDP2; its logged gradient norms equal a float64 computation of the same step in one
process; checkpoints are one full file in the unsharded format with a checked health; a resumed
run continues bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_train import FAULT_STEP, MODEL_ARGS

from stabletrain.config import load_settings
from stabletrain.data.loader import build_loader
from stabletrain.debug.grad_norm import compute_grad_norm, layer_grad_norms
from stabletrain.runfiles.history import read_run
from stabletrain.tasks import build_task
from stabletrain.utils.rng import seed_everything

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("fsdp_train.py")


def launch(out: Path, *args: str, timeout: float = 300, ranks: int = 2) -> dict[int, dict]:
    """``python fsdp_train.py OUT ARGS`` (Fabric starts rank 1); each rank's result."""
    from conftest import cli_env

    env = cli_env()
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r: json.loads((out / f"result_rank{r}.json").read_text()) for r in range(ranks)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 6-step FSDP run (checkpoints after steps 3 and 6), and the same run resumed from step 3."""
    straight = tmp_path_factory.mktemp("fsdp_straight")
    resumed = tmp_path_factory.mktemp("fsdp_resumed")
    first = launch(straight, "train")
    second = launch(resumed, "resume", str(straight / "checkpoints" / "step_000003.ckpt"))
    return straight, resumed, first, second


def _ckpt(out: Path, name: str = "last.ckpt") -> dict:
    return torch.load(out / "checkpoints" / name, weights_only=True)


def _reference_step0(settings: dict) -> tuple[float, dict[str, float]]:
    """Step 0 in one process in float64: the same initial weights (the seed), every rank's microbatch
    (rank r of 2 reads its own samples), each loss halved as FSDP's averaging reduce-scatter does."""
    s = load_settings({**settings, "out": "unused"})
    seed_everything(s.seed)
    task = build_task(s)
    model = task.model.double()
    for rank in range(2):
        loader, _ = build_loader(task.dataset, microbatch_size=s.batch_size // 2, seed=s.seed, rank=rank,
                                 world_size=2, start=0, num_workers=0)
        _, batch = next(iter(loader))
        (model.training_step(batch) / 2).backward()
    gn = compute_grad_norm(model.named_parameters())
    names, values = layer_grad_norms(gn)
    return float(gn.total), dict(zip(names, values.tolist()))


def test_all_ranks_finish_and_the_model_really_is_sharded(runs):
    straight, _, first, _ = runs
    assert [first[r]["ended"] for r in (0, 1)] == ["done", "done"]
    log = (straight / "train.log").read_text()
    assert "device cpu x 2" in log and "Done: 6 steps" in log
    settings = json.loads((straight / "settings.json").read_text())
    assert settings["strategy"] == "fsdp" and settings["world_size"] == 2


def test_gradient_norm_equals_the_single_process_float64_one(runs):
    straight, _, _, _ = runs
    rows = read_run(straight / "metrics.jsonl").rows
    settings = {k: v for k, v in json.loads((straight / "settings.json").read_text()).items()
                if k in ("seed", "batch_size", "model_args", "task")}
    settings["model_args"] = {**MODEL_ARGS, **{k: settings["model_args"][k] for k in MODEL_ARGS}}
    total, layers = _reference_step0(settings)
    row = rows[0]
    assert row["step"] == 0
    # A rank's own shard gives a fraction of this; the global norm is the whole.
    assert row["gradient_norm"] == pytest.approx(total, rel=1e-5)
    logged = {k.removeprefix("gradient_norm/"): v for k, v in row.items() if k.startswith("gradient_norm/")}
    assert set(logged) == set(layers) and len(layers) > 5
    for name, value in layers.items():
        assert logged[name] == pytest.approx(value, rel=1e-5, abs=1e-9), name


def test_checkpoint_is_one_full_file_in_the_unsharded_format_with_its_health(runs):
    straight, _, _, _ = runs
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == ["last.ckpt", "step_000003.ckpt"]
    state = _ckpt(straight)
    s = load_settings({"out": "unused", "task": "language_model", "model_args": MODEL_ARGS})
    plain = build_task(s).model
    assert list(state["model"]) == list(plain.state_dict())
    assert all(state["model"][k].shape == v.shape and type(state["model"][k]) is torch.Tensor
               for k, v in plain.state_dict().items())
    # torch's own positional optimizer format: it loads into an unsharded AdamW.
    n_params = sum(len(g["params"]) for g in state["optimizer"]["param_groups"])
    assert n_params == len(list(plain.parameters())) and sorted(state["optimizer"]["state"]) == list(range(n_params))
    # The health was computed from the full model, not from one rank's shard.
    weights = torch.cat([t.flatten().double() for t in state["model"].values() if t.is_floating_point()])
    health = state["health"]
    assert health["healthy"] is True and health["finite"] is True
    assert health["weight_norm"] == pytest.approx(float(weights.norm()), rel=1e-5)


def test_resume_is_bitwise_exact(runs):
    straight, resumed, _, second = runs
    assert [second[r]["ended"] for r in (0, 1)] == ["done", "done"]
    a, b = _ckpt(straight), _ckpt(resumed)
    assert a["step"] == b["step"] == 6
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i, st in a["optimizer"]["state"].items():
        for key, value in st.items():
            assert torch.equal(value, b["optimizer"]["state"][i][key]), (i, key)
    rows_a = {r["step"]: r for r in read_run(straight / "metrics.jsonl").rows}
    rows_b = {r["step"]: r for r in read_run(resumed / "metrics.jsonl").rows}
    assert sorted(rows_b) == [3, 4, 5]
    for step in (3, 4, 5):
        assert rows_b[step]["loss"] == rows_a[step]["loss"]
        assert rows_b[step]["gradient_norm"] == rows_a[step]["gradient_norm"]
    assert "Resumed from step 3" in (resumed / "train.log").read_text()


def test_mechanism_signals_are_global_under_fsdp(runs):
    """The last row's weight RMS and Adam eps fraction equal those of the full (gathered) model and
    optimizer in last.ckpt, written after that step: one rank's shard would give other values."""
    straight, _, _, _ = runs
    row = read_run(straight / "metrics.jsonl").rows[-1]
    assert row["step"] == 5
    state = _ckpt(straight)
    s = load_settings({"out": "unused", "task": "language_model", "model_args": MODEL_ARGS})
    names = [n for n, _ in build_task(s).model.named_parameters()]
    for group, members in (("decay", [n for n in names if state["model"][n].ndim >= 2]),
                           ("no_decay", [n for n in names if state["model"][n].ndim < 2])):
        weights = torch.cat([state["model"][n].double().flatten() for n in members])
        assert row[f"signals/weight_rms/{group}"] == pytest.approx(float(weights.square().mean().sqrt()), rel=1e-5)
    below = total = 0
    for group in state["optimizer"]["param_groups"]:
        beta2, eps = group["betas"][1], group["eps"]
        for index in group["params"]:
            st = state["optimizer"]["state"][index]
            v_hat = st["exp_avg_sq"].double() / (1 - beta2 ** float(st["step"]))
            below += int((v_hat.sqrt() < eps).sum())
            total += v_hat.numel()
    assert row["signals/adam_eps_fraction"] == pytest.approx(below / total, rel=1e-6)
    assert 0 < row["signals/update_rms/decay"] < 1 and row["signals/update_rms_max"] > 0
    # The probes ran under FSDP2's own hooks: each rank's attention (rank 0's is logged).
    assert row["signals/attn_logit_max/blocks.1.attn"] > 0 and row["signals/output_logsumexp"] > 0


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The NaN planted by rank 1 at FAULT_STEP, once with the guard on, once with it off."""
    guarded = tmp_path_factory.mktemp("fsdp_guard")
    unguarded = tmp_path_factory.mktemp("fsdp_noguard")
    return guarded, launch(guarded, "guard"), unguarded, launch(unguarded, "noguard")


def test_the_guard_stops_every_rank_at_the_step_one_rank_broke(faults):
    guarded, results, _, _ = faults
    assert results[1]["planted"] and not results[0]["planted"]
    for rank in (0, 1):
        assert results[rank]["ended"] == "NonFiniteStepError" and results[rank]["step"] == FAULT_STEP
        assert results[rank]["message"].startswith(f"Non-finite loss and gradient norm at step {FAULT_STEP}")
    assert not (guarded / "checkpoints").exists(), "nothing was saved: the first checkpoint was due later"


def test_a_nonfinite_sharded_state_is_never_written(faults):
    # Without the guard the NaN reaches the weights; the check of the gathered state refuses it.
    _, _, unguarded, results = faults
    for rank in (0, 1):
        assert results[rank]["ended"] == "NonFiniteCheckpointError"
        assert results[rank]["message"].startswith(f"Refused to write the checkpoint after step {FAULT_STEP}")
    assert "tok_emb.weight" in results[0]["message"], "rank 0 names the tensors of the full state it gathered"
    assert not (unguarded / "checkpoints").exists() or not any((unguarded / "checkpoints").iterdir())
