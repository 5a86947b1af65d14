"""The report's "Quarantined samples": the samples the self-healing kept out of training, each with
the step that found it and the evidence (``quarantine.json``, see :mod:`stabletrain.safety.quarantine`)."""

from __future__ import annotations

from pathlib import Path

from stabletrain.safety.quarantine import QUARANTINE_FILE, read_quarantine

__all__ = ["quarantine_line", "quarantine_section"]


def quarantine_section(out: Path) -> list[str]:
    """summary.md's section: one row per quarantined sample; [] when none."""
    entries = read_quarantine(out)
    if not entries:
        return []
    md = ["", "## Quarantined samples", "",
          f"Kept out of training from the step that found them on, and after a resume (`{out / QUARANTINE_FILE}`).",
          "", "| sample | step | trigger | evidence | capture |", "|---|---|---|---|---|"]
    for e in entries:
        capture = f"`{e['capture']}`" if e.get("capture") else "-"
        evidence = str(e.get("evidence", "")).replace("|", "/")
        md.append(f"| {e['index']} | {e.get('step', '?')} | {e.get('trigger', '?')} | {evidence} | {capture} |")
    return md


def quarantine_line(out: Path) -> str:
    """The terminal's line: which samples are quarantined; "" when none."""
    entries = read_quarantine(out)
    if not entries:
        return ""
    shown = ", ".join(str(e["index"]) for e in entries[:12]) + (f", ... ({len(entries) - 12} more)"
                                                                 if len(entries) > 12 else "")
    return f"quarantined samples: {shown} (evidence in {out / QUARANTINE_FILE})"
