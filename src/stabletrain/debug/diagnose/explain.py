"""The prose of a diagnosis: what happened (the summary), why (the cause class explained with its evidence),
and the probable cause, plus the phrases the report and the next actions share. See ``docs/diagnose.md``.
"""

from __future__ import annotations

import math
from typing import Any

from stabletrain.debug import advice
from stabletrain.debug.diagnose.classify import SOFTMAX_OPS, damaged_before, op_kind, precision_failure
from stabletrain.debug.diagnose.run_signals import mechanism_cause
from stabletrain.debug.diagnose.search import samples_text
from stabletrain.debug.diagnose.types import NOT_REPRODUCIBLE, PRECISION_INDUCED, Evidence
from stabletrain.debug.diagnose.weights import huge_from_start
from stabletrain.debug.nan_capture import REASON_NORM_OVERFLOW, REASON_OTHER_RANK, REASON_SKIPPED
from stabletrain.debug.op_trace import OpFinding
from stabletrain.debug.replay import NaNCapture
from stabletrain.utils.text import fmt_list, fmt_number

# ------------------------------------------------------------------------------------ why


def other_rank_only(ev: Evidence, cap: NaNCapture) -> bool:
    """This rank's capture alone, taken because another rank failed: its own step was healthy. Either it
    found nothing itself (other_rank), or its loss was finite and its gradients non-finite only once
    averaged with the other ranks' (DDP): replayed alone, from its own data, they are finite."""
    if len(cap.ranks) != 1:
        return False
    if ev.reason == REASON_OTHER_RANK:
        return True
    return (ev.reason == "nonfinite_gradients" and ev.cause == NOT_REPRODUCIBLE and cap.world_size > 1
            and all(math.isfinite(float(x)) for x in cap.ranks[0].losses))


def cause_explanation(ev: Evidence, cap: NaNCapture) -> str:
    """The cause class in plain language, with the replays that decided it."""
    if ev.cause == NOT_REPRODUCIBLE:
        return _not_reproducible_explanation(ev, cap)
    finite_in = [p for p, ok in ev.reproduces_in.items() if not ok]
    failing_in = [p for p, ok in ev.reproduces_in.items() if ok]
    dtype = advice.dtype_name(ev.precision)
    det = "" if ev.deterministic else (
        " The two replays in the captured precision disagree bitwise, though both fail: some kernels are "
        "nondeterministic."
    )
    if ev.cause == PRECISION_INDUCED:
        return (
            f"It comes back every time in {ev.precision} ({dtype}) and is finite in {', '.join(finite_in)}: the values "
            f"leave the range or precision of {dtype}, while the arithmetic is sound in wider types." + det
        )
    text = f"It comes back every time in {', '.join(failing_in)}"
    if "32-true" in failing_in:
        dtype = "float32"  # the widest type that fails is the one whose range the values exceed
    if finite_in:
        big = next((r for r in ev.replays if r.precision in finite_in), None)
        mag = ""
        if big is not None and big.losses:
            loss = fmt_number(max(abs(x) for x in big.losses))
            mag = f" (loss {loss}, gradient_norm {fmt_number(big.gradient_norm)})"
        text += (
            f", and only {', '.join(finite_in)} keeps it finite{mag}: the values exceed what {dtype} can hold. "
            "A wider type postpones the overflow; it does not fix the values"
        )
    else:
        text += ": the same arithmetic on the same data fails whatever the precision"
    return text + "." + det


def _not_reproducible_explanation(ev: Evidence, cap: NaNCapture) -> str:
    first, again = ev.replays[0], ev.replays[1]
    if other_rank_only(ev, cap):
        averaged = ("" if ev.reason == REASON_OTHER_RANK else
                    " Its loss was finite, and its gradients, replayed alone from its own data, are finite too: they "
                    "were non-finite in training only once averaged with the other ranks' gradients.")
        return (
            f"This rank's own step was healthy: another rank's step failed and this rank stopped with it.{averaged} "
            f"Diagnose the folder of all ranks ({cap.ranks[0].path.parent.parent}) instead."
        )
    n = sum(r.reproduced for r in (first, again))
    if n == 1:
        which = "first" if first.reproduced else "second"
        head = (
            f"Replayed twice from exactly the captured weights, data and random state in {ev.precision}, the step "
            f"failed only the {which} time: the same computation gives different results from run to run."
        )
    else:
        head = (
            f"Replayed twice from exactly the captured weights, data and random state in {ev.precision}, the step "
            "was finite both times: what training computed cannot be computed again from what it started with."
        )
    return head + (
        " So the failure is not caused by the weights, the data or the arithmetic of this step. Likely causes: "
        "nondeterminism (nondeterministic GPU kernels, a race, random numbers drawn from a source the capture does "
        "not hold), something outside the model's forward and backward (a callback or hook that changed values, "
        "memory corruption), or a hardware fault (a flipped bit, an overheating GPU)."
    )


