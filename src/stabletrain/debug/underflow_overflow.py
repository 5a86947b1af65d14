"""Name the first module whose values go non-finite, in the forward and the backward pass.

:class:`UnderflowOverflowMonitor` hooks every module of a model and records, for each call,
the absolute min and max of the module's own weights, of every input tensor and of every
output tensor (tensors nested in tuples, lists and dicts included). With ``include_backward``
(the default) it also records the gradients flowing into and out of each module, and the
gradient of each weight, in backward execution order. When a value goes non-finite it names
the module where it first appeared, which tensor it was, and writes the last frames to
``<out_dir>/underflow_overflow_rank{rank}.log`` with the culprit last.

What it costs: every statistic stays on the device, and "did anything go non-finite?" is
decided once per forward and once per backward, each time with one host synchronisation,
whatever the size of the model. Statistics are read back only when a value went non-finite
or on a traced step.

Attribution, in execution order:

* a non-finite weight, or output of module ``M``: ``M``;
* a non-finite input of ``M`` that no earlier frame produced: the module whose ``forward``
  called ``M`` (a functional op between two modules, e.g. ``torch.log`` in the parent's
  ``forward``); for the outermost module, the data;
* backward: the gradient of a weight of ``M``, or of an input of ``M``: ``M``'s backward; the
  gradient of an output that no module consumed: the parent whose own ops used it.

In a plain PyTorch loop::

    from stabletrain import UnderflowOverflowMonitor

    with UnderflowOverflowMonitor(model, out_dir="out/debug") as monitor:
        for step, (x, y) in enumerate(loader):
            monitor.set_step(step)
            loss = loss_fn(model(x), y)      # raises UnderflowOverflowError at the end of forward
            loss.backward()                  # ... or at the end of backward
            optimizer.step()
            optimizer.zero_grad()

In ``stabletrain.train`` the same class runs behind ``debug_args.underflow_overflow`` and
decides together with the other ranks (see :class:`UnderflowOverflowCallback`).
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from stabletrain.errors import StabletrainError
from stabletrain.events import TrainerLike
from stabletrain.utils.dist import ranks_with
from stabletrain.utils.io import atomic_write_text
from stabletrain.utils.text import fmt_column
from stabletrain.utils.tree import named_tensors

__all__ = [
    "UnderflowOverflowMonitor",
    "UnderflowOverflowError",
    "UnderflowOverflowAbort",
    "UnderflowOverflowCallback",
    "log_path",
    "tensor_stats",
]

#: Under fp16 loss scaling, the SCALER_PATIENCE-th step in a row with a non-finite gradient is
#: an error (the GradScaler skips such steps and lowers the scale; a real fault keeps coming back).
SCALER_PATIENCE = 10


def _any_nonfinite(amaxes: list[Tensor]) -> Tensor:
    """A device bool scalar: True when any of these abs-max scalars is NaN or Inf."""
    if not amaxes:
        return torch.zeros((), dtype=torch.bool)
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in amaxes:
        by_device.setdefault(t.device, []).append(t)
    flags = [~torch.stack(ts).isfinite().all() for ts in by_device.values()]
    flag = flags[0]
    for other in flags[1:]:
        flag = flag | other.to(flag.device)
    return flag


def log_path(out_dir: str | Path, rank: int) -> Path:
    """``<out_dir>/underflow_overflow_rank{rank}.log``."""
    return Path(out_dir) / f"underflow_overflow_rank{rank}.log"


# --------------------------------------------------------------------------------------
# The statistics kernel: the one place that decides how a tensor is measured
# --------------------------------------------------------------------------------------


def tensor_stats(t: Tensor, scratch: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """``(abs min, abs max)`` of ``t`` as device scalars, without a host synchronisation.

    A NaN anywhere makes both NaN and an inf of either sign makes the abs max inf, so the
    abs max alone decides finiteness.

    Args:
        t: A floating-point tensor with at least one element.
        scratch: CPU only: a dict in which to keep a buffer per dtype for ``|t|`` (it grows
            to the largest tensor measured); without it ``|t|`` is allocated afresh.

    Kernels measured over the 58 module outputs of one forward of the benchmark model (53M
    elements, 2 CPU threads, torch 2.14, best of 10): ``torch.aminmax(t)`` (signed, no abs
    min) 7 ms, ``|t|`` into a reused buffer then ``torch.aminmax`` 13 ms, ``torch.aminmax(t)``
    plus ``t.abs().amin()`` 17 ms, ``torch.linalg.vector_norm(t, +-inf)`` 78 ms each (not
    vectorised on the CPU). On a busy machine a fresh ``|t|`` costs far more than the buffer.
    On a GPU ``vector_norm(t, +-inf)`` are fused passes that never materialise ``|t|`` (a
    temporary as large as the activation, e.g. the logits).
    """
    if t.device.type == "cpu":
        if scratch is None:
            return torch.aminmax(t.abs())
        n = t.numel()
        buf = scratch.get(t.dtype)
        if buf is None or buf.numel() < n:
            buf = scratch[t.dtype] = torch.empty(n, dtype=t.dtype)
        out = buf[:n].view(t.shape)
        torch.abs(t, out=out)
        return torch.aminmax(out)
    return torch.linalg.vector_norm(t, float("-inf")), torch.linalg.vector_norm(t, float("inf"))


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


#: What to do after an UnderflowOverflowError, whoever raised it.
_NEXT_STEPS = (
    "Next: read the report (the culprit frame is last); replay the step offline to find the op and the sample: "
    "debug_args.nancapture.enabled=true (NaNCaptureMonitor in a plain loop), then stabletrain diagnose on the "
    "capture; if the module runs in float16 or bfloat16, rule reduced precision in or out with precision=32-true; "
    "continue from the newest healthy checkpoint (resume_from=) once fixed."
)


class UnderflowOverflowError(StabletrainError):
    """A non-finite value appeared; training stopped.

    Attributes:
        step: The step (``set_step``) during which it appeared.
        rank: The rank raising this error.
        detected_by: The ranks that found a non-finite value (``[rank]`` on one process).
        phase: ``"forward"`` or ``"backward"`` (None on a rank that found nothing itself).
        module: Path of the culprit module in the user's own names (``""`` is the model
            itself); None on a rank that found nothing itself.
        module_type: Class name of the culprit module.
        tensor: Which tensor went bad: a weight name, ``input[i]``, ``output[k]``,
            ``output['key']``, ``<child> input[i]`` for a value made between two child
            modules, ``grad of ...`` in backward, or ``loss``.
        value: ``"nan"``, or ``"inf"`` for an infinity of either sign.
        explanation: One sentence on how the culprit was chosen.
        log_path: This rank's log, ``underflow_overflow_rank{rank}.log`` (also ``report_path``).
        rows: Rows of the batch (samples of the microbatch) whose values in that tensor are
            non-finite, when it has the batch as first dimension and was still held when the
            decision was made; None when unknown.
    """

    def __init__(
        self,
        *,
        step: int,
        rank: int,
        detected_by: Sequence[int],
        log_path: Path,
        phase: Optional[str] = None,
        module: Optional[str] = None,
        module_type: Optional[str] = None,
        tensor: Optional[str] = None,
        value: Optional[str] = None,
        explanation: str = "",
        rows: Optional[list[int]] = None,
    ):
        self.step = step
        self.rank = rank
        self.detected_by = list(detected_by)
        self.log_path = Path(log_path)
        self.phase = phase
        self.module = module
        self.module_type = module_type
        self.tensor = tensor
        self.value = value
        self.explanation = explanation
        self.rows = rows
        if module is not None:
            where = _display(module, module_type)
            samples = f" Samples (rows of the batch) holding it: {rows}." if rows else ""
            msg = (
                f"step {step}, rank {rank}, {phase}: the first non-finite value ({value}) is in {where}, "
                f"tensor {tensor}. {explanation}{samples} The last frames, culprit last: {self.log_path}"
            )
        else:
            others = ", ".join(str(r) for r in self.detected_by)
            msg = (
                f"step {step}: rank {others} found a non-finite value"
                f"{f' in the {phase} pass' if phase else ''} (see underflow_overflow_rank{self.detected_by[0]}.log "
                f"beside this rank's report); rank {rank} found none and stopped with it. "
                f"This rank's last frames: {self.log_path}"
            )
        super().__init__(msg + "\n" + _NEXT_STEPS)

    @property
    def report_path(self) -> Path:
        """The same as :attr:`log_path` (the name the README uses)."""
        return self.log_path


class UnderflowOverflowAbort(StabletrainError):
    """``abort_after_batch_num`` was reached (raised by a standalone monitor's ``set_step``).

    Attributes:
        step: The last step that ran.
        log_path: The log holding the traced steps.
    """

    def __init__(self, step: int, log_path: Path):
        self.step = step
        self.log_path = Path(log_path)
        super().__init__(
            f"abort_after_batch_num={step}: stopped after step {step} as asked; "
            f"traced steps are in {self.log_path}"
        )


def _display(path: str, cls: Optional[str]) -> str:
    if path == "":
        return f"the model itself ({cls})"
    return f"module {path} ({cls})"


# --------------------------------------------------------------------------------------
# Records (host side; statistics stay device tensors until a report is written)
# --------------------------------------------------------------------------------------


class _Call:
    """One call of a module's forward."""

    __slots__ = ("path", "cls", "parent", "depth", "mid", "batch")

    def __init__(self, path: str, cls: str, parent: Optional["_Call"], mid: int):
        self.path = path
        self.cls = cls
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.mid = mid
        #: The outermost call's batch size (first dimension of its first input), for sample rows.
        self.batch: Optional[int] = parent.batch if parent is not None else None


class _GradSite:
    """A tensor whose gradient is watched, with every role it played in the forward."""

    __slots__ = ("ref", "version", "roles", "shape", "dtype")

    def __init__(self, ref: Any, version: int, shape: tuple, dtype: torch.dtype):
        self.ref = ref
        self.version = version
        self.roles: list[tuple[_Call, str, str]] = []  # (call, "input" | "output", label)
        self.shape = shape
        self.dtype = dtype


#: What one hook records of one tensor: (label, role, abs min, abs max, shape, dtype), the
#: statistics as device scalars; role is weight|input|output|loss|grad.
_StatsRow = tuple


class _Event:
    """What one hook saw: a module's inputs, its outputs, the loss, or one gradient."""

    __slots__ = ("phase", "step", "micro", "kind", "call", "lines", "site")

    def __init__(self, phase: str, step: int, micro: int, kind: str, call: Optional[_Call], lines: list, site: Any = None):
        self.phase = phase
        self.step = step
        self.micro = micro
        self.kind = kind  # enter | exit | loss | grad | param
        self.call = call
        self.lines = lines
        self.site = site


#: Containers nested deeper than this in a module's inputs or outputs are not looked into.
_MAX_DEPTH = 4


def _tensors_of(obj: Any, prefix: str) -> Iterator[tuple[str, Tensor]]:
    """(label, tensor) of a module's inputs or outputs; a lone output tensor is ``output[0]``."""
    if isinstance(obj, Tensor) and prefix == "output":
        return iter([("output[0]", obj)])
    return named_tensors(obj, prefix, max_depth=_MAX_DEPTH)


def _value_kind(amin: float, amax: float) -> Optional[str]:
    if amax != amax:
        return "nan"
    if amax == float("inf"):
        return "inf"
    return None


def _to_host(tensors: list[Tensor]) -> list[float]:
    """Values of many device scalars, one transfer per device."""
    out: list[float] = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        values = torch.stack([tensors[i].float() for i in idx]).tolist()
        for i, v in zip(idx, values):
            out[i] = v
    return out


# --------------------------------------------------------------------------------------
# The monitor
# --------------------------------------------------------------------------------------


class UnderflowOverflowMonitor:
    """Per-module abs min/max tracing that names the first non-finite value.

    Args:
        model: The model to watch; every module gets a forward pre-hook and a forward hook,
            every parameter a gradient hook. Names are ``model.named_modules()`` names.
        out_dir: Folder of the report ``underflow_overflow_rank{rank}.log``.
        rank: This process's rank (in the report's name and in the error).
        max_frames_to_save: Frames written on a detection, the culprit last.
        trace_batch_nums: Steps at which every frame is written, without aborting.
        abort_after_batch_num: ``set_step`` raises :class:`UnderflowOverflowAbort` once this
            step has finished.
        include_backward: Also watch the gradients of module inputs, outputs and weights.
        auto_check: Decide at the end of each outermost forward call and each backward pass
            (one host sync each) and raise there. False: only record; the caller decides with
            :meth:`nonfinite_flag` and :meth:`fail` (what the trainer does, so that all ranks
            decide together).

    Raises:
        UnderflowOverflowError: From the forward call or the ``backward()`` in which a value
            went non-finite (with ``auto_check``), after the report is written.

    Example::

        with UnderflowOverflowMonitor(model, out_dir="out/debug") as monitor:
            for step, batch in enumerate(loader):
                monitor.set_step(step)
                loss = model(batch).mean()
                loss.backward()
                optimizer.step(); optimizer.zero_grad()

    On exit it removes the hooks it added, and only those.
    """

    def __init__(
        self,
        model: nn.Module,
        out_dir: str | Path = ".",
        rank: int = 0,
        max_frames_to_save: int = 21,
        trace_batch_nums: Iterable[int] = (),
        abort_after_batch_num: Optional[int] = None,
        include_backward: bool = True,
        *,
        auto_check: bool = True,
    ):
        if max_frames_to_save < 1:
            raise ValueError(f"max_frames_to_save must be at least 1, got {max_frames_to_save}")
        trace = sorted(set(int(s) for s in trace_batch_nums))
        if any(s < 0 for s in trace):
            raise ValueError(f"trace_batch_nums must be step numbers >= 0, got {trace}")
        if abort_after_batch_num is not None and abort_after_batch_num < 0:
            raise ValueError(f"abort_after_batch_num must be None or >= 0, got {abort_after_batch_num}")
        self.model = model
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.max_frames_to_save = max_frames_to_save
        self.trace_batch_nums = frozenset(trace)
        self.abort_after_batch_num = abort_after_batch_num
        self.include_backward = include_backward
        self.auto_check = auto_check
        self.log_path = log_path(out_dir, rank)
        self.step = 0
        self.micro_step = 0
        self.tracing = 0 in self.trace_batch_nums
        self._stepped = False
        self._closed = False
        self._root_cls = type(model).__name__
        self._handles: list[Any] = []
        self._stack: list[_Call] = []
        self._events: list[_Event] = []
        self._pending: list[Tensor] = []  # abs max of everything forward since the last decision
        self._pending_bw: list[Tensor] = []  # ... and of every gradient
        self._history: deque[_Event] = deque(maxlen=4 * max_frames_to_save + 8)
        self._seen: dict[int, tuple] = {}  # id(tensor) -> (weakref, version, stats) within a forward
        self._grad_sites: dict[int, _GradSite] = {}
        self._weight_cache: dict[int, tuple] = {}
        self._bw_queued = False
        self._log_text: Optional[str] = None
        self._local = threading.local()  # per-thread scratch buffers of tensor_stats
        self._attach()

    # ------------------------------------------------------------------ hooks in and out

    def _stats(self, t: Tensor) -> tuple[Tensor, Tensor]:
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = {}
        return tensor_stats(t, buffers)

    def _attach(self) -> None:
        self._info: dict[int, tuple[str, str, list[tuple[str, nn.Parameter]]]] = {}
        for path, module in self.model.named_modules():
            own = [(n, p) for n, p in module.named_parameters(recurse=False)]
            self._info[id(module)] = (path, type(module).__name__, own)
            self._handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._handles.append(
                module.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)
            )
        if not self.include_backward:
            return
        seen: set[int] = set()
        for path, module in self.model.named_modules():
            owner = _Call(path, type(module).__name__, None, id(module))
            for name, p in module.named_parameters(recurse=False):
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                hook = functools.partial(self._on_param_grad, owner, name, tuple(p.shape), p.dtype)
                self._handles.append(p.register_hook(hook))

    def close(self) -> None:
        """Write a pending trace, then remove every hook this monitor added (idempotent)."""
        if self._closed:
            return
        try:
            if self.tracing and self._events:
                self.write_trace()
        finally:
            self._closed = True
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._events.clear()
            self._pending.clear()
            self._pending_bw.clear()
            self._seen.clear()
            self._grad_sites.clear()
            self._local = threading.local()

    def __enter__(self) -> "UnderflowOverflowMonitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------ accessors

    @property
    def num_watched_modules(self) -> int:
        """Modules with hooks: every module of the model, the model itself included."""
        return len(self._info)

    @property
    def has_records(self) -> bool:
        """Whether the hooks recorded values since the last decision (:meth:`accept`,
        :meth:`fail`) or the last trace written (:meth:`write_trace`)."""
        return bool(self._events)

    @property
    def log_written(self) -> bool:
        """Whether this monitor has written its log (:attr:`log_path`) yet."""
        return self._log_text is not None

    # ---------------------------------------------------------------------- step control

    def set_step(self, step: int) -> None:
        """Call at the start of each step. Writes the previous step's trace if it was traced.

        Raises:
            UnderflowOverflowAbort: ``step`` is past ``abort_after_batch_num``.
        """
        if self._stepped and step == self.step:
            return
        if self.tracing and self._events:
            self.write_trace()
        if self.abort_after_batch_num is not None and step > self.abort_after_batch_num:
            raise UnderflowOverflowAbort(self.abort_after_batch_num, self.log_path)
        self._stepped = True
        self.step = step
        self.micro_step = 0
        self.tracing = step in self.trace_batch_nums

    # --------------------------------------------------------------------------- forward

    def _measure(self, t: Tensor) -> tuple[Tensor, Tensor, Any]:
        """``(abs min, abs max, weak reference)`` of ``t``."""
        # A tensor is often the output of one module and the input of the next, and of the
        # parents of both: measure each (tensor, version) once per forward.
        if t.is_inference():
            return (*self._stats(t), None)
        key = id(t)
        version = t._version
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is t and hit[1] == version:
            return (*hit[2], hit[0])
        stats = self._stats(t)
        ref = weakref.ref(t)
        self._seen[key] = (ref, version, stats)
        return (*stats, ref)

    def _weight_stats(self, p: Tensor) -> tuple[Tensor, Tensor]:
        # Weights change at the optimizer step only (which bumps their version): measure them
        # once per change, not once per call (gradient accumulation, shared modules).
        key = (p._version, p.data_ptr(), p.dtype, p.device)
        hit = self._weight_cache.get(id(p))
        if hit is not None and hit[0] == key:
            return hit[1]
        stats = self._stats(p)
        self._weight_cache[id(p)] = (key, stats)
        return stats

    def _stats_row(self, label: str, role: str, t: Tensor, decisive: bool = True) -> Optional[_StatsRow]:
        """A row of the log for ``t``; a ``decisive`` one takes part in the decision."""
        if not t.is_floating_point() or t.numel() == 0 or t.is_sparse:
            return None
        if role == "weight":
            amin, amax = self._weight_stats(t)
            ref = None
        else:
            amin, amax, ref = self._measure(t)
        if decisive:
            self._pending.append(amax)
        # The reference and (id, version) let a report find the samples and who consumed the tensor.
        return (label, role, amin, amax, tuple(t.shape), t.dtype, ref, (id(t), t._version))

    def _data_flag(self, t: Tensor) -> Tensor:
        """A device bool: does the model's input ``t`` hold a NaN/Inf that is not an additive
        mask (a tensor of only 0 and -inf)? It takes part in the decision, without a sync."""
        flag = ~torch.isfinite(t).all() & ~((t == 0) | torch.isneginf(t)).all()
        self._pending.append(torch.where(flag, float("inf"), 0.0).to(torch.float32))
        return flag

    def _watch_grad(self, t: Tensor, call: _Call, role: str, label: str) -> None:
        key = id(t)
        version = t._version
        site = self._grad_sites.get(key)
        if site is not None and site.ref() is t and site.version == version:
            site.roles.append((call, role, label))
            return
        site = _GradSite(weakref.ref(t), version, tuple(t.shape), t.dtype)
        site.roles.append((call, role, label))
        try:
            t.register_hook(functools.partial(self._on_grad, site))
        except RuntimeError:  # e.g. a tensor that cannot have hooks; nothing to watch
            return
        self._grad_sites[key] = site

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._closed:
            return None
        path, cls, params = self._info[id(module)]
        call = _Call(path, cls, self._stack[-1] if self._stack else None, id(module))
        if call.parent is None:
            first = next((t for t in named_tensors((args, kwargs), "", max_depth=_MAX_DEPTH) if t[1].ndim), None)
            call.batch = int(first[1].shape[0]) if first is not None else None
        self._stack.append(call)
        watch = self.include_backward and torch.is_grad_enabled()
        lines = []
        with torch.no_grad():
            for name, p in params:
                line = self._stats_row(name, "weight", p)
                if line is not None:
                    lines.append(line)
            tensors = list(_tensors_of(args, "input"))
            if kwargs:
                tensors.extend(_tensors_of(kwargs, "input"))
            for label, t in tensors:
                # Inputs do not decide: an Inf handed to a module (an attention mask) is harmful
                # only if it comes out of it, which its outputs show. Except in the data.
                line = self._stats_row(label, "input", t, decisive=False)
                if line is not None:
                    if call.parent is None:
                        line = line + (self._data_flag(t),)
                    lines.append(line)
                    if watch and t.requires_grad:
                        self._watch_grad(t, call, "input", label)
        if lines:
            self._events.append(_Event("forward", self.step, self.micro_step, "enter", call, lines))
        return None

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._closed or not self._stack or self._stack[-1].mid != id(module):
            return None  # attached in the middle of a forward
        call = self._stack.pop()
        watch = self.include_backward and torch.is_grad_enabled()
        lines = []
        with torch.no_grad():
            for label, t in _tensors_of(output, "output"):
                # What the model returns decides: a NaN/Inf inside that never reaches it was
                # neutralised (a masked softmax). The log still finds where it began.
                line = self._stats_row(label, "output", t, decisive=call.parent is None)
                if line is not None:
                    lines.append(line)
                    if watch and t.requires_grad:
                        self._watch_grad(t, call, "output", label)
        if lines:
            self._events.append(_Event("forward", self.step, self.micro_step, "exit", call, lines))
        if not self._stack:  # the outermost call returned: this forward is complete
            self._seen.clear()
            self._grad_sites.clear()
            # Not while another exception is on its way out of the forward (always_call).
            if self.auto_check and not self.tracing and sys.exc_info()[1] is None:
                self.check()
        return None

    def record_loss(self, loss: Tensor) -> None:
        """Also watch a value computed outside the model's forward, e.g. the loss in
        ``training_step``; it is blamed on the model itself."""
        if self._closed or not isinstance(loss, Tensor):
            return
        with torch.no_grad():
            line = self._stats_row("loss", "loss", loss.detach())
        if line is not None:
            call = _Call("", self._root_cls, None, id(self.model))
            self._events.append(_Event("forward", self.step, self.micro_step, "loss", call, [line]))

    # -------------------------------------------------------------------------- backward

    def _backward_event(self, event: _Event, amax: Tensor) -> None:
        self._pending_bw.append(amax)
        self._events.append(event)
        if self.auto_check and not self.tracing and not self._bw_queued:
            # One decision at the end of this backward pass, however many hooks fire.
            self._bw_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_grad(self, site: _GradSite, grad: Tensor) -> None:
        if self._closed or grad is None or not grad.is_floating_point() or grad.numel() == 0:
            return None
        with torch.no_grad():
            amin, amax = self._stats(grad)
        line = ("grad", "grad", amin, amax, tuple(grad.shape), grad.dtype, weakref.ref(grad), None)
        self._backward_event(_Event("backward", self.step, self.micro_step, "grad", None, [line], site), amax)
        return None

    def _on_param_grad(self, owner: _Call, name: str, shape: tuple, dtype: torch.dtype, grad: Tensor) -> None:
        if self._closed or grad is None or grad.numel() == 0 or grad.is_sparse:
            return None
        with torch.no_grad():
            amin, amax = self._stats(grad)
        line = (f"grad of {name}", "grad", amin, amax, tuple(grad.shape), grad.dtype, None, None)
        self._backward_event(_Event("backward", self.step, self.micro_step, "param", owner, [line]), amax)
        return None

    def _end_of_backward(self) -> None:
        self._bw_queued = False
        if not self._closed and not self.tracing:
            self.check()

    # -------------------------------------------------------------------------- deciding

    def nonfinite_flag(self) -> Tensor:
        """A device bool scalar: True when anything recorded since the last decision is
        non-finite. No host synchronisation; reading it is one."""
        return _any_nonfinite(self._pending + self._pending_bw)

    def nonfinite_code(self) -> Tensor:
        """A device float32 scalar: 2 when a forward value recorded since the last decision is
        non-finite, 1 when only gradients are, 0 when everything is finite. The largest code
        over ranks (an all-reduce max) says what the worst rank saw. No host synchronisation."""
        forward = _any_nonfinite(self._pending).float()
        backward = _any_nonfinite(self._pending_bw).float()
        return torch.maximum(2 * forward, backward.to(forward.device))

    def check(self) -> None:
        """Decide now (one host sync): raise if anything since the last decision is non-finite."""
        if bool(self.nonfinite_flag()):
            self.fail()
        self.accept()

    def accept(self) -> None:
        """Forget the statistics since the last decision (they were finite)."""
        self._history.extend(self._events[-self._history.maxlen :])  # type: ignore[misc]
        self._events = []
        self._pending = []
        self._pending_bw = []

    def fail(self, detected_by: Optional[Sequence[int]] = None, phase: Optional[str] = None) -> None:
        """Write the report and raise :class:`UnderflowOverflowError`.

        Args:
            detected_by: Ranks that found a non-finite value (default: this rank). When this
                rank is not among them, the report and the error say which rank found it.
            phase: The phase the other rank found it in (for the message only).
        """
        detected = [self.rank] if detected_by is None else list(detected_by)
        events = list(self._history) + self._events
        n_history = len(self._history)
        values = self._host_values(events)
        found = _culprit(events, values, n_history) if self.rank in detected else None
        first = found[:2] if found else None
        # Leave a clean state behind in case the caller catches the error and goes on.
        self._events, self._pending, self._pending_bw = [], [], []
        self._history.clear()
        if first is None:
            text = self._other_rank_section(events, values, detected, phase)
            path = self._append_log(text)
            raise UnderflowOverflowError(
                step=self.step, rank=self.rank, detected_by=detected, log_path=path, phase=phase
            )
        i, j = first
        blame = _blame(events[i], j, self._root_cls)
        if found[2]:  # an output made NaN from an Inf that came in (a fully masked softmax row)
            blame = blame[:3] + (
                f"Its {found[2]} held Inf (an attention mask, say) and its inputs held no NaN: an operation of "
                "this call made NaN from that Inf (a softmax over a row that is masked everywhere, inf - inf).",
            )
        value = _value_kind(*values[(i, j)])
        rows = _rows(events, values, i, j)
        text = self._failure_section(events[: i + 1], values, first, blame, value)
        path = self._append_log(text)
        culprit_path, culprit_cls, tensor, explanation = blame
        raise UnderflowOverflowError(
            step=events[i].step,
            rank=self.rank,
            detected_by=detected,
            log_path=path,
            phase=events[i].phase,
            module=culprit_path,
            module_type=culprit_cls,
            tensor=tensor,
            value=value,
            explanation=explanation,
            rows=rows,
        )

    # --------------------------------------------------------------------------- reports

    def _host_values(self, events: list[_Event]) -> dict[tuple[int, int], tuple[float, float]]:
        keys, tensors = [], []
        for i, ev in enumerate(events):
            for j, line in enumerate(ev.lines):
                keys.append((i, j))
                tensors.extend(line[2:4])
        flat = _to_host(tensors)
        return {k: (flat[2 * n], flat[2 * n + 1]) for n, k in enumerate(keys)}

    def write_trace(self) -> Path:
        """Write every frame recorded in the current (traced) step to the report, then forget
        them: a non-finite value seen while tracing does not stop training and does not
        affect later steps."""
        events = self._events
        values = self._host_values(events)
        found = _culprit(events, values, 0)
        first = found[:2] if found else None
        harmless = ""
        if first is None:
            # Nothing harmful, but say what was seen: the first non-finite output (an input
            # that is only an attention mask is not worth a line).
            first = next(((i, j) for i, ev in enumerate(events) for j, line in enumerate(ev.lines)
                          if line[1] != "input" and _value_kind(*values[(i, j)])), None)
            harmless = (" It did no harm: the model's outputs, the loss and the gradients stayed finite."
                        if first is not None else "")
        frames = _frames(events)
        head = f"=== step {self.step}: trace (trace_batch_nums), every frame, {len(frames)} frames ==="
        lines = [head]
        if first is not None:
            blame = _blame(events[first[0]], first[1], self._root_cls)
            lines.append(
                f"non-finite values seen in this step; the first: {_display(blame[0], blame[1])}, "
                f"{blame[2]} ({events[first[0]].phase}). Not aborting: the step is traced.{harmless}"
            )
        lines.extend(_render(frames, values, first, None))
        path = self._append_log("\n".join(lines) + "\n")
        self._history.clear()
        self.accept()
        return path

    def _failure_section(self, events, values, first, blame, value) -> str:
        i, j = first
        culprit_path, culprit_cls, tensor, explanation = blame
        ev = events[i]
        # The culprit's frame ends with the bad line: later lines of that hook are not part
        # of the story (e.g. the outputs of a module whose weight is bad).
        events = events[:i] + [_Event(ev.phase, ev.step, ev.micro, ev.kind, ev.call, ev.lines[: j + 1], ev.site)]
        frames = _frames(events)
        observed = _frame_module(frames[-1])
        extra = None
        if observed != culprit_path:
            extra = (culprit_path, culprit_cls, ev.phase, ev.step, ev.micro, explanation)
        # The frame holding the first non-finite line is always kept, even with
        # max_frames_to_save=1 and a culprit frame after it.
        keep = max(1, self.max_frames_to_save - (1 if extra else 0))
        frames = frames[-keep:]
        lines = [
            f"=== step {ev.step}, {ev.phase}: non-finite value ({value}) ===",
            f"culprit: {_display(culprit_path, culprit_cls)}",
            f"tensor:  {tensor}",
            f"why:     {explanation}" if explanation else "why:     it is the first non-finite value in execution order",
            f"frames:  the last {len(frames) + (1 if extra else 0)} in execution order, the culprit last",
            "",
        ]
        lines.extend(_render(frames, values, (len(events) - 1, j), extra, tensor))
        return "\n".join(lines) + "\n"

    def _other_rank_section(self, events, values, detected, phase) -> str:
        frames = _frames(events)[-self.max_frames_to_save :]
        others = ", ".join(str(r) for r in detected)
        lines = [
            f"=== step {self.step}: rank {others} found a non-finite value"
            f"{f' ({phase})' if phase else ''}; none on this rank (rank {self.rank}) ===",
            f"see underflow_overflow_rank{detected[0]}.log for the culprit; this rank's last {len(frames)} frames follow",
            "",
        ]
        lines.extend(_render(frames, values, None, None))
        return "\n".join(lines) + "\n"

    def _append_log(self, section: str) -> Path:
        if self._log_text is None:
            self._log_text = (
                f"stabletrain underflow/overflow report, rank {self.rank}\n"
                f"model: {self._root_cls}, {len(self._info)} modules watched, "
                f"backward {'included' if self.include_backward else 'not included'}\n"
                "columns: abs min and abs max of each tensor (nan/inf: non-finite), the tensor, "
                "its dtype and shape\n"
                "frames are in execution order; [forward]/[backward], step and microbatch in each header\n\n"
            )
        self._log_text += section + "\n"
        return atomic_write_text(self._log_text, self.log_path)


