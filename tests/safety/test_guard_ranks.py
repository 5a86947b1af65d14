"""``join_rank_failures`` over a real process group of two (gloo, file rendezvous): each rank hands
in what it found in its own shards, and every rank gets the joined failure. A unit test of the
collective (two fresh processes, about 3 s), so it stays in the fast layer; the trainer's 2-process
FSDP2 runs that use it are tests/distributed/test_fsdp_guard.py (slow)."""

from __future__ import annotations

import pickle

import torch.distributed as dist
import torch.multiprocessing as mp

from stabletrain.safety.guard import ORIGIN_OPTIMIZER, GuardFailure, join_rank_failures


def _failure(rank: int) -> GuardFailure:
    if rank == 0:  # found nothing in its own shards; stops because rank 1 did
        return GuardFailure(step=-1, rank=0, world_size=2, origin="forward_backward", nonfinite=[], loss=1.0,
                            gradient_norm=2.0, stopped_at=7, other_rank_step=7)
    return GuardFailure(step=7, rank=1, world_size=2, origin=ORIGIN_OPTIMIZER, nonfinite=["parameters"], loss=1.0,
                        gradient_norm=2.0, stopped_at=7, param_names=["fc.weight"], param_counts={"fc.weight": 3})


def _worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        joined = join_rank_failures(_failure(rank))
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(joined, f)
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_failure_joined_over_ranks(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_worker, args=(init, str(tmp_path / "joined")), nprocs=2, join=True, start_method="spawn")
    joined = [pickle.loads((tmp_path / f"joined.{r}").read_bytes()) for r in range(2)]
    for rank, f in enumerate(joined):
        assert (f.rank, f.step, f.origin, f.stopped_at, f.other_rank_step) == (rank, 7, ORIGIN_OPTIMIZER, 7, None)
        assert f.param_names == ["fc.weight"] and f.param_counts == {"fc.weight": 3}
        assert f.describe().startswith(f"The optimizer step of step 7 (rank {rank} of 2) wrote non-finite values")


def test_without_a_process_group_of_several_the_failure_is_returned_as_it_is():
    assert not dist.is_initialized() or dist.get_world_size() == 1
    own = _failure(1)
    assert join_rank_failures(own) is own
