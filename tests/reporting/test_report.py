"""`stabletrain report`: summary and plots from metrics.jsonl, checked on real runs."""

from __future__ import annotations

import json
import math
import re
import sys

import numpy as np
import pytest
from PIL import Image

import stabletrain
from conftest import run_cli, tiny_lm
from stabletrain.loggers.jsonl import JsonlLogger
from stabletrain.reporting import KIND_COLORS, RunData, report, signal_figure
from stabletrain.safety.net import NonFiniteCheckpointError
from stabletrain.training.loop import train


@pytest.fixture(scope="module")
def boom(tmp_path_factory):
    """The built-in task with SGD at lr=10: explodes, then NaN; per-layer norms logged. The
    guard is off so that NaN steps are logged to the end, where the final checkpoint is refused."""
    out = tmp_path_factory.mktemp("report") / "boom"
    with pytest.raises(NonFiniteCheckpointError):
        train(out=out, gradient_norm_per_layer=True, guard={"enabled": False},
              **tiny_lm(steps=16, model_args={"optimizer": "sgd", "lr": 10.0}))
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
    # SGD at lr 10: the signals name runaway updates before the NaN (docs/mechanisms.md); the verdict stays
    # the worst status, non-finite.
    assert r.status == {"gradient_norm": "non-finite", "loss": "non-finite", "signals": "runaway updates"}
    assert r.verdict == "non-finite" and r.mechanisms[0].id == "runaway_updates"
    names = [p.name for p in r.files]
    assert names == ["summary.md", "gradient_norm.png", "loss.png", "gradient_norm_layers.png"]
    assert all(p.parent == boom / "report" for p in r.files)

    printed = capsys.readouterr().out
    assert printed.strip() == r.text
    assert f"stabletrain report: {boom} (steps 0-15, 16 logged points (every step))" in printed
    exploding = next(e for e in r.episodes if e.kind == "exploding" and e.signal == "gradient_norm")
    assert f"gradient_norm: non-finite - exploding at steps {exploding.start_step}-{exploding.end_step}" in printed
    assert "verdict: non-finite" in printed and "model_args.lr=1 (now 10; the run's lr x0.1, not verified" in printed

    md = (boom / "report" / "summary.md").read_text()
    assert "**Verdict: non-finite**" in md
    assert f"### gradient_norm: exploding, steps {exploding.start_step}-{exploding.end_step}" in md
    assert "- lower the learning rate: model_args.lr=1 (now 10; the run's lr x0.1, not verified" in md
    assert "![gradient_norm](gradient_norm.png)" in md and "![gradient_norm_layers](gradient_norm_layers.png)" in md
    # The same episodes the live alerts recorded during training.
    _, events = RunData(boom).rows, RunData(boom).events
    live = {(e["kind"], e["signal"], e["step"]) for e in events if e["event"] == "trend_alert"}
    assert live == {(e.kind, e.signal, e.detected_step) for e in r.episodes if e.alerted}


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
    assert r.verdict == "stable" and r.mechanisms == []
    assert r.status == {"gradient_norm": "stable", "loss": "stable", "signals": "no mechanism named"}
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
    assert f"{tmp_path / 'nothing'}: no such folder; pass the out folder of a training run" in missing.stderr
    assert "stabletrain report out/my_run" in missing.stderr


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


# ------------------------------------------------------------- synthetic runs, every verdict


def _noise(seed: int, n: int, decades: float) -> np.ndarray:
    return 10 ** np.random.default_rng(seed).normal(0.0, decades, n)


def _write_run(out, gradient_norm, loss, lr=1e-3, warmup_steps=0):
    """A run folder as the trainer leaves it: metrics.jsonl written by the real logger, and
    the settings.json fields the report reads."""
    out.mkdir(parents=True)
    logger = JsonlLogger(out / "metrics.jsonl")
    for step, (g, l) in enumerate(zip(gradient_norm, loss)):
        logger.log_metrics({"loss": float(l), "gradient_norm": float(g), "lr": lr}, step=step)
    logger.close()
    settings = {"task": "custom", "precision": "32-true", "model_args": {"lr": lr, "warmup_steps": warmup_steps}}
    (out / "settings.json").write_text(json.dumps(settings))


def _ranges(text: str, signal: str, label: str) -> list[tuple[int, int]]:
    line = next(l for l in text.splitlines() if l.strip().startswith(f"{signal}:"))
    found = re.search(rf"{label} at ([^;]+)", line)
    assert found, line
    return [tuple(int(s) for s in m.groups()) for m in re.finditer(r"steps (\d+)-(\d+)", found.group(1))]


