"""SpikeDetector: planted spikes in logged-loss series are found after warm-up, clean series raise no alarm."""

from __future__ import annotations

import math

import pytest
import torch

from stabletrain.safety.spike_detector import SpikeDetector, trigger_name


def _run(losses, grad_norms=None, **kwargs):
    """Feed the series one step at a time; the verdicts as (step, trigger, zscore) for bad steps."""
    det = SpikeDetector(**kwargs)
    bad = []
    for step, loss in enumerate(losses):
        gn = 1.0 if grad_norms is None else grad_norms[step]
        v = det.observe(torch.tensor(loss, dtype=torch.float32), torch.tensor(gn, dtype=torch.float32))
        if v[0] > 0:
            bad.append((step, trigger_name(v[1]), float(v[2])))
    return bad


def _noisy_level(steps, seed, sigma=0.1, start=8.0, end=2.0):
    """A loss falling from ``start`` to ``end`` with log-normal step-to-step noise of ``sigma``."""
    g = torch.Generator().manual_seed(seed)
    level = torch.logspace(math.log10(start), math.log10(end), steps, dtype=torch.float64)
    return (level * torch.exp(sigma * torch.randn(steps, generator=g, dtype=torch.float64))).tolist()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("factor", [1e5, 1e8])
def test_a_spike_the_warm_up_let_in_does_not_hide_the_same_spike_after_warm_up(seed, factor):
    """The heal example's outlier sample came back one epoch later: its first spike fell in the
    warm-up (not judged, so it entered the window and the largest loss seen), and the second one,
    1e5 times the recent level, scored z~5 against a noise the first had inflated: missed."""
    losses = _noisy_level(60, seed)
    losses[12] *= factor   # in the warm-up (20 good steps): not judged, enters the window
    losses[44] *= factor   # after it: must be found
    bad = _run(losses)
    assert [(s, t) for s, t, _ in bad] == [(44, "loss_spike")], bad
    assert bad[0][2] > 20, "the noise is that of the clean steps, not the warm-up spike's jumps"


@pytest.mark.parametrize("seed", range(20))
def test_clean_noisy_series_raise_no_alarm(seed):
    # Heavier noise than the benchmark's runs, a falling trend, and a jumpy start.
    losses = _noisy_level(300, seed, sigma=0.15, start=15.0, end=1.0)
    grad_norms = _noisy_level(300, seed + 100, sigma=0.2, start=2.0, end=6.0)
    assert _run(losses, grad_norms) == []


def test_a_doubling_after_a_clean_stretch_is_still_a_spike():
    losses = _noisy_level(80, 0, sigma=0.02)
    losses[60] *= 2.0
    assert [(s, t) for s, t, _ in _run(losses)] == [(60, "loss_spike")]