# --------------------------------------------------------------------------------------
# Attribution and rendering
# --------------------------------------------------------------------------------------


def _decisive(ev: _Event, line: _StatsRow) -> bool:
    """Whether a non-finite value in ``line`` does harm by itself: a weight, the loss, a
    gradient, or what the model returns."""
    role = line[1]
    if role in ("weight", "loss", "grad"):
        return True
    if role == "input":
        return len(line) > 8 and bool(line[8])  # the model's input data, unless a mask
    return role == "output" and ev.call is not None and ev.call.parent is None


def _culprit(
    events: list[_Event], values: dict[tuple[int, int], tuple[float, float]], start: int
) -> Optional[tuple[int, int, str]]:
    """``(event, line, inf_label)``: the line to blame among ``events[start:]``, or None when no
    value that does harm (see :func:`_decisive`) is non-finite. ``inf_label`` names the Inf
    input an output made NaN from (else "").

    In execution order: a non-finite weight, loss or gradient; a NaN given to the model; or the
    first non-finite module output that was not neutralised (every later module that took it
    returned finite values). For that output: a NaN (or Inf) that came in with the same kind is
    passed on, and blamed where it first appeared (the model's input: the data; else an input
    no module returned: the caller's own ops); a NaN made from an Inf input is the call's own.
    """
    def kind(i: int, j: int) -> Optional[str]:
        return _value_kind(*values[(i, j)])

    bad = [(i, j) for i in range(start, len(events)) for j in range(len(events[i].lines)) if kind(i, j)]
    if not any(_decisive(events[i], events[i].lines[j]) for i, j in bad):
        return None
    enters: dict[int, int] = {}
    exits: dict[int, int] = {}
    takers: dict[tuple, list[int]] = {}  # (id, version, shape, dtype) -> events that took it as input
    for i in range(start, len(events)):
        ev = events[i]
        if ev.call is not None and ev.kind in ("enter", "exit"):
            (enters if ev.kind == "enter" else exits)[id(ev.call)] = i
        if ev.kind == "enter":
            for line in ev.lines:
                if line[1] == "input":
                    takers.setdefault(_identity(line), []).append(i)

    def finite_exit(i_enter: int) -> bool:
        k = exits.get(id(events[i_enter].call))
        return k is not None and all(not kind(k, j) for j in range(len(events[k].lines)))

    def first_seen(i: int, j: int) -> tuple[int, int]:
        """The earliest input line carrying the same tensor (the model's own input, say)."""
        key = _identity(events[i].lines[j])
        for i2 in range(start, i + 1):
            for j2, line in enumerate(events[i2].lines):
                if line[1] == "input" and _identity(line) == key:
                    return i2, j2
        return i, j

    for i, j in bad:
        ev, line = events[i], events[i].lines[j]
        role = line[1]
        if role in ("weight", "loss", "grad"):
            return i, j, ""
        if role == "input":
            if len(line) > 8 and bool(line[8]):
                return i, j, ""  # a NaN/Inf in the data that is not a mask is never there on purpose
            continue
        # An output: neutralised when every later module that took it returned finite values.
        later = [k for k in takers.get(_identity(line), []) if k > i]
        if not _decisive(ev, line) and later and all(finite_exit(k) for k in later):
            continue
        k_in = enters.get(id(ev.call))
        ins = [] if k_in is None else [(k_in, jj) for jj, ln in enumerate(events[k_in].lines)
                                        if ln[1] == "input" and kind(k_in, jj)]
        same = [(a, b) for a, b in ins if kind(a, b) == kind(i, j)]
        if same:
            return (*first_seen(*same[0]), "")
        if kind(i, j) == "nan" and ins:
            return i, j, events[ins[0][0]].lines[ins[0][1]][0]
        return i, j, ""
    return None