# ------------------------------------------------------------------------------ what happened


def summary(ev: Evidence, cap: NaNCapture) -> str:
    """What happened, in one or two sentences: why training stopped, and what the first replay gives."""
    first = ev.replays[0]
    n_mb = len(first.losses)
    ranks = (f"rank {ev.ranks[0]} of {ev.world_size}" if len(ev.ranks) == 1
             else f"ranks {', '.join(map(str, ev.ranks))} of {ev.world_size}")
    what = {
        "nonfinite_loss": "a non-finite loss",
        "nonfinite_gradients": "non-finite gradients",
        REASON_SKIPPED: "fp16 loss scaling skipped steps in a row "
                        f"(loss scale {fmt_number(ev.loss_scale or math.nan)})",
        REASON_OTHER_RANK: "a failure on another rank",
        REASON_NORM_OVERFLOW: "a gradient norm overflow",
    }
    head = (f"Training stopped at step {ev.step} ({ranks}, {ev.precision}, {n_mb} microbatch(es)) on "
            f"{what.get(ev.reason, ev.reason)}{_rank_split(cap, ev.reason, what)}")
    if ev.reason == REASON_NORM_OVERFLOW:
        text = (f"{head}: every gradient element was finite, but {largest_text(cap)}, and the float32 gradient norm "
                "was inf.")
    else:
        text = (f"{head}; {len(cap.nan_param_names)} of {len(cap.ranks[0].params)} parameters had NaN/Inf "
                "gradients.")
    if ev.cause == NOT_REPRODUCIBLE:
        return text
    return text + _replay_summary(ev)


def _rank_split(cap: NaNCapture, reason: str, what: dict[str, str]) -> str:
    """Of a capture of several ranks whose reasons differ: which rank had the leading one, and what the
    others saw (a non-finite loss on one rank makes every rank's averaged gradients non-finite)."""
    if len(cap.ranks) < 2 or len({r.reason for r in cap.ranks}) < 2:
        return ""
    leading = [r.rank for r in cap.ranks if r.reason == reason]
    others = [f"rank {r.rank}: {what.get(r.reason, r.reason)}" for r in cap.ranks if r.reason != reason]
    how = (", averaged in from the gradients of the ranks whose loss was non-finite"
           if reason == "nonfinite_loss" and all(r.reason == "nonfinite_gradients" for r in cap.ranks
                                                 if r.reason != reason) else "")
    return f" on rank {', '.join(map(str, leading))} ({'; '.join(others)}{how})"


def _replay_summary(ev: Evidence) -> str:
    first = ev.replays[0]
    bitwise = " Its losses are bitwise those of training." if ev.matches_capture else ""
    bad = [i for i, x in enumerate(first.losses) if not math.isfinite(x)]
    if not bad and not first.nan_param_names and not math.isfinite(first.gradient_norm):
        return " The replay gives the same: finite losses and gradient elements, gradient norm inf." + bitwise
    if bad:
        text = (f" The replay gives the same: losses {', '.join(fmt_number(first.losses[i]) for i in bad)} "
                f"in microbatch(es) {', '.join(map(str, bad))}")
    else:
        text = " The replay gives the same: every loss is finite, but the backward pass is not"
    return text + f", NaN/Inf gradients in {len(first.nan_param_names)} parameter(s)." + bitwise


def largest_text(cap: NaNCapture) -> str:
    """'|gradient| reached 2.5e+19 in fc.weight', from a gradient_norm_overflow capture."""
    largest = next((r.largest_gradients for r in cap.ranks if r.largest_gradients), [])
    if not largest:
        return "the gradients were too large"
    name, value = largest[0]
    return f"|gradient| reached {fmt_number(value)} in {name}"


# ---------------------------------------------------------------------------- probable cause


def probable_cause(ev: Evidence, cap: NaNCapture) -> str:
    """The most likely cause, in plain language: a mechanism the logged signals named before the step (runaway
    updates, ...) first, then where it ended; bad data and what replays cannot reproduce are their own causes."""
    ending = _probable_cause(ev, cap)
    if ev.cause == NOT_REPRODUCIBLE or ev.data.status == "isolated" or ev.origin == "data":
        return ending
    return mechanism_cause(ev.mechanisms, ending) or ending


