"""The summary of a run: the text printed and ``report/summary.md`` (signals, verdict, newest healthy
checkpoint, episodes, next actions, events). See ``docs/report.md``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from stabletrain.debug.mechanisms.rules import Mechanism, RuleContext, published_fixes
from stabletrain.debug.remedies.record import UNVERIFIED, VerifiedRecord, label_suggestion
from stabletrain.debug.trends import AlertContext, Episode, next_actions
from stabletrain.reporting.data import RunData
from stabletrain.reporting.quarantine import quarantine_line, quarantine_section
from stabletrain.reporting.verdict import STATUS_OF_KIND, STATUS_ORDER, of_signal, scaler_skip_note


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


def _signal_line(signal: str, status: str, episodes: Sequence[Episode], mechanisms: Sequence[Mechanism] = ()) -> str:
    if signal == "signals":
        if not mechanisms:
            return f"signals: {status} (docs/mechanisms.md)"
        return "signals: " + "; ".join(m.describe() for m in mechanisms)
    mine = of_signal(episodes, signal)
    if signal == "parameters":
        return "parameters: non-finite - " + "; ".join(f"{e.note} at {e.steps_text()}" for e in mine)
    if not mine:
        return f"{signal}: {status}"
    groups: dict[str, list[str]] = {}
    for e in mine:
        label = STATUS_OF_KIND[e.kind] + (" (warmup, tolerated)" if e.tolerated else "")
        groups.setdefault(label, []).append(e.steps_text())
    detail = "; ".join(f"{label} at {', '.join(ranges)}" for label, ranges in groups.items())
    return f"{signal}: {status} - {detail}"


def _checkpoint_line(out: Path) -> str:
    """The newest healthy checkpoint, the same one the run's messages and diagnose name."""
    from stabletrain.runfiles.checkpoint import list_checkpoints, newest_healthy

    folder = out / "checkpoints"
    infos = list_checkpoints(folder)
    if not infos:
        return "checkpoints: none written"
    best = newest_healthy(folder)
    if best is None:
        return f"checkpoints: none of {len(infos)} is healthy (newest: {infos[-1].reason()})"
    return f"newest healthy checkpoint: {best.path} (step {best.step}: {best.why})"


def _mechanism_actions(mechanisms: Sequence[Mechanism], settings: dict[str, Any]) -> list[str]:
    """The published fixes of the mechanisms that are causes (not consequences, not settled by a resume)."""
    context = RuleContext.from_settings(settings)
    actions: list[str] = []
    for m in mechanisms:
        if m.follows or m.settled:
            continue
        fixes = published_fixes(m.id, context)
        if fixes:
            actions.append(f"{m.name}: " + "; or ".join(fixes) + f" (the published fix, {m.info.reference}; "
                           f"{UNVERIFIED})")
    return actions


def _actions(episodes: Sequence[Episode], context: AlertContext) -> list[str]:
    seen: dict[str, None] = {}
    ordered = sorted(
        (e for e in episodes if not e.tolerated),
        key=lambda e: (bool(e.settled), STATUS_ORDER.index(STATUS_OF_KIND[e.kind]))
    )
    for e in ordered:
        if e.signal == "parameters":
            e = Episode("nonfinite", "loss", e.start_step, e.end_step, e.detected_step, e.value)
        for a in next_actions(e, context):
            seen.setdefault(a, None)
    return list(seen)


def terminal_text(
    out: Path,
    data: RunData,
    status: dict[str, str],
    verdict: str,
    episodes: Sequence[Episode],
    context: AlertContext,
    files: Sequence[Path],
    plot_note: str,
    mechanisms: Sequence[Mechanism] = (),
    record: Optional[VerifiedRecord] = None,
) -> str:
    lines = [f"stabletrain report: {out} ({_span_text(data)})"]
    skips = scaler_skip_note(data)
    for signal, st in status.items():
        line = _signal_line(signal, st, episodes, mechanisms)
        lines.append("  " + line + (f" ({skips})" if signal == "gradient_norm" and skips else ""))
    lines.append(f"verdict: {verdict}")
    lines.append(_checkpoint_line(out))
    if quarantine_line(out):
        lines.append(quarantine_line(out))
    actions = _mechanism_actions(mechanisms, data.settings) + _actions(episodes, context)
    if record is not None:
        actions = record.next_actions(actions)
    if actions:
        lines.append("next:")
        lines += [f"  - {a}" for a in actions]
    if record is not None:
        lines.append(f"verified remedies: {record.path} ({_RECORD_NOTE})")
    if plot_note:
        lines.append(plot_note)
    lines.append(f"written: {files[0]}" + "".join(f", {p.name}" for p in files[1:]))
    return "\n".join(lines)


#: Where a quoted verification comes from, and why it still holds.
_RECORD_NOTE = "written by --verify (diagnose or report); this run's metrics.jsonl is unchanged since"


def _mechanism_section(mechanisms: Sequence[Mechanism], settings: dict[str, Any],
                       record: Optional[VerifiedRecord]) -> list[str]:
    """summary.md's mechanisms with their published fixes (marked tried or not after a verification), and
    the verified remedy of a current verification."""
    md: list[str] = []
    if mechanisms:
        md += ["", "## Mechanisms named in the signals", "", "See docs/mechanisms.md for each rule.", ""]
        for m in mechanisms:
            md += [f"### {m.name}{' in ' + m.where if m.where else ''}, {m.steps_text()}", "", m.describe() + ".", ""]
        fixes = _mechanism_actions(mechanisms, settings)
        if record is not None:
            fixes = [label_suggestion(a, record.measured) for a in fixes]
        if fixes:
            md += ["Next actions:", ""] + [f"- {a}" for a in fixes] + [""]
    if record is not None:
        md += ["", "## Remedies verified", "", record.next_action, "", f"From `{record.path}` ({_RECORD_NOTE}).", ""]
    return md


def markdown_text(
    out: Path,
    data: RunData,
    status: dict[str, str],
    verdict: str,
    episodes: Sequence[Episode],
    context: AlertContext,
    images: Sequence[Path],
    plot_note: str,
    mechanisms: Sequence[Mechanism] = (),
    record: Optional[VerifiedRecord] = None,
) -> str:
    md = [f"# stabletrain report: {out.name}", ""]
    md.append(f"Run `{out}`: {_span_text(data)}. {_run_line(data)}.".replace(". .", "."))
    md += ["", f"**Verdict: {verdict}**", "", _checkpoint_line(out), ""]
    md += ["| signal | status | episodes |", "|---|---|---|"]
    for signal, st in status.items():
        if signal == "signals":
            cell = "; ".join(f"{m.name} {m.steps_text()}" for m in mechanisms)
            md.append(f"| `signals/...` | {st} | {cell or '-'} |")
            continue
        mine = of_signal(episodes, signal)
        cell = "; ".join(
            f"{e.kind} {e.steps_text()}" + (" (warmup, tolerated)" if e.tolerated else "") for e in mine
        )
        if signal == "gradient_norm" and scaler_skip_note(data):
            cell = "; ".join(filter(None, [cell, scaler_skip_note(data)]))
        md.append(f"| `{signal}` | {st} | {cell or '-'} |")
    md += _mechanism_section(mechanisms, data.settings, record)
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
    md += quarantine_section(out)
    # mechanism_signals says what the signals/... keys measure (docs/mechanisms.md), not something that happened.
    others = [ev for ev in data.events
              if ev.get("event") not in ("trend_alert", "recovery", "mechanism_signals", "mechanism", "mechanism_end")]
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
