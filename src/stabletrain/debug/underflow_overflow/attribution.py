"""Which value is to blame, and on whom: the first harmful non-finite value in execution order,
where it came from, which module (or the caller's own ops, or the data) made it, and which
samples of the batch hold it. See ``docs/underflow_overflow.md`` (Who is blamed).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .records import Call, Event, GradSite, Role, StatsRow, Values, module_label
from .stats import value_kind

__all__ = [
    "Culprit",
    "Blame",
    "innermost",
    "outermost",
    "decisive",
    "identity",
    "find_culprit",
    "blame",
    "explain",
    "first_nonfinite_shown",
    "sample_rows",
]

#: A non-finite value in these rows does harm wherever it is.
_ALWAYS_HARMFUL = ("weight", "loss", "grad")

#: Modules whose class name holds one of these take additive attention masks (-inf on purpose):
#: nn.Softmax, nn.MultiheadAttention, Hugging Face's *Attention, a CausalSelfAttention.
_MASK_TAKERS = ("softmax", "attention", "attn")


class Culprit(NamedTuple):
    """The row to blame: row ``line`` of event ``event``."""

    event: int
    line: int
    #: The label of the input holding Inf that an output made NaN from (a fully masked softmax
    #: row); "" otherwise.
    inf_input: str = ""


class Blame(NamedTuple):
    """Who made the value: the module (its path, ``""`` for the model) and why it is blamed."""

    module: str
    module_type: str
    tensor: str
    explanation: str


def innermost(roles: list[Role], kind: str) -> Optional[Role]:
    """The deepest call among ``roles`` of this kind (``"input"`` or ``"output"``)."""
    found = [r for r in roles if r.kind == kind]
    return max(found, key=lambda r: r.call.depth) if found else None


def outermost(roles: list[Role], kind: str) -> Optional[Role]:
    """The shallowest call among ``roles`` of this kind."""
    found = [r for r in roles if r.kind == kind]
    return min(found, key=lambda r: r.call.depth) if found else None


def identity(line: StatsRow) -> tuple:
    """What makes two rows the same tensor: (id, version), shape and dtype."""
    return (line.key, line.shape, line.dtype)


def _bad_data(line: StatsRow) -> bool:
    """A NaN/Inf in the model's input data that is not a mask: never there on purpose."""
    return line.data_flag is not None and bool(line.data_flag)


def decisive(ev: Event, line: StatsRow) -> bool:
    """Whether a non-finite value in ``line`` does harm by itself: a weight, the loss, a
    gradient, the model's input data (unless a mask), or what the model returns."""
    if line.role in _ALWAYS_HARMFUL:
        return True
    if line.role == "input":
        return _bad_data(line)
    return line.role == "output" and ev.call is not None and ev.call.parent is None


