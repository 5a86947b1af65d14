"""The statistics kernel's helpers: the device flags, the one read-back, and the Meter's caches
(a stale cache would report a tensor's old values)."""

from __future__ import annotations

import pytest
import torch

from stabletrain.debug.underflow_overflow.stats import Meter, any_nonfinite, to_host, unmasked_nonfinite, value_kind
from stabletrain.utils.sync import CountSyncs

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_device_flags_need_no_sync_and_tell_data_from_masks(bad):
    with CountSyncs() as syncs:
        amaxes = [torch.tensor(1.0), torch.tensor(abs(bad)), torch.tensor(0.0)]
        flag = any_nonfinite(amaxes)
        data = torch.tensor([[0.5, bad], [1.0, 2.0]])
        in_data = unmasked_nonfinite(data)
        mask = unmasked_nonfinite(torch.tensor([[0.0, -INF], [0.0, 0.0]]))
    assert syncs.count == 0
    assert bool(flag) and bool(in_data) and not bool(mask), "an additive mask of 0 and -inf is not bad data"
    assert not bool(any_nonfinite([])) and not bool(any_nonfinite(amaxes[::2]))
    assert not bool(unmasked_nonfinite(torch.ones(3)))


def test_to_host_keeps_the_order_and_value_kind_reads_it():
    tensors = [torch.tensor(1.5), torch.tensor(NAN, dtype=torch.float16), torch.tensor(-2.0, dtype=torch.float64)]
    values = to_host(tensors)
    assert values[0] == 1.5 and values[1] != values[1] and values[2] == -2.0
    assert [value_kind(0.0, v) for v in (1.0, NAN, INF, 3e38)] == [None, "nan", "inf", None]


def test_meter_measures_a_tensor_again_after_an_in_place_change():
    meter = Meter()
    t = torch.tensor([[-3.0, 1.0], [0.5, 2.0]])
    amin, amax, ref = meter.measure(t)
    assert (amin.item(), amax.item()) == (0.5, 3.0) and ref() is t
    assert meter.measure(t)[1] is amax, "the same (tensor, version) is measured once per forward"
    t.mul_(10)  # bumps the version: the cached statistics are stale
    cached = meter.measure(t)[1]
    assert cached.item() == 30.0
    meter.end_forward()  # after a forward, an id may be another tensor's: nothing is reused
    assert meter.measure(t)[1] is not cached
    with torch.inference_mode():
        inference = torch.full((2,), -4.0)
    amin, amax, ref = meter.measure(inference)
    assert (amin.item(), amax.item(), ref) == (4.0, 4.0, None), "no weak reference to an inference tensor"


@torch.no_grad()  # as in the monitor's hooks
def test_meter_measures_a_weight_once_per_change():
    meter = Meter()
    w = torch.nn.Parameter(torch.tensor([1.0, -5.0]))
    first = meter.weight(w)
    assert meter.weight(w) is first, "a weight shared by calls, or measured in every microbatch, costs once"
    w.add_(-1.0)  # what an optimizer step does
    assert meter.weight(w)[1].item() == 6.0
    w.data = torch.tensor([0.25, 0.5])  # a new storage, same Parameter
    assert tuple(x.item() for x in meter.weight(w)) == (0.25, 0.5)
