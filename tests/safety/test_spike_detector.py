"""SpikeDetector on its own: its defaults are the trainer's, its verdict's names and descriptions,
and a saved state loaded onto the detector's own device and dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from stabletrain.config import OnInstabilityArgs
from stabletrain.safety.spike_detector import CLIP, TRIGGERS, SpikeDetector, describe_trigger, trigger_name


def test_the_plain_loop_defaults_are_the_trainer_s():
    """docs/self_healing.md: ``InstabilityGuard(optimizer)  # same defaults as the trainer``."""
    d, args = SpikeDetector(), OnInstabilityArgs()
    assert (d.window, d.zscore, d.warmup, d.max_ratio, d.min_std) == (
        args.window, args.zscore, args.warmup, args.max_ratio, args.min_std)
    assert d.device == torch.device("cpu") and d.buffer.device == torch.device("cpu")


@pytest.mark.parametrize("window, warmup", [(1, 20), (50, 1)])
def test_window_and_warmup_below_2_are_refused(window, warmup):
    with pytest.raises(ValueError, match=f"window and warmup must be >= 2, got window={window}, warmup={warmup}"):
        SpikeDetector(window=window, warmup=warmup)


def test_window_and_warmup_of_2_are_the_smallest_allowed():
    d = SpikeDetector(window=2, warmup=2)
    assert (d.window, d.warmup) == (2, 2) and d.buffer.shape == (2, 2)


def test_trigger_names_by_code():
    assert [trigger_name(c) for c in range(len(TRIGGERS))] == list(TRIGGERS)
    assert trigger_name(0.0) == "none" and trigger_name(3.0) == "loss_spike"
    assert trigger_name(5) == "unknown(5)" and trigger_name(-1) == "unknown(-1)"


@pytest.mark.parametrize("code, zscore, ratio, expected", [
    (3, 8.14, 12.34, "loss_spike (12.3x the largest loss seen)"),  # over max_ratio: the ratio says it
    (3, 8.14, 10.0, "loss_spike (z=8.1)"),                          # at max_ratio: not over it
    (3, 8.14, 2.0, "loss_spike (z=8.1)"),
    (3, math.nan, math.nan, "loss_spike"),
    (4, 7.04, 50.0, "grad_spike (z=7.0)"),                          # a gradient spike: never the loss ratio
    (4, math.nan, 1.0, "grad_spike"),
    (1, 3.0, 50.0, "nonfinite_loss"),                               # non-finite: no score, no ratio
    (2, 3.0, 0.5, "nonfinite_grad"),
    (0, 3.0, 0.5, "none"),
])
def test_describe_trigger(code, zscore, ratio, expected):
    assert describe_trigger(code, zscore, ratio, 10.0) == expected


def _trained(device="cpu") -> SpikeDetector:
    d = SpikeDetector(window=4, warmup=2, device=device)
    for loss, gn in ((2.0, 1.0), (1.9, 1.1), (1.8, 0.9), (1.85, 1.0), (1.7, 1.05)):
        d.observe(torch.tensor(loss), torch.tensor(gn))
    return d


def test_a_state_saved_elsewhere_loads_onto_the_detector_s_device_and_dtypes():
    saved = _trained().state_dict()
    # As read back from a file by other code: float32 values, int32 count, 1-element tensors.
    foreign = {"recent": saved["recent"].float(), "count": saved["count"].int().reshape(1),
               "max_loss": saved["max_loss"].float().reshape(1)}
    d = SpikeDetector(window=4, warmup=2, device="meta")  # a device other than the state's
    d.load_state_dict(foreign)
    assert d.buffer.device.type == d.count.device.type == d.max_loss.device.type == "meta"
    assert (d.buffer.dtype, d.count.dtype, d.max_loss.dtype) == (torch.float64, torch.int64, torch.float64)
    assert d.count.shape == d.max_loss.shape == ()
    on_cpu = SpikeDetector(window=4, warmup=2)
    on_cpu.load_state_dict(foreign)
    assert int(on_cpu.count) == 5 and float(on_cpu.max_loss) == pytest.approx(2.0)
    assert torch.equal(on_cpu.buffer, saved["recent"].float().double())


