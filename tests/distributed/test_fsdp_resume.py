"""Resume of an FSDP2 run on 2 CPU processes is bitwise exact, from a full state dict saved by
rank 0 and from torch.distributed.checkpoint (DCP) shards, each in fresh processes."""

from __future__ import annotations

import pytest
import torch
from fsdp_common import build_lm, torchrun
from fsdp_worker import RESUME_AT, RESUME_STEPS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_resume")
    for phase in ("first", "second"):  # two launches: the resumed run starts from nothing in memory
        proc = torchrun(["resume", str(out), phase], timeout=400)
        assert proc.returncode == 0, (phase, proc.stderr[-4000:])
    return out


def _load(out, name):
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("how", ["full", "sharded"])
def test_resume_is_bitwise_exact(run, how):
    straight, resumed = _load(run, "straight"), _load(run, f"resumed_{how}")
    assert len(straight["losses"]) == RESUME_STEPS
    assert resumed["losses"] == straight["losses"][RESUME_AT:], "the same losses, bit for bit"
    assert list(resumed["model"]) == list(straight["model"])
    for name, value in straight["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    for name, state in straight["optimizer"]["state"].items():
        for key, value in state.items():
            got = resumed["optimizer"]["state"][name][key]
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(value)), (name, key)
    # The weights did change after the checkpoint: the comparison is not of untouched copies.
    assert not torch.equal(straight["model"]["head.weight"], build_lm(0).head.weight)


def test_full_checkpoint_is_one_file_in_the_unsharded_format(run):
    ckpt = _load(run, "ckpt_full")  # weights_only: nothing but tensors, numbers, strings, containers
    plain = build_lm(0).state_dict()
    assert list(ckpt["model"]) == list(plain)
    assert all(ckpt["model"][k].shape == v.shape for k, v in plain.items())
    # Optimizer state keyed by parameter name, so it does not depend on how the model was sharded.
    assert sorted(ckpt["optimizer"]["state"]) == sorted(n for n in plain)
    assert ckpt["optimizer"]["state"]["head.weight"]["exp_avg"].shape == plain["head.weight"].shape
    assert len(ckpt["rng"]) == 2 and ckpt["step"] == RESUME_AT
    files = sorted(p.name for p in (run / "ckpt_sharded").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "rng_rank0.pt", "rng_rank1.pt"]
