"""benchmarks/all_tools.py's summary and regression record, on per-round times made up here (no
training, no timing): a variant made slower in every round is named WORSE against the record, the
others are the same within their noise, and the ratios, quartiles and syncs are what the rounds say."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def all_tools():
    sys.path.insert(0, str(BENCH))  # all_tools imports its neighbour common.py
    try:
        spec = importlib.util.spec_from_file_location("all_tools_under_test", BENCH / "all_tools.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def _rounds(slow: dict[str, float], seed: int, n: int = 20) -> tuple[dict[str, list[float]], list[bool]]:
    """Per-round seconds: a shared load factor per round (what interleaving cancels), 1% noise per
    variant, and ``slow[name]`` times the base's cost on top."""
    rng = random.Random(seed)
    cost = {"plain": 0.500, "gradient_norm": 0.502, "guard": 0.506, "underflow_overflow": 0.600}
    times: dict[str, list[float]] = {k: [] for k in cost}
    logged = [i % 10 == 0 for i in range(n)]
    for i in range(n):
        load = rng.uniform(0.8, 1.6)
        for name, c in cost.items():
            extra = 0.02 if logged[i] else 0.0
            times[name].append(load * (c * (1 + slow.get(name, 0.0)) + extra) * rng.gauss(1.0, 0.01))
    return times, logged


def test_summary_ratios_quartiles_and_the_logged_steps_weight(all_tools):
    times = {"plain": [1.0] * 9 + [2.0], "gradient_norm": [1.1] * 9 + [2.2]}
    logged = [False] * 9 + [True]
    rows = all_tools.summarise(times, logged, {"gradient_norm": 0.05})
    # (9 x median unlogged + median logged) / 10, plus the extra seconds per step
    assert rows["plain"]["ms"] == pytest.approx((9 * 1.0 + 2.0) / 10 * 1e3)
    assert rows["gradient_norm"]["ms"] == pytest.approx(((9 * 1.1 + 2.2) / 10 + 0.05) * 1e3)
    assert rows["gradient_norm"]["ratio"] == pytest.approx(((9 * 1.1 + 2.2) / 10 + 0.05) / 1.1)
    assert rows["gradient_norm"]["q1"] == pytest.approx(1.1) and rows["gradient_norm"]["se"] == pytest.approx(0.0)
    assert rows["plain"]["base"] is None and "ratio" not in rows["plain"]


def test_a_deliberate_slowdown_is_named_worse_and_the_rest_is_within_noise(all_tools, tmp_path, capsys):
    record = tmp_path / "record.json"
    meta = {"date": "d", "machine": "m", "clock": "cpu", "threads": 1, "rounds": 20, "model": "bench"}
    syncs = {"plain": (53, 54), "gradient_norm": (53, 54), "guard": (53, 54), "underflow_overflow": (55, 56)}
    times, logged = _rounds({}, seed=1)
    all_tools.write_record(all_tools.summarise(times, logged, {}), syncs, meta, record)
    saved = json.loads(record.read_text())
    assert saved["variants"]["underflow_overflow"]["added_syncs"] == [2, 2]
    assert saved["clock"] == "cpu" and set(saved["variants"]) == set(syncs)

    times, logged = _rounds({"guard": 0.05}, seed=2)  # 5% of the guard's step, in every round
    capsys.readouterr()
    all_tools.compare(all_tools.summarise(times, logged, {}), meta, record)
    out = capsys.readouterr().out
    assert "worse than recorded: guard" in out
    assert "guard " in out and ": WORSE" in out.split("guard ", 1)[1].splitlines()[0]
    for name in ("gradient_norm", "underflow_overflow"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(name))
        assert line.endswith("same within noise"), line

    times, logged = _rounds({}, seed=3)  # an unchanged run: nothing is named
    all_tools.compare(all_tools.summarise(times, logged, {}), {**meta, "clock": "wall"}, record)
    out = capsys.readouterr().out
    assert "worse than recorded: none" in out
    assert "not like for like" in out and "clock recorded cpu now wall" in out
