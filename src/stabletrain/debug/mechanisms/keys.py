"""The ``signals/...`` keys: their names, in one place, and what each one measures.

Every logger receives them under these names (metrics.jsonl, TensorBoard, MLflow, W&B).
:data:`KEYS` documents each key pattern; docs/mechanisms.md shows the same table, and a test
keeps the two in step.
"""

from __future__ import annotations

import re

PREFIX = "signals/"

ATTN_LOGIT_MAX = PREFIX + "attn_logit_max"
ATTN_ENTROPY = PREFIX + "attn_entropy"
ATTN_ENTROPY_MIN = PREFIX + "attn_entropy_min"
OUTPUT_LOGSUMEXP = PREFIX + "output_logsumexp"
OUTPUT_LOGIT_ABSMAX = PREFIX + "output_logit_absmax"
OUTPUT_LOGIT_MEAN = PREFIX + "output_logit_mean"
WEIGHT_RMS = PREFIX + "weight_rms"
UPDATE_RMS = PREFIX + "update_rms"
UPDATE_RMS_MAX = PREFIX + "update_rms_max"
UPDATE_RMS_ARGMAX = PREFIX + "update_rms_argmax"
ADAM_EPS_FRACTION = PREFIX + "adam_eps_fraction"

#: The key groups a "not measured" notice names (see :class:`~stabletrain.debug.mechanisms.monitor.Notice`).
ATTENTION_KEYS = PREFIX + "attn_*"
OUTPUT_KEYS = PREFIX + "output_*"
WEIGHT_KEYS = WEIGHT_RMS + "/*"
UPDATE_KEYS = f"{UPDATE_RMS}/*, {UPDATE_RMS_MAX}, {UPDATE_RMS_ARGMAX}"
ADAM_KEYS = ADAM_EPS_FRACTION

#: Key pattern -> what it measures. ``<module>`` is a module's name in the model
#: (``blocks.0.attn``; ``:root`` for the model itself), ``<group>`` an optimizer parameter group's
#: ``name`` (``group<i>`` when it has none).
KEYS: dict[str, str] = {
    f"{ATTN_LOGIT_MAX}/<module>": "largest pre-softmax attention logit (q.k * scale, plus an additive mask) of the "
                                  "module over batch, heads, queries and keys; masked entries left out",
    f"{ATTN_ENTROPY}/<module>": "attention entropy in nats, -sum p log p over the keys of one query, averaged over "
                                "batch, heads and queries; queries whose keys are all masked left out",
    ATTN_LOGIT_MAX: "largest attn_logit_max over the attention modules",
    ATTN_ENTROPY_MIN: "smallest attn_entropy over the attention modules",
    OUTPUT_LOGSUMEXP: "output logits' log-partition: logsumexp over the class dimension, averaged over the rows "
                      "that enter the loss (rows whose target is ignore_index left out)",
    OUTPUT_LOGIT_ABSMAX: "largest absolute logit over the same rows",
    OUTPUT_LOGIT_MEAN: "mean logit over the class dimension and the same rows: the common level of the logits, "
                       "which the softmax and so the loss ignore",
    f"{WEIGHT_RMS}/<group>": "root mean square of the group's parameters after the step",
    f"{UPDATE_RMS}/<group>": "relative update of the step over the group: norm(w_after - w_before) / norm(w_before), "
                             "the update's RMS over the weights' RMS",
    UPDATE_RMS_MAX: "largest relative update norm(dw) / norm(w_before) of one parameter tensor (tensors whose weights "
                    "were all zero before the step left out)",
    UPDATE_RMS_ARGMAX: "which tensor that is: its position in the parameters list of the run's "
                       "mechanism_signals event (from 0)",
    ADAM_EPS_FRACTION: "Adam family: fraction of second-moment entries whose bias-corrected sqrt(v_hat) is below "
                       "eps (the update of such an entry is damped by eps rather than normalised)",
}


#: What a key may hold after ``signals/``: MLflow refuses any other character in a metric name.
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\- :/]")


def module_key(base: str, module: str) -> str:
    """``signals/attn_logit_max/<module>``; the model itself is ``:root`` (no module name holds
    a colon), a module outside the model ``:<its class>``."""
    return f"{base}/{safe_name(module or ':root')}"


def safe_name(name: str) -> str:
    """``name`` with every character a logger may refuse replaced by ``_``."""
    return _UNSAFE.sub("_", name)
