"""Shared fixtures: tiny settings, a CLI runner that uses this checkout's sources."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from stabletrain.training.reproductions import settings_with

SRC = Path(__file__).resolve().parents[1] / "src"

# The planted-fault models (nan_models, fault_models, real_models) are shared by the debug and
# safety tests: importable from every test folder.
sys.path.insert(0, str(Path(__file__).resolve().parent / "debug"))

#: A language model small enough that a step takes a few milliseconds on one CPU core.
TINY_LM: dict[str, Any] = {
    "model_args": {"n_layers": 1, "n_heads": 2, "dim": 32, "context_length": 16, "dropout": 0.0, "warmup_steps": 2},
    "batch_size": 8,
    "steps": 4,
    "log_every_num_steps": 1,
}


def tiny_lm(**overrides: Any) -> dict[str, Any]:
    """TINY_LM with overrides; nested dicts are merged one level deep."""
    return settings_with(TINY_LM, **overrides)


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m stabletrain ARGS`` with this checkout's sources."""
    return subprocess.run(
        [sys.executable, "-m", "stabletrain", *args],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cli(tmp_path: Path):
    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return run_cli(*args, cwd=tmp_path, timeout=timeout)

    return run


class LinearData(torch.utils.data.Dataset):
    """``n`` samples ``{"x": [4], "y": [1]}`` of a fixed linear map (seeded): a custom dataset
    that any small regression model learns."""

    def __init__(self, n: int = 64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class Regression(torch.nn.Module):
    """A small MLP for :class:`LinearData` (weights seeded): a user's own model with ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.body(batch["x"]), batch["y"])


@pytest.fixture
def gloo_group_of_one(tmp_path):
    """A gloo process group of one in this process, for DTensors on a one-rank mesh; ended after the
    test unless one was running already (``fsdp_in_process``'s)."""
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    if own:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_in_process():
    """For a module that trains with ``strategy="fsdp", devices=1`` in this process: Lightning Fabric starts a
    process group of one and sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE, ... in ``os.environ``; after the
    module the group is ended and the variables restored, so that processes launched later by other tests
    (which copy this environment) start their own."""
    saved = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def plant_exp_avg_sq_overflow(optimizer, at_step: int = 2):
    """After optimizer step ``at_step`` (from 0), Adam's ``exp_avg_sq`` of the first parameter holds an
    Inf, as a float16 ``g**2`` overflow leaves it, while every weight stays finite (the update of that
    entry is then 0: the weight is frozen silently). Returns the hook's handle."""
    steps = [0]

    def hook(opt, args, kwargs):
        if steps[0] == at_step:
            p = opt.param_groups[0]["params"][0]
            opt.state[p]["exp_avg_sq"].view(-1)[0] = float("inf")
        steps[0] += 1

    return optimizer.register_step_post_hook(hook)
