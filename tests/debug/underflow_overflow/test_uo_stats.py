"""The statistics kernel's helpers: the device flags, the one read-back, and the Meter's caches
(a stale cache would report a tensor's old values)."""

from __future__ import annotations

import pytest
import torch

from stabletrain.debug.underflow_overflow.stats import (
    Meter,
    any_nonfinite,
    nan_min,
    raw_stats,
    tensor_stats,
    to_host,
    unmasked_nonfinite,
    value_kind,
)
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


def _signed_nan(dtype: torch.dtype) -> torch.Tensor:
    ints = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}[dtype]
    nan = torch.tensor(NAN, dtype=dtype)
    return (nan.view(ints) | torch.iinfo(ints).min).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_the_kernel_gives_exact_abs_min_and_max_against_float64(dtype, layout):
    """|t| read back as integers (stats.raw_stats) against a float64 reference: exact, with
    negative zeros, subnormals, and every value in a vectorised body and a scalar tail."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 67, 1001):
        base = torch.randn(n, 2, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-6, 6, (n, 2), generator=gen)
        t = base.to(dtype)
        t[0, 0] = -0.0 if n > 1 else t[0, 0]
        if n > 3:
            t[n // 2, 1] = torch.finfo(dtype).tiny / 4  # subnormal (a flushed zero in bf16 is still exact)
            t[n - 1, 0] = -torch.finfo(dtype).max
        x = t[:, 0] if layout == "strided" else t.reshape(-1)
        want = x.double().abs()
        for scratch in (None, {}):
            amin, amax = tensor_stats(x, scratch)
            assert amin.dtype == amax.dtype == dtype
            assert (amin.double().item(), amax.double().item()) == (want.min().item(), want.max().item()), (n, scratch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", ["nan", "-nan", "inf", "-inf"])
def test_a_non_finite_value_shows_in_the_abs_max_and_a_nan_in_both(dtype, bad):
    t = torch.randn(100, dtype=torch.float64).to(dtype)
    t[37] = {"nan": torch.tensor(NAN, dtype=dtype), "-nan": _signed_nan(dtype),
             "inf": torch.tensor(INF, dtype=dtype), "-inf": torch.tensor(-INF, dtype=dtype)}[bad]
    lo, hi = raw_stats(t, {})
    amin, amax = tensor_stats(t, {})
    if "nan" in bad:
        assert hi.isnan() and amax.isnan() and amin.isnan(), "a NaN makes both NaN"
        assert not lo.isnan(), "the raw kernel leaves the abs min to the host (nan_min)"
        assert nan_min(lo.item(), hi.item())[0] != nan_min(lo.item(), hi.item())[0]
    else:
        assert hi.item() == amax.item() == INF and amin.item() == lo.item() == t.double().abs().min().item()
    assert value_kind(*nan_min(lo.item(), hi.item())) == ("nan" if "nan" in bad else "inf")


def test_the_monitor_reads_a_nan_as_nan_in_both_columns(tmp_path):
    from stabletrain.debug.underflow_overflow.records import Call, Event, StatsRow, host_values

    meter = Meter()
    t = torch.tensor([2.0, NAN, -0.5])
    amin, amax, _ = meter.measure(t)
    row = StatsRow("output[0]", "output", amin, amax, (3,), t.dtype, None, None)
    values = host_values([Event("forward", 0, 0, "exit", Call("m", "M", None, 1), [row])])
    lo, hi = values[(0, 0)]
    assert lo != lo and hi != hi


def test_the_same_gradient_handed_to_two_hooks_is_measured_once():
    meter = Meter()
    g = torch.randn(4, 3)
    first = meter.measure(g)
    second = meter.measure(g)  # autograd passes one tensor to both inputs of an add
    assert second[0] is first[0] and second[1] is first[1]
    g.add_(1.0)
    assert meter.measure(g)[1] is not first[1], "changed in place: measured again"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_large_tensor_is_measured_in_chunks_exactly(dtype):
    """Past 2 chunks (stats.CHUNK elements each) a contiguous CPU tensor is taken chunk by chunk:
    the extremes at a chunk's edges, in its last partial chunk, a NaN or an Inf in a later chunk
    are found as in one pass; a strided view of the same size takes the one pass."""
    from stabletrain.debug.underflow_overflow import stats

    gen = torch.Generator().manual_seed(1)
    n = 3 * stats.CHUNK + 5
    t = (torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    t[stats.CHUNK - 1] = -0.125  # the smallest magnitude, the last element of the first chunk
    t[2 * stats.CHUNK] = -64.0  # the largest, the first of the third
    for x in (t, torch.stack([t, t], 1)[:, 0]):
        scratch: dict = {}
        lo, hi = raw_stats(x, scratch)
        assert (lo.item(), hi.item()) == (0.125, 64.0)
        assert ("chunk", dtype) in scratch if x.is_contiguous() else ("chunk", dtype) not in scratch
    for bad, want in ((NAN, "nan"), (-INF, "inf")):
        t[n - 2] = bad  # in the last, partial chunk
        assert value_kind(*nan_min(*(v.item() for v in raw_stats(t, {})))) == want
    scratch = {}
    with CountSyncs() as syncs:
        raw_stats(t, scratch)
    assert syncs.count == 0
    assert scratch[("chunk", dtype)].numel() == stats.CHUNK, "one chunk's buffer, not the tensor's size"
