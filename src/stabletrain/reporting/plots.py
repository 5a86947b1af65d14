"""The plots of a run: ``<signal>.png`` (log scale, trend line, lr, episodes shaded, resumes and skipped
steps marked) and the per-layer heatmap ``gradient_norm_layers.png``. Needs matplotlib. See ``docs/report.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from stabletrain.debug.trends import Episode
from stabletrain.reporting.data import RunData
from stabletrain.reporting.verdict import of_signal

KIND_COLORS = {
    "exploding": "#d62728",
    "vanishing": "#1f77b4",
    "spike": "#ff7f0e",
    "plateau": "#bcbd22",
    "nonfinite": "#9467bd",
}
#: Heatmap rows beyond this are grouped into their parent modules.
MAX_HEATMAP_ROWS = 48


def plot_all(
    data: RunData, episodes: Sequence[Episode], status: dict[str, str], folder: Path, warmup: int
) -> list[Path]:
    """``<signal>.png`` for each signal with a status, and the per-layer heatmap when per-layer norms were logged."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    images = []
    for signal in ("gradient_norm", "loss"):
        if signal not in status:
            continue
        path = folder / f"{signal}.png"
        signal_figure(data, signal, status[signal], episodes, warmup).savefig(path)
        images.append(path)
    layers = data.layer_keys()
    if layers:
        path = folder / "gradient_norm_layers.png"
        _plot_layers(path, data, layers, episodes)
        images.append(path)
    return images