def _identity(line: _StatsRow) -> tuple:
    return (line[7], line[4], line[5])


def _rows(
    events: list[_Event], values: dict[tuple[int, int], tuple[float, float]], i: int, j: int
) -> Optional[list[int]]:
    """Rows of the batch whose values are non-finite in line ``j`` of event ``i``: read from its
    tensor when still held unchanged with the batch as first dimension; when it was freed, from
    the first later tensor of the same pass that is (the bad rows travel with the samples,
    except through layers that mix samples, such as BatchNorm in training)."""
    call = events[i].call
    batch = call.batch if call is not None else None
    if batch is None:
        batch = next((ev.call.batch for ev in events[: i + 1] if ev.call is not None and ev.call.batch), None)
    if batch is None:
        return None
    candidates = [(i, j)] + [(k, m) for k in range(i + 1, len(events)) if events[k].phase == events[i].phase
                             for m in range(len(events[k].lines)) if _value_kind(*values[(k, m)])]
    for k, m in candidates:
        ref, ident = events[k].lines[m][6], events[k].lines[m][7]
        t = ref() if ref is not None else None
        if t is None or (ident is not None and t._version != ident[1]) or t.ndim == 0 or t.shape[0] != batch:
            continue
        with torch.no_grad():
            bad = ~torch.isfinite(t.detach()).reshape(batch, -1).all(1)
            return torch.nonzero(bad).flatten().tolist()
    return None


