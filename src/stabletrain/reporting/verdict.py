"""The verdict of a run: its episodes (the trend detector's, and those only the run's events show), the status
of each signal and the worst of them. See ``docs/report.md``.

A run whose loss or gradient norm went non-finite (logged, or found by the guard between logged
steps) or grew by two orders of magnitude or more is never "stable"; with fewer logged points
than the detector needs for a band (``trend_alerts.persist`` + 1) and nothing found, the verdict
is "too few logged steps". A resumed run is read as one timeline: the rows logged after a resume
replace those of the same and later steps (see :mod:`stabletrain.runfiles.history`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

from stabletrain.config import TrendAlertArgs
from stabletrain.debug.mechanisms.rules import NAMES, Mechanism, mechanisms_of_run
from stabletrain.debug.trends import Episode, TrendDetector
from stabletrain.reporting.data import RunData

#: Worst first: the overall verdict is the worst status of any signal. A mechanism named in the signals
#: (docs/mechanisms.md) is its own status, between exploding and vanishing: a run that shows one is never stable.
TOO_FEW = "too few logged steps"
STATUS_ORDER = ("non-finite", "exploding", *NAMES, "vanishing", "plateau", "spiking", TOO_FEW, "stable")
#: The status of the ``signals`` line when the rows hold signals and no rule named a mechanism.
NO_MECHANISM = "no mechanism named"
#: Growth over the lowest earlier value that makes a series "exploding" whatever the detector says.
ORDERS_OF_MAGNITUDE = 100.0
STATUS_OF_KIND = {
    "nonfinite": "non-finite",
    "exploding": "exploding",
    "vanishing": "vanishing",
    "plateau": "plateau",
    "spike": "spiking",
}


def run_thresholds(settings: Mapping[str, Any]) -> tuple[Optional[TrendAlertArgs], int]:
    """The run's own trend thresholds (None: defaults) and its lr warmup steps, from its settings.json."""
    args = None
    if isinstance(settings.get("trend_alerts"), dict):
        try:  # the run's own thresholds; a settings.json of another version falls back to defaults
            args = TrendAlertArgs(**settings["trend_alerts"])
        except ValueError:
            args = None
    warmup = int((settings.get("model_args") or {}).get("warmup_steps") or 0)
    return args, warmup


def run_episodes(data: RunData, args: Optional[TrendAlertArgs], warmup: int) -> list[Episode]:
    """Every episode of the run: the live detector's over the whole series, then the missed ones."""
    detector = TrendDetector(args, warmup_steps=warmup)
    for row in data.rows:
        detector.update(row["step"], row)
    episodes = detector.finish()
    return episodes + missed_episodes(data, episodes)


def run_mechanisms(data: RunData) -> list[Mechanism]:
    """The mechanisms the run's signals show (:mod:`stabletrain.debug.mechanisms.rules`, with the run's own
    thresholds), and those named in a timeline a resume replaced (from their ``mechanism`` rows)."""
    return mechanisms_of_run(data.rows, data.settings, data.abandoned_events, data.resumes)


def statuses(data: RunData, episodes: Sequence[Episode], min_points: int,
             mechanisms: Sequence[Mechanism] = ()) -> tuple[dict[str, str], str]:
    """The status of each logged signal (and of the parameters, when the optimizer made them non-finite;
    ``signals``: the first mechanism named, when the rows hold ``signals/...`` keys), and the verdict: the
    worst of them. A signal with fewer than ``min_points`` logged points and no episode has too few logged
    steps."""
    status: dict[str, str] = {}
    for signal in ("gradient_norm", "loss"):
        if not any(signal in r for r in data.rows):
            continue
        kinds = [STATUS_OF_KIND[e.kind] for e in of_signal(episodes, signal) if not e.tolerated]
        if kinds:
            status[signal] = min(kinds, key=STATUS_ORDER.index)
        else:
            status[signal] = TOO_FEW if sum(signal in r for r in data.rows) < min_points else "stable"
    if any(e.signal == "parameters" for e in episodes):
        status["parameters"] = "non-finite"
    causes = [m for m in mechanisms if not m.follows] or list(mechanisms)
    if causes:
        status["signals"] = causes[0].name
    elif any(k.startswith("signals/") for r in data.rows[:3] for k in r):
        status["signals"] = NO_MECHANISM
    ranked = [v for v in status.values() if v in STATUS_ORDER]
    verdict = min(ranked, key=STATUS_ORDER.index) if ranked else TOO_FEW
    return status, verdict


def missed_episodes(data: RunData, episodes: Sequence[Episode]) -> list[Episode]:
    """What the detector cannot see but the run shows: a non-finite step the guard found
    between logged steps (or parameters the optimizer made non-finite), a checkpoint refused
    for NaN/Inf, and a series that grew by orders of magnitude without an exploding episode."""
    found = _event_episodes(data.events, {(e.kind, e.signal) for e in episodes})
    found += _recovery_episodes(data.events) + _abandoned_episodes(data)
    for signal in ("gradient_norm", "loss"):
        # Only where the detector saw nothing (a spike is already not "stable").
        if not any(e.signal == signal and not e.tolerated for e in episodes):
            found += _growth_episode(data, signal, episodes)
    return found