def _readable_log_ticks(ax: Any, values: np.ndarray) -> None:
    """Plain numbers (0.5, 2, 300, 1e+06) on a log axis; minor labels when under two decades."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    span = np.log10(values.max() / values.min()) if values.size else 0.0
    ax.yaxis.set_minor_formatter(fmt if span < 2 else NullFormatter())
    ax.tick_params(axis="y", which="minor", labelsize=7)


def step_halfwidth(steps: np.ndarray) -> float:
    return float(np.median(np.diff(steps))) / 2 if len(steps) > 1 else 0.5


def _shade(ax: Any, steps: np.ndarray, episodes: Sequence[Episode], signal: Optional[str]) -> None:
    """Episodes as coloured bands, one legend entry per kind."""
    half = step_halfwidth(steps)
    labelled: set[str] = set()
    for e in episodes:
        if signal is not None and e not in of_signal([e], signal):
            continue
        label = e.kind + (" (warmup, tolerated)" if e.tolerated else "")
        ax.axvspan(
            e.start_step - half,
            e.end_step + half,
            color=KIND_COLORS[e.kind],
            alpha=0.12 if e.tolerated else 0.28,
            hatch="//" if e.tolerated else None,
            lw=0,
            label=None if label in labelled else label,
            zorder=0,
        )
        labelled.add(label)


def _rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    """Centred rolling median (for display; the detector itself only looks backwards)."""
    out = np.full(len(values), np.nan)
    half = window // 2
    for i in range(len(values)):
        chunk = values[max(0, i - half) : i + half + 1]
        chunk = chunk[np.isfinite(chunk)]
        if len(chunk) and np.isfinite(values[i]):
            out[i] = np.median(chunk)
    return out


def signal_figure(data: RunData, signal: str, status: str, episodes: Sequence[Episode], warmup: int = 0) -> Any:
    """The figure of ``<signal>.png``: log y-scale when every finite value is positive.

    Args:
        data: The run's series.
        signal: ``gradient_norm`` or ``loss``.
        status: Its status, for the title.
        episodes: Episodes to shade (those of other signals are skipped).
        warmup: lr warmup steps, shaded grey.

    Returns:
        A ``matplotlib.figure.Figure`` (not registered with pyplot): ``fig.axes[0]`` is the
        signal's axis, ``fig.axes[1]`` the lr axis when lr was logged.

    Example::

        fig = signal_figure(RunData(Path("out/run")), "gradient_norm", "stable", [])
        print(fig.axes[0].get_yscale())   # log
    """
    from matplotlib.figure import Figure
    from matplotlib.transforms import blended_transform_factory

    steps, values, lr, title_right = data.steps, data.series(signal), data.series("lr"), data.out.name
    fig = Figure(figsize=(10, 4.2), dpi=110)
    ax = fig.subplots()
    finite = np.isfinite(values)
    positive = finite & (values > 0)
    log = positive.any() and (positive == finite).all()
    if warmup and steps[0] < warmup:
        ax.axvspan(steps[0], min(warmup, steps[-1]), color="#000000", alpha=0.05, lw=0, label="lr warmup", zorder=0)
    _shade(ax, steps, episodes, signal)
    shown = np.where(finite, values, np.nan)
    few = len(steps) <= 150
    ax.plot(steps, shown, color="#4c72b0", lw=0.9, alpha=0.55, marker="o" if few else None, ms=2.5, label=signal)
    window = max(3, min(20, len(steps) // 10))
    ax.plot(steps, _rolling_median(shown, window), color="#1a2f5a", lw=2.0, label=f"trend (median of {window})")
    _mark_run_events(ax, data)
    bad = ~finite
    if bad.any():
        trans = blended_transform_factory(ax.transData, ax.transAxes)
        ax.scatter(steps[bad], np.full(bad.sum(), 0.96), transform=trans, marker="x", color="#9467bd", s=22,
                   label="NaN/Inf", zorder=5, clip_on=False)
    if log:
        ax.set_yscale("log")
        _readable_log_ticks(ax, shown[positive])
    ax.set_xlabel("step")
    ax.set_ylabel(signal + (" (log scale)" if log else ""))
    ax.set_title(f"{signal}: {status}", loc="left", fontsize=12, fontweight="bold")
    ax.set_title(title_right, loc="right", fontsize=9, color="#555555")
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)
    ax.set_xlim(steps[0] - step_halfwidth(steps), steps[-1] + step_halfwidth(steps))
    handles, labels = ax.get_legend_handles_labels()
    if np.isfinite(lr).any():
        ax2 = ax.twinx()
        # Each run's lr is its own: the line is not drawn across a resume (its lr may differ).
        ax2.plot(*broken_at(steps, lr, data.resumes), color="#7f7f7f", lw=1.0, ls="--", label="lr (right axis)")
        ax2.set_ylabel("lr", color="#7f7f7f")
        ax2.tick_params(axis="y", colors="#7f7f7f")
        ax2.set_ylim(bottom=0)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(len(labels), 5),
              fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def broken_at(steps: np.ndarray, values: np.ndarray, breaks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` to plot ``values`` against ``steps`` with no line between the last step before
    each of ``breaks`` and the first step at or after it: a NaN point is put between them."""
    cut = sorted({int(np.searchsorted(steps, b)) for b in breaks} - {0} - {len(steps)})
    if not cut:
        return steps.astype(np.float64), values
    x = np.insert(steps.astype(np.float64), cut, [(steps[i - 1] + steps[i]) / 2 for i in cut])
    return x, np.insert(values.astype(np.float64), cut, np.nan)


def _mark_run_events(ax: Any, data: RunData) -> None:
    """Resumes (dashed lines), steps the fp16 GradScaler skipped (ticks at the bottom) and the
    first non-finite step the guard found (a solid line)."""
    from matplotlib.transforms import blended_transform_factory

    trans = blended_transform_factory(ax.transData, ax.transAxes)
    resumes = [s for s in data.resumes if s not in data.rollbacks]
    for i, step in enumerate(resumes):
        ax.axvline(step, color="#2ca02c", ls="--", lw=1.2, label="resumed" if i == 0 else None, zorder=4)
    for i, step in enumerate(sorted(set(data.rollbacks))):  # a recovery, not a user's resume
        ax.axvline(step, color="#ff7f0e", ls=":", lw=1.4, label="rolled back to (on_instability)" if i == 0 else None,
                   zorder=4)
    skipped = data.series("skipped_steps")
    if np.isfinite(skipped).any():
        prev = np.concatenate([[0.0], skipped[:-1]])
        grew = np.isfinite(skipped) & (skipped > np.nan_to_num(prev, nan=0.0))
        if grew.any():
            ax.scatter(data.steps[grew], np.full(grew.sum(), 0.03), transform=trans, marker="^", color="#8c564b",
                       s=26, label="fp16 skipped steps", zorder=5, clip_on=False)
    recoveries = [ev["step"] for ev in data.events
                  if ev.get("event") == "recovery" and isinstance(ev.get("step"), int)]
    if recoveries:
        ax.scatter(recoveries, np.full(len(recoveries), 0.97), transform=trans, marker="v", color="#d62728", s=40,
                   label="recovery (on_instability)", zorder=6, clip_on=False)
    guard = [ev["step"] for ev in data.events
             if ev.get("event") == "nonfinite_step" and isinstance(ev.get("step"), int)]
    for i, step in enumerate(guard):
        ax.axvline(step, color="#9467bd", lw=1.6, label="first non-finite step (guard)" if i == 0 else None, zorder=4)