def _innermost(roles: list[tuple[_Call, str, str]], role: str) -> Optional[tuple[_Call, str, str]]:
    found = [r for r in roles if r[1] == role]
    return max(found, key=lambda r: r[0].depth) if found else None


def _outermost(roles: list[tuple[_Call, str, str]], role: str) -> Optional[tuple[_Call, str, str]]:
    found = [r for r in roles if r[1] == role]
    return min(found, key=lambda r: r[0].depth) if found else None


def _blame(ev: _Event, j: int, root_cls: str) -> tuple[str, str, str, str]:
    """(culprit path, culprit class, tensor, explanation) for line ``j`` of ``ev``."""
    label, role = ev.lines[j][0], ev.lines[j][1]
    if ev.kind == "grad":
        roles = ev.site.roles
        consumer = _innermost(roles, "input")
        if consumer is not None:
            call, _, in_label = consumer
            return call.path, call.cls, f"grad of {in_label}", (
                f"The gradient this module's backward sent to its {in_label} is the first non-finite value in backward."
            )
        producer = _outermost(roles, "output")
        inner = _innermost(roles, "output")
        assert producer is not None and inner is not None
        where = f"{inner[0].path} {inner[2]}" if inner[0].path else inner[2]
        if producer[0].parent is not None:
            parent = producer[0].parent
            return parent.path, parent.cls, f"grad of {where}", (
                f"No module took {where} as input: the backward of an operation in the own forward of "
                f"{_display(parent.path, parent.cls)} that used it made the gradient non-finite."
            )
        return "", root_cls, f"grad of {where}", (
            "The gradient of the model's output is non-finite: it comes from the backward of what used the "
            "output (the loss in training_step)."
        )
    call = ev.call
    assert call is not None
    if ev.kind == "param":
        return call.path, call.cls, label, f"The backward of this module made the gradient of its {label[8:]} non-finite."
    if role == "loss":
        return "", root_cls, "loss", "The model's outputs were finite; the loss computed from them is not."
    if role == "weight":
        return call.path, call.cls, label, "A weight of this module is non-finite."
    if role == "output":
        return call.path, call.cls, label, "The inputs and weights of this call were finite, its output is not."
    # A non-finite input nobody produced before: made by the caller's own ops.
    if call.parent is not None:
        parent = call.parent
        return parent.path, parent.cls, f"{call.path} {label}", (
            f"No module returned it: an operation in the own forward of {_display(parent.path, parent.cls)}, "
            f"between its child modules, made the {label} of {call.path}."
        )
    return call.path, call.cls, label, "The input given to the model is non-finite: check the batch."


