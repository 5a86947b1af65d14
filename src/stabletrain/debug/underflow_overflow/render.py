"""The text the tool writes: the log file ``underflow_overflow_rank{rank}.log`` (its header, the
frames of a failure, a trace or another rank's failure) and the messages of its errors.
See ``docs/underflow_overflow.md`` for an example of each.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from stabletrain.utils.io import atomic_write_text
from stabletrain.utils.text import fmt_column

from .attribution import Blame, innermost
from .records import Call, Event, Values, module_label
from .stats import value_kind

__all__ = [
    "log_path",
    "log_header",
    "LogFile",
    "Frame",
    "group_frames",
    "frame_lines",
    "failure_section",
    "trace_section",
    "other_rank_section",
    "failure_message",
    "bystander_message",
    "abort_message",
]


def log_path(out_dir: str | Path, rank: int) -> Path:
    """``<out_dir>/underflow_overflow_rank{rank}.log``."""
    return Path(out_dir) / f"underflow_overflow_rank{rank}.log"


def log_header(rank: int, model_cls: str, n_modules: int, include_backward: bool, sharded: bool = False) -> str:
    """The lines that open the log: what was watched and how to read the columns."""
    fsdp = (
        "FSDP2: weights are measured whole (unsharded, in forward); a 'grad of <weight> [shard]' row is this "
        "rank's shard of the reduced gradient, once per step (the whole gradient's abs min/max is the min/max "
        "over the ranks' reports)\n"
        if sharded
        else ""
    )
    return (
        f"stabletrain underflow/overflow report, rank {rank}\n"
        f"model: {model_cls}, {n_modules} modules watched, "
        f"backward {'included' if include_backward else 'not included'}\n"
        "columns: abs min and abs max of each tensor (nan/inf: non-finite), the tensor, "
        "its dtype and shape\n"
        f"{fsdp}"
        "frames are in execution order; [forward]/[backward], step and microbatch in each header\n\n"
    )


class LogFile:
    """The log: its header, then every section appended so far, rewritten atomically each time."""

    def __init__(self, path: Path, header: str):
        self.path = path
        self._header = header
        self._text: Optional[str] = None

    @property
    def written(self) -> bool:
        return self._text is not None

    def append(self, section: str) -> Path:
        self._text = (self._header if self._text is None else self._text) + section + "\n"
        return atomic_write_text(self._text, self.path)


# ------------------------------------------------------------------------------------ frames


class Frame:
    """A block of the log: one module call (its inputs and outputs), or consecutive gradients
    shown under one module, with a header ``[phase] step N.micro  module (Class) suffix``."""

    __slots__ = ("phase", "step", "micro", "module", "cls", "suffix", "rows")

    def __init__(self, phase: str, step: int, micro: int, module: str, cls: str, suffix: str):
        self.phase, self.step, self.micro = phase, step, micro
        self.module, self.cls, self.suffix = module, cls, suffix
        self.rows: list[tuple[int, int, str, str]] = []  # (event index, line index, label, dtype[shape])


class _OwnOps(NamedTuple):
    """The last frame when the culprit is a module's own ops, not the frame the value was seen in."""

    path: str
    cls: str
    phase: str
    step: int
    micro: int
    explanation: str


def _grad_display(ev: Event) -> tuple[Call, str, list[str]]:
    """The module a gradient is shown under, its label, and the tensor's other roles."""
    assert ev.site is not None
    roles = ev.site.roles
    main = innermost(roles, "input") or innermost(roles, "output")
    assert main is not None
    others = [f"{c.path or '<model>'} {lab}" for c, _, lab in roles if (c, lab) != (main.call, main.label)]
    return main.call, f"grad of {main.label}", others


def _labels(ev: Event) -> tuple[Call, list[str]]:
    """The call an event is shown under and the labels of its rows."""
    if ev.kind != "grad":
        assert ev.call is not None
        return ev.call, [line.label for line in ev.lines]
    call, label, others = _grad_display(ev)
    if others:
        label += " (= " + ", ".join(others[:2]) + (", ..." if len(others) > 2 else "") + ")"
    return call, [label]


def _continues(frame: Frame, prev: Event, ev: Event, call: Call) -> bool:
    """Whether ``ev`` goes into the frame of ``prev``: a call's outputs right after its inputs, or
    another gradient under the same module."""
    if ev.phase != prev.phase or frame.module != call.path or frame.step != ev.step:
        return False
    return (ev.kind == "exit" and prev.kind == "enter" and prev.call is ev.call) or ev.phase == "backward"


_SUFFIX = {"enter": "inputs", "exit": "outputs", "loss": "training_step", "grad": "", "param": ""}


def group_frames(events: list[Event]) -> list[Frame]:
    """Group events into frames: a module call whose inputs and outputs are adjacent is one
    frame; consecutive gradients shown under the same module are one frame."""
    frames: list[Frame] = []
    prev: Optional[Event] = None
    for i, ev in enumerate(events):
        call, labels = _labels(ev)
        if prev is not None and frames and _continues(frames[-1], prev, ev, call):
            frame = frames[-1]
            if ev.kind == "exit":
                frame.suffix = ""
        else:
            frame = Frame(ev.phase, ev.step, ev.micro, call.path, call.cls, _SUFFIX[ev.kind])
            frames.append(frame)
        for j, label in enumerate(labels):
            line = ev.lines[j]
            meta = f"{str(line.dtype).replace('torch.', '')}{list(line.shape)}"
            frame.rows.append((i, j, label, meta))
        prev = ev
    return frames


