"""The Markdown account of a diagnosis (``diagnosis.md``, ``print(diagnosis)``): one function per section.
See ``docs/diagnose.md``.
"""

from __future__ import annotations

import math
from typing import Any

from stabletrain.debug import advice
from stabletrain.debug.diagnose.classify import damaged_before
from stabletrain.debug.diagnose.explain import bad_input_text, chain_text, finding_text, out_of_range_text
from stabletrain.debug.diagnose.run_signals import mechanism_lines
from stabletrain.debug.diagnose.search import keys_text
from stabletrain.debug.diagnose.types import NOT_REPRODUCIBLE, DataReport, Evidence
from stabletrain.debug.op_trace import OpFinding, TensorStat
from stabletrain.utils.text import fmt_list, fmt_number


def markdown(ev: Evidence, *, summary: str, probable_cause: str, cause_explanation: str,
             next_actions: list[str]) -> str:
    """The whole account: the evidence with the prose written from it."""
    sections = [
        title(ev, probable_cause),
        what_happened(summary),
        mechanism_lines(ev.mechanisms),
        where(ev),
        why(ev, cause_explanation),
        which_data(ev.data),
        before_or_during(ev),
        numbered_actions(next_actions),
        [footer(ev)],
    ]
    lines = sections[0]
    for section in sections[1:]:
        if section:
            lines += ["", *section]
    return "\n".join(lines)


def title(ev: Evidence, probable_cause: str) -> list[str]:
    ranks = f"rank {ev.ranks[0]}" if len(ev.ranks) == 1 else f"ranks {', '.join(map(str, ev.ranks))}"
    return [
        f"# Diagnosis of step {ev.step} ({ranks}): {ev.path}",
        "",
        f"**Verdict: {ev.cause_title}** — {probable_cause}.",
    ]


def what_happened(summary: str) -> list[str]:
    return ["## What happened", "", summary]


def where(ev: Evidence) -> list[str]:
    """The first harmful op, its inputs, its line and module, and where a non-finite input came from."""
    lines = ["## Where", ""]
    f = ev.finding
    if f is not None:
        lines += [f"First harmful non-finite op: {finding_text(f)}.", ""]
        lines += [_input_line(s) for s in f.inputs]
        lines += _op_lines(ev, f)
        if ev.origin:
            lines.append(f"- its input was already non-finite: it came from {_origin_text(ev, ev.origin)}")
        if ev.traced_on:
            lines.append(_traced_on_line(ev, ev.traced_on))
    elif ev.cause == NOT_REPRODUCIBLE:
        lines.append("Not traced: the failure does not come back when the step is replayed.")
    else:
        lines.append("No non-finite value reached the loss or a gradient when the culprit subset was traced.")
    return lines


def _input_line(s: TensorStat) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in (("NaN", s.nan), ("+Inf", s.posinf), ("-Inf", s.neginf)) if n)
    flag = f" — already non-finite: {counts}" if s.nonfinite else ""
    mag = (f"abs min {fmt_number(s.abs_min)}, abs max {fmt_number(s.abs_max)}" if math.isfinite(s.abs_max)
           else "no finite value")
    return f"- input {s.index}: {s.dtype} {list(s.shape)}, {mag}{flag}"


def _op_lines(ev: Evidence, f: OpFinding) -> list[str]:
    """The op's source line, where it ran, what it differentiates and where its value came from."""
    lines = []
    if f.source:
        lines.append(f"- source: `{f.source}`")
    if f.outside_forward:
        lines.append("- ran outside every module's forward: in training_step, the step function or the training loop")
    if f.phase == "backward" and f.forward_op:
        lines.append(f"- differentiates `{f.forward_op}`, created in the forward pass"
                     + ("" if f.outside_forward else f" of {f.where}"))
    if f.origin == "inf" or (f.reached == "gradient" and f.phase == "forward"):
        reached = f"; it reached the {f.reached}" + (" in the backward pass" if f.reached == "gradient" else "")
        lines.append(f"- origin: {chain_text(ev, f)}{reached if f.reached else ''}")
    return lines


def _origin_text(ev: Evidence, origin: str) -> str:
    return {
        "data": f"the data ({bad_input_text(ev)})",
        "weights": "the weights, non-finite at the start of the step",
        "buffers": f"buffers ({', '.join(ev.weights.nonfinite_buffers[:3])})",
        "precision_conversion": f"the conversion of the batch to {advice.dtype_name(ev.precision)} "
                                f"({out_of_range_text(ev)})",
    }.get(origin, origin)


