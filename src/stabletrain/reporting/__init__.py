"""reporting: ``stabletrain report out/my_run``, trends and plots from a finished (or running) run.

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

See ``docs/report.md``. One job per file: ``data`` (the logged series), ``verdict`` (episodes, status per
signal), ``summary`` (the printed text and summary.md), ``plots`` (the PNGs), ``build`` (:func:`report`).
"""

from stabletrain.reporting.build import Report, report
from stabletrain.reporting.data import RunData
from stabletrain.reporting.plots import KIND_COLORS, MAX_HEATMAP_ROWS, signal_figure
from stabletrain.reporting.verdict import ORDERS_OF_MAGNITUDE, STATUS_ORDER, TOO_FEW

__all__ = [
    "report",
    "Report",
    "RunData",
    "STATUS_ORDER",
    "signal_figure",
    # importable before the split, kept so
    "KIND_COLORS",
    "MAX_HEATMAP_ROWS",
    "ORDERS_OF_MAGNITUDE",
    "TOO_FEW",
]