class _Frame:
    __slots__ = ("phase", "step", "micro", "module", "cls", "suffix", "rows")

    def __init__(self, phase, step, micro, module, cls, suffix):
        self.phase, self.step, self.micro = phase, step, micro
        self.module, self.cls, self.suffix = module, cls, suffix
        self.rows: list[tuple[int, int, str, str]] = []  # (event index, line index, label, dtype[shape])


def _frame_module(frame: _Frame) -> str:
    return frame.module


def _grad_display(ev: _Event) -> tuple[_Call, str, list[str]]:
    """The module a gradient is shown under, its label, and the tensor's other roles."""
    roles = ev.site.roles
    main = _innermost(roles, "input") or _innermost(roles, "output")
    assert main is not None
    others = [f"{c.path or '<model>'} {lab}" for c, _, lab in roles if (c, lab) != (main[0], main[2])]
    return main[0], f"grad of {main[2]}", others


def _frames(events: list[_Event]) -> list[_Frame]:
    """Group events into frames: a module call whose inputs and outputs are adjacent is one
    frame; consecutive gradients shown under the same module are one frame."""
    frames: list[_Frame] = []
    prev: Optional[_Event] = None
    for i, ev in enumerate(events):
        if ev.kind == "grad":
            call, label, others = _grad_display(ev)
            if others:
                label += " (= " + ", ".join(others[:2]) + (", ..." if len(others) > 2 else "") + ")"
            labels = [label]
        else:
            call = ev.call
            labels = [line[0] for line in ev.lines]
        if (
            prev is not None
            and frames
            and ev.phase == prev.phase
            and frames[-1].module == call.path
            and frames[-1].step == ev.step
            and (
                (ev.kind == "exit" and prev.kind == "enter" and prev.call is ev.call)
                or (ev.phase == "backward")
            )
        ):
            frame = frames[-1]
            if ev.kind == "exit":
                frame.suffix = ""
        else:
            suffix = {"enter": "inputs", "exit": "outputs", "loss": "training_step", "grad": "", "param": ""}[ev.kind]
            frame = _Frame(ev.phase, ev.step, ev.micro, call.path, call.cls, suffix)
            frames.append(frame)
        for j, label in enumerate(labels):
            line = ev.lines[j]
            meta = f"{str(line[5]).replace('torch.', '')}{list(line[4])}"
            frame.rows.append((i, j, label, meta))
        prev = ev
    return frames