def _probable_cause(ev: Evidence, cap: NaNCapture) -> str:
    if ev.cause == NOT_REPRODUCIBLE:
        if other_rank_only(ev, cap):
            return "another rank's step failed; this rank only stopped with it"
        return ("nondeterminism, an external cause or a hardware fault: the captured step does not fail again when "
                "replayed")
    if ev.weights.status == "nonfinite" and damaged_before(ev):
        return _nonfinite_state_cause(ev)
    if ev.weights.status == "huge":
        top = ev.weights.largest[0]
        start = huge_from_start(cap, ev.weights, ev.history)
        if start:
            return (f"the weights were already huge when the step began (|w| up to {fmt_number(top.abs_max)} in "
                    f"{top.name}), but not from divergence: {start}; the initialisation or the weights loaded put "
                    "them there")
        return (f"the weights were already huge when the step began (|w| up to {fmt_number(top.abs_max)} in "
                f"{top.name}): training was diverging in earlier steps, most likely from a learning rate too high")
    f = ev.finding
    data_text = f" for {culprit_samples(ev)}" if ev.data.status == "isolated" else ""
    if f is None and ev.reason == REASON_NORM_OVERFLOW:
        return (f"finite gradients too large for a float32 norm ({largest_text(cap)}){data_text}: no op produced "
                "a non-finite value, but the update would be huge")
    if f is None:
        return "the failure could not be traced to an op" + data_text
    kind = op_kind(f)
    if kind == "propagated":
        return _propagated_cause(ev, f)
    if kind == "nan_from_inf":
        what = ("a softmax over a row that is masked everywhere has nothing left to normalise (an all-padding "
                "sample, a query with no allowed key)" if f.op_name in SOFTMAX_OPS else
                "arithmetic turns a deliberate Inf into NaN (inf - inf, 0 * inf)")
        return f"NaN from a masking -Inf: {chain_text(ev, f)}: {what}" + ("" if f.rows else data_text)
    if ev.cause == PRECISION_INDUCED:
        return _precision_cause(ev, f, data_text)
    return _numerical_cause(f, kind, data_text)


def _nonfinite_state_cause(ev: Evidence) -> str:
    """Weights or buffers were non-finite when the step began."""
    w = ev.weights
    if w.nonfinite:
        top = w.nonfinite[0]
        others = "" if len(w.nonfinite) == 1 else f" and {len(w.nonfinite) - 1} other parameter(s)"
        who = "an earlier step" if w.damage is None or w.damage.step is None else f"step {w.damage.step}"
        text = (f"the weights were already non-finite when the step began ({top.nonfinite} value(s) of {top.name}"
                f"{others}): {who} did the damage")
    else:
        f = ev.finding
        where = f" and {f.op_name} in {f.where} is the first op to read them" if f else ""
        noun = "buffer" if len(w.nonfinite_buffers) == 1 else "buffers"
        text = (f"the {noun} {fmt_list(w.nonfinite_buffers, 3)} already held NaN/Inf when the step began{where}: "
                "an earlier step's forward pass, which updates them, did the damage")
    if ev.data.status == "isolated":
        text += f"; only the data that reaches them fails ({culprit_samples(ev)})"
    return text


def _propagated_cause(ev: Evidence, f: OpFinding) -> str:
    """The op only passed on a non-finite input: name where it came from."""
    if ev.origin == "data":
        return f"bad data: {bad_input_text(ev)}; {f.op_name} in {f.where} is only the first op to use it"
    if ev.origin == "precision_conversion":
        dtype = advice.dtype_name(ev.precision)
        return (f"the batch holds values beyond {dtype}'s range ({out_of_range_text(ev)}): {ev.precision} converts "
                f"the batch to {dtype}, which turns them into Inf before {f.op_name} in {f.where}")
    return (f"a non-finite value reached {f.op_name} in {f.where} from outside the traced ops "
            f"({ev.origin or 'unknown origin'})")


def _precision_cause(ev: Evidence, f: OpFinding, data_text: str) -> str:
    """A reduced precision broke an op with finite inputs: rounding, or an overflow."""
    dtype = advice.dtype_name(ev.precision)
    if precision_failure(f) == "rounding":
        zero = any(s.abs_min == 0 for s in f.inputs)
        lost = ("an input that is exactly 0 in " + dtype if zero else f"inputs that {dtype} has rounded")
        return (f"{dtype} rounding: {f.op_name} in {f.where} ({f.phase}) gives {output_kinds(f)} from {lost}"
                f"{data_text}; the same step is finite in float32, which keeps that value")
    if f.phase == "backward" and ev.precision == "16-mixed":
        return (f"{dtype} overflow in the backward pass ({f.op_name} in {f.where}) at loss scale "
                f"{fmt_number(ev.loss_scale or math.nan)}{data_text}: the gradients do not fit in {dtype}")
    made = "Inf" if f.output.posinf or f.output.neginf else "NaN"
    return (f"{dtype} overflow: {f.op_name} in {f.where} ({f.phase}) turns inputs up to "
            f"|{fmt_number(largest_input(f))}| into {made}{data_text}; the same step is finite in float32")


