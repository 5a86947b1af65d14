"""The guard under FSDP2: what each rank found in its own shards, joined (``joined_failure``), and the
optimizer-step capture of a sharded run, written as shards and put back together by diagnose. In one
process (world size 1, the trainer's FSDP2 code path); the 2-process run with damage on one rank only is
tests/distributed/test_fsdp_guard.py. ``join_rank_failures`` itself is tested over a real process group
of two (gloo, file rendezvous; two fresh processes, about 3 s)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stabletrain
from conftest import tiny_lm
from stabletrain.safety.guard import (
    ORIGIN_GRADIENTS,
    ORIGIN_OPTIMIZER,
    GuardFailure,
    NonFiniteStepError,
    join_rank_failures,
    joined_failure,
)


@pytest.fixture(scope="module", autouse=True)
def _process_group(fsdp_in_process):
    """Fabric's process group of one for FSDP2 in this process, ended after the module."""
    yield


def _failure(rank, step, **kw):
    base = dict(step=step, rank=rank, world_size=3, origin=ORIGIN_OPTIMIZER, nonfinite=[], loss=1.0,
                gradient_norm=2.0, stopped_at=5)
    return GuardFailure(**{**base, **kw})


def test_a_rank_that_found_nothing_describes_what_the_others_found():
    parts = [
        _failure(0, -1, other_rank_step=5),
        _failure(1, 5, nonfinite=["parameters"], param_names=["a.weight"], param_counts={"a.weight": 2},
                 explanation="rank 1's why"),
        _failure(2, 5, nonfinite=["parameters", "optimizer_state"], param_names=["a.weight", "b.weight"],
                 param_counts={"a.weight": 3, "b.weight": 1}, state_entries=["b.weight: exp_avg"],
                 largest_name="b.weight", largest_abs=math.inf),
    ]
    joined = joined_failure(parts[0], parts)
    assert (joined.rank, joined.step, joined.other_rank_step, joined.origin) == (0, 5, None, ORIGIN_OPTIMIZER)
    assert joined.param_names == ["a.weight", "b.weight"] and joined.param_counts == {"a.weight": 5, "b.weight": 1}
    assert joined.nonfinite == ["parameters", "optimizer_state"] and joined.state_entries == ["b.weight: exp_avg"]
    assert joined.explanation == "rank 1's why" and joined.largest_name == "b.weight"
    assert "Parameters with NaN/Inf: 2: a.weight (5), b.weight (1)." in joined.describe()
    assert "Another rank" not in joined.describe() and "(rank 0 of 3)" in joined.describe()
    # A rank that found it keeps its own values and adds the others' names.
    own = joined_failure(parts[2], parts)
    assert own.rank == 2 and own.largest_name == "b.weight" and own.param_names == ["a.weight", "b.weight"]


def test_gradient_names_of_every_rank_and_elementwise_finiteness_joined():
    parts = [_failure(r, 4, origin=ORIGIN_GRADIENTS, nonfinite=["gradient_norm"], param_names=[f"p{r}"],
                      gradients_elementwise_finite=not r) for r in range(3)]
    joined = joined_failure(parts[0], parts)
    assert joined.param_names == ["p0", "p1", "p2"] and joined.gradients_elementwise_finite is False
    assert joined_failure(parts[0], [_failure(0, -1), _failure(1, -1)]) is parts[0], "nobody found it: unchanged"


def test_the_base_is_this_rank_when_it_found_it_else_the_lowest_rank_that_did_even_at_step_0():
    from stabletrain.debug.optimizer_damage import RangeTrip

    parts = [
        _failure(0, -1, other_rank_step=0),
        _failure(1, 0, loss=1.5, explanation="rank 1's why", largest_name="a", largest_abs=1e20,
                 trips=[RangeTrip("a", "parameter", 1e20)]),
        _failure(2, 0, loss=2.5, explanation="rank 2's why", largest_name="b", largest_abs=5e20,
                 trips=[RangeTrip("b", "parameter", 5e20), RangeTrip("a", "parameter", 1e20)]),
    ]
    # Rank 0 found nothing: rank 1's values (the lowest rank that found it), at step 0.
    joined = joined_failure(parts[0], parts)
    assert (joined.step, joined.loss, joined.explanation, joined.rank) == (0, 1.5, "rank 1's why", 0)
    # Rank 2 found it itself: its own values, the others' names.
    own = joined_failure(parts[2], parts)
    assert (own.step, own.loss, own.explanation, own.rank) == (0, 2.5, "rank 2's why", 2)
    for f in (joined, own):
        assert [t.name for t in f.trips] == ["b", "a"], "one trip per tensor, the largest first"
        assert (f.largest_name, f.largest_abs) == ("b", 5e20), "the largest value over every rank"
        assert f.gradients_elementwise_finite is None, "no rank checked the gradients elementwise"


