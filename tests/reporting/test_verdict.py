"""The verdict steps of ``stabletrain report`` on hand-written metrics.jsonl files: the run's own thresholds,
the episodes only the run's events show, and the status per signal with the worst as the verdict."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from stabletrain.config import TrendAlertArgs
from stabletrain.debug.trends import Episode
from stabletrain.reporting.data import RunData
from stabletrain.reporting.verdict import TOO_FEW, missed_episodes, run_episodes, run_thresholds, statuses


def _run(tmp_path: Path, rows: list[dict[str, Any]], settings: dict[str, Any] | None = None) -> RunData:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if settings is not None:
        (tmp_path / "settings.json").write_text(json.dumps(settings))
    return RunData(tmp_path)


def test_the_runs_own_thresholds_and_warmup_are_used_and_a_foreign_settings_file_falls_back(tmp_path):
    args, warmup = run_thresholds({"trend_alerts": {"persist": 5, "window": 30}, "model_args": {"warmup_steps": 40}})
    assert isinstance(args, TrendAlertArgs) and (args.persist, args.window) == (5, 30) and warmup == 40
    assert run_thresholds({}) == (None, 0)
    assert run_thresholds({"trend_alerts": {"persist": 0}})[0] is None  # invalid there: the defaults


def test_a_guard_stop_between_logged_steps_is_a_nonfinite_episode_of_its_signal(tmp_path):
    rows = [{"step": s, "loss": 2.0, "gradient_norm": 1.0} for s in range(0, 40, 10)]
    rows.append({"event": "nonfinite_step", "step": 35, "nonfinite": ["gradient_norm"]})
    data = _run(tmp_path, rows)
    (found,) = missed_episodes(data, [])
    assert (found.kind, found.signal, found.start_step, found.end_step) == ("nonfinite", "gradient_norm", 35, 35)
    assert math.isnan(found.value) and not found.open and "guard" in found.note
    # Already found by the detector: not twice.
    seen = Episode("nonfinite", "gradient_norm", 30, 35, 30, math.nan)
    assert missed_episodes(data, [seen]) == []


def test_growth_of_two_orders_of_magnitude_is_exploding_from_the_lowest_value_before_it(tmp_path):
    values = [3.0, 1.0, 2.0, 50.0, 150.0]
    data = _run(tmp_path, [{"step": 10 * i, "loss": v} for i, v in enumerate(values)])
    (found,) = missed_episodes(data, [])
    assert (found.kind, found.signal, found.start_step, found.end_step) == ("exploding", "loss", 10, 40)
    assert (found.value, found.reference) == (150.0, 1.0)
    assert found.note == f"grew {math.log10(150.0):.1f} orders of magnitude"


def test_the_verdict_is_the_worst_status_and_a_short_run_has_too_few_logged_steps(tmp_path):
    data = _run(tmp_path, [{"step": s, "loss": 2.0, "gradient_norm": 1.0} for s in range(3)])
    status, verdict = statuses(data, [], min_points=4)
    assert status == {"gradient_norm": TOO_FEW, "loss": TOO_FEW} and verdict == TOO_FEW
    status, verdict = statuses(data, [], min_points=3)
    assert status == {"gradient_norm": "stable", "loss": "stable"} and verdict == "stable"
    episodes = [
        Episode("spike", "loss", 1, 1, 1, 5.0, 2.0),
        Episode("spike", "gradient_norm", 0, 0, 0, 9.0, 1.0, tolerated=True),  # warmup: not counted
        Episode("nonfinite", "parameters", 2, 2, 2, math.nan, note="the optimizer step made weights non-finite"),
    ]
    status, verdict = statuses(data, episodes, min_points=3)
    assert status == {"gradient_norm": "stable", "loss": "spiking", "parameters": "non-finite"}
    assert verdict == "non-finite"


def test_run_episodes_are_the_detectors_then_the_missed_ones(tmp_path):
    learning = [{"step": s, "loss": 2.0 * 0.9**s, "gradient_norm": 1.0} for s in range(30)]
    refused = {"event": "checkpoint_refused", "step": 31, "nonfinite": ["fc.weight"]}
    # Nothing the detector sees: the refused checkpoint is the only episode.
    (episode,) = run_episodes(_run(tmp_path / "a", learning + [refused]), None, 0)
    assert (episode.kind, episode.signal, episode.start_step) == ("nonfinite", "parameters", 31)
    assert "fc.weight" in episode.note
    # The detector saw the NaN loss: the refused checkpoint adds nothing.
    nan = {"step": 30, "loss": float("nan"), "gradient_norm": 1.0}
    episodes = run_episodes(_run(tmp_path / "b", learning + [nan, refused]), None, 0)
    assert [(e.kind, e.signal, e.start_step, e.open) for e in episodes] == [("nonfinite", "loss", 30, False)]
