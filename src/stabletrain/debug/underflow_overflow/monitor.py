"""UnderflowOverflowMonitor: hooks on every module and parameter that record abs min/max on the
device, and the decision, once per forward and once per backward, whether anything went
non-finite. See ``docs/underflow_overflow.md``.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Iterator, NoReturn, Optional, Sequence

import torch
from torch import Tensor, nn

from stabletrain.distributed.norms import is_dtensor, local_tensor
from stabletrain.utils.dist import max_over_ranks, ranks_with
from stabletrain.utils.tree import named_tensors

from .attribution import Blame, blame, explain, find_culprit, first_nonfinite_shown, sample_rows
from .errors import UnderflowOverflowAbort, UnderflowOverflowError
from .records import MAX_DEPTH, Call, Event, GradSite, Role, StatsRow, Values, host_values, tensors_of
from .render import LogFile, failure_section, log_header, log_path, other_rank_section, trace_section
from .stats import Meter, any_nonfinite, check_abs_bits, unmasked_nonfinite, value_kind

__all__ = ["UnderflowOverflowMonitor"]

#: After a label whose statistics are of this rank's shard only (FSDP2 weight gradients).
SHARD = "[shard]"


def class_name(module: nn.Module) -> str:
    """The module's own class name: ``Block`` for the ``FSDPBlock`` that ``fully_shard`` makes of it."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = type(module)
    if fsdp is not None and isinstance(module, fsdp.FSDPModule):
        cls = next((b for b in cls.__bases__ if b is not fsdp.FSDPModule), cls)
    return cls.__name__


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
            decide together), or with :meth:`check_all_ranks` in a plain multi-process loop.

    Under FSDP2 create it after ``fully_shard`` (see ``docs/underflow_overflow.md``, Under FSDP2).

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
        self._root_cls = class_name(model)
        self._handles: list[Any] = []
        self._stack: list[Call] = []
        self._events: list[Event] = []
        self._pending: list[Tensor] = []  # abs max of everything forward since the last decision
        self._pending_bw: list[Tensor] = []  # ... and of every gradient
        self._history: deque[Event] = deque(maxlen=4 * max_frames_to_save + 8)
        self._grad_sites: dict[int, GradSite] = {}
        self._bw_queued = False
        self._meter = Meter()
        self._modules: dict[int, tuple[str, str, list[str]]] = {}
        self._params_checked = False
        #: FSDP2 (parameters are DTensors): weights are read unsharded at hook time and measured at
        #: every call, weight gradients are this rank's shard. See ``docs/underflow_overflow.md``.
        self.sharded = any(is_dtensor(p) for p in model.parameters())
        for device in {torch.device("cpu"), *(p.device for p in model.parameters())}:
            check_abs_bits(device)  # once, here rather than in the first step (stats.py)
        self._attach()
        header = log_header(rank, self._root_cls, len(self._modules), include_backward, sharded=self.sharded)
        self._log = LogFile(self.log_path, header)

    # ------------------------------------------------------------------ hooks in and out

    def _attach(self) -> None:
        for path, module in self.model.named_modules():
            own = [n for n, _ in module.named_parameters(recurse=False)]
            self._modules[id(module)] = (path, class_name(module), own)
            self._handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._handles.append(
                module.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)
            )
        if not self.include_backward:
            return
        seen: set[int] = set()
        for path, module in self.model.named_modules():
            owner = Call(path, class_name(module), None, id(module))
            for name, p in module.named_parameters(recurse=False):
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                if self.sharded and is_dtensor(p):
                    # FSDP2: autograd runs through unsharded copies, so a hook on the parameter
                    # never fires; this one does, once the reduce-scatter has filled p.grad.
                    hook = functools.partial(self._on_sharded_grad, owner, name)
                    self._handles.append(p.register_post_accumulate_grad_hook(hook))
                else:
                    hook = functools.partial(self._on_param_grad, owner, name, tuple(p.shape), p.dtype)
                    self._handles.append(p.register_hook(hook))

    def _check_parameters(self) -> None:
        """Once, outside a forward: the model was not sharded after the monitor was created
        (``fully_shard`` replaces every parameter, so the gradient hooks would never fire and
        the weights' cache would go stale)."""
        self._params_checked = True
        if not self.sharded and any(is_dtensor(p) for p in self.model.parameters()):
            raise ValueError(
                "UnderflowOverflowMonitor: the model's parameters became DTensors after the monitor was created "
                "(fully_shard, or fabric.setup_module with FSDP), so their gradients would go unwatched. "
                "Create the monitor after sharding the model: after fully_shard / fabric.setup_module."
            )

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
            self._meter.release()
            self._grad_sites.clear()

    def __enter__(self) -> UnderflowOverflowMonitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------ accessors

    @property
    def num_watched_modules(self) -> int:
        """Modules with hooks: every module of the model, the model itself included."""
        return len(self._modules)

    @property
    def has_records(self) -> bool:
        """Whether the hooks recorded values since the last decision (:meth:`accept`,
        :meth:`fail`) or the last trace written (:meth:`write_trace`)."""
        return bool(self._events)

    @property
    def log_written(self) -> bool:
        """Whether this monitor has written its log (:attr:`log_path`) yet."""
        return self._log.written

    # ---------------------------------------------------------------------- step control

    def set_step(self, step: int) -> None:
        """Call at the start of each step. Writes the previous step's trace if it was traced.

        Raises:
            UnderflowOverflowAbort: ``step`` is past ``abort_after_batch_num``.
        """
        if self._stepped and step == self.step:
            return
        if not self._params_checked:
            self._check_parameters()
        if self.tracing and self._events:
            self.write_trace()
        if self.abort_after_batch_num is not None and step > self.abort_after_batch_num:
            raise UnderflowOverflowAbort(self.abort_after_batch_num, self.log_path)
        self._stepped = True
        self.step = step
        self.micro_step = 0
        self.tracing = step in self.trace_batch_nums

    # --------------------------------------------------------------------------- forward

    def _stats_row(self, label: str, role: str, t: Tensor, decisive: bool = True) -> Optional[StatsRow]:
        """A row of the log for ``t``; a ``decisive`` one takes part in the decision."""
        if not t.is_floating_point() or t.numel() == 0 or t.is_sparse:
            return None
        if role == "weight":
            # FSDP2 keeps the version counter of its unsharded weights across steps, so the
            # per-change cache could return a stale value: measure them at every call.
            amin, amax = self._meter.stats(t) if self.sharded else self._meter.weight(t)
            ref = None
        else:
            amin, amax, ref = self._meter.measure(t)
        if decisive:
            self._pending.append(amax)
        # The reference and (id, version) let a report find the samples and who consumed the tensor.
        return StatsRow(label, role, amin, amax, tuple(t.shape), t.dtype, ref, (id(t), t._version))

    def _data_flag(self, t: Tensor) -> Tensor:
        """A device bool: does the model's input ``t`` hold a NaN/Inf that is not an additive
        mask? It takes part in the decision, without a sync."""
        with torch.no_grad():
            flag = unmasked_nonfinite(t)
            self._pending.append(torch.where(flag, float("inf"), 0.0).to(torch.float32))
        return flag

    def _watch_grad(self, t: Tensor, call: Call, role: str, label: str) -> None:
        key = id(t)
        version = t._version
        site = self._grad_sites.get(key)
        if site is not None and site.ref() is t and site.version == version:
            site.roles.append(Role(call, role, label))
            return
        site = GradSite(weakref.ref(t), version, tuple(t.shape), t.dtype)
        site.roles.append(Role(call, role, label))
        try:
            t.register_hook(functools.partial(self._on_grad, site))
        except RuntimeError:  # e.g. a tensor that cannot have hooks; nothing to watch
            return
        self._grad_sites[key] = site

    def _input_rows(self, call: Call, args: tuple, kwargs: dict, watch: bool) -> list[StatsRow]:
        lines: list[StatsRow] = []
        tensors: Iterable[tuple[str, Tensor]]
        if not kwargs and len(args) == 1 and isinstance(args[0], Tensor):
            tensors = (("input[0]", args[0]),)  # the common call, without walking containers
        else:
            tensors = list(tensors_of(args, "input"))
            if kwargs:
                tensors.extend(tensors_of(kwargs, "input"))
        for label, t in tensors:
            # Inputs do not decide: an Inf handed to a module (an attention mask) is harmful
            # only if it comes out of it, which its outputs show. Except in the data.
            line = self._stats_row(label, "input", t, decisive=False)
            if line is None:
                continue
            if call.parent is None:
                line = line._replace(data_flag=self._data_flag(t))
            lines.append(line)
            if watch and t.requires_grad:
                self._watch_grad(t, call, "input", label)
        return lines

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._closed:
            return None
        path, cls, params = self._modules[id(module)]
        call = Call(path, cls, self._stack[-1] if self._stack else None, id(module))
        if call.parent is None:
            first = next((t for t in named_tensors((args, kwargs), "", max_depth=MAX_DEPTH) if t[1].ndim), None)
            call.batch = int(first[1].shape[0]) if first is not None else None
        self._stack.append(call)
        watch = self.include_backward and torch.is_grad_enabled()
        # No no_grad() here: the statistics are taken of detached tensors (Meter.stats).
        lines = [row for name, p in self._weights(module, params)
                 if (row := self._stats_row(name, "weight", p)) is not None]
        lines.extend(self._input_rows(call, args, kwargs, watch))
        if lines:
            self._events.append(Event("forward", self.step, self.micro_step, "enter", call, lines))
        return None

    def _weights(self, module: nn.Module, names: list[str]) -> Iterator[tuple[str, Tensor]]:
        """``(label, tensor)`` of ``module``'s own weights as they are now: inside an FSDP2 forward
        the unsharded parameters, not the sharded ones hooked in ``__init__``."""
        for name in names:
            p = module._parameters.get(name)
            if p is None:
                continue
            if is_dtensor(p):  # not unsharded (a module run outside its FSDP root): this rank's part
                yield f"{name} {SHARD}", local_tensor(p)
            else:
                yield name, p

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._closed or not self._stack or self._stack[-1].mid != id(module):
            return None  # attached in the middle of a forward
        call = self._stack.pop()
        watch = self.include_backward and torch.is_grad_enabled()
        lines = []
        for label, t in tensors_of(output, "output"):
            # What the model returns decides: a NaN/Inf inside that never reaches it was
            # neutralised (a masked softmax). The log still finds where it began.
            line = self._stats_row(label, "output", t, decisive=call.parent is None)
            if line is not None:
                lines.append(line)
                if watch and t.requires_grad:
                    self._watch_grad(t, call, "output", label)
        if lines:
            self._events.append(Event("forward", self.step, self.micro_step, "exit", call, lines))
        if not self._stack:  # the outermost call returned: this forward is complete
            self._meter.end_forward()
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
        line = self._stats_row("loss", "loss", loss.detach())
        if line is not None:
            call = Call("", self._root_cls, None, id(self.model))
            self._events.append(Event("forward", self.step, self.micro_step, "loss", call, [line]))

    # -------------------------------------------------------------------------- backward

    def _backward_event(self, event: Event, amax: Tensor) -> None:
        self._pending_bw.append(amax)
        self._events.append(event)
        if self.auto_check and not self.tracing and not self._bw_queued:
            # One decision at the end of this backward pass, however many hooks fire.
            self._bw_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_grad(self, site: GradSite, grad: Tensor) -> None:
        if self._closed or grad is None or not grad.is_floating_point() or grad.numel() == 0:
            return None
        amin, amax, ref = self._meter.measure(grad)  # the same gradient reaches several hooks: once
        line = StatsRow("grad", "grad", amin, amax, tuple(grad.shape), grad.dtype, ref, None)
        self._backward_event(Event("backward", self.step, self.micro_step, "grad", None, [line], site), amax)
        return None

    def _on_param_grad(self, owner: Call, name: str, shape: tuple, dtype: torch.dtype, grad: Tensor) -> None:
        if self._closed or grad is None or grad.numel() == 0 or grad.is_sparse:
            return None
        amin, amax, _ = self._meter.measure(grad)
        line = StatsRow(f"grad of {name}", "grad", amin, amax, tuple(grad.shape), grad.dtype, None, None)
        self._backward_event(Event("backward", self.step, self.micro_step, "param", owner, [line]), amax)
        return None

    def _on_sharded_grad(self, owner: Call, name: str, param: Tensor) -> None:
        grad = param.grad
        if self._closed or grad is None:
            return None
        local = local_tensor(grad)
        if local.numel() == 0 or local.is_sparse:  # a rank whose shard of a small tensor is empty
            return None
        amin, amax = self._meter.stats(local)
        line = StatsRow(f"grad of {name} {SHARD}", "grad", amin, amax, tuple(local.shape), local.dtype, None, None)
        self._backward_event(Event("backward", self.step, self.micro_step, "param", owner, [line]), amax)
        return None

    def _end_of_backward(self) -> None:
        self._bw_queued = False
        if not self._closed and not self.tracing:
            self.check()

    # -------------------------------------------------------------------------- deciding

    def nonfinite_flag(self) -> Tensor:
        """A device bool scalar: True when anything recorded since the last decision is
        non-finite. No host synchronisation; reading it is one."""
        return any_nonfinite(self._pending + self._pending_bw)

    def nonfinite_code(self) -> Tensor:
        """A device float32 scalar: 2 when a forward value recorded since the last decision is
        non-finite, 1 when only gradients are, 0 when everything is finite. The largest code
        over ranks (an all-reduce max) says what the worst rank saw. No host synchronisation."""
        forward = any_nonfinite(self._pending).float()
        backward = any_nonfinite(self._pending_bw).float()
        return torch.maximum(2 * forward, backward.to(forward.device))

    def check(self) -> None:
        """Decide now (one host sync): raise if anything since the last decision is non-finite."""
        if bool(self.nonfinite_flag()):
            self.fail()
        self.accept()

    def check_all_ranks(self, fabric: Any = None) -> None:
        """Decide together with the other ranks (every rank must call it at the same point, with
        ``auto_check=False``): one all-reduce and one host sync; when any rank found a non-finite
        value, every rank writes its report and raises :class:`UnderflowOverflowError`, and the
        error says which ranks found it. Works with a Lightning ``fabric``, an initialised
        ``torch.distributed`` process group, or a single process.
        """
        code = self.nonfinite_code()
        worst = max_over_ranks(code, fabric)
        if worst == 0:
            self.accept()
            return
        self.fail(detected_by=ranks_with(code > 0, fabric), phase="forward" if worst == 2 else "backward")

    def accept(self) -> None:
        """Forget the statistics since the last decision (they were finite)."""
        self._history.extend(self._events[-(self._history.maxlen or 0) :])
        self._events = []
        self._pending = []
        self._pending_bw = []

    def fail(self, detected_by: Optional[Sequence[int]] = None, phase: Optional[str] = None) -> NoReturn:
        """Write the report and raise :class:`UnderflowOverflowError`.

        Args:
            detected_by: Ranks that found a non-finite value (default: this rank). When this
                rank is not among them, the report and the error say which rank found it.
            phase: The phase the other rank found it in (for the message only).
        """
        detected = [self.rank] if detected_by is None else list(detected_by)
        events = list(self._history) + self._events
        values = host_values(events)
        found = find_culprit(events, values, len(self._history)) if self.rank in detected else None
        # Leave a clean state behind in case the caller catches the error and goes on.
        self._events, self._pending, self._pending_bw = [], [], []
        self._history.clear()
        if found is None:
            section = other_rank_section(self.step, self.rank, events, values, detected, phase, self.max_frames_to_save)
            raise UnderflowOverflowError(
                step=self.step, rank=self.rank, detected_by=detected, log_path=self._log.append(section), phase=phase
            )
        self._raise_culprit(events, values, (found.event, found.line), explain(events, found, self._root_cls), detected)

    def _raise_culprit(
        self, events: list[Event], values: Values, at: tuple[int, int], culprit: Blame, detected: list[int]
    ) -> NoReturn:
        i, j = at
        value = value_kind(*values[at])
        rows = sample_rows(events, values, i, j)
        section = failure_section(events[: i + 1], values, at, culprit, value, self.max_frames_to_save)
        raise UnderflowOverflowError(
            step=events[i].step,
            rank=self.rank,
            detected_by=detected,
            log_path=self._log.append(section),
            phase=events[i].phase,
            module=culprit.module,
            module_type=culprit.module_type,
            tensor=culprit.tensor,
            value=value,
            explanation=culprit.explanation,
            rows=rows,
        )

    # --------------------------------------------------------------------------- traces

    def write_trace(self) -> Path:
        """Write every frame recorded in the current (traced) step to the report, then forget
        them: a non-finite value seen while tracing does not stop training and does not
        affect later steps."""
        events = self._events
        values = host_values(events)
        found = find_culprit(events, values, 0)
        at = (found.event, found.line) if found else first_nonfinite_shown(events, values)
        seen = blame(events[at[0]], at[1], self._root_cls) if at else None
        path = self._log.append(trace_section(self.step, events, values, at, seen, harmful=found is not None))
        self._history.clear()
        self.accept()
        return path