def _render(
    frames: list[_Frame],
    values: dict[tuple[int, int], tuple[float, float]],
    mark: Optional[tuple[int, int]],
    extra: Optional[tuple],
    extra_tensor: str = "",
) -> list[str]:
    out = [f"  {'abs min':>11} {'abs max':>11}  tensor"]
    for frame in frames:
        name = frame.module or "<model>"
        suffix = f" {frame.suffix}" if frame.suffix else ""
        micro = f".{frame.micro}" if frame.micro else ""
        out.append(f"[{frame.phase}] step {frame.step}{micro}  {name} ({frame.cls}){suffix}")
        for i, j, label, meta in frame.rows:
            amin, amax = values[(i, j)]
            flag = f"   <-- first non-finite ({_value_kind(amin, amax)})" if mark == (i, j) else ""
            out.append(f"  {fmt_column(amin)} {fmt_column(amax)}  {label:<24} {meta}{flag}")
    if extra is not None:
        path, cls, phase, step, micro, explanation = extra
        name = path or "<model>"
        m = f".{micro}" if micro else ""
        out.append(f"[{phase}] step {step}{m}  {name} ({cls}) own ops  <-- culprit")
        out.append(f"  {extra_tensor}: {explanation}")
    return out


# --------------------------------------------------------------------------------------
# The trainer's callback
# --------------------------------------------------------------------------------------