def _layer_rows(keys: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Heatmap rows: the modules that directly own parameters, each with its parameter keys.

    A logged name is a parameter when no other logged name lies below it (modules always have
    their parameters below them). Too many rows are merged into their parents.
    """
    names = [k[len("gradient_norm/") :] for k in keys]
    prefixes = {n.rsplit(".", i)[0] for n in names for i in range(1, n.count(".") + 1)}
    params = [n for n in names if n not in prefixes]
    depth = max((p.count(".") for p in params), default=0)
    while True:
        rows: dict[str, list[str]] = {}
        for p in params:
            parts = p.split(".")
            owner = ".".join(parts[: min(len(parts) - 1, depth)]) or p
            rows.setdefault(owner, []).append("gradient_norm/" + p)
        if len(rows) <= MAX_HEATMAP_ROWS or depth == 0:
            return list(rows.items())
        depth -= 1


def _plot_layers(path: Path, data: RunData, keys: Sequence[str], episodes: Sequence[Episode]) -> None:
    import matplotlib.pyplot as plt
    from matplotlib import colormaps

    rows = _layer_rows(keys)
    steps = data.steps
    grid = np.full((len(rows), len(steps)), np.nan)
    for i, (_, params) in enumerate(rows):
        sq = np.zeros(len(steps))
        for k in params:
            v = data.series(k)
            sq = sq + v * v  # NaN/Inf propagate: a non-finite parameter makes its row non-finite
        with np.errstate(divide="ignore", invalid="ignore"):
            grid[i] = np.log10(np.sqrt(sq))
    cmap = colormaps["viridis"].with_extremes(bad="#e0245e")
    height = max(3.4, 0.24 * len(rows) + 2.0)
    fig, (strip, ax) = plt.subplots(
        2, 1, figsize=(10, height), dpi=110, sharex=True, layout="constrained",
        gridspec_kw={"height_ratios": [0.35, max(2.0, 0.24 * len(rows))]},
    )
    finite = grid[np.isfinite(grid)]
    vmin, vmax = (np.percentile(finite, 1), np.percentile(finite, 99.5)) if finite.size else (0, 1)
    half = step_halfwidth(steps)
    image = ax.imshow(
        np.ma.masked_invalid(grid),
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        vmin=vmin,
        vmax=vmax,
        extent=(steps[0] - half, steps[-1] + half, len(rows) - 0.5, -0.5),
    )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([name for name, _ in rows], fontsize=7 if len(rows) > 24 else 8)
    ax.set_xlabel("step")
    # Episodes of either signal on a strip above, so they do not hide the cells.
    _shade(strip, steps, episodes, None)
    strip.set_yticks([])
    strip.set_ylabel("episodes", rotation=0, ha="right", va="center", fontsize=8)
    strip.tick_params(axis="x", bottom=False)
    handles, labels = strip.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8, frameon=False)
    bar = fig.colorbar(image, ax=[strip, ax], pad=0.01, fraction=0.04)
    bar.set_label("log10 gradient norm")
    title = "gradient_norm per layer (modules owning parameters)"
    if not np.isfinite(grid).all():
        title += "; red = NaN/Inf"
    strip.set_title(title, loc="left", fontsize=11, fontweight="bold")
    strip.set_title(data.out.name, loc="right", fontsize=9, color="#555555")
    fig.savefig(path)
    plt.close(fig)
