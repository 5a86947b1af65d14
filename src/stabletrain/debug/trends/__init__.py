"""trends: read gradient_norm and loss as trends and warn once per unstable episode, with next actions.

In any loop, :class:`TrendDetector` on plain numbers (:func:`detect_trends` offline); in the trainer,
:class:`TrendAlerts` (on by default, ``trend_alerts``). See ``docs/trend_alerts.md``.

One job per file: ``episode`` (an episode, its next actions and alert text), ``stats`` (robust statistics),
``signals`` (the per-signal rules), ``detector`` (the detector and its rules), ``callback`` (the trainer
callback and the checkpoint context).
"""

from stabletrain.debug.trends.callback import HISTORY_ROWS, TrendAlerts, checkpoint_context
from stabletrain.debug.trends.detector import CONVERGED_LOSS_RATIO, TrendDetector, detect_trends
from stabletrain.debug.trends.episode import KINDS, SIGNALS, AlertContext, Episode, format_alerts, next_actions
from stabletrain.debug.trends.signals import EARLY_ORDERS, HORIZON_WINDOWS, VANISH_MIN_BAND_SHARE
from stabletrain.debug.trends.stats import theil_sen_slope

__all__ = [
    "Episode",
    "AlertContext",
    "TrendDetector",
    "TrendAlerts",
    "detect_trends",
    "next_actions",
    "checkpoint_context",
    "theil_sen_slope",
    "KINDS",
    # importable before the split, kept so
    "SIGNALS",
    "format_alerts",
    "HISTORY_ROWS",
    "CONVERGED_LOSS_RATIO",
    "EARLY_ORDERS",
    "HORIZON_WINDOWS",
    "VANISH_MIN_BAND_SHARE",
]
