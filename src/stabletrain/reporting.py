"""``stabletrain report out/my_run``: trends and plots from a finished (or running) run.

Reads ``out/metrics.jsonl`` (and ``settings.json`` for the run's thresholds, warmup and
learning rate), runs the same trend detector as the live alerts over the whole series, and
writes ``out/report/``:

=============================  =================================================================
File                           What
=============================  =================================================================
``summary.md``                 stable / exploding / vanishing / spiking / plateau / non-finite /
                               too few logged steps per signal, each episode's step range, the
                               newest healthy checkpoint and the next actions
``gradient_norm.png``          gradient_norm over steps, log scale, trend line, lr, episodes shaded
``loss.png``                   the same for the loss
``gradient_norm_layers.png``   per-layer heatmap (log10 norm per layer and step), when the run
                               logged per-layer norms (``gradient_norm_per_layer=true``)
=============================  =================================================================

The summary is also printed. Plots need matplotlib (``pip install "stabletrain[plots]"``);
without it the summary is still written.

A run whose loss or gradient norm went non-finite (logged, or found by the guard between logged
steps) or grew by two orders of magnitude or more is never "stable"; with fewer logged points
than the detector needs for a band (``trend_alerts.persist`` + 1) and nothing found, the verdict
is "too few logged steps". A resumed run is read as one timeline: the rows logged after a resume
replace those of the same and later steps (see :mod:`stabletrain.run_history`); the plots mark
the resumes, the steps the fp16 GradScaler skipped and the first non-finite step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from stabletrain.config import TrendAlertArgs
from stabletrain.debug.trends import AlertContext, Episode, TrendDetector, checkpoint_context, next_actions
from stabletrain.errors import StabletrainError
from stabletrain.run_history import read_run

#: Worst first: the overall verdict is the worst status of any signal.
TOO_FEW = "too few logged steps"
STATUS_ORDER = ("non-finite", "exploding", "vanishing", "plateau", "spiking", TOO_FEW, "stable")
#: Growth over the lowest earlier value that makes a series "exploding" whatever the detector says.
ORDERS_OF_MAGNITUDE = 100.0
_STATUS_OF_KIND = {
    "nonfinite": "non-finite",
    "exploding": "exploding",
    "vanishing": "vanishing",
    "plateau": "plateau",
    "spike": "spiking",
}
KIND_COLORS = {
    "exploding": "#d62728",
    "vanishing": "#1f77b4",
    "spike": "#ff7f0e",
    "plateau": "#bcbd22",
    "nonfinite": "#9467bd",
}
#: Heatmap rows beyond this are grouped into their parent modules.
MAX_HEATMAP_ROWS = 48


@dataclass
class Report:
    """What ``stabletrain.report`` found and wrote.

    Attributes:
        out: The run folder.
        folder: ``out/report``.
        status: Per signal (``gradient_norm``, ``loss``): stable, exploding, vanishing,
            spiking, plateau or non-finite.
        verdict: The worst status over all signals.
        episodes: Every episode found (warmup spikes included, marked tolerated).
        files: The files written, summary first.
        text: The summary as printed.
    """

    out: Path
    folder: Path
    status: dict[str, str]
    verdict: str
    episodes: list[Episode]
    files: list[Path] = field(default_factory=list)
    text: str = ""


class RunData:
    """The series of one run, one row per step: after a resume the later rows win (see
    :mod:`stabletrain.run_history`)."""

    def __init__(self, out: Path):
        self.out = out
        path = out / "metrics.jsonl"
        if not path.exists():
            raise StabletrainError(
                f"no metrics.jsonl in {out}: pass the out folder of a training run "
                "(stabletrain report out/my_run), trained with loggers.jsonl.enabled=true"
            )
        history = read_run(path)
        self.events = history.events
        self.resumes = history.resumes
        self.rows = history.rows
        if not self.rows:
            raise StabletrainError(f"{path} holds no logged steps yet")
        settings_path = out / "settings.json"
        self.settings: dict[str, Any] = json.loads(settings_path.read_text()) if settings_path.exists() else {}
        self.steps = np.array([r["step"] for r in self.rows], dtype=np.int64)

    def series(self, key: str) -> np.ndarray:
        return np.array([_as_float(r.get(key)) for r in self.rows], dtype=np.float64)

    def layer_keys(self) -> list[str]:
        keys: dict[str, None] = {}
        for row in self.rows:
            for k in row:
                if k.startswith("gradient_norm/"):
                    keys.setdefault(k, None)
        return list(keys)


def report(out: str | Path, *, quiet: bool = False, plots: bool = True) -> Report:
    """Analyse a run's metrics.jsonl and write ``out/report/`` (summary and plots).

    Args:
        out: A training run's output folder.
        quiet: Do not print the summary.
        plots: Write the PNG plots (needs matplotlib).

    Returns:
        A :class:`Report` with the status per signal, the episodes and the files written.

    Raises:
        StabletrainError: ``out`` holds no metrics.jsonl, or it has no logged steps.

    Example::

        import stabletrain
        r = stabletrain.report("out/my_run")
        print(r.verdict, [p.name for p in r.files])
    """
    out = Path(out)
    data = RunData(out)
    settings = data.settings
    args = None
    if isinstance(settings.get("trend_alerts"), dict):
        try:  # the run's own thresholds; a settings.json of another version falls back to defaults
            args = TrendAlertArgs(**settings["trend_alerts"])
        except ValueError:
            args = None
    warmup = int((settings.get("model_args") or {}).get("warmup_steps") or 0)
    detector = TrendDetector(args, warmup_steps=warmup)
    for row in data.rows:
        detector.update(row["step"], row)
    episodes = detector.finish()
    episodes += _missed_episodes(data, episodes)
    context = AlertContext.from_settings(settings)
    context.history = [{k: r.get(k) for k in ("step", "lr", "loss", "gradient_norm")} for r in data.rows]
    checkpoint_context(context, _Folder(out / "checkpoints"))
    min_points = (args or TrendAlertArgs()).persist + 1

    status: dict[str, str] = {}
    for signal in ("gradient_norm", "loss"):
        if not any(signal in r for r in data.rows):
            continue
        kinds = [_STATUS_OF_KIND[e.kind] for e in _of_signal(episodes, signal) if not e.tolerated]
        if kinds:
            status[signal] = min(kinds, key=STATUS_ORDER.index)
        else:
            status[signal] = TOO_FEW if sum(signal in r for r in data.rows) < min_points else "stable"
    if any(e.signal == "parameters" for e in episodes):
        status["parameters"] = "non-finite"
    verdict = min(status.values(), key=STATUS_ORDER.index) if status else TOO_FEW

    folder = out / "report"
    folder.mkdir(parents=True, exist_ok=True)
    images: list[Path] = []
    plot_note = ""
    if plots:
        try:
            images = _plot_all(data, episodes, status, folder, warmup)
        except ImportError:
            plot_note = 'plots skipped: matplotlib is not installed (pip install "stabletrain[plots]")'

    markdown = _markdown(out, data, status, verdict, episodes, context, images, plot_note)
    summary_path = folder / "summary.md"
    summary_path.write_text(markdown, encoding="utf-8")
    files = [summary_path, *images]
    text = _terminal(out, data, status, verdict, episodes, context, files, plot_note)
    if not quiet:
        print(text)
    return Report(out=out, folder=folder, status=status, verdict=verdict, episodes=episodes, files=files, text=text)


# ----------------------------------------------------------------------------- summaries


class _Folder:
    """What :func:`~stabletrain.debug.trends.checkpoint_context` needs of a trainer."""

    def __init__(self, folder: Path):
        self.folder = folder

    def healthy_checkpoint(self) -> Any:
        from stabletrain.checkpoint import newest_healthy

        return newest_healthy(self.folder)


def _missed_episodes(data: RunData, episodes: Sequence[Episode]) -> list[Episode]:
    """What the detector cannot see but the run shows: a non-finite step the guard found
    between logged steps (or parameters the optimizer made non-finite), a checkpoint refused
    for NaN/Inf, and a series that grew by orders of magnitude without an exploding episode."""
    found: list[Episode] = []
    kinds = {(e.kind, e.signal) for e in episodes}
    for ev in data.events:
        step = ev.get("step")
        if not isinstance(step, int):
            continue
        if ev.get("event") == "nan_detected":  # nancapture stopped the run before logging the step
            signal = "loss" if ev.get("reason") == "nonfinite_loss" else "gradient_norm"
            if ev.get("reason") in ("nonfinite_loss", "nonfinite_gradients", "gradient_norm_overflow") and (
                    "nonfinite", signal) not in kinds:
                found.append(Episode("nonfinite", signal, step, step, step, math.nan,
                                     note=f"found by nancapture ({ev.get('reason')})", open=False))
                kinds.add(("nonfinite", signal))
        elif ev.get("event") == "nonfinite_step":
            what = ev.get("nonfinite") or []
            for signal in ("loss", "gradient_norm"):
                if signal in what and ("nonfinite", signal) not in kinds:
                    found.append(Episode("nonfinite", signal, step, step, step, math.nan,
                                         note="found by the guard", open=False))
                    kinds.add(("nonfinite", signal))
            if ev.get("origin") == "optimizer_step" or not ({"loss", "gradient_norm"} & set(what)):
                note = "the optimizer step made " + " and ".join(w.replace("_", " ") for w in what)
                found.append(Episode("nonfinite", "parameters", step, step, step, math.nan, note=note + " non-finite",
                                     open=False))
        elif ev.get("event") == "checkpoint_refused" and not any(k == "nonfinite" for k, _ in kinds):
            found.append(Episode("nonfinite", "parameters", step, step, step, math.nan,
                                 note="a checkpoint was refused: " + ", ".join(ev.get("nonfinite") or [])[:200],
                                 open=False))
    for signal in ("gradient_norm", "loss"):
        # Only where the detector saw nothing (a spike is already not "stable").
        if any(e.signal == signal and not e.tolerated for e in episodes):
            continue
        tolerated = [(e.start_step, e.end_step) for e in episodes if e.signal == signal and e.tolerated]
        values = data.series(signal)
        low, low_step = math.inf, None
        for step, v in zip(data.steps.tolist(), values.tolist()):
            if not math.isfinite(v) or v <= 0 or any(a <= step <= b for a, b in tolerated):
                continue
            if low_step is not None and v >= ORDERS_OF_MAGNITUDE * low:
                found.append(Episode("exploding", signal, low_step, step, step, v, low, open=False,
                                     note=f"grew {math.log10(v / low):.1f} orders of magnitude"))
                break
            if v < low:
                low, low_step = v, step
    return found


def _of_signal(episodes: Sequence[Episode], signal: str) -> list[Episode]:
    """The episodes of one signal: each has its own step range (a non-finite gradient_norm
    and the loss that followed it are two episodes, each starting where its signal did)."""
    return [e for e in episodes if e.signal == signal]


def _span_text(data: RunData) -> str:
    steps = data.steps
    every = int(np.median(np.diff(steps))) if len(steps) > 1 else 1
    if isinstance(data.settings.get("log_every_num_steps"), int):
        every = data.settings["log_every_num_steps"]  # the guard may log its last steps in between
    cadence = "every step" if every == 1 else f"every {every} steps"
    return f"steps {steps[0]}-{steps[-1]}, {len(steps)} logged points ({cadence})"


def _run_line(data: RunData) -> str:
    s = data.settings
    parts = []
    if s.get("task"):
        parts.append(f"task {s['task']}")
    if s.get("precision"):
        parts.append(f"precision {s['precision']}")
    lr = (s.get("model_args") or {}).get("lr")
    if lr is not None:
        parts.append(f"model_args.lr {lr:g}")
    warm = (s.get("model_args") or {}).get("warmup_steps")
    if warm:
        parts.append(f"warmup {warm} steps")
    clip = s.get("gradient_clip_val")
    if clip:
        parts.append(f"gradient_clip_val {clip:g}")
    return ", ".join(parts)


def _signal_line(signal: str, status: str, episodes: Sequence[Episode]) -> str:
    mine = _of_signal(episodes, signal)
    if signal == "parameters":
        return "parameters: non-finite - " + "; ".join(f"{e.note} at {e.steps_text()}" for e in mine)
    if not mine:
        return f"{signal}: {status}"
    groups: dict[str, list[str]] = {}
    for e in mine:
        label = _STATUS_OF_KIND[e.kind] + (" (warmup, tolerated)" if e.tolerated else "")
        groups.setdefault(label, []).append(e.steps_text())
    detail = "; ".join(f"{label} at {', '.join(ranges)}" for label, ranges in groups.items())
    return f"{signal}: {status} - {detail}"


def _checkpoint_line(out: Path) -> str:
    """The newest healthy checkpoint, the same one the run's messages and diagnose name."""
    from stabletrain.checkpoint import list_checkpoints, newest_healthy

    folder = out / "checkpoints"
    infos = list_checkpoints(folder)
    if not infos:
        return "checkpoints: none written"
    best = newest_healthy(folder)
    if best is None:
        return f"checkpoints: none of {len(infos)} is healthy (newest: {infos[-1].reason()})"
    return f"newest healthy checkpoint: {best.path} (step {best.step}: {best.why})"