def _traced_on_line(ev: Evidence, t: dict[str, Any]) -> str:
    what = f"microbatch(es) {keys_text(t['microbatches'])}"
    if t.get("rows"):
        indices = t.get("dataset_indices")
        what += f", rows {t['rows']}" + (f" (dataset indices {indices})" if indices else "")
    return f"- traced on {what}, in {ev.precision}"


def why(ev: Evidence, cause_explanation: str) -> list[str]:
    """The full replays as a table, and the cause class they give."""
    lines = [
        "## Why",
        "",
        "| replay | precision | result | losses | gradient_norm |",
        "|---|---|---|---|---|",
    ]
    for r in ev.replays:
        res = "fails" if r.reproduced else "finite"
        lines.append(f"| {r.label} | {r.precision} | {res} | {fmt_list(r.losses, 4, fmt_number)} | "
                     f"{fmt_number(r.gradient_norm)} |")
    lines += ["", f"**{ev.cause_title}**: {cause_explanation}"]
    if ev.matches_capture is False and ev.cause != NOT_REPRODUCIBLE:
        lines.append("")
        lines.append("Note: the replayed losses differ in their last bits from those training logged "
                     "(another device, library version, or nondeterministic kernels).")
    return lines


def which_data(data: DataReport) -> list[str]:
    """What the subset search found, the non-finite values already in the data, and the caveats."""
    note = data.note[:1].upper() + data.note[1:] + "." if data.note else "-"
    if data.status in ("isolated", "not_data_specific") and data.microbatches:
        note += f" ({data.replays} subset replay(s), {data.check} checks)"
    lines = ["## Which data", "", note]
    bad_in = data.nonfinite_inputs
    if bad_in:
        shown = ", ".join(
            (f"sample {b['index']}" if b["index"] is not None else f"microbatch {b['micro_step']} row {b['row']}")
            + f" {b['field']} ({b['count']})" for b in bad_in[:5])
        lines.append(f"- non-finite values already in the captured data: {shown}{' ...' if len(bad_in) > 5 else ''}")
    lines += [f"- caveat: {c}" for c in data.caveats]
    return lines


def before_or_during(ev: Evidence) -> list[str]:
    """Whether the weights and buffers were healthy when the step began, the checkpoints, the last logged steps."""
    w = ev.weights
    lines = ["## Before or during the step", "", _weights_verdict(ev), ""]
    lines.append("Largest weights: " + ", ".join(
        f"{p.name} {fmt_number(p.abs_max)}" + (f" (and {p.nonfinite} NaN/Inf)" if p.nonfinite else "")
        for p in w.largest) + ".")
    if w.nonfinite_buffers and w.nonfinite:
        lines.append(f"Non-finite buffers: {', '.join(w.nonfinite_buffers[:5])}.")
    if w.checkpoints:
        lines.append("Checkpoints: " + ", ".join(
            f"step {c['step']} |w| {fmt_number(c['abs_max'])}" + (
                "" if c["healthy"] else " (bad)" if not c["abs_max"] < w.threshold else " (non-finite buffers)")
            for c in w.checkpoints) + ".")
    if ev.history:
        lines.append("Last logged steps: " + ", ".join(
            f"{h.get('step')}: loss {fmt_number(h.get('loss'))} grad_norm {fmt_number(h.get('gradient_norm'))}"
            for h in ev.history) + ".")
    return lines


def _weights_verdict(ev: Evidence) -> str:
    w = ev.weights
    if w.status == "healthy":
        return (f"The weights were healthy when the step began (all finite, |w| below {fmt_number(w.threshold)}): "
                "the step itself failed.")
    if w.status == "huge":
        return (f"The weights were already huge when the step began (|w| >= {fmt_number(w.threshold)}): the damage "
                "happened in earlier steps.")
    if w.nonfinite:
        names = ", ".join(f"{p.name} ({p.nonfinite})" for p in w.nonfinite[:4])
        when = f": {w.damage.text}." if w.damage is not None else "."
        return f"The weights already held NaN/Inf when the step began: {names}. The damage happened in earlier " \
               f"steps{when}"
    return (f"The weights were finite, but buffers already held NaN/Inf when the step began: "
            f"{fmt_list(w.nonfinite_buffers, 4)}. The damage happened in earlier steps"
            + ("." if damaged_before(ev) else ", though the failure traces back to something else (see Where)."))


def numbered_actions(actions: list[str]) -> list[str]:
    return ["## Next actions", "", *(f"{i}. {a}" for i, a in enumerate(actions, 1))]


def footer(ev: Evidence) -> str:
    """How long each phase took, and where the replays ran."""
    return ("Diagnosed in " + ", ".join(f"{k} {v:.2f}s" for k, v in ev.timings.items())
            + f" = {sum(ev.timings.values()):.1f}s on {ev.device}.")