def _numerical_cause(f: OpFinding, kind: str, data_text: str) -> str:
    """An op made a non-finite value from finite inputs whatever the precision."""
    where = f" at {f.source}" if f.source else ""
    if kind == "log":
        return f"log of zero or of a negative number: {f.op_name} in {f.where}{where}{data_text}"
    if kind == "div":
        return f"division by zero: {f.op_name} in {f.where}{where}{data_text}"
    if kind == "sqrt":
        return f"square root of a negative number: {f.op_name} in {f.where}{where}{data_text}"
    if kind == "sqrt_grad":
        op = (f.forward_op or "").replace("Backward0", "").lower()
        return (f"a finite forward pass with an infinite gradient: the derivative of {op} "
                f"at 0 in {f.where}{where}{data_text}")
    if kind == "overflow":
        return (f"overflow: {f.op_name} in {f.where} ({f.phase}) turns inputs up to |{fmt_number(largest_input(f))}| "
                f"into Inf{data_text}")
    return f"{f.op_name} in {f.where} ({f.phase}) produced a non-finite value{data_text}"


# ------------------------------------------------------------------------- shared phrases


def output_kinds(f: OpFinding) -> str:
    """The kinds of non-finite values the op wrote: "NaN", "+Inf/-Inf", ..."""
    return "/".join(k for k, n in (("NaN", f.output.nan), ("+Inf", f.output.posinf), ("-Inf", f.output.neginf)) if n)


def largest_input(f: OpFinding) -> float:
    """The largest finite magnitude among the op's inputs (NaN when none is finite)."""
    return max((s.abs_max for s in f.inputs if math.isfinite(s.abs_max)), default=math.nan)


def culprit_samples(ev: Evidence) -> str:
    """The isolated culprit samples, by dataset index when known."""
    return samples_text(ev.data.row_sets, ev.data.index_sets)


def finding_text(f: OpFinding) -> str:
    """"`aten.log.default` in gate (Gate), forward pass, float32, gives -Inf"."""
    grad = f" (the gradient of {f.forward_op})" if f.forward_op else ""
    return f"`{f.op}`{grad} in {f.where}, {f.phase} pass, {f.dtype}, gives {output_kinds(f)}"


def chain_text(ev: Evidence, f: OpFinding) -> str:
    """Where the value was born and what it came from, with the samples it was born on."""
    text = f.chain(rows=False)
    if f.rows:
        ix = ev.traced_on.get("dataset_indices") if ev.traced_on else None
        rows = (ev.traced_on or {}).get("rows") or []
        indices = [ix[rows.index(r)] for r in f.rows if r in rows] if ix and rows else None
        text += ", on " + samples_text([f.rows], [indices] if indices and len(indices) == len(f.rows) else None)
    return text


def _culprit_inputs(ev: Evidence, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries of a data scan that belong to the culprit samples."""
    rows = set(ev.data.rows or ((ev.traced_on or {}).get("rows") or []))
    keys = set(ev.data.microbatches)
    return [e for e in entries if (e["rank"], e["micro_step"]) in keys and (e["row"] is None or e["row"] in rows)]


def _sample_label(entry: dict[str, Any]) -> str:
    if entry["index"] is not None:
        return f"sample {entry['index']}"
    return f"row {entry['row']}" if entry["row"] is not None else f"microbatch {entry['micro_step']}"


def bad_input_text(ev: Evidence) -> str:
    """The culprit samples' non-finite input values: "batch['x'] of sample 7 holds 1 non-finite value"."""
    parts = [f"{bad['field']} of {_sample_label(bad)} holds {bad['count']} non-finite "
             f"value{'s' if bad['count'] > 1 else ''}" for bad in _culprit_inputs(ev, ev.data.nonfinite_inputs)]
    return ", ".join(parts[:3]) or "the input"


def out_of_range_text(ev: Evidence) -> str:
    """The culprit samples' values beyond the range of the type the batch is converted to."""
    parts = [f"{e['field']} of {_sample_label(e)} reaches {fmt_number(e['abs_max'])} in magnitude"
             for e in _culprit_inputs(ev, ev.data.out_of_range_inputs)]
    return ", ".join(parts[:3]) or "the data"