def _actions(episodes: Sequence[Episode], context: AlertContext) -> list[str]:
    seen: dict[str, None] = {}
    ordered = sorted(
        (e for e in episodes if not e.tolerated), key=lambda e: STATUS_ORDER.index(_STATUS_OF_KIND[e.kind])
    )
    for e in ordered:
        if e.signal == "parameters":
            e = Episode("nonfinite", "loss", e.start_step, e.end_step, e.detected_step, e.value)
        for a in next_actions(e, context):
            seen.setdefault(a, None)
    return list(seen)


def _terminal(
    out: Path,
    data: RunData,
    status: dict[str, str],
    verdict: str,
    episodes: Sequence[Episode],
    context: AlertContext,
    files: Sequence[Path],
    plot_note: str,
) -> str:
    lines = [f"stabletrain report: {out} ({_span_text(data)})"]
    for signal, st in status.items():
        lines.append("  " + _signal_line(signal, st, episodes))
    lines.append(f"verdict: {verdict}")
    lines.append(_checkpoint_line(out))
    actions = _actions(episodes, context)
    if actions:
        lines.append("next:")
        lines += [f"  - {a}" for a in actions]
    if plot_note:
        lines.append(plot_note)
    lines.append(f"written: {files[0]}" + "".join(f", {p.name}" for p in files[1:]))
    return "\n".join(lines)