class _Provenance:
    """Who took and who returned each tensor among ``events[start:]``."""

    def __init__(self, events: list[Event], values: Values, start: int):
        self.events, self.values, self.start = events, values, start
        self.enters: dict[int, int] = {}  # id(call) -> its "enter" event
        self.exits: dict[int, int] = {}  # id(call) -> its "exit" event
        self.takers: dict[tuple, list[int]] = {}  # identity -> "enter" events that took it as input
        for i in range(start, len(events)):
            ev = events[i]
            if ev.call is not None and ev.kind in ("enter", "exit"):
                (self.enters if ev.kind == "enter" else self.exits)[id(ev.call)] = i
            if ev.kind == "enter":
                for line in ev.lines:
                    if line.role == "input":
                        self.takers.setdefault(identity(line), []).append(i)

    def kind(self, i: int, j: int) -> Optional[str]:
        return value_kind(*self.values[(i, j)])

    def nonfinite(self) -> list[tuple[int, int]]:
        """Every non-finite row from ``start`` on, in execution order."""
        return [(i, j) for i in range(self.start, len(self.events))
                for j in range(len(self.events[i].lines)) if self.kind(i, j)]

    def _finite_exit(self, i_enter: int) -> bool:
        k = self.exits.get(id(self.events[i_enter].call))
        return k is not None and all(not self.kind(k, j) for j in range(len(self.events[k].lines)))

    def neutralised(self, i: int, j: int) -> bool:
        """Whether every later module that took this output returned finite values (a masked softmax)."""
        later = [k for k in self.takers.get(identity(self.events[i].lines[j]), []) if k > i]
        return bool(later) and all(self._finite_exit(k) for k in later)

    def _first_seen(self, i: int, j: int) -> tuple[int, int]:
        """The earliest input row carrying the same tensor (the model's own input, say)."""
        key = identity(self.events[i].lines[j])
        for i2 in range(self.start, i + 1):
            for j2, line in enumerate(self.events[i2].lines):
                if line.role == "input" and identity(line) == key:
                    return i2, j2
        return i, j

    def origin(self, i: int, j: int) -> Culprit:
        """Where the non-finite output ``(i, j)`` began: passed on from an input of the same kind
        (blamed where it was first seen), made NaN from an Inf input, or made by the call itself."""
        ev = self.events[i]
        k_in = self.enters.get(id(ev.call))
        ins = [] if k_in is None else [(k_in, jj) for jj, ln in enumerate(self.events[k_in].lines)
                                        if ln.role == "input" and self.kind(k_in, jj)]
        same = [(a, b) for a, b in ins if self.kind(a, b) == self.kind(i, j)]
        if same:
            return Culprit(*self._first_seen(*same[0]))
        if self.kind(i, j) == "nan" and ins:
            first = self._first_seen(*ins[0])
            if self._made_by_caller(first) and not self._mask_reaching_softmax(ev.call, ins):
                return Culprit(*first)  # the caller's own op made the Inf; this call only made NaN of it
            return Culprit(i, j, self.events[ins[0][0]].lines[ins[0][1]].label)
        return Culprit(i, j)

    def _made_by_caller(self, at: tuple[int, int]) -> bool:
        """Whether the input row ``at`` (where a tensor was first seen) was made by the own ops of
        the calling module: no module returned it and it is not the model's own input."""
        call = self.events[at[0]].call
        if call is None or call.parent is None:
            return False
        key = identity(self.events[at[0]].lines[at[1]])
        return not any(line.role == "output" and identity(line) == key
                       for ev in self.events[self.start: at[0]] for line in ev.lines)

    def _mask_reaching_softmax(self, call: Optional[Call], ins: list[tuple[int, int]]) -> bool:
        """Whether the Inf inputs can be an additive attention mask that this call was built to
        take: a softmax or attention module, given Inf of the sign a mask holds (-inf; a held
        tensor with a +inf is no mask). A Linear's input is never an attention mask."""
        if call is None or not any(word in call.cls.lower() for word in _MASK_TAKERS):
            return False
        for a, b in ins:
            line = self.events[a].lines[b]
            t = line.ref() if line.ref is not None else None
            if t is not None and (line.key is None or t._version == line.key[1]):
                with torch.no_grad():
                    if bool(torch.isposinf(t.detach()).any()):
                        return False
        return True


def find_culprit(events: list[Event], values: Values, start: int) -> Optional[Culprit]:
    """The row to blame among ``events[start:]``, or None when no value that does harm (see
    :func:`decisive`) is non-finite.

    In execution order: a non-finite weight, loss or gradient; a NaN given to the model; or the
    first non-finite module output that was not neutralised (every later module that took it
    returned finite values). For that output: a NaN (or Inf) that came in with the same kind is
    passed on, and blamed where it first appeared (the model's input: the data; else an input
    no module returned: the caller's own ops); a NaN made from an Inf input is the call's own.
    """
    flow = _Provenance(events, values, start)
    bad = flow.nonfinite()
    if not any(decisive(events[i], events[i].lines[j]) for i, j in bad):
        return None
    for i, j in bad:
        ev, line = events[i], events[i].lines[j]
        if line.role in _ALWAYS_HARMFUL:
            return Culprit(i, j)
        if line.role == "input":
            if _bad_data(line):
                return Culprit(i, j)
            continue  # an input decides nothing: what comes out of the module does
        if not decisive(ev, line) and flow.neutralised(i, j):
            continue
        return flow.origin(i, j)
    return None


def _blame_gradient(site: GradSite, root_cls: str) -> Blame:
    """A non-finite gradient of a tensor: the innermost module that took it as input made it in
    its backward; if none took it, the parent whose own ops used the output."""
    consumer = innermost(site.roles, "input")
    if consumer is not None:
        return Blame(consumer.call.path, consumer.call.cls, f"grad of {consumer.label}", (
            f"The gradient this module's backward sent to its {consumer.label} is the first non-finite value "
            "in backward."
        ))
    producer = outermost(site.roles, "output")
    inner = innermost(site.roles, "output")
    assert producer is not None and inner is not None
    where = f"{inner.call.path} {inner.label}" if inner.call.path else inner.label
    parent = producer.call.parent
    if parent is not None:
        return Blame(parent.path, parent.cls, f"grad of {where}", (
            f"No module took {where} as input: the backward of an operation in the own forward of "
            f"{module_label(parent.path, parent.cls)} that used it made the gradient non-finite."
        ))
    return Blame("", root_cls, f"grad of {where}", (
        "The gradient of the model's output is non-finite: it comes from the backward of what used the "
        "output (the loss in training_step)."
    ))


