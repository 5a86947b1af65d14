"""The sync counter sees every way per-step code can make the host wait for the device."""

from __future__ import annotations

import pytest
import torch

from stabletrain.utils.sync import CountSyncs

t = torch.arange(6.0) - 2.5
mask = t > 0

SYNCING = {
    "item": lambda: t.sum().item(),
    "float": lambda: float(t.sum()),
    "bool": lambda: bool(mask.any()),
    "if": lambda: 1 if t.max() > 0 else 0,
    "nonzero": lambda: t.nonzero(),
    "where(cond)": lambda: torch.where(mask),
    "argwhere": lambda: torch.argwhere(mask),
    "masked_select": lambda: t.masked_select(mask),
    "bool index": lambda: t[mask],
    "bool index put": lambda: t.clone().__setitem__(mask, 0.0),
    "equal": lambda: torch.equal(t, t),
    "allclose": lambda: torch.allclose(t, t),
    "unique": lambda: torch.unique(t),
    "unique_consecutive": lambda: torch.unique_consecutive(t),
    "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    "tolist": lambda: t.tolist(),
    "numpy": lambda: t.numpy(),
    "cpu": lambda: t.cpu(),
    "to('cpu')": lambda: t.to("cpu"),
    "to(device='cpu')": lambda: t.to(device="cpu"),
}

QUIET = {
    "arithmetic": lambda: (t * 2 + 1).sum(),
    "integer index": lambda: t[torch.tensor([0, 2])],
    "slice": lambda: t[1:3],
    "where(cond, a, b)": lambda: torch.where(mask, t, 0.0),
    "isfinite all": lambda: torch.isfinite(t).all(),
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(torch.tensor([1, 2]), output_size=3),
    "non-blocking copy": lambda: t.to("cpu", non_blocking=True),
    "dtype cast": lambda: t.to(torch.float64),
    # The training device: the CPU here, the GPU in a GPU run (a copy *to* the device there).
    "to(training device)": lambda: t.to(torch.device("cpu")),
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_counts_every_syncing_call(name):
    with CountSyncs() as syncs:
        SYNCING[name]()
    assert syncs.count == 1, dict(syncs.by_op)


@pytest.mark.parametrize("name", sorted(QUIET))
def test_device_side_work_is_not_counted(name):
    with CountSyncs() as syncs:
        QUIET[name]()
    assert syncs.count == 0, dict(syncs.by_op)


def test_tensor_methods_are_restored_after_counting():
    before = (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.to)
    with CountSyncs():
        pass
    assert (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.to) == before