def _markdown(
    out: Path,
    data: RunData,
    status: dict[str, str],
    verdict: str,
    episodes: Sequence[Episode],
    context: AlertContext,
    images: Sequence[Path],
    plot_note: str,
) -> str:
    md = [f"# stabletrain report: {out.name}", ""]
    md.append(f"Run `{out}`: {_span_text(data)}. {_run_line(data)}.".replace(". .", "."))
    md += ["", f"**Verdict: {verdict}**", "", _checkpoint_line(out), ""]
    md += ["| signal | status | episodes |", "|---|---|---|"]
    for signal, st in status.items():
        mine = _of_signal(episodes, signal)
        cell = "; ".join(
            f"{e.kind} {e.steps_text()}" + (" (warmup, tolerated)" if e.tolerated else "") for e in mine
        )
        md.append(f"| `{signal}` | {st} | {cell or '-'} |")
    alerts = [e for e in episodes if not e.tolerated]
    if alerts:
        md += ["", "## Episodes", ""]
        for e in alerts:
            md.append(f"### {e.signal}: {e.kind}, {e.steps_text()}")
            md += ["", e.describe() + ".", "", "Next actions:", ""]
            md += [f"- {a}" for a in next_actions(e, context)]
            md.append("")
    tolerated = [e for e in episodes if e.tolerated]
    if tolerated:
        md += ["", "## Tolerated", ""]
        md += [f"- {e.describe()}" for e in tolerated]
    md += recovery_section(data.events)
    others = [ev for ev in data.events if ev.get("event") not in ("trend_alert", "recovery")]
    if others:
        md += ["", "## Other events recorded during training", ""]
        for ev in others:
            detail = ev.get("message") or ", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("event", "step"))
            md.append(f"- step {ev.get('step', '?')}: **{ev.get('event')}** {detail}")
    if images or plot_note:
        md += ["", "## Plots", ""]
        md += [f"![{p.stem}]({p.name})" for p in images]
        if plot_note:
            md.append(plot_note)
    md += [
        "",
        "Read `gradient_norm` as a trend: its scale depends on model, data and batch size. "
        "Stable means it stays within a steady band; a short spike during warmup is normal.",
        "",
    ]
    return "\n".join(md)


