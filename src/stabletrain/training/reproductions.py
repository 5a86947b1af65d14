"""Real, unplanted reproductions of the silent instabilities of docs/mechanisms.md, on the built-in language model
small enough for a CPU: the tests (tests/debug/mechanisms/test_reproductions.py), the benchmarks
(benchmarks/lr_sensitivity.py, benchmarks/mechanism_lead_time.py) and the docs run the same settings from here.

Each function trains the built-in language model in-process with ``stabletrain.train``, changing
only settings a user sets (lr, weight decay, dropout, eps, optimizer, warmup, schedule), never the
model or the data, and returns the metric rows of ``metrics.jsonl``, read back from the file, so
that the rules that name a mechanism can be tested on what a real run logs. Every function takes
the same keyword overrides as ``stabletrain.train`` (nested groups merged one level deep), e.g.
``run_attention_growth(tmp_path, qk_norm=True, steps=100)``.

The model is :data:`TINY` (one block of width 32, 16 tokens, about 30K parameters): a step takes a
few milliseconds on one CPU core. What each run shows, measured (tests/debug/mechanisms/
test_reproductions.py holds the assertions, docs/mechanisms.md the numbers):

- :func:`run_attention_growth`: AdamW at lr 0.1 without weight decay or dropout: the largest
  attention logit grows from 0.04 to over 1000 and the attention entropy falls to about 0; the
  loss stalls near 3.0 where lr 0.01 reaches 2.2. ``qk_norm=True`` keeps the logit near 20 and
  lowers the final loss.
- :func:`run_adam_eps`: AdamW with an eps far above the gradients' RMS: nearly every second-moment
  entry is below eps, the first update is 140x smaller, the weights hardly move and the loss falls
  by less than 1 nat in 100 steps; eps 1e-8 trains.
- :func:`run_sgd_blowup`: the README's tour, SGD at lr 1: the weight RMS and the relative update
  grow, then the loss goes NaN and the guard stops the run (rows up to the last logged step).

Output-logit divergence is not here: no setting tried made it happen on this model in CPU time
(docs/mechanisms.md#reproductions says what was tried, with the numbers).
"""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from typing import Any, Optional

import torch

from stabletrain.errors import StabletrainError
from stabletrain.loggers.jsonl import read_metrics

#: The model and the settings every reproduction starts from (no weight decay, no dropout).
TINY: dict[str, Any] = {
    "model_args": {
        "n_layers": 1,
        "n_heads": 2,
        "dim": 32,
        "context_length": 16,
        "dropout": 0.0,
        "weight_decay": 0.0,
        "warmup_steps": 5,
    },
    "batch_size": 8,
    "loggers": {"tensorboard": {"enabled": False}},
    "checkpoint_every_num_steps": 1_000_000,  # only the final checkpoint
}


class Rows(list):
    """The metric rows of a run (a list of dicts), with ``out`` (the run's folder, for
    ``stabletrain report`` or ``diagnose``), ``events`` (the ``{"event": ...}`` rows of
    metrics.jsonl: trend alerts, mechanism_signals, ...), ``console`` (what the run printed) and
    ``error`` (the exception that stopped it, or None)."""

    out: Path
    events: list[dict[str, Any]]
    console: str
    error: Optional[BaseException]


