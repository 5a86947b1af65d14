"""RollbackSnapshots on its own: when it takes a snapshot, what it restores (also twice from the
same snapshot, as a rollback that comes back to it does), what it costs, and its errors."""

from __future__ import annotations

import pytest
import torch

from stabletrain import RollbackSnapshots
from stabletrain.utils.rng import get_rng_state


class Positions:
    """An extra object whose state is a list it keeps and appends to in place (e.g. a data
    position log): what it is given back by a restore must not be the snapshot's own list."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _step(model, opt, extra=None, i=0):
    model(torch.randn(4, 3)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    if extra is not None:
        extra.seen.append(i)


def _state(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()})


def _equal(a, b) -> bool:
    (ma, oa), (mb, ob) = a, b
    return all(torch.equal(ma[k], mb[k]) for k in ma) and oa.keys() == ob.keys() and all(
        torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])


def test_snapshots_are_taken_every_n_steps_once_each():
    model, opt = _setup()
    default = RollbackSnapshots(model, opt)
    assert default.step is None, "no snapshot yet"
    assert [default.maybe_take(s) for s in (0, 0, 1, 49, 50, 51, 100)] == [True, False, False, False, True, False, True]
    assert default.step == 100
    every3 = RollbackSnapshots(model, opt, every=3)
    assert [s for s in range(10) if every3.maybe_take(s)] == [0, 3, 6, 9]
    every1 = RollbackSnapshots(model, opt, every=1)
    assert [s for s in range(3) if every1.maybe_take(s)] == [0, 1, 2]


@pytest.mark.parametrize("every", [0, -2])
def test_every_below_1_is_refused_with_the_value(every):
    model, opt = _setup()
    with pytest.raises(ValueError, match=f"every must be >= 1, got {every}"):
        RollbackSnapshots(model, opt, every=every)


def test_restore_before_any_snapshot_says_what_to_call():
    model, opt = _setup()
    with pytest.raises(RuntimeError, match=r"^RollbackSnapshots.restore: no snapshot yet; call maybe_take\(step\) at "
                                           r"each step start$"):
        RollbackSnapshots(model, opt).restore()


def test_restoring_twice_from_one_snapshot_gives_the_snapshot_both_times():
    """A rollback can return to the same snapshot again (its state keeps leading to bad steps):
    the steps run after the first restore must not have changed the snapshot."""
    model, opt = _setup()
    positions = Positions()
    for i in range(2):
        _step(model, opt, positions, i)
    snapshots = RollbackSnapshots(model, opt, every=5, extra=(positions,))
    assert snapshots.maybe_take(5)
    at_snapshot, rng = _state(model, opt), torch.get_rng_state()
    for attempt in range(2):
        for i in range(3):
            _step(model, opt, positions, 10 * attempt + i)
        assert not _equal(_state(model, opt), at_snapshot)
        assert snapshots.restore() == 5
        assert _equal(_state(model, opt), at_snapshot), attempt
        assert positions.seen == [0, 1], attempt
        assert torch.equal(torch.get_rng_state(), rng)
        torch.randn(7)  # the RNG moves on after the restore


def test_nbytes_counts_every_tensor_of_the_snapshot_exactly():
    model, opt = _setup()
    _step(model, opt)

    class Extra:
        def state_dict(self):
            return {"buffer": torch.zeros(5, dtype=torch.float64), "count": 3, "name": "x"}

        def load_state_dict(self, state):
            pass

    snapshots = RollbackSnapshots(model, opt, extra=(Extra(),))
    assert snapshots.nbytes == 0
    snapshots.take(0)
    params = sum(p.numel() * 4 for p in model.parameters())
    # AdamW: exp_avg and exp_avg_sq per parameter (float32) and a float32 step count per parameter;
    # the extra's float64 buffer; the RNG states (torch's, and NumPy's / Python's as tensors).
    rng = _tensor_bytes(get_rng_state())
    assert rng >= torch.get_rng_state().numel()
    assert snapshots.nbytes == params + 2 * params + 4 * len(list(model.parameters())) + 5 * 8 + rng


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0