# ---------------------------------------------------------------------------------- plots


def _plot_all(data: RunData, episodes: Sequence[Episode], status: dict[str, str], folder: Path, warmup: int) -> list[Path]:
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


def _step_halfwidth(steps: np.ndarray) -> float:
    return float(np.median(np.diff(steps))) / 2 if len(steps) > 1 else 0.5


def _shade(ax: Any, steps: np.ndarray, episodes: Sequence[Episode], signal: Optional[str]) -> None:
    """Episodes as coloured bands, one legend entry per kind."""
    half = _step_halfwidth(steps)
    labelled: set[str] = set()
    for e in episodes:
        if signal is not None and e not in _of_signal([e], signal):
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
    ax.set_xlim(steps[0] - _step_halfwidth(steps), steps[-1] + _step_halfwidth(steps))
    handles, labels = ax.get_legend_handles_labels()
    if np.isfinite(lr).any():
        ax2 = ax.twinx()
        ax2.plot(steps, lr, color="#7f7f7f", lw=1.0, ls="--", label="lr (right axis)")
        ax2.set_ylabel("lr", color="#7f7f7f")
        ax2.tick_params(axis="y", colors="#7f7f7f")
        ax2.set_ylim(bottom=0)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(len(labels), 5),
              fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def recovery_section(events: Sequence[dict[str, Any]]) -> list[str]:
    """The summary's "Recoveries" section: one table row per ``{"event": "recovery"}`` row."""
    rows = [ev for ev in events if ev.get("event") == "recovery"]
    if not rows:
        return []
    md = ["", "## Recoveries (on_instability)", "",
          "| step | trigger | action | skipped samples | capture | diagnosis |", "|---|---|---|---|---|---|"]
    for ev in rows:
        trigger = str(ev.get("trigger"))
        z, ratio = ev.get("zscore"), ev.get("ratio")
        if isinstance(z, (int, float)) and math.isfinite(z):
            trigger += f" (z={z:.1f}" + (f", {ratio:.1f}x the largest loss" if isinstance(ratio, (int, float))
                                         and ratio > 1 else "") + ")"
        action = str(ev.get("action"))
        if ev.get("rolled_back_to") is not None:
            action += f" to step {ev['rolled_back_to']}"
        samples = ev.get("skipped_samples") or []
        shown = ", ".join(str(i) for i in samples[:12]) + (f", ... ({len(samples) - 12} more)" if len(samples) > 12
                                                            else "")
        capture = f"`{ev['capture']}`" if ev.get("capture") else "-"
        verdict = _diagnosis_verdict(ev.get("capture")) or "not computed (`stabletrain diagnose <capture>`)"
        md.append(f"| {ev.get('step')} | {trigger} | {action} | {shown or '-'} | {capture} | {verdict} |")
    return md


def _diagnosis_verdict(capture: Any) -> Optional[str]:
    """The verdict of ``diagnosis.json`` next to a recovery's capture (its rank folder, or the
    step folder of all ranks), when diagnose has run."""
    if not isinstance(capture, str):
        return None
    for folder in (Path(capture).parent, Path(capture).parent.parent):
        try:
            verdict = json.loads((folder / "diagnosis.json").read_text(encoding="utf-8")).get("verdict")
        except (OSError, ValueError):
            continue
        if isinstance(verdict, str):
            return verdict.replace("|", "/")
    return None


def _mark_run_events(ax: Any, data: RunData) -> None:
    """Resumes (dashed lines), steps the fp16 GradScaler skipped (ticks at the bottom) and the
    first non-finite step the guard found (a solid line)."""
    from matplotlib.transforms import blended_transform_factory

    trans = blended_transform_factory(ax.transData, ax.transAxes)
    for i, step in enumerate(data.resumes):
        ax.axvline(step, color="#2ca02c", ls="--", lw=1.2, label="resumed" if i == 0 else None, zorder=4)
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
    half = _step_halfwidth(steps)
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


def _as_float(v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return math.nan


__all__ = ["report", "Report", "RunData", "STATUS_ORDER", "signal_figure"]
