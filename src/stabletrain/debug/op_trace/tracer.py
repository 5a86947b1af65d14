"""Op-level tracing with provenance: where a harmful NaN or Inf is born, in forward or backward.

:class:`OpTracer` (a ``TorchDispatchMode`` plus module hooks) checks every aten op's output and
keeps, per tensor storage, where each NaN/Inf was born and what it came from;
:func:`trace_first_nonfinite` runs one step under it and reports the value that does harm (a
non-finite loss or gradient) with its chain of origins and the batch rows. Slow: for one captured
step, not for training. See docs/diagnose.md and
docs/accuracy.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from stabletrain.debug.op_trace.bad_op import OUTSIDE, BadInput, BadOp
from stabletrain.debug.op_trace.findings import NAN, NEGINF, POSINF, OpFinding
from stabletrain.debug.op_trace.ops import (
    CONSTANT_OPS,
    UNINITIALISED_OPS,
    copy_written,
    is_float,
    kind_mask,
    magnitude,
    nonfinite_kinds,
    writes_in_place,
)
from stabletrain.debug.op_trace.provenance import Provenance


class _Tracer(TorchDispatchMode):
    def __init__(self, owner: "OpTracer"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        owner = self.owner
        watching = owner.finding is None and owner.armed
        # An in-place op overwrites its input: keep a copy, so the report shows the input as
        # it was (finite) rather than the op's own non-finite result.
        before = copy_written(func, args, kwargs) if watching and writes_in_place(func) else None
        out = func(*args, **kwargs)
        owner.op_count += 1
        if watching:
            owner.inspect(func, args, kwargs, out, before=before)
        return out

class OpTracer:
    """Context manager that traces where NaN/Inf values are born and reports the first one
    that does harm (see the module docstring).

    Args:
        model: The module whose submodule names are reported.
        check_backward: Also trace the backward pass (needs anomaly mode for source lines).
        armed: Inspect ops from the start; with False, ops are only counted until
            :meth:`arm` is called (e.g. a replay arms it once the captured state is loaded,
            so that restoring non-finite weights is not reported as the failing op).

    Example::

        with OpTracer(model) as tracer:
            tracer.watch_batch(batch)             # optional: name the data and its rows
            loss = model.training_step(batch)
            tracer.check_loss(loss)               # a non-finite loss is reported with its origin
            loss.backward()                       # ... else the first non-finite gradient
        print(tracer.finding.describe() if tracer.finding else "all finite")
    """

    def __init__(self, model: nn.Module, check_backward: bool = True, armed: bool = True):
        self.model = model
        self.check_backward = check_backward
        self.armed = armed
        self.finding: Optional[OpFinding] = None
        self.op_count = 0
        #: Samples in the traced batch (from :meth:`watch_batch` or the model's first input).
        self.batch_size: Optional[int] = None
        self.module_stack: list[tuple[str, str]] = []
        # Autograd nodes are tagged in their own metadata (not by id(): ids of freed nodes are reused).
        self.node_key = f"stabletrain.op_trace.owner.{id(self)}"
        self._handles: list[Any] = []
        self._anomaly: Any = None
        self._mode: Optional[_Tracer] = None
        #: Where each non-finite value seen so far came from, per storage.
        self.provenance = Provenance()
        self._first_nan: Optional[OpFinding] = None
        self._loss_checked = False

    # -- what the tensors are ----------------------------------------------------------
    def arm(self) -> None:
        """Start inspecting ops (see ``armed``)."""
        self.armed = True
        self._register_model()

    def _register_model(self) -> None:
        # Registered when armed: a replay replaces the parameters' storages before that.
        for name, p in self.model.named_parameters():
            self.provenance.know(p, "weight", name)
        for name, b in self.model.named_buffers():
            self.provenance.know(b, "buffer", name)

    def watch_batch(self, batch: Any, prefix: str = "batch") -> None:
        """Name the tensors of ``batch`` (as ``batch['x']``) for NaN/Inf found in them, and
        take its first dimension as the batch for per-sample rows."""
        leaves, _ = tree_flatten_with_path(batch)
        for path, t in leaves:
            if isinstance(t, torch.Tensor):
                if self.batch_size is None and t.ndim:
                    self.batch_size = int(t.shape[0])
                self.provenance.know(t, "data", prefix + keystr(path))

    def batch_rows(self, t: torch.Tensor, kind: Optional[str] = None) -> Optional[list[int]]:
        """Rows of the batch where ``t`` holds non-finite values (of ``kind``), when ``t`` has a
        batch dimension first (or the batch flattened with heads or tokens, batch-major)."""
        n = self.batch_size
        if not n or t.ndim == 0 or t.shape[0] % n:
            return None
        if t.dtype == torch.bool:  # already the mask of bad elements
            bad = t
        else:
            bad = kind_mask(t, kind) if kind else ~torch.isfinite(magnitude(t.detach()))
        per_row = bad.reshape(t.shape[0], -1).any(1).nonzero().flatten()
        return sorted(set((per_row // (t.shape[0] // n)).tolist()))

    # -- module tracking -----------------------------------------------------------
    def _pre(self, name: str, type_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not self.module_stack and self.batch_size is None:
                leaves = tree_flatten((args, kwargs))[0]
                first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.ndim), None)
                if first is not None:
                    self.batch_size = int(first.shape[0])
            if not self.module_stack and self.armed:
                # What the outermost module is given and no traced op made is its input data.
                for i, a in enumerate(args):
                    for t in tree_flatten(a)[0]:
                        if isinstance(t, torch.Tensor):
                            self.provenance.know(t, "data", f"input[{i}]")
                for k, v in kwargs.items():
                    for t in tree_flatten(v)[0]:
                        if isinstance(t, torch.Tensor):
                            self.provenance.know(t, "data", f"input[{k!r}]")
            # What fed this module was computed by whoever runs now: the parent's forward, or
            # nobody's when it is called from training_step or the loop. Claim it so before this
            # module's post-hook can take it.
            if self.check_backward:
                self._claim_nodes((args, kwargs), self.module_stack[-1] if self.module_stack else OUTSIDE)
            self.module_stack.append((name, type_name))

        return hook

    def _post(self, name: str, type_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self.module_stack and self.module_stack[-1][0] == name:
                self.module_stack.pop()
            if self.check_backward:
                self._claim_nodes(output, (name, type_name))

        return hook

    def _claim_nodes(self, output: Any, owner: tuple[str, str]) -> None:
        """Give the not-yet-owned autograd nodes behind ``output`` to ``owner`` (innermost first)."""
        leaves, _ = tree_flatten(output)
        todo = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        key = self.node_key
        while todo:
            node = todo.pop()
            if node is None:
                continue
            meta = cast(dict, node.metadata)  # a dict (the stubs say a method)
            if key in meta:
                continue
            meta[key] = owner
            todo.extend(n for n, _ in node.next_functions if n is not None)

    # -- op inspection ---------------------------------------------------------------
    def inspect(self, func: Any, args: Any, kwargs: Any, out: Any, before: Any = None) -> None:
        """Trace the origins of ``func``'s non-finite outputs; report the first harmful one.

        Args:
            func, args, kwargs, out: The op, its arguments and what it returned.
            before: For an in-place op, ``(args, kwargs)`` with the written tensors as they were.
        """
        name = func.__name__.split(".")[0]
        if name in UNINITIALISED_OPS:
            return
        outs = [t for t in tree_flatten(out)[0] if is_float(t)]
        bad = [t for t in outs if not bool(torch.isfinite(t).all())]
        if not bad:
            return  # finite: whatever Inf came in was neutralised here
        op = BadOp(self, func, args, kwargs, before)
        inputs = []
        if name not in CONSTANT_OPS:
            for now, was in zip(op.flat_now, op.flat_was):
                if is_float(was) and not bool(torch.isfinite(was).all()):
                    inputs.append(BadInput(now, was))
        first: Optional[dict[str, OpFinding]] = None
        for t in bad:
            origins = self.provenance.output_origins(op, t, inputs)
            self.provenance.record(t, origins)
            first = first or origins
            if self._first_nan is None and NAN in origins:
                self._first_nan = origins[NAN]
        if op.in_backward and first:
            # A non-finite value in the backward pass is a non-finite gradient.
            self._report(first, "gradient")

    def _report(self, origins: dict[str, OpFinding], reached: str) -> None:
        f = origins.get(NAN) or origins.get(POSINF) or origins.get(NEGINF)
        if f is None or self.finding is not None:
            return
        if f.cause is not None and not f.cause.deliberate:
            f = f.cause  # the Inf (an overflow, log(0), a bad input) did the harm, the NaN followed
        self.finding = dataclasses.replace(f, reached=reached)

    def check_loss(self, loss: Any) -> None:
        """Report the origin of a non-finite ``loss`` (the harm done in the forward pass)."""
        self._loss_checked = True
        if self.finding is not None or not self.armed or not is_float(loss):
            return
        if bool(torch.isfinite(loss).all()):
            return
        origins = self.provenance.origins(loss)
        if origins:
            self._report({k: origins[k] for k in nonfinite_kinds(loss) if k in origins} or origins, "loss")

    # -- context manager -------------------------------------------------------------
    def __enter__(self) -> "OpTracer":
        for name, module in self.model.named_modules():
            type_name = type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._pre(name, type_name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name, type_name), with_kwargs=True))
        if self.armed:
            self._register_model()
        if self.check_backward:
            self._anomaly = torch.autograd.set_detect_anomaly(True, check_nan=False)
            self._anomaly.__enter__()
        self._mode = _Tracer(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        if self._anomaly is not None:
            self._anomaly.__exit__(*exc)
            self._anomaly = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.finding is None and not self._loss_checked and self._first_nan is not None:
            self.finding = self._first_nan  # no loss to judge harm by: a NaN born is one
        self.provenance.clear()

    def claim_remaining(self, output: Any, name: str = "", type_name: str = "") -> None:
        """Give nodes created outside every module (e.g. a loss in training_step) an explicit
        owner; nodes left unclaimed are reported with ``outside_forward=True``."""
        if self.check_backward:
            self._claim_nodes(output, (name, type_name or type(self.model).__name__))

def trace_first_nonfinite(
    model: nn.Module,
    forward: Callable[[], torch.Tensor],
    backward: bool = True,
    batch: Any = None,
) -> tuple[Optional[OpFinding], Optional[torch.Tensor]]:
    """Run ``forward()`` (which returns a scalar loss), then its backward, under op tracing.

    Args:
        model: The model whose module names are reported.
        forward: Runs the forward pass and returns the loss.
        backward: Also run and trace ``loss.backward()``.
        batch: The batch ``forward`` uses, if any: NaN/Inf in it are named as the data, and its
            first dimension gives the rows (samples) of findings (see :meth:`OpTracer.watch_batch`).

    Returns:
        ``(finding or None, loss)``: the origin of a non-finite loss, else of the first
        non-finite value in the backward pass.
    """
    with OpTracer(model, check_backward=backward) as tracer:
        if batch is not None:
            tracer.watch_batch(batch)
        loss = forward()
        tracer.check_loss(loss)
        if backward and isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    return tracer.finding, loss