def frame_lines(
    frames: list[Frame],
    values: Values,
    mark: Optional[tuple[int, int]],
    own_ops: Optional[_OwnOps] = None,
    own_ops_tensor: str = "",
) -> list[str]:
    """The table of ``frames``: the row ``mark`` flagged as the first non-finite value, then the
    culprit's own ops when they are to blame."""
    out = [f"  {'abs min':>11} {'abs max':>11}  tensor"]
    for frame in frames:
        name = frame.module or "<model>"
        suffix = f" {frame.suffix}" if frame.suffix else ""
        micro = f".{frame.micro}" if frame.micro else ""
        out.append(f"[{frame.phase}] step {frame.step}{micro}  {name} ({frame.cls}){suffix}")
        for i, j, label, meta in frame.rows:
            amin, amax = values[(i, j)]
            flag = f"   <-- first non-finite ({value_kind(amin, amax)})" if mark == (i, j) else ""
            out.append(f"  {fmt_column(amin)} {fmt_column(amax)}  {label:<24} {meta}{flag}")
    if own_ops is not None:
        name = own_ops.path or "<model>"
        m = f".{own_ops.micro}" if own_ops.micro else ""
        out.append(f"[{own_ops.phase}] step {own_ops.step}{m}  {name} ({own_ops.cls}) own ops  <-- culprit")
        out.append(f"  {own_ops_tensor}: {own_ops.explanation}")
    return out


# ---------------------------------------------------------------------------------- sections


def failure_section(
    events: list[Event], values: Values, at: tuple[int, int], culprit: Blame, value: Optional[str], max_frames: int
) -> str:
    """The section of a failure: the culprit, then the last ``max_frames`` frames up to the row
    ``at`` (the last of ``events``), the culprit last."""
    i, j = at
    ev = events[i]
    # The culprit's frame ends with the bad row: later rows of that hook are not part of the
    # story (e.g. the outputs of a module whose weight is bad).
    events = events[:i] + [ev.upto(j)]
    frames = group_frames(events)
    own_ops = None
    if frames[-1].module != culprit.module:
        own_ops = _OwnOps(culprit.module, culprit.module_type, ev.phase, ev.step, ev.micro, culprit.explanation)
    # The frame holding the first non-finite row is always kept, even with max_frames=1 and a
    # culprit frame after it.
    keep = max(1, max_frames - (1 if own_ops else 0))
    frames = frames[-keep:]
    why = culprit.explanation or "it is the first non-finite value in execution order"
    lines = [
        f"=== step {ev.step}, {ev.phase}: non-finite value ({value}) ===",
        f"culprit: {module_label(culprit.module, culprit.module_type)}",
        f"tensor:  {culprit.tensor}",
        f"why:     {why}",
        f"frames:  the last {len(frames) + (1 if own_ops else 0)} in execution order, the culprit last",
        "",
    ]
    lines.extend(frame_lines(frames, values, (len(events) - 1, j), own_ops, culprit.tensor))
    return "\n".join(lines) + "\n"


def trace_section(
    step: int, events: list[Event], values: Values, at: Optional[tuple[int, int]], seen: Optional[Blame],
    harmful: bool,
) -> str:
    """The section of a traced step: every frame; ``at``, the first non-finite row worth naming
    (made by ``seen``), is flagged, and said to be harmless unless ``harmful``."""
    frames = group_frames(events)
    lines = [f"=== step {step}: trace (trace_batch_nums), every frame, {len(frames)} frames ==="]
    if at is not None and seen is not None:
        harmless = "" if harmful else (
            " It did no harm: the model's outputs, the loss and the gradients stayed finite.")
        lines.append(
            f"non-finite values seen in this step; the first: {module_label(seen.module, seen.module_type)}, "
            f"{seen.tensor} ({events[at[0]].phase}). Not aborting: the step is traced.{harmless}"
        )
    lines.extend(frame_lines(frames, values, at))
    return "\n".join(lines) + "\n"


def other_rank_section(
    step: int, rank: int, events: list[Event], values: Values, detected: Sequence[int], phase: Optional[str],
    max_frames: int,
) -> str:
    """The section of a rank that found nothing while ``detected`` did: its own last frames."""
    frames = group_frames(events)[-max_frames:]
    others = ", ".join(str(r) for r in detected)
    lines = [
        f"=== step {step}: rank {others} found a non-finite value"
        f"{f' ({phase})' if phase else ''}; none on this rank (rank {rank}) ===",
        f"see underflow_overflow_rank{detected[0]}.log for the culprit; this rank's last {len(frames)} frames follow",
        "",
    ]
    lines.extend(frame_lines(frames, values, None))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- messages


def failure_message(
    step: int, rank: int, phase: Optional[str], culprit: str, tensor: Optional[str], value: Optional[str],
    explanation: str, rows: Optional[list[int]], path: Path,
) -> str:
    """The error of the rank that found the value; ``culprit`` as :func:`module_label` writes it."""
    samples = f" Samples (rows of the batch) holding it: {rows}." if rows else ""
    return (
        f"step {step}, rank {rank}, {phase}: the first non-finite value ({value}) is in {culprit}, "
        f"tensor {tensor}. {explanation}{samples} The last frames, culprit last: {path}"
    )


def bystander_message(step: int, rank: int, detected_by: Sequence[int], phase: Optional[str], path: Path) -> str:
    """The error of a rank that found nothing and stops with the ranks that did."""
    others = ", ".join(str(r) for r in detected_by)
    return (
        f"step {step}: rank {others} found a non-finite value"
        f"{f' in the {phase} pass' if phase else ''} (see underflow_overflow_rank{detected_by[0]}.log "
        f"beside this rank's report); rank {rank} found none and stopped with it. "
        f"This rank's last frames: {path}"
    )


def abort_message(step: int, path: Path) -> str:
    return f"abort_after_batch_num={step}: stopped after step {step} as asked; traced steps are in {path}"