def _blame_forward(ev: Event, j: int, root_cls: str) -> Blame:
    """A weight, input, output or loss row, or a weight's gradient."""
    label, role = ev.lines[j].label, ev.lines[j].role
    call = ev.call
    assert call is not None
    if ev.kind == "param":
        return Blame(call.path, call.cls, label,
                     f"The backward of this module made the gradient of its {label[8:]} non-finite.")
    if role == "loss":
        return Blame("", root_cls, "loss", "The model's outputs were finite; the loss computed from them is not.")
    if role == "weight":
        return Blame(call.path, call.cls, label, "A weight of this module is non-finite.")
    if role == "output":
        return Blame(call.path, call.cls, label, "The inputs and weights of this call were finite, its output is not.")
    # A non-finite input nobody produced before: made by the caller's own ops.
    parent = call.parent
    if parent is not None:
        return Blame(parent.path, parent.cls, f"{call.path} {label}", (
            f"No module returned it: an operation in the own forward of {module_label(parent.path, parent.cls)}, "
            f"between its child modules, made the {label} of {call.path}."
        ))
    return Blame(call.path, call.cls, label, "The input given to the model is non-finite: check the batch.")


def blame(ev: Event, j: int, root_cls: str) -> Blame:
    """Who made the value in row ``j`` of ``ev`` (``root_cls``: the model's class)."""
    if ev.kind == "grad":
        assert ev.site is not None
        return _blame_gradient(ev.site, root_cls)
    return _blame_forward(ev, j, root_cls)


def explain(events: list[Event], culprit: Culprit, root_cls: str) -> Blame:
    """:func:`blame` for the culprit, saying so when an output made NaN from an Inf that came in."""
    found = blame(events[culprit.event], culprit.line, root_cls)
    if not culprit.inf_input:
        return found
    return found._replace(explanation=(
        f"Its {culprit.inf_input} held Inf (an attention mask, say) and its inputs held no NaN: an operation of "
        "this call made NaN from that Inf (a softmax over a row that is masked everywhere, inf - inf)."
    ))


def first_nonfinite_shown(events: list[Event], values: Values) -> Optional[tuple[int, int]]:
    """The row a trace names when nothing harmful went non-finite: the first non-finite weight,
    output, loss or gradient (an input that is only an attention mask is not worth a line)."""
    return next(((i, j) for i, ev in enumerate(events) for j, line in enumerate(ev.lines)
                 if line.role != "input" and value_kind(*values[(i, j)])), None)


def _batch_size(events: list[Event], i: int) -> Optional[int]:
    call = events[i].call
    batch = call.batch if call is not None else None
    if batch is None:
        batch = next((ev.call.batch for ev in events[: i + 1] if ev.call is not None and ev.call.batch), None)
    return batch


def sample_rows(events: list[Event], values: Values, i: int, j: int) -> Optional[list[int]]:
    """Rows of the batch whose values are non-finite in row ``j`` of event ``i``: read from its
    tensor when still held unchanged with the batch as first dimension; when it was freed, from
    the first later tensor of the same pass that is (the bad rows travel with the samples,
    except through layers that mix samples, such as BatchNorm in training). None when unknown."""
    batch = _batch_size(events, i)
    if batch is None:
        return None
    candidates = [(i, j)] + [(k, m) for k in range(i + 1, len(events)) if events[k].phase == events[i].phase
                             for m in range(len(events[k].lines)) if value_kind(*values[(k, m)])]
    for k, m in candidates:
        line = events[k].lines[m]
        t = line.ref() if line.ref is not None else None
        if t is None or (line.key is not None and t._version != line.key[1]) or t.ndim == 0 or t.shape[0] != batch:
            continue
        with torch.no_grad():
            bad = ~torch.isfinite(t.detach()).reshape(batch, -1).all(1)
            return torch.nonzero(bad).flatten().tolist()
    return None