def _event_episodes(events: Sequence[Mapping[str, Any]], kinds: set[tuple[str, str]]) -> list[Episode]:
    """Non-finite episodes the run's events show (nancapture's stop, the guard's, a refused checkpoint),
    where ``kinds`` (``(kind, signal)`` already found; updated) has none of that signal yet."""
    found: list[Episode] = []
    for ev in events:
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
    return found


#: Recovery triggers (``on_instability``) and the signal each one is about.
_TRIGGER_SIGNAL = {"nonfinite_loss": "loss", "nonfinite_grad": "gradient_norm", "loss_spike": "loss",
                   "grad_spike": "gradient_norm"}


def _recovery_episodes(events: Sequence[Mapping[str, Any]]) -> list[Episode]:
    """One episode per ``on_instability`` recovery: a step the run had to skip or roll back was not
    stable, even when the logged rows around it look calm (the skipped step is never logged)."""
    found: list[Episode] = []
    for ev in events:
        step = ev.get("step")
        if ev.get("event") != "recovery" or not isinstance(step, int):
            continue
        trigger = str(ev.get("trigger", ""))
        action = ev.get("action")
        note = ("the recovery limit was reached: the run stopped" if action == "stop"
                else f"recovered by {action} ({trigger})")
        kind = "nonfinite" if trigger.startswith("nonfinite") else "spike"
        found.append(Episode(kind, _TRIGGER_SIGNAL.get(trigger, "loss"), step, step, step, math.nan, note=note,
                             open=False))
    return found


def _abandoned_episodes(data: RunData) -> list[Episode]:
    """What the timelines a resume replaced went through: a NaN or a 100-fold growth before a resume
    stays part of the run's story (the resumed rows no longer show it)."""
    if not data.resumes:
        return []
    resumed = f"before the resume from step {min(data.resumes)}"
    settled = f"the run was resumed from step {min(data.resumes)}, and that timeline replaced this one"
    found = [Episode(e.kind, e.signal, e.start_step, e.end_step, e.detected_step, e.value, e.reference,
                     note=f"{e.note + '; ' if e.note else ''}{resumed}", open=False, settled=settled)
             for e in _event_episodes(data.abandoned_events, set())]
    for signal in ("gradient_norm", "loss"):
        points = [(r["step"], float(r[signal])) for r in data.abandoned_rows
                  if isinstance(r.get(signal), (int, float)) and not isinstance(r.get(signal), bool)]
        bad = next(((st, v) for st, v in points if not math.isfinite(v)), None)
        if bad is not None and not any(e.signal == signal and e.kind == "nonfinite" for e in found):
            found.append(Episode("nonfinite", signal, bad[0], bad[0], bad[0], bad[1], note=resumed, open=False,
                                 settled=settled))
            continue
        low = math.inf
        for st, v in points:
            if math.isfinite(v) and v > 0 and low < math.inf and v >= ORDERS_OF_MAGNITUDE * low:
                found.append(Episode("exploding", signal, st, st, st, v, low, open=False, settled=settled,
                                     note=f"grew {math.log10(v / low):.1f} orders of magnitude, {resumed}"))
                break
            if math.isfinite(v) and v > 0:
                low = min(low, v)
    return found


def _growth_episode(data: RunData, signal: str, episodes: Sequence[Episode]) -> list[Episode]:
    """An exploding episode where ``signal`` grew :data:`ORDERS_OF_MAGNITUDE`-fold over its lowest earlier
    value (outside tolerated warmup spikes); none when it did not."""
    tolerated = [(e.start_step, e.end_step) for e in episodes if e.signal == signal and e.tolerated]
    low, low_step = math.inf, None
    for step, v in zip(data.steps.tolist(), data.series(signal).tolist()):
        if not math.isfinite(v) or v <= 0 or any(a <= step <= b for a, b in tolerated):
            continue
        if low_step is not None and v >= ORDERS_OF_MAGNITUDE * low:
            return [Episode("exploding", signal, low_step, step, step, v, low, open=False,
                            note=f"grew {math.log10(v / low):.1f} orders of magnitude")]
        if v < low:
            low, low_step = v, step
    return []


def of_signal(episodes: Sequence[Episode], signal: str) -> list[Episode]:
    """The episodes of one signal: each has its own step range (a non-finite gradient_norm
    and the loss that followed it are two episodes, each starting where its signal did)."""
    return [e for e in episodes if e.signal == signal]


def scaler_skip_note(data: RunData) -> str:
    """How many steps the fp16 GradScaler skipped (the guard's count, logged as ``skipped_steps``)
    and how its loss scale went, as a clause for the gradient norm's line; "" without skips. Its
    own skips are not an episode (:class:`~stabletrain.debug.trends.TrendDetector`)."""
    skipped = [(int(r["step"]), float(r["skipped_steps"])) for r in data.rows
               if isinstance(r.get("skipped_steps"), (int, float)) and math.isfinite(r["skipped_steps"])]
    if not skipped or skipped[-1][1] <= 0:
        return ""
    total = int(skipped[-1][1])
    first = next(step for step, n in skipped if n > 0)
    scales = [float(r["loss_scale"]) for r in data.rows if isinstance(r.get("loss_scale"), (int, float))]
    scale = f", while its loss scale went from {scales[0]:.4g} to {scales[-1]:.4g}" if scales else ""
    return (f"the fp16 GradScaler skipped {total} step{'s' if total != 1 else ''}, the first by step {first}"
            f"{scale}: its own overflow rule, not counted as non-finite")