def test_the_window_is_kept_newest_first_and_an_older_ring_state_loads_the_same():
    """stabletrain before 2026-12-05 saved a ring ``buffer`` (the newest good step at
    ``(count - 1) % window``): a checkpoint of it resumes to the same window and the same verdicts."""
    d = _trained()  # 5 good steps through a window of 4
    logs = torch.tensor([[2.0, 1.9, 1.8, 1.85, 1.7], [1.0, 1.1, 0.9, 1.0, 1.05]]).double().log()
    assert torch.allclose(d.buffer, logs.flip(1)[:, :4], rtol=0, atol=1e-15), "newest first"
    ring = torch.zeros(2, 4, dtype=torch.float64)
    for i in range(5):
        ring[:, i % 4] = logs[:, i]
    old = SpikeDetector(window=4, warmup=2)
    old.load_state_dict({"buffer": ring, "count": torch.tensor(5), "max_loss": torch.tensor(2.0)})
    assert torch.equal(old.buffer, d.buffer) and int(old.count) == 5
    for loss, gn in ((1.75, 1.0), (9.0, 1.0), (1.7, 30.0)):
        a, b = (t.observe(torch.tensor(loss), torch.tensor(gn)).tolist() for t in (d, old))
        assert a == b or all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b)), (a, b)
    partial = torch.zeros(2, 4, dtype=torch.float64)
    partial[:, :2] = logs[:, :2]  # 2 good steps: slots 0 and 1, the rest never written
    young = SpikeDetector(window=4, warmup=2)
    young.load_state_dict({"buffer": partial, "count": torch.tensor(2), "max_loss": torch.tensor(2.0)})
    assert torch.equal(young.buffer[:, :2], logs[:, :2].flip(1)) and not young.buffer[:, 2:].any()


def test_a_state_of_another_window_is_refused_with_the_setting_to_keep():
    saved = _trained().state_dict()
    with pytest.raises(ValueError, match=r"^the saved detector window holds 4 steps, this one 6: resume with the same "
                                         r"on_instability.window$"):
        SpikeDetector(window=6).load_state_dict(saved)


