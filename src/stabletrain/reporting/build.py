"""``stabletrain.report(out)``: the orchestrator, from a run's files to ``out/report/`` and a :class:`Report`.
See ``docs/report.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabletrain.config import TrendAlertArgs
from stabletrain.debug.mechanisms.rules import Mechanism
from stabletrain.debug.remedies.record import current_record
from stabletrain.debug.trends import AlertContext, Episode, checkpoint_context
from stabletrain.reporting.data import RunData
from stabletrain.reporting.plots import plot_all
from stabletrain.reporting.summary import markdown_text, terminal_text
from stabletrain.reporting.verdict import run_episodes, run_mechanisms, run_thresholds, statuses


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
        mechanisms: The mechanisms named in the run's signals (docs/mechanisms.md).
        files: The files written, summary first.
        text: The summary as printed.
    """

    out: Path
    folder: Path
    status: dict[str, str]
    verdict: str
    episodes: list[Episode]
    mechanisms: list[Mechanism] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    text: str = ""


def report(out: str | Path, *, quiet: bool = False, plots: bool = True, verified: bool = True) -> Report:
    """Analyse a run's metrics.jsonl and write ``out/report/`` (summary and plots).

    Args:
        out: A training run's output folder.
        quiet: Do not print the summary.
        plots: Write the PNG plots (needs matplotlib).
        verified: Quote the run's last verification of remedies (``diagnose --verify`` or ``report --verify``,
            ``debug/remedies/remedies.json``) while its metrics.jsonl is unchanged since: its verified
            remedy first among the next actions, the suggestions marked tried or not. False: the
            suggestions as they are, unverified.

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
    args, warmup = run_thresholds(data.settings)
    episodes = run_episodes(data, args, warmup)
    context = AlertContext.from_settings(data.settings)
    context.history = [{k: r.get(k) for k in ("step", "lr", "loss", "gradient_norm")} for r in data.rows]
    checkpoint_context(context, _Folder(out / "checkpoints"))
    mechanisms = run_mechanisms(data)
    status, verdict = statuses(data, episodes, min_points=(args or TrendAlertArgs()).persist + 1,
                               mechanisms=mechanisms)

    folder = out / "report"
    folder.mkdir(parents=True, exist_ok=True)
    images: list[Path] = []
    plot_note = ""
    if plots:
        try:
            images = plot_all(data, episodes, status, folder, warmup)
        except ImportError:
            plot_note = 'plots skipped: matplotlib is not installed (pip install "stabletrain[plots]")'

    record = current_record(out) if verified else None
    markdown = markdown_text(out, data, status, verdict, episodes, context, images, plot_note, mechanisms, record)
    summary_path = folder / "summary.md"
    summary_path.write_text(markdown, encoding="utf-8")
    files = [summary_path, *images]
    text = terminal_text(out, data, status, verdict, episodes, context, files, plot_note, mechanisms, record)
    if not quiet:
        print(text)
    return Report(out=out, folder=folder, status=status, verdict=verdict, episodes=episodes, mechanisms=mechanisms,
                  files=files, text=text)


class _Folder:
    """What :func:`~stabletrain.debug.trends.checkpoint_context` needs of a trainer."""

    def __init__(self, folder: Path):
        self.folder = folder

    def healthy_checkpoint(self) -> Any:
        from stabletrain.runfiles.checkpoint import newest_healthy

        return newest_healthy(self.folder)
