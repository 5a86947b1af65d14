"""`stabletrain report`: summary and plots from metrics.jsonl, checked on real runs."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from PIL import Image

import stabletrain
from stabletrain.reporting import KIND_COLORS, RunData, report
from stabletrain.trainer import train

from conftest import run_cli, tiny_lm


@pytest.fixture(scope="module")
def boom(tmp_path_factory):
    """The built-in task with SGD at lr=10: explodes, then NaN; per-layer norms logged."""
    out = tmp_path_factory.mktemp("report") / "boom"
    train(out=out, gradient_norm_per_layer=True, **tiny_lm(steps=16, model_args={"optimizer": "sgd", "lr": 10.0}))
    return out


@pytest.fixture(scope="module")
def stable(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "stable"
    train(out=out, **tiny_lm(steps=120, log_every_num_steps=2, model_args={"warmup_steps": 10}))
    return out


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def _count_near(img: np.ndarray, rgb, tol: int = 6) -> int:
    return int((np.abs(img - np.array(rgb)).max(axis=2) <= tol).sum())


def _shade_rgb(kind: str, alpha: float = 0.28) -> tuple[int, int, int]:
    """An episode band's colour over the white plot background."""
    c = [int(KIND_COLORS[kind][i : i + 2], 16) for i in (1, 3, 5)]
    return tuple(round(255 + alpha * (x - 255)) for x in c)


def _assert_real_plot(path, min_size=(800, 300)):
    img = _pixels(path)
    h, w, _ = img.shape
    assert w >= min_size[0] and h >= min_size[1], (w, h)
    assert path.stat().st_size > 20_000
    assert img.std() > 20, "not blank"
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 200, "lines, text and shading, not a flat image"
    return img


def test_report_of_an_exploding_run(boom, capsys):
    r = report(boom)
    assert r.status == {"gradient_norm": "non-finite", "loss": "non-finite"} and r.verdict == "non-finite"
    names = [p.name for p in r.files]
    assert names == ["summary.md", "gradient_norm.png", "loss.png", "gradient_norm_layers.png"]
    assert all(p.parent == boom / "report" for p in r.files)

    printed = capsys.readouterr().out
    assert printed.strip() == r.text
    assert f"stabletrain report: {boom} (steps 0-15, 16 logged points (every step))" in printed
    exploding = next(e for e in r.episodes if e.kind == "exploding" and e.signal == "gradient_norm")
    assert f"gradient_norm: non-finite - exploding at steps {exploding.start_step}-{exploding.end_step}" in printed
    assert "verdict: non-finite" in printed and "model_args.lr=1 (now 10)" in printed

    md = (boom / "report" / "summary.md").read_text()
    assert "**Verdict: non-finite**" in md
    assert f"### gradient_norm: exploding, steps {exploding.start_step}-{exploding.end_step}" in md
    assert "- lower the learning rate: model_args.lr=1 (now 10)" in md
    assert "![gradient_norm](gradient_norm.png)" in md and "![gradient_norm_layers](gradient_norm_layers.png)" in md
    # The same episodes the live alerts recorded during training.
    _, events = RunData(boom).rows, RunData(boom).events
    live = {(e["kind"], e["signal"], e["step"]) for e in events if e["event"] == "trend_alert"}
    assert live == {(e.kind, e.signal, e.detected_step) for e in r.episodes if not e.tolerated}


def test_exploding_plots_have_shaded_episodes_and_nan_markers(boom):
    report(boom, quiet=True)
    grad = _assert_real_plot(boom / "report" / "gradient_norm.png")
    assert _count_near(grad, _shade_rgb("exploding")) > 5_000, "the exploding episode is shaded"
    assert _count_near(grad, (0x94, 0x67, 0xBD), tol=30) > 50, "NaN/Inf steps are marked"
    loss = _assert_real_plot(boom / "report" / "loss.png")
    assert _count_near(loss, _shade_rgb("exploding")) > 5_000

    heat = _assert_real_plot(boom / "report" / "gradient_norm_layers.png")
    assert _count_near(heat, (0xE0, 0x24, 0x5E), tol=4) > 5_000, "non-finite cells in their own colour"
    viridis_dark = (0x44, 0x01, 0x54)
    assert _count_near(heat, viridis_dark, tol=40) > 100, "finite cells on the colour scale"


def test_report_of_a_stable_run(stable):
    r = report(stable, quiet=True)
    assert r.verdict == "stable" and r.status == {"gradient_norm": "stable", "loss": "stable"}
    assert [p.name for p in r.files] == ["summary.md", "gradient_norm.png", "loss.png"], "no heatmap without per-layer norms"
    grad = _assert_real_plot(stable / "report" / "gradient_norm.png")
    for kind in ("exploding", "vanishing", "plateau", "nonfinite"):
        assert _count_near(grad, _shade_rgb(kind), tol=3) < 50, kind
    assert "**Verdict: stable**" in (stable / "report" / "summary.md").read_text()


def test_cli_and_python_api(boom, tmp_path):
    result = run_cli("report", str(boom), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "verdict: non-finite" in result.stdout and "written:" in result.stdout
    assert stabletrain.report(boom, quiet=True).verdict == "non-finite"

    missing = run_cli("report", str(tmp_path / "nothing"), cwd=tmp_path)
    assert missing.returncode == 1
    assert "no metrics.jsonl in" in missing.stderr and "stabletrain report out/my_run" in missing.stderr


def test_summary_without_matplotlib(boom, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = report(boom, quiet=True)
    assert [p.name for p in r.files] == ["summary.md"]
    assert 'pip install "stabletrain[plots]"' in r.text


def test_a_resumed_run_counts_each_step_once(tmp_path):
    rows = [{"step": s, "loss": 2.0, "gradient_norm": 1.0} for s in (0, 1, 2, 3, 2, 3, 4)]
    rows[4]["gradient_norm"] = 5.0  # step 2 logged again after resuming: the later value counts
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = RunData(tmp_path)
    assert list(data.steps) == [0, 1, 2, 3, 4] and data.series("gradient_norm")[2] == 5.0