def _reference(steps, window, zscore, warmup, max_ratio, min_std):
    """The documented rule in plain float64 Python: a step is bad when its loss or gradient norm is
    non-finite, or (after ``warmup`` good steps) its log loss lies more than ``zscore`` noise units
    above the mean of the last 5 good steps (noise: the step-to-step scatter, von Neumann, over the
    last ``window`` good steps, each difference capped at CLIP times their median), or its log gradient norm more than ``zscore`` standard deviations
    above the window's mean, or its loss exceeds ``max_ratio`` x the largest good loss."""
    good: list[tuple[float, float]] = []
    max_loss, out = 0.0, []
    for loss, gn in steps:
        if not math.isfinite(loss) or not math.isfinite(gn):
            ratio = loss / max(max_loss, 1e-30)
            out.append([1.0, 1.0 if not math.isfinite(loss) else 2.0, math.nan, ratio, loss, gn])
            continue
        x = (math.log(max(loss, 1e-30)), math.log(max(gn, 1e-30)))
        win = good[-window:]
        n = len(win)
        recent = win[-5:]
        mean_l = sum(v[0] for v in recent) / max(len(recent), 1)
        diffs = [abs(win[i][0] - win[i - 1][0]) for i in range(1, n)]
        if diffs:  # each difference capped at CLIP x their (lower) median
            cap = CLIP * sorted(diffs)[(len(diffs) - 1) // 2]
            diffs = [min(d, cap) for d in diffs]
        noise = math.sqrt(sum(d * d for d in diffs) / (2 * max(len(diffs), 1)))
        z_l = (x[0] - mean_l) / max(noise, min_std)
        mean_g = sum(v[1] for v in win) / max(n, 1)
        std_g = math.sqrt(sum((v[1] - mean_g) ** 2 for v in win) / max(n - 1, 1))
        z_g = (x[1] - mean_g) / max(std_g, min_std)
        judged = len(good) >= warmup
        ratio = loss / max(max_loss, 1e-30)
        loss_bad = judged and (z_l > zscore or (max_loss > 0 and ratio > max_ratio))
        grad_bad = judged and z_g > zscore
        trigger = 3 if loss_bad else 4 if grad_bad else 0
        score = z_l if trigger == 3 else z_g if trigger == 4 else math.nan
        out.append([float(trigger > 0), float(trigger), score, ratio, loss, gn])
        if not trigger:
            good.append(x)
            max_loss = max(max_loss, loss)
    return out


def test_verdicts_match_a_float64_reference_of_the_documented_rule():
    """30 steps through a window of 8 (the ring wraps): a falling noisy loss, a NaN, an Inf gradient
    norm, a loss spike, a ratio spike and a gradient spike; every verdict entry as the reference."""
    g = torch.Generator().manual_seed(1)
    steps = []
    for i in range(30):
        loss = 3.0 * math.exp(-0.03 * i) * (1 + 0.05 * float(torch.randn((), generator=g)))
        gn = 1.0 + 0.1 * float(torch.randn((), generator=g))
        steps.append((loss, gn))
    steps[4] = (math.nan, 1.0)
    steps[9] = (1.0, math.inf)
    steps[14] = (steps[14][0] * 1.6, steps[14][1])    # a z-score loss spike
    steps[19] = (steps[19][0] * 30.0, steps[19][1])   # over max_ratio
    steps[24] = (steps[24][0], steps[24][1] * 20.0)   # a gradient spike
    settings = dict(window=8, zscore=4.0, warmup=5, max_ratio=10.0, min_std=0.01)
    steps = [(float(torch.tensor(loss)), float(torch.tensor(gn))) for loss, gn in steps]  # float32 values
    detector = SpikeDetector(**settings)
    got = [detector.observe(torch.tensor(loss), torch.tensor(gn)).tolist() for loss, gn in steps]
    want = _reference(steps, **settings)
    triggers = [int(v[1]) for v in want]
    assert [i for i, t in enumerate(triggers) if t] == [4, 9, 14, 19, 24], triggers
    assert [triggers[i] for i in (4, 9, 14, 19, 24)] == [1, 2, 3, 3, 4]
    for step, (a, b) in enumerate(zip(got, want)):
        assert a[:2] == b[:2], (step, a, b)
        for x, y in zip(a[2:], b[2:]):
            assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-9, abs=1e-12), (step, a, b)


def test_state_lives_on_the_detector_s_device_in_float64_and_int64():
    d = SpikeDetector(window=4, warmup=2, device="meta")
    state = d.state_dict()
    assert {k: (v.device.type, v.dtype) for k, v in state.items()} == {
        "recent": ("meta", torch.float64), "count": ("meta", torch.int64), "max_loss": ("meta", torch.float64)}
    verdict = d.observe(torch.tensor(2.0), torch.tensor(1.0))  # host values, moved to the detector's device
    assert verdict.device.type == "meta" and verdict.dtype == torch.float64 and verdict.shape == (6,)
    assert {k: v.device.type for k, v in d.state_dict().items()} == {"recent": "meta", "count": "meta",
                                                                      "max_loss": "meta"}