class UnderflowOverflowCallback:
    """``debug_args.underflow_overflow`` in ``stabletrain.train``.

    Attaches an :class:`UnderflowOverflowMonitor` to ``trainer.model`` (the user's module,
    so names carry no wrapper prefixes) and decides at two points every rank reaches, with
    ``trainer.max_over_ranks``: before the backward of the step's last microbatch (every forward
    of the step) and after the last backward (before clipping and the optimizer step). That
    is two host synchronisations per optimizer step, with or without gradient accumulation;
    the statistics of all microbatches stay on the device until then, so the first bad frame
    is found just the same. When any rank found a non-finite value, every rank writes its
    report and raises :class:`UnderflowOverflowError` at the same point, so none is left
    waiting in a collective.

    At each decision every rank contributes a code (2: a forward value is non-finite, 1: only
    a gradient is, 0: all finite) and the ranks agree on the largest. Under fp16 loss scaling
    a code of 1 is expected now and then (the GradScaler skips the step; with gradient
    accumulation the first decision can already see an earlier microbatch's gradients, and the
    step is judged once, at the second); the ``SCALER_PATIENCE``-th such step in a row is an
    error.
    """

    def __init__(self, args: Any):
        self.args = args
        self.monitor: Optional[UnderflowOverflowMonitor] = None
        self._skipped = 0

    def on_train_start(self, trainer: TrainerLike) -> None:
        a = self.args
        self.monitor = UnderflowOverflowMonitor(
            trainer.model,
            out_dir=Path(trainer.out) / "debug",
            rank=trainer.rank,
            max_frames_to_save=a.max_frames_to_save,
            trace_batch_nums=a.trace_batch_nums,
            include_backward=a.include_backward,
            auto_check=False,
        )
        trainer.console.info(
            f"underflow_overflow: watching {self.monitor.num_watched_modules} modules"
            f"{' forward and backward' if a.include_backward else ' (forward only)'}; "
            f"report: {self.monitor.log_path}"
        )

    def on_step_start(self, trainer: TrainerLike, *, step: int) -> None:
        assert self.monitor is not None
        self.monitor.set_step(step)

    def on_microbatch(self, trainer: TrainerLike, *, step: int, micro_step: int, batch: Any, indices: Any) -> None:
        assert self.monitor is not None
        self.monitor.micro_step = micro_step

    def on_before_backward(self, trainer: TrainerLike, *, step: int, micro_step: int, loss: Tensor) -> None:
        monitor = self.monitor
        assert monitor is not None
        monitor.record_loss(loss)
        if micro_step == trainer.settings.gradient_accumulation_steps - 1 and not monitor.tracing:
            self._decide(trainer, "forward")

    def on_after_backward(self, trainer: TrainerLike, *, step: int, grad_norm: Any) -> None:
        monitor = self.monitor
        assert monitor is not None
        if monitor.tracing:
            if monitor.has_records:
                monitor.write_trace()
        elif monitor.include_backward:
            self._decide(trainer, "backward")

    def on_after_optimizer_step(self, trainer: TrainerLike, *, step: int) -> None:
        stop = self.args.abort_after_batch_num
        if stop is not None and step >= stop:
            assert self.monitor is not None
            where = f"; traced steps are in {self.monitor.log_path}" if self.monitor.log_written else ""
            trainer.request_stop(
                f"debug_args.underflow_overflow.abort_after_batch_num={stop} reached{where}"
            )

    def _decide(self, trainer: TrainerLike, phase: str) -> None:
        monitor = self.monitor
        assert monitor is not None
        code = monitor.nonfinite_code()
        worst = int(trainer.max_over_ranks(code))  # the one host sync of this decision
        if worst == 0:
            monitor.accept()
            if phase == "backward":
                self._skipped = 0
            return
        if worst == 1 and trainer.scaler is not None:
            # Only scaled gradients are non-finite: the GradScaler will skip this step.
            if phase == "forward":
                # Gradients of earlier microbatches (gradient accumulation): keep their records
                # for the end of the step, which counts the skipped step once.
                return
            self._skipped += 1
            if self._skipped < SCALER_PATIENCE:
                monitor.accept()
                trainer.log_event({"event": "underflow_overflow_scaler_skip", "step": trainer.step, "in_a_row": self._skipped})
                return
        detected = ranks_with(code > 0, trainer.fabric)
        try:
            monitor.fail(detected_by=detected, phase="forward" if worst == 2 else "backward")
        except UnderflowOverflowError as exc:
            trainer.log_event({
                "event": "underflow_overflow", "step": exc.step, "phase": exc.phase or phase, "module": exc.module,
                "tensor": exc.tensor, "value": exc.value, "detected_by": exc.detected_by, "report": str(exc.log_path),
            })
            raise

    def _close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()

    def on_train_end(self, trainer: TrainerLike) -> None:
        self._close()

    def on_exception(self, trainer: TrainerLike, *, exception: BaseException) -> None:
        self._close()


def check_settings(settings: Any) -> list[str]:
    """Problems with ``debug_args.underflow_overflow`` given the other settings."""
    args = settings.debug_args.underflow_overflow
    problems = []
    if args.enabled and not settings.torch_compile_args.disable:
        problems.append(
            "debug_args.underflow_overflow.enabled: cannot be combined with torch_compile_args.disable=false "
            "(the monitor's per-module hooks and data-dependent checks do not run inside a compiled graph); "
            "set torch_compile_args.disable=true while debugging, or turn the monitor off"
        )
    return problems
