"""reporting: ``stabletrain report out/my_run`` and :func:`stabletrain.report`, trends and plots of a finished (or
running) run: the same trend detector as the live alerts over ``metrics.jsonl``, a verdict per signal, and
``out/report/`` (``summary.md``, one plot per signal, the per-layer heatmap). See ``docs/report.md``.

One job per file: ``data`` (the logged series), ``verdict`` (episodes, status per signal), ``summary`` (the
printed text and summary.md), ``plots`` (the PNGs), ``build`` (:func:`report`).
"""

from stabletrain.reporting.build import Report, report
from stabletrain.reporting.data import RunData
from stabletrain.reporting.plots import KIND_COLORS, MAX_HEATMAP_ROWS, signal_figure
from stabletrain.reporting.summary import recovery_section
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
    "recovery_section",
]