def test_the_first_judged_steps_match_the_reference_with_a_short_window():
    """warmup=2, window=3: the first judged step has 2 good steps behind it (one step-to-step pair),
    and the ring is not full yet; then it wraps."""
    losses = [1.0, 1.2, 1.9, 1.1, 1.0, 3.5, 1.05, 0.95, 1.0]
    gns = [1.0, 1.3, 1.1, 4.0, 1.0, 1.1, 0.9, 1.2, 1.0]
    steps = [(float(torch.tensor(a)), float(torch.tensor(b))) for a, b in zip(losses, gns)]
    settings = dict(window=3, zscore=1.5, warmup=2, max_ratio=10.0, min_std=0.05)
    detector = SpikeDetector(**settings)
    got = [detector.observe(torch.tensor(a), torch.tensor(b)).tolist() for a, b in steps]
    want = _reference(steps, **settings)
    assert [int(v[1]) for v in want][:4] == [0, 0, 3, 4], "judged from the third step (2 good ones before it)"
    for step, (a, b) in enumerate(zip(got, want)):
        assert a[:2] == b[:2], (step, a, b)
        for x, y in zip(a[2:], b[2:]):
            assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-9, abs=1e-12), (step, a, b)


def test_a_z_score_exactly_at_the_threshold_is_not_a_spike():
    """'more than zscore noise units above': flat losses of 1 (log 0, no noise: the floor min_std),
    then a loss of 4 scores log(4) / min_std; a threshold of exactly that is not passed."""
    z = float(torch.log(torch.tensor(4.0, dtype=torch.float64))) / 0.5
    for threshold, bad in ((z, 0.0), (z * (1 - 1e-12), 1.0)):
        d = SpikeDetector(window=4, warmup=2, zscore=threshold, min_std=0.5, max_ratio=100.0)
        for _ in range(3):
            d.observe(torch.tensor(1.0), torch.tensor(1.0))
        verdict = d.observe(torch.tensor(4.0), torch.tensor(1.0)).tolist()
        assert verdict[0] == bad, (threshold, verdict)


def test_the_loss_ratio_rule_with_losses_below_1():
    """Losses that scatter too much for a z-score spike: only 'above max_ratio x the largest loss
    seen' flags the step, for losses below 1 too; exactly max_ratio x is not above it."""
    for last, bad in ((1.5, 1.0), (1.25, 0.0)):
        d = SpikeDetector(window=8, warmup=4, zscore=6.0, max_ratio=10.0)
        for loss in (0.02, 0.125, 0.02, 0.125, 0.02, 0.125):
            d.observe(torch.tensor(loss, dtype=torch.float64), torch.tensor(1.0))
        verdict = d.observe(torch.tensor(last, dtype=torch.float64), torch.tensor(1.0)).tolist()
        assert verdict[3] == last / 0.125 and verdict[0] == bad, verdict
        if bad:
            assert verdict[1] == 3 and math.isnan(verdict[2]) is False


def test_the_loss_ratio_is_compared_in_float64():
    """A max_ratio that float32 cannot hold (10.1 rounds up to 10.100000381): a ratio of
    10.1000001 is above the setting and flags the step."""
    d = SpikeDetector(window=8, warmup=2, zscore=1e9, max_ratio=10.1)
    for _ in range(3):
        d.observe(torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0))
    verdict = d.observe(torch.tensor(10.1000001, dtype=torch.float64), torch.tensor(1.0)).tolist()
    assert verdict[3] == 10.1000001 and verdict[:2] == [1.0, 3.0], verdict


def test_the_loss_ratio_rule_is_off_while_every_good_loss_was_zero():
    """The ratio to the largest good loss is undefined while that is 0 (a loss that sat at exactly 0):
    a loss of 1e-28 is 100 times the floor it is divided by, yet no spike. With a wide noise floor
    (min_std=1) the z-score rule does not flag it either, so only the ratio rule could."""
    detector = SpikeDetector(min_std=1.0, warmup=5)
    for _ in range(10):
        assert detector.observe(torch.tensor(0.0), torch.tensor(1.0))[0] == 0
    verdict = detector.observe(torch.tensor(1e-28), torch.tensor(1.0))
    assert verdict[0] == 0 and verdict[3] > detector.max_ratio, verdict.tolist()
