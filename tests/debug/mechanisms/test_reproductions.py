"""Real, unplanted reproductions of the silent instabilities (tests/mechanism_runs.py): the
built-in trainer, settings only, and the signals the run logs show each mechanism and its fix.

The numbers asserted are those of the runs (docs/mechanisms.md#reproductions), with margins:
each reproduction is compared with the same run at a good setting, not with a fixed constant
alone."""

from __future__ import annotations

import math
from typing import Any, Callable

import mechanism_runs as runs
import pytest


@pytest.fixture(scope="module")
def run_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[dict[str, Any]]]:
    """Each distinct run once per module: several tests read the same rows."""
    cache: dict[tuple, list[dict[str, Any]]] = {}

    def get(fn: Callable[..., list[dict[str, Any]]], **kw: Any) -> list[dict[str, Any]]:
        key = (fn.__name__, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = fn(tmp_path_factory.mktemp(fn.__name__), **kw)
        return cache[key]

    return get


def values(rows: list[dict], key: str) -> list[float]:
    return [v for _, v in runs.series(rows, key)]


# --------------------------------------------------------------------------------------
# a. attention-logit growth at a high lr; qk_norm removes it
# --------------------------------------------------------------------------------------


def test_attention_logits_grow_by_orders_of_magnitude_at_a_high_lr(run_once):
    rows = run_once(runs.run_attention_growth)  # AdamW, lr 0.1, no weight decay, no dropout
    logit_max = values(rows, "signals/attn_logit_max")
    entropy = values(rows, "signals/attn_entropy_min")
    assert logit_max[0] < 1 and entropy[0] > 1.5  # nearly uniform attention at initialisation
    assert max(logit_max) > 1000 * logit_max[0] and max(logit_max) > 100
    assert min(entropy) < 0.05  # one-hot attention: about one key per query
    growth = runs.first_departure(rows, "signals/attn_logit_max", factor=100)
    assert growth is not None and growth <= 20  # early: within the first 10% of the run
    assert all(math.isfinite(v) for v in values(rows, "loss"))  # silent: no NaN, no Inf


def test_the_high_lr_run_ends_far_worse_than_a_good_lr(run_once):
    high = runs.final_loss(run_once(runs.run_attention_growth))
    good = runs.final_loss(run_once(runs.run_attention_growth, lr=0.01))
    assert high > good + 0.4, (high, good)


def test_qk_norm_bounds_the_attention_logits_and_lowers_the_loss(run_once):
    plain = run_once(runs.run_attention_growth)
    normed = run_once(runs.run_attention_growth, qk_norm=True)
    assert max(values(normed, "signals/attn_logit_max")) < 50
    assert min(values(normed, "signals/attn_entropy_min")) > 0.1
    assert runs.final_loss(normed) < runs.final_loss(plain) - 0.2, (runs.final_loss(normed), runs.final_loss(plain))