def settings_with(base: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """``base`` with ``overrides``; nested dicts are merged one level deep."""
    settings = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(settings.get(key), dict):
            settings[key].update(value)
        else:
            settings[key] = value
    return settings


def run_lm(out: Path, **settings: Any) -> Rows:
    """Train :data:`TINY` with ``settings`` into ``out`` (console captured) and return the metric
    rows of ``out/metrics.jsonl``. A run the guard stops (NaN) returns the rows logged before it."""
    merged = settings_with(TINY, **settings)
    captured = io.StringIO()
    error: Optional[BaseException] = None
    threads = torch.get_num_threads()
    # One thread: a model this small runs fastest on one, and a second one only contends with
    # the other test workers for the cores (3-5x slower on a loaded 2-core machine).
    torch.set_num_threads(1)
    from stabletrain.training.loop import train

    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        try:
            train(out=out, **merged)
        except StabletrainError as exc:
            if not (Path(out) / "metrics.jsonl").exists():
                raise
            error = exc
        finally:
            torch.set_num_threads(threads)
    metric_rows, events = read_metrics(Path(out) / "metrics.jsonl")
    rows = Rows(metric_rows)
    rows.out, rows.events, rows.console, rows.error = Path(out), events, captured.getvalue(), error
    return rows


def _run(
    tmp_path: Path, name: str, defaults: dict[str, Any], model_args: dict[str, Any], overrides: dict[str, Any]
) -> Rows:
    settings = settings_with(defaults, **overrides)
    settings["model_args"] = {**settings.get("model_args", {}), **model_args, **overrides.get("model_args", {})}
    out = Path(tmp_path) / name
    n = 0
    while out.exists():  # several runs in one tmp_path
        n += 1
        out = Path(tmp_path) / f"{name}_{n}"
    return run_lm(out, **settings)


def run_attention_growth(tmp_path: Path, qk_norm: bool = False, lr: float = 0.1, **overrides: Any) -> Rows:
    """Attention-logit growth: AdamW at peak lr 0.1 (100x the default), no weight decay, no dropout,
    200 steps, cosine schedule, logged every 10 steps."""
    defaults = {"steps": 200, "log_every_num_steps": 10}
    return _run(tmp_path, f"attention_lr{lr:g}_qk{int(qk_norm)}", defaults, {"lr": lr, "qk_norm": qk_norm}, overrides)


def run_adam_eps(tmp_path: Path, eps: float = 1.0, lr: float = 0.01, **overrides: Any) -> Rows:
    """The Adam epsilon regime: AdamW with eps 1, about 100x the RMS of the tiny model's gradient
    entries (a gradient norm near 1.5 over 30K entries: 0.009), as eps 1e-8 is against the gradients
    of a wide model late in training; lr 0.01 (a good lr at eps 1e-8), 100 steps logged every 10."""
    defaults = {"steps": 100, "log_every_num_steps": 10}
    return _run(tmp_path, f"adam_eps{eps:g}", defaults, {"lr": lr, "eps": eps}, overrides)


def run_sgd_blowup(tmp_path: Path, lr: float = 1.0, **overrides: Any) -> Rows:
    """The README tour: SGD (momentum 0.9) at lr 1 (the guard stops the run at the first
    non-finite step), up to 100 steps logged every step."""
    defaults = {"steps": 100, "log_every_num_steps": 1}
    return _run(tmp_path, f"sgd_lr{lr:g}", defaults, {"lr": lr, "optimizer": "sgd"}, overrides)


# --------------------------------------------------------------------------------------
# Reading the rows
# --------------------------------------------------------------------------------------


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` over the rows that have it."""
    return [(int(r["step"]), float(r[key])) for r in rows if key in r]


def first_departure(rows: list[dict], key: str, factor: float, below: bool = False) -> Optional[int]:
    """First step whose ``key`` is ``factor`` times above (``below``: below) its value at the
    first logged step; None when it never is."""
    points = series(rows, key)
    if not points:
        return None
    start = points[0][1]
    for step, value in points:
        if (value < start / factor) if below else (value > start * factor or not math.isfinite(value)):
            return step
    return None


def first_nonfinite(rows: list[dict], key: str = "loss") -> Optional[int]:
    """First logged step whose ``key`` is NaN or infinite."""
    return next((s for s, v in series(rows, key) if not math.isfinite(v)), None)


def final_loss(rows: list[dict], last: int = 3) -> float:
    """Mean loss of the last ``last`` logged steps (one batch's loss is noisy)."""
    losses = [v for _, v in series(rows, "loss")][-last:]
    return sum(losses) / len(losses)


def mechanism_events(rows: Rows) -> list[dict[str, Any]]:
    """The ``{"event": "mechanism"}`` rows the run's live alerts wrote, in order."""
    return [e for e in rows.events if e.get("event") == "mechanism"]


def _smoothed(rows: list[dict]) -> dict[int, float]:
    """Each logged step's loss averaged with the two logged before it (one batch's loss is noisy)."""
    points = series(rows, "loss")
    out = {}
    for i, (step, _) in enumerate(points):
        window = [v for _, v in points[max(0, i - 2) : i + 1]]
        out[step] = sum(window) / len(window)
    return out


def loss_lost_step(rows: list[dict], reference: list[dict], margin: float = 0.05) -> Optional[int]:
    """When the loss was lost: for a run whose loss blows up, the first logged step whose loss is twice
    (or more, or non-finite) the lowest before it; for one that only stalls, the first logged step from
    which its loss (smoothed over 3 logged points) stays more than ``margin`` above the same run at a
    good setting (``reference``: the same data order) at every later shared step. None when neither."""
    low = math.inf
    for step, value in series(rows, "loss"):
        if not math.isfinite(value) or value >= 2 * low:
            return step
        low = min(low, value)
    mine, ref = _smoothed(rows), _smoothed(reference)
    shared = [s for s in mine if s in ref]
    for i, step in enumerate(shared):
        if all(mine[t] > (1 + margin) * ref[t] for t in shared[i:]):
            return step
    return None


def run_output_drift(tmp_path: Path, weight_decay: float = 0.0, lr: float = 0.5, **overrides: Any) -> Rows:
    """Output-logit divergence, after attention-logit growth: AdamW at a constant lr 0.5 without weight
    decay, qk_norm on, 400 steps logged every 10. The logits' common level (``signals/output_logit_mean``)
    sinks from 0 to below -20 while the loss degrades; weight decay 0.1 (a published fix) keeps it near -4
    and the loss 1 nat lower (the attention still grows at this lr). The attention fails first (qk_norm's
    gains grow at this lr), so the output drift is named as following it: no setting tried here makes the
    output logits diverge first (docs/mechanisms.md)."""
    defaults = {"steps": 400, "log_every_num_steps": 10}
    model_args = {"lr": lr, "qk_norm": True, "lr_schedule": "constant", "weight_decay": weight_decay}
    return _run(tmp_path, f"output_drift_wd{weight_decay:g}", defaults, model_args, overrides)