def test_an_explanation_comes_from_the_base_else_from_any_rank_else_none():
    with_why = [_failure(0, 3, explanation=""), _failure(1, 3, explanation="rank 1's why")]
    assert joined_failure(with_why[0], with_why).explanation == "rank 1's why"
    without = [_failure(0, 3), _failure(1, 3)]
    assert joined_failure(without[0], without).explanation == ""


def test_the_optimizer_step_of_a_sharded_run_is_captured_as_shards_and_diagnosed(tmp_path):
    """16-true AdamW under FSDP2: eps is 0 in float16, the first update divides by 0. The guard re-runs the
    step from the shards kept at the start (no gather) and captures each rank's shards of the gradients and
    optimizer state; diagnose puts them together and reproduces the step."""
    out = tmp_path / "half"
    with pytest.raises(NonFiniteStepError) as info:
        stabletrain.train(out=out, strategy="fsdp", accelerator="cpu", devices=1, precision="16-true",
                          debug_args={"nancapture": {"enabled": True}}, **tiny_lm(steps=5, checkpoint_every_num_steps=1))
    err = info.value
    assert (err.step, err.origin) == (0, ORIGIN_OPTIMIZER) and "tok_emb.weight" in err.param_names
    raw = torch.load(err.capture_path, weights_only=True)
    entry = raw["optimizer_step"]
    assert raw["sharded"] is True and entry["source"]["path"] == "the start of the run"
    assert entry["grads"] == {} and set(entry["grads_shards"]["tensors"]) == set(raw["params"])
    assert entry["state_shards"]["tensors"] == {}, "AdamW creates its state in its first step, this one"
    assert sorted(entry["after"]["nonfinite_params"]) == sorted(err.param_names)
    d = stabletrain.diagnose(err.capture_path, write=False)
    assert d.cause == "optimizer_step" and d.reproduced and d.float32_finite and d.gradients_finite
    assert set(d.nonfinite_params) == set(err.param_names)
    assert d.gradient_norm == d.captured_gradient_norm, "forward and backward replayed bitwise"


# ----------------------------------------------------------- join_rank_failures over two processes


def _rank_failure(rank: int) -> GuardFailure:
    if rank == 0:  # found nothing in its own shards; stops because rank 1 did
        return _failure(0, -1, world_size=2, origin=ORIGIN_GRADIENTS, stopped_at=7, other_rank_step=7)
    return _failure(1, 7, world_size=2, nonfinite=["parameters"], stopped_at=7, param_names=["fc.weight"],
                    param_counts={"fc.weight": 3})


def _worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        joined = join_rank_failures(_rank_failure(rank))
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(joined, f)
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_failure_joined_over_ranks(tmp_path):
    # In this process (no process group, or Fabric's group of one): nothing to join. (Called here also so
    # that mutation testing, which maps tests to the functions they call in the test's own process,
    # runs this test for join_rank_failures' mutants; the workers inherit the mutant.)
    assert not dist.is_initialized() or dist.get_world_size() == 1
    own = _rank_failure(1)
    assert join_rank_failures(own) is own
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_worker, args=(init, str(tmp_path / "joined")), nprocs=2, join=True, start_method="spawn")
    joined = [pickle.loads((tmp_path / f"joined.{r}").read_bytes()) for r in range(2)]
    for rank, f in enumerate(joined):
        assert (f.rank, f.step, f.origin, f.stopped_at, f.other_rank_step) == (rank, 7, ORIGIN_OPTIMIZER, 7, None)
        assert f.param_names == ["fc.weight"] and f.param_counts == {"fc.weight": 3}
        assert f.describe().startswith(f"The optimizer step of step 7 (rank {rank} of 2) wrote non-finite values")
