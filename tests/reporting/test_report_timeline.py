"""The report tells the truth: too few points, an explosion seen from the second logged step,
one timeline across resumes, resumes and skipped steps marked on the plots."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

import stabletrain
from stabletrain.debug.trends import detect_trends
from stabletrain.reporting import RunData, signal_figure
from stabletrain.reporting.plots import broken_at


def _write(out, lines):
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_too_few_logged_steps_is_not_stable(tmp_path):
    _write(tmp_path, [{"step": s, "loss": 2.0, "gradient_norm": 1.0, "lr": 1e-3} for s in (0, 10, 20)])
    r = stabletrain.report(tmp_path, quiet=True, plots=False)
    assert r.verdict == "too few logged steps" and set(r.status.values()) == {"too few logged steps"}
    assert "verdict: too few logged steps" in r.text


def test_a_jump_of_orders_of_magnitude_is_exploding_from_the_second_logged_step():
    episodes = detect_trends(loss=[5.6, 232232.0], gradient_norm=[4.6, 3070.0], steps=[0, 10])
    assert {(e.kind, e.signal, e.start_step, e.detected_step) for e in episodes} == {
        ("exploding", "loss", 10, 10), ("exploding", "gradient_norm", 10, 10)}
    # Ten times is a change, not yet an explosion without a band to compare with.
    assert detect_trends(loss=[5.6, 56.0], steps=[0, 10]) == []


def test_the_lr_1e3_shape_is_never_called_stable(tmp_path):
    """loss 5.6 -> 2e5 -> 5e8 -> NaN at the default cadence: 4 logged points."""
    rows = [(0, 5.6, 4.6), (10, 232232.0, 3070.0), (20, 502669504.0, 728300.0), (23, float("nan"), float("nan"))]
    _write(tmp_path, [{"step": s, "loss": l, "gradient_norm": g, "lr": 1.0} for s, l, g in rows])
    r = stabletrain.report(tmp_path, quiet=True, plots=False)
    assert r.verdict == "non-finite" and r.status == {"gradient_norm": "non-finite", "loss": "non-finite"}
    assert "loss: non-finite - exploding at steps 10-20; non-finite at step 23" in r.text


def _count_near(path, rgb, tol=40) -> int:
    img = np.asarray(Image.open(path).convert("RGB")).astype(int)
    return int((np.abs(img - np.array(rgb)).max(axis=2) <= tol).sum())


def test_a_resumed_run_is_one_timeline_with_resumes_and_skipped_steps_marked(tmp_path):
    first = [{"step": s, "loss": 3.0 if s < 20 else 3.0 * 10 ** (s - 19), "gradient_norm": 1.0, "lr": 1e-3,
              "loss_scale": 1024.0, "skipped_steps": float(s // 8)} for s in range(30)]
    alert = {"event": "trend_alert", "step": 25, "kind": "exploding", "signal": "loss"}
    resume = {"event": "resume", "step": 12, "checkpoint": "x"}
    second = [{"step": s, "loss": 2.0, "gradient_norm": 1.0, "lr": 1e-4, "loss_scale": 1024.0,
               "skipped_steps": 3.0} for s in range(12, 20)]
    _write(tmp_path, [*first, alert, resume, *second])
    data = RunData(tmp_path)
    assert list(data.steps) == list(range(20)), "rows 20-29 belong to the abandoned timeline"
    assert data.series("loss")[12] == 2.0 and data.resumes == [12]
    assert [e["event"] for e in data.events] == ["resume"], "so do its events"
    r = stabletrain.report(tmp_path, quiet=True)
    plot = tmp_path / "report" / "loss.png"
    assert _count_near(plot, (0x2C, 0xA0, 0x2C), tol=30) > 150, "the resume is a green dashed line"
    assert _count_near(plot, (0x8C, 0x56, 0x4B), tol=30) > 30, "skipped steps are brown ticks"
    assert "resume" in (tmp_path / "report" / "summary.md").read_text()
    # The abandoned timeline's blow-up is part of the run's story (issue 25, item 8), answered by the resume.
    assert r.verdict == "exploding", r.verdict
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "before the resume from step 12" in summary and "already answered: the run was resumed from step 12" in summary
    assert all(e.settled for e in r.episodes if e.kind == "exploding"), "the resumed rows themselves are calm"


def test_the_lr_line_is_not_drawn_across_a_resume(tmp_path):
    """Resumed at step 4 with a tenth of the lr: no line from (3, 1e-2) to (4, 1e-3) claims a decay."""
    first = [{"step": s, "loss": 3.0, "gradient_norm": 1.0, "lr": 1e-2} for s in range(4)]
    second = [{"step": s, "loss": 2.5, "gradient_norm": 1.0, "lr": 1e-3} for s in range(4, 8)]
    _write(tmp_path, [*first, {"event": "resume", "step": 4, "checkpoint": "x"}, *second])
    fig = signal_figure(RunData(tmp_path), "loss", "stable", [])
    x, y = fig.axes[1].lines[0].get_xydata().T
    drawn = [(x[i], x[i + 1]) for i in range(len(x) - 1) if np.isfinite(y[i]) and np.isfinite(y[i + 1])]
    assert (3.0, 4.0) not in drawn and (0.0, 1.0) in drawn and (6.0, 7.0) in drawn
    assert list(y[np.isfinite(y)]) == [1e-2] * 4 + [1e-3] * 4, "every logged lr is still drawn"


def test_broken_at_puts_a_gap_before_each_break_inside_the_steps():
    steps, values = np.array([0, 10, 20, 30]), np.array([1.0, 2.0, 3.0, 4.0])
    x, y = broken_at(steps, values, [20, 0, 40, 20])
    assert list(x) == [0, 10, 15, 20, 30] and np.isnan(y[2]) and list(np.delete(y, 2)) == [1, 2, 3, 4]
    assert list(broken_at(steps, values, [])[0]) == [0, 10, 20, 30]