def _legend_labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_report_of_vanishing_gradients_and_a_loss_plateau(tmp_path):
    steps = np.arange(400)
    grad = np.exp(-steps / 30) * _noise(1, 400, 0.05)  # 1 -> 1e-6
    loss = 2.3 * _noise(2, 400, 0.01)  # flat from the start
    out = tmp_path / "fading"
    _write_run(out, grad, loss)

    r = report(out, quiet=True)
    assert r.status == {"gradient_norm": "vanishing", "loss": "plateau"} and r.verdict == "vanishing"
    (start, end), = _ranges(r.text, "gradient_norm", "vanishing")
    hundredfold = int(np.argmax(grad <= 0.01))
    assert hundredfold - 10 <= start <= hundredfold + 10 and end == 399, (start, hundredfold)
    assert _ranges(r.text, "loss", "plateau") == [(0, 399)]
    assert "verdict: vanishing" in r.text
    assert "  - raise the learning rate: model_args.lr=0.003 (now 0.001)" in r.text
    assert "check that the input normalization matches your data: transform_args.normalize.mean/std" in r.text
    md = (out / "report" / "summary.md").read_text()
    assert "**Verdict: vanishing**" in md and f"### gradient_norm: vanishing, steps {start}-399" in md
    assert "### loss: plateau, steps 0-399" in md and "| `loss` | plateau | plateau steps 0-399 |" in md

    data = RunData(out)
    fig = signal_figure(data, "gradient_norm", r.status["gradient_norm"], r.episodes)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "gradient_norm (log scale)"
    low, high = ax.get_ylim()
    assert low <= grad.min() and high >= grad.max() and np.log10(high / low) >= 5, "six decades, all shown"
    assert "vanishing" in _legend_labels(fig) and "plateau" not in _legend_labels(fig)
    fig = signal_figure(data, "loss", r.status["loss"], r.episodes)
    assert fig.axes[0].get_yscale() == "log" and "plateau" in _legend_labels(fig)
    assert fig.axes[0].get_title(loc="left") == "loss: plateau"
    # The PNGs are these figures.
    _assert_real_plot(out / "report" / "gradient_norm.png")
    assert _count_near(_pixels(out / "report" / "gradient_norm.png"), _shade_rgb("vanishing")) > 5_000
    assert _count_near(_pixels(out / "report" / "loss.png"), _shade_rgb("plateau")) > 5_000


def test_report_of_a_late_spike_and_a_loss_that_is_not_positive(tmp_path):
    steps = np.arange(300)
    grad = 1.0 * _noise(4, 300, 0.1)
    grad[200] = 60.0
    loss = -1.0 - 2.0 * (1 - np.exp(-steps / 60)) + 0.01 * np.random.default_rng(5).normal(size=300)  # an NLL < 0
    out = tmp_path / "spike"
    _write_run(out, grad, loss, warmup_steps=100)

    r = report(out, quiet=True)
    assert r.status["gradient_norm"] == "spiking" and r.verdict == "spiking"
    assert "  gradient_norm: spiking - spiking at step 200" in r.text.splitlines()
    fig = signal_figure(RunData(out), "gradient_norm", "spiking", r.episodes)
    assert fig.axes[0].get_yscale() == "log" and "spike" in _legend_labels(fig)
    fig = signal_figure(RunData(out), "loss", r.status["loss"], r.episodes)
    assert fig.axes[0].get_yscale() == "linear", "no log scale for values <= 0"
    assert fig.axes[0].get_ylabel() == "loss"


def test_each_signal_reports_its_own_nonfinite_range(tmp_path):
    """gradient_norm NaN from step 30 while the loss is still finite (3.8e11), the loss NaN
    from step 31: the loss's range starts at 31."""
    grad = [1.0] * 20 + [10.0 * 3**i for i in range(10)] + [math.nan] * 10
    loss = [2.0] * 20 + [2.0 * 5**i for i in range(11)] + [math.nan] * 9
    assert math.isfinite(loss[30]) and math.isnan(grad[30]) and math.isnan(loss[31])
    out = tmp_path / "boom"
    _write_run(out, grad, loss)
    r = report(out, quiet=True)
    assert r.status == {"gradient_norm": "non-finite", "loss": "non-finite"}
    assert _ranges(r.text, "gradient_norm", "non-finite") == [(30, 39)]
    assert _ranges(r.text, "loss", "non-finite") == [(31, 39)]
    md = (out / "report" / "summary.md").read_text()
    assert "### loss: nonfinite, steps 31-39" in md
    assert "loss is not finite (steps 31-39): nan, after gradient_norm, not finite since step 30." in md
