"""mechanisms: the signals of silent instabilities, measured on logged steps, on the device.

The ``signals/...`` keys (:data:`~stabletrain.debug.mechanisms.keys.KEYS`): per attention module
the max pre-softmax logit and the mean attention entropy, the output logits' log-partition and
max |logit|, per parameter group the weight RMS and the relative update, and for Adam-family
optimizers the fraction of second moments below eps. In any loop, :class:`MechanismMonitor`; in
the trainer, :class:`MechanismSignals` (on by default, ``debug_args.mechanisms``). See
docs/mechanisms.md.

One job per file: ``keys`` (the key names and what each measures), ``attention`` (attention
statistics and the attention-module rule), ``logits`` (output-logit statistics), ``probes``
(finding both in the forward pass), ``updates`` (the optimizer statistics), ``monitor`` (the
plain-loop monitor), ``callback`` (the trainer callback).
"""

from stabletrain.debug.mechanisms.attention import AttentionStats, is_attention_module, sdpa_stats, softmax_stats
from stabletrain.debug.mechanisms.callback import MechanismSignals
from stabletrain.debug.mechanisms.keys import KEYS
from stabletrain.debug.mechanisms.logits import LogitStats, logit_stats
from stabletrain.debug.mechanisms.monitor import MechanismMonitor, Notice
from stabletrain.debug.mechanisms.probes import SignalProbes
from stabletrain.debug.mechanisms.updates import UpdateStats

__all__ = [
    "KEYS",
    "AttentionStats",
    "LogitStats",
    "MechanismMonitor",
    "MechanismSignals",
    "Notice",
    "SignalProbes",
    "UpdateStats",
    "is_attention_module",
    "logit_stats",
    "sdpa_stats",
    "softmax_stats",
]
