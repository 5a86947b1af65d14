"""nancapture: stop at the first non-finite step and capture it for offline replay.

After every gradient-accumulation cycle (gradients final and un-scaled, before clipping
and the optimizer step) the monitor decides whether the step went bad. On detection it
writes ``<out>/debug/nan_capture/rank{rank}/nan_capture.pt`` atomically and raises
:class:`NaNDetectedError`, whose message holds a replay command that works when pasted
into a shell (paths quoted), or, when no command can build your model (a constructor with
required arguments, a class defined inside a function), a Python template that says what
to fill in. :func:`stabletrain.load_nan_capture` reads the file back and ``.replay()``
reruns the step (see :mod:`stabletrain.debug.replay`).

What counts as a failure:

* any gradient element is NaN, +Inf or -Inf; detected from the total gradient norm the
  trainer already computes (a finite L2 norm means every gradient element is finite), so
  the common case costs no extra pass over the gradients;
* every gradient element is finite but the float32 gradient norm overflows (an element
  above about 1.8e19, whose square exceeds float32's 3.4e38): the reason is
  ``gradient_norm_overflow``, told apart from NaN/Inf elements only once the norm is found
  non-finite. An optimizer step with such gradients is huge (SGD) or puts Inf into the
  optimizer state (Adam's average of squared gradients), and clipping would divide by an
  infinite norm, so this step is captured too;
* a microbatch loss is non-finite;
* under fp16 loss scaling, non-finite gradients alone are expected (the GradScaler skips
  the step and lowers its scale); the monitor captures only when the loss itself is
  non-finite or when ``max_skipped_steps`` steps in a row were skipped. Which steps the
  scaler skips is read from the scaler itself (its per-device found-inf flags after
  ``unscale_``), so finite gradients whose norm overflows, which the scaler would apply,
  are captured at once.

Cost per optimizer step while nothing is wrong (see ``benchmarks/nancapture_overhead.py``):

* one host synchronisation: the failure flag is reduced over ranks (``any_rank``) and read
  once; every rank therefore stops at the same step, and no rank waits in a collective
  for one that raised;
* no copy of the batch: the monitor keeps references to the step's microbatches (the
  trainer never modifies a batch in place; a plain loop that does passes
  ``copy_batches=True`` for a device-side copy) and lets go of them once the step is
  found healthy, so at most one step's microbatches are held;
* no copy of the parameters: at detection time the optimizer has not stepped, so the
  parameters are still those the step started from. Buffers do change during the forward
  pass (BatchNorm running statistics), so the persistent buffers are copied on the device
  at the start of each step (none in the built-in language model, a few KB in a CNN);
* the RNG states (torch CPU and CUDA, NumPy, Python) of each microbatch, taken just before
  its forward pass, kept as the objects the RNGs return (a few KB) and converted to the
  file format only on capture.

The capture holds only tensors, numbers, strings, lists, tuples and dicts, plus a format
name and version, so it loads with ``torch.load(weights_only=True)`` and never runs code.

In a plain PyTorch loop::

    from stabletrain import NaNCaptureMonitor

    monitor = NaNCaptureMonitor(model, out_dir="out/debug/nan_capture", step_fn=my_step_fn)
    for step in range(steps):
        monitor.begin_step(step)                  # before the first forward of the step
        for batch in microbatches_of(step):
            monitor.collect_batch(batch)          # just before the forward pass
            loss = my_step_fn(model, batch)
            monitor.collect_loss(loss)            # optional: losses go into the capture
            (loss / len(microbatches)).backward()
        monitor.check_and_capture()               # raises NaNDetectedError; before optimizer.step()
        optimizer.step()
        optimizer.zero_grad()
"""

from __future__ import annotations

import datetime
import inspect
import math
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from stabletrain.debug.grad_norm import GradNorm, compute_grad_norm
from stabletrain.errors import StabletrainError
from stabletrain.events import TrainerLike
from stabletrain.utils.dist import any_rank as dist_any_rank
from stabletrain.utils.dist import rank_and_world_size
from stabletrain.utils.io import atomic_torch_save
from stabletrain.utils.rng import raw_rng_state, storable_rng_state
from stabletrain.utils.text import MEASURED_DIGITS, abs_path, fmt_list, fmt_number, shell_path
from stabletrain.utils.tree import cpu_copy, detached_copy, to_storable

#: The ``format`` entry of every capture file, and the newest ``version`` this code writes and reads.
FORMAT = "stabletrain.nan_capture"
VERSION = 1
FILE_NAME = "nan_capture.pt"

#: Why a capture was taken (the ``reason`` entry).
REASON_GRADIENTS = "nonfinite_gradients"
REASON_LOSS = "nonfinite_loss"
REASON_SKIPPED = "skipped_steps"
REASON_OTHER_RANK = "other_rank"
REASON_NORM_OVERFLOW = "gradient_norm_overflow"

__all__ = [
    "NaNCaptureMonitor",
    "NaNDetectedError",
    "NaNCaptureError",
    "NaNCaptureCallback",
    "FORMAT",
    "VERSION",
    "FILE_NAME",
]


class NaNCaptureError(StabletrainError):
    """A capture cannot be written, found, read or replayed; the message says why.

    Attributes:
        path: The file or folder concerned, when there is one.
    """

    def __init__(self, message: str, path: Optional[str | Path] = None):
        super().__init__(message)
        self.path = None if path is None else Path(path)

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.path))


class NaNDetectedError(StabletrainError):
    """A training step produced non-finite gradients or losses; the step was captured.

    Raised before clipping and the optimizer step, so no non-finite value reached the
    parameters, the optimizer state or a checkpoint.

    Attributes:
        step: The optimizer step that failed (numbered from 0).
        rank: The process that raised (every rank raises at the same step).
        nan_param_names: Parameters whose gradient holds a NaN or Inf on this rank (empty
            for ``"gradient_norm_overflow"``: every element is finite).
        capture_path: The capture file, ``.../nan_capture/rank{rank}/nan_capture.pt``.
        reason: ``"nonfinite_gradients"``, ``"nonfinite_loss"``, ``"gradient_norm_overflow"``
            (every gradient element finite, but so large that the float32 gradient norm
            overflows), ``"skipped_steps"`` (fp16 loss scaling skipped ``max_skipped_steps``
            steps in a row) or ``"other_rank"``.
        replay_command: A shell command that replays the capture; or, when no command can
            rebuild your model (its class needs constructor arguments or is not defined at
            the top level of a file), a Python template with a line marked ``FILL IN``.

    Example::

        try:
            stabletrain.train(out="out/boom", debug_args={"nancapture": {"enabled": True}}, ...)
        except stabletrain.NaNDetectedError as err:
            result = stabletrain.load_nan_capture(err.capture_path).replay()
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        rank: int,
        nan_param_names: Sequence[str],
        capture_path: str | Path,
        reason: str = REASON_GRADIENTS,
        replay_command: str = "",
    ):
        super().__init__(message)
        self.step = step
        self.rank = rank
        self.nan_param_names = list(nan_param_names)
        self.capture_path = Path(capture_path)
        self.reason = reason
        self.replay_command = replay_command

    def __reduce__(self) -> Any:
        # Picklable across processes despite the keyword-only constructor.
        return (
            _rebuild_nan_detected_error,
            (str(self), self.step, self.rank, self.nan_param_names, str(self.capture_path), self.reason, self.replay_command),
        )


def _rebuild_nan_detected_error(message: str, step: int, rank: int, names: list[str], path: str, reason: str, command: str) -> NaNDetectedError:
    return NaNDetectedError(
        message, step=step, rank=rank, nan_param_names=names, capture_path=path, reason=reason, replay_command=command
    )


# --------------------------------------------------------------------------------------
# The monitor
# --------------------------------------------------------------------------------------


def default_step_fn(model: nn.Module, batch: Any, *step_args: Any) -> Tensor:
    """The loss of one microbatch when no ``step_fn`` is given: ``model.training_step(batch)``
    (and the microbatch's captured ``step_args``, if any)."""
    return model.training_step(batch, *step_args)  # type: ignore[operator]


#: Step functions and model builders under this package are found by replay from the names a
#: capture stores (stabletrain.integrations); nothing outside it is imported from a capture.
INTEGRATIONS_PACKAGE = "stabletrain.integrations."


class NaNCaptureMonitor:
    """Detect the first non-finite optimizer step in any PyTorch loop and capture it.

    Call :meth:`begin_step` before the step's first forward pass, :meth:`collect_batch`
    just before each microbatch's forward pass (the RNG states are taken there, so dropout
    replays identically), optionally :meth:`collect_loss` after it, and
    :meth:`check_and_capture` once the gradients are final (after the last backward and,
    under fp16 loss scaling, after ``scaler.unscale_(optimizer)``) and before clipping
    and ``optimizer.step()``.

    Args:
        model: The module being trained (unwrapped: not the DDP wrapper), with the
            parameter names you want to see in reports.
        out_dir: Folder of the captures; this rank writes ``out_dir/rank{rank}/nan_capture.pt``.
        rank: This process's rank; default: ``torch.distributed``'s rank when initialised, else 0.
        world_size: Number of processes; default: from ``torch.distributed``, else 1.
        scaler: The fp16 ``torch.amp.GradScaler``, if any. With a scaler, non-finite
            gradients alone are skipped steps, not failures.
        max_skipped_steps: With a scaler: capture after this many consecutive skipped steps.
        precision: The precision the loop runs in, as a Lightning Fabric name ("32-true",
            "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"); replay uses it.
            Default: "16-mixed" with a scaler; else what the loop is seen to use when the step
            is captured: parameters in float16, bfloat16 or float64 make "16-true",
            "bf16-true" or "64-true"; float32 parameters under ``torch.autocast`` during the
            step (seen when the model or one of its children is called) make "16-mixed" or
            "bf16-mixed"; else "32-true".
        gradient_accumulation_steps: Microbatches per optimizer step; default: the number
            of :meth:`collect_batch` calls in the step. Replay divides each loss by it.
        step_fn: ``step_fn(model, batch) -> loss``, if the model has no ``training_step``.
            Only its name is stored (in the replay command); replay needs it passed again.
        settings: Resolved stabletrain settings (as in ``settings.json``) that rebuild a
            built-in model; None for your own model.
        model_meta: The built-in task's ``model_meta`` (with ``settings``).
        copy_batches: Keep a device-side copy of each microbatch instead of a reference.
            Needed only if the loop or the model modifies batch tensors in place.
        any_rank: ``any_rank(flag_tensor) -> bool``, true on every rank when the flag is
            set on any; default: an all-reduce over ``torch.distributed`` when it is
            initialised with more than one process, else ``bool(flag)``.
        replay_command: The command shown in the error; default: derived from the model.

    Example::

        monitor = NaNCaptureMonitor(model, out_dir="out/debug/nan_capture")
        for step, batch in enumerate(loader):
            monitor.begin_step(step)
            monitor.collect_batch(batch)
            loss = model.training_step(batch)
            monitor.collect_loss(loss)
            loss.backward()
            monitor.check_and_capture()   # raises NaNDetectedError
            optimizer.step()
            optimizer.zero_grad()
    """

    def __init__(
        self,
        model: nn.Module,
        out_dir: str | Path = "out/debug/nan_capture",
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        scaler: Any = None,
        max_skipped_steps: int = 10,
        precision: Optional[str] = None,
        gradient_accumulation_steps: Optional[int] = None,
        step_fn: Optional[Callable[[nn.Module, Any], Tensor]] = None,
        settings: Optional[dict[str, Any]] = None,
        model_meta: Optional[dict[str, Any]] = None,
        copy_batches: bool = False,
        any_rank: Optional[Callable[[Tensor], bool]] = None,
        replay_command: Optional[str] = None,
    ):
        if max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps must be >= 1, got {max_skipped_steps}")
        dist_rank, dist_world = rank_and_world_size()
        self.model = model
        self.out_dir = Path(out_dir)
        self.rank = dist_rank if rank is None else int(rank)
        self.world_size = dist_world if world_size is None else int(world_size)
        self.scaler = scaler if (scaler is not None and getattr(scaler, "is_enabled", lambda: True)()) else None
        self.max_skipped_steps = int(max_skipped_steps)
        self._precision = str(precision) if precision is not None else ("16-mixed" if self.scaler is not None else None)
        #: The autocast dtype seen at the model's forward calls in this step (None: autocast off).
        self._autocast: Optional[torch.dtype] = None
        # The model's forward, and its children's for a training_step that calls them directly.
        watched = [model, *model.children()] if self._precision is None else []
        self._hooks = [m.register_forward_pre_hook(self._see_autocast) for m in watched]
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.step_fn = step_fn
        self.settings = settings
        self.model_meta = model_meta
        self.copy_batches = copy_batches
        self.any_rank = any_rank or dist_any_rank
        self.replay_command = replay_command or default_replay_command(
            self.capture_dir if self.world_size == 1 else self.out_dir,
            model=model,
            step_fn=step_fn,
            builtin=settings is not None and settings.get("task") not in (None, "custom"),
        )
        #: Extra advice appended to the error message (the trainer adds where to resume from).
        self.advice: Optional[Callable[[int], str]] = None
        self.step: Optional[int] = None
        self._batches: list[Any] = []
        self._indices: list[Any] = []
        self._step_args: list[Any] = []
        self._rng: list[Any] = []
        self._losses: list[Tensor] = []
        self._buffers: list[tuple[str, Tensor]] = []
        self._skipped: Optional[Tensor] = None

    @property
    def precision(self) -> str:
        """The precision written into a capture (see ``precision`` in the class docstring)."""
        if self._precision is not None:
            return self._precision
        return infer_precision(self.model, self._autocast)

    def _see_autocast(self, module: nn.Module, args: Any) -> None:
        device = next((p.device.type for p in self.model.parameters()), "cpu")
        if torch.is_autocast_enabled(device):
            self._autocast = torch.get_autocast_dtype(device)

    @property
    def capture_dir(self) -> Path:
        """This rank's capture folder, ``out_dir/rank{rank}``."""
        return self.out_dir / f"rank{self.rank}"

    @property
    def capture_path(self) -> Path:
        return self.capture_dir / FILE_NAME

    # ------------------------------------------------------------------ per step

    def begin_step(self, step: int) -> None:
        """Start optimizer step ``step``: forget the last step, copy the persistent buffers.

        Call it before the step's first forward pass (BatchNorm updates its running
        statistics during the forward pass; the capture must hold the values before it).
        """
        self.step = int(step)
        self._batches, self._indices, self._rng, self._losses, self._step_args = [], [], [], [], []
        self._autocast = None
        # A device-side copy, no host transfer; empty for models without persistent buffers.
        self._buffers = [(name, b.detach().clone()) for name, b in persistent_buffers(self.model)]

    def collect_batch(self, batch: Any, indices: Any = None, step_args: Sequence[Any] = ()) -> None:
        """Record one microbatch just before its forward pass.

        Args:
            batch: The microbatch exactly as the model receives it (already on the device).
            indices: Dataset indices of its samples, if known (a tensor or list).
            step_args: Further positional arguments replay passes to the step function after
                the batch, e.g. ``(batch_idx,)`` for a LightningModule's
                ``training_step(batch, batch_idx)``; numbers, strings or tensors.
        """
        if self.step is None:
            raise RuntimeError("NaNCaptureMonitor.collect_batch: call begin_step(step) first")
        self._batches.append(detached_copy(batch) if self.copy_batches else batch)
        self._indices.append(indices)
        self._step_args.append(list(step_args))
        self._rng.append(raw_rng_state())

    def collect_loss(self, loss: Tensor) -> None:
        """Record the loss the model returned for the last collected microbatch (before any
        division by the accumulation steps or loss scaling). Kept on the device."""
        self._losses.append(loss.detach())

    def check_and_capture(self, grad_norm: Optional[GradNorm] = None) -> None:
        """Decide whether this step failed; if so write the capture and raise.

        Costs one host synchronisation (inside ``any_rank``), on every rank.

        Args:
            grad_norm: The step's :class:`~stabletrain.debug.grad_norm.GradNorm`, if already
                computed (the trainer passes its own); else it is computed here.

        Raises:
            NaNDetectedError: On every rank, when any rank saw a failure.
        """
        if self.step is None:
            raise RuntimeError("NaNCaptureMonitor.check_and_capture: call begin_step(step) first")
        gn = grad_norm if grad_norm is not None else compute_grad_norm(self.model.named_parameters())
        flag = self._failure_flag(gn)
        if not self.any_rank(flag):
            self._release()
            return
        self._raise(gn)

    def write_capture(
        self,
        reason: str,
        *,
        nan_param_names: Sequence[str] = (),
        params: Optional[dict[str, Tensor]] = None,
        extra: Optional[dict[str, Any]] = None,
    ) -> Path:
        """Write this step's capture for ``reason`` now, without raising (other tools'
        failures, e.g. the guard's optimizer-step capture).

        Args:
            reason: The capture's ``reason`` entry.
            nan_param_names: Parameters to list as non-finite.
            params: The parameter values the step started from, if the model's current ones
                are not (e.g. after the optimizer step); CPU copies are made of them.
            extra: More entries for the file (tensors, numbers, strings, lists, dicts only).
        """
        return self._write(list(nan_param_names), reason, 0, [], params=params, extra=extra)

    def close(self) -> None:
        """Let go of everything held and remove the monitor's hook (idempotent)."""
        self._release()
        self._buffers = []
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> "NaNCaptureMonitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _release(self) -> None:
        self._batches, self._indices, self._rng, self._losses, self._step_args = [], [], [], [], []

    def _failure_flag(self, gn: GradNorm) -> Tensor:
        """A device bool: did this rank's step fail? No host synchronisation."""
        # Non-finite norm: a NaN/Inf element, or finite elements whose float32 norm overflows.
        # Which of the two is told apart only on the failure path (_raise).
        grad_bad = ~torch.isfinite(gn.total)
        device = grad_bad.device
        if self.scaler is None:
            flag = grad_bad
        else:
            # Skipped steps are expected under loss scaling; count them in a row on the device.
            # The scaler's own found-inf flags say which steps it skips (elementwise); a
            # non-finite norm without them is an overflow of finite gradients that it applies.
            found_inf = self._scaler_found_inf(device)
            skipped_now = grad_bad if found_inf is None else found_inf
            if self._skipped is None or self._skipped.device != device:
                self._skipped = torch.zeros((), dtype=torch.int64, device=device)
            self._skipped = torch.where(skipped_now, self._skipped + 1, torch.zeros_like(self._skipped))
            flag = self._skipped >= self.max_skipped_steps
            if found_inf is not None:
                flag = flag | (grad_bad & ~found_inf)
        if self._losses:
            losses = torch.stack([loss.reshape(()).float().to(device) for loss in self._losses])
            flag = flag | ~torch.isfinite(losses).all()
        return flag

    def _scaler_found_inf(self, device: torch.device) -> Optional[Tensor]:
        """A device bool: did the GradScaler find an Inf/NaN gradient (and so skip this step)?

        Read from the flags ``scaler.unscale_(optimizer)`` leaves per device; None when the
        gradients were not un-scaled yet (then the gradient norm stands in for them).
        """
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if not isinstance(states, dict):
            return None
        flags = [
            f.reshape(()).to(device)
            for state in states.values()
            if getattr(state.get("stage"), "name", None) == "UNSCALED"
            for f in state.get("found_inf_per_device", {}).values()
        ]
        if not flags:
            return None
        return torch.stack(flags).sum() > 0

    def _raise(self, gn: GradNorm) -> None:
        # The rare path: host reads are fine from here on.
        losses = [loss.float().cpu() for loss in self._losses]
        loss_bad = [i for i, loss in enumerate(losses) if not bool(torch.isfinite(loss))]
        total = float(gn.total)
        skipped = int(self._skipped) if self._skipped is not None else 0
        # Elementwise: a non-finite float32 norm alone does not mean a non-finite element.
        names = nonfinite_grad_names(self.model.named_parameters())
        largest: list[tuple[str, float]] = []
        if loss_bad:
            reason = REASON_LOSS
        elif self.scaler is not None and skipped >= self.max_skipped_steps:
            reason = REASON_SKIPPED
        elif names:
            reason = REASON_GRADIENTS
        elif not math.isfinite(total):
            reason = REASON_NORM_OVERFLOW
            largest = largest_abs_grads(self.model.named_parameters())
        else:
            reason = REASON_OTHER_RANK
        path = self._write(names, reason, skipped, largest)
        message = self._message(names, reason, skipped, losses, path, largest)
        raise NaNDetectedError(
            message,
            step=int(self.step),  # type: ignore[arg-type]
            rank=self.rank,
            nan_param_names=names,
            capture_path=path,
            reason=reason,
            replay_command=self.replay_command,
        )

    def _write(self, names: list[str], reason: str, skipped: int, largest: list[tuple[str, float]],
               params: Optional[dict[str, Tensor]] = None, extra: Optional[dict[str, Any]] = None) -> Path:
        batches, unstorable = [], []
        for i, b in enumerate(self._batches):
            try:
                batches.append(to_storable(b, f"microbatch {i}"))
            except TypeError as exc:
                batches.append(None)
                unstorable.append(str(exc))
        scale = None
        if self.scaler is not None:
            s = getattr(self.scaler, "_scale", None)
            scale = float(s) if isinstance(s, Tensor) else float(self.scaler.get_scale())
        device = next((p.device.type for p in self.model.parameters()), "cpu")
        state = {
            "format": FORMAT,
            "version": VERSION,
            "step": int(self.step),  # type: ignore[arg-type]
            "rank": self.rank,
            "world_size": self.world_size,
            "reason": reason,
            "precision": self.precision,
            "device": device,
            "loss_scale": scale,
            "consecutive_skipped_steps": skipped,
            "gradient_accumulation_steps": int(self.gradient_accumulation_steps or len(self._batches)),
            "params": {n: cpu_copy(p) for n, p in (params.items() if params is not None
                                                   else self.model.named_parameters())},
            "buffers": {n: cpu_copy(b) for n, b in self._buffers},
            "microbatches": batches,
            "unstorable": unstorable,
            "indices": [_indices_to_storable(ix) for ix in self._indices],
            # Absent in older captures; read as no arguments.
            "step_args": [to_storable(a, f"step_args of microbatch {i}") for i, a in enumerate(self._step_args)],
            "rng": [storable_rng_state(r) for r in self._rng],
            "losses": [cpu_copy(loss) for loss in self._losses],
            "nan_param_names": list(names),
            # With gradient_norm_overflow: the parameters with the largest |gradient| element.
            "largest_gradients": [{"name": n, "abs_max": v} for n, v in largest],
            "settings": self.settings,
            "model_meta": self.model_meta,
            "model_class": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            "step_fn": None if self.step_fn is None else _qualified_name(self.step_fn),
            "replay_command": self.replay_command,
            "stabletrain_version": _stabletrain_version(),
            "torch_version": str(torch.__version__),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            **(extra or {}),
        }
        try:
            return atomic_torch_save(state, self.capture_path)
        except OSError as exc:
            raise NaNCaptureError(f"cannot write the NaN capture to {self.capture_path}: {exc}", self.capture_path) from exc

    def _message(
        self, names: list[str], reason: str, skipped: int, losses: list[Tensor], path: Path,
        largest: list[tuple[str, float]],
    ) -> str:
        where = f"step {self.step} (rank {self.rank} of {self.world_size})"
        n_params = sum(1 for _ in self.model.parameters())
        if reason == REASON_LOSS:
            head = f"Non-finite loss at {where}"
        elif reason == REASON_SKIPPED:
            head = (
                f"fp16 loss scaling skipped {skipped} steps in a row (max_skipped_steps={self.max_skipped_steps}) "
                f"up to {where}; the loss scale is down to {self._scale_text()}"
            )
        elif reason == REASON_OTHER_RANK:
            head = f"Another rank found a non-finite value at {where}; this rank stopped with it"
        elif reason == REASON_NORM_OVERFLOW:
            head = (
                f"Gradient norm overflow at {where}: every gradient element is finite, but they are so large "
                "that the float32 gradient norm is inf (an element above about 1.8e19 squares past float32's 3.4e38)"
            )
        else:
            head = f"Non-finite gradients at {where}"
        lines = [head + "."]
        if names:
            lines.append(
                f"Gradients with NaN/Inf: {len(names)} of {n_params} parameters: {fmt_list(names, 6)}"
                + ("; all are in the capture." if len(names) > 6 else ".")
            )
        if largest:
            shown = ", ".join(f"{n} {fmt_number(v, MEASURED_DIGITS)}" for n, v in largest)
            lines.append(f"Largest |gradient|: {shown}.")
            lines.append(
                "An optimizer step with these gradients would be huge (SGD moves a weight by lr x gradient) or put Inf "
                "into the optimizer state (Adam's average of squared gradients overflows float32), and clipping would "
                "divide by an infinite norm: the next step would blow up. Lower the learning rate (model_args.lr) or "
                "clip gradients (gradient_clip_val) so that earlier steps cannot grow them this far, and look for the "
                "input that produces them (stabletrain diagnose on the capture)."
            )
        if losses:
            lines.append(
                f"Microbatch losses: {', '.join(fmt_number(float(loss), MEASURED_DIGITS) for loss in losses)}."
            )
        lines.append(f"The step was captured before clipping and the optimizer step: {path}")
        if is_replay_template(self.replay_command):
            # No command can rebuild the model: a template, presented as one, never as a command.
            why = no_replay_command_reason(self.model, self.step_fn) or "see stabletrain replay --help"
            lines.append(
                f"Replay it offline in Python. No shell command can rebuild the model ({why}), so here is a "
                "template: complete each line after a '# FILL IN' comment (replace the ...), then run it:"
            )
            lines.extend(f"    {line}" for line in self.replay_command.splitlines())
        else:
            lines.append("Replay it offline:")
            lines.append(f"    {self.replay_command}")
        if self.advice is not None:
            lines.append(self.advice(int(self.step)))  # type: ignore[arg-type]
        return "\n".join(lines)

    def _scale_text(self) -> str:
        s = getattr(self.scaler, "_scale", None)
        return fmt_number(float(s), MEASURED_DIGITS) if isinstance(s, Tensor) else "?"


# --------------------------------------------------------------------------------------
# The trainer's callback
# --------------------------------------------------------------------------------------


class NaNCaptureCallback:
    """Wires :class:`NaNCaptureMonitor` into the trainer (``debug_args.nancapture``).

    The trainer calls ``on_microbatch`` after the batch is on the device and just before
    the forward pass, and ``on_after_backward`` with the gradient norm it computed after
    un-scaling and before clipping, which the check reuses.
    """

    def __init__(self, args: Any):
        self.args = args
        self.monitor: Optional[NaNCaptureMonitor] = None

    def on_train_start(self, trainer: TrainerLike) -> None:
        settings = trainer.resolved_settings()
        custom = settings.get("task") == "custom"
        folder = trainer.out / "debug" / "nan_capture"
        self.monitor = NaNCaptureMonitor(
            trainer.model,
            folder,
            rank=trainer.rank,
            world_size=trainer.world_size,
            scaler=trainer.scaler,
            max_skipped_steps=self.args.max_skipped_steps,
            precision=trainer.precision,
            gradient_accumulation_steps=trainer.settings.gradient_accumulation_steps,
            settings=settings,
            model_meta=dict(trainer.task.model_meta),
            any_rank=trainer.any_rank,
            # One process: its rank folder. Several: the folder of all ranks, replayed together.
            replay_command=default_replay_command(
                folder / f"rank{trainer.rank}" if trainer.world_size == 1 else folder,
                model=trainer.model,
                builtin=not custom,
            ),
        )
        self.monitor.advice = lambda step: self._advice(trainer, step)

    def on_step_start(self, trainer: TrainerLike, *, step: int) -> None:
        assert self.monitor is not None
        self.monitor.begin_step(step)

    def on_microbatch(self, trainer: TrainerLike, *, step: int, micro_step: int, batch: Any, indices: Any) -> None:
        assert self.monitor is not None
        self.monitor.collect_batch(batch, indices)

    def on_after_microbatch(self, trainer: TrainerLike, *, step: int, micro_step: int, loss: Tensor) -> None:
        assert self.monitor is not None
        self.monitor.collect_loss(loss)

    def on_after_backward(self, trainer: TrainerLike, *, step: int, grad_norm: GradNorm) -> None:
        assert self.monitor is not None
        self.monitor.check_and_capture(grad_norm)

    def on_train_end(self, trainer: TrainerLike) -> None:
        if self.monitor is not None:
            self.monitor.close()

    def on_exception(self, trainer: TrainerLike, *, exception: BaseException) -> None:
        if isinstance(exception, NaNDetectedError):
            # An event row in metrics.jsonl (and the other loggers), next to the last logged step.
            trainer.log_event({
                "event": "nan_detected",
                "step": exception.step,
                "reason": exception.reason,
                "nan_param_names": exception.nan_param_names,
                "capture": str(exception.capture_path),
            })
        if self.monitor is not None:
            self.monitor.close()

    def _advice(self, trainer: TrainerLike, step: int) -> str:
        """Where to continue: the trainer names the newest checkpoint recorded healthy (measured
        when written, see stabletrain.checkpoint_health), with a command to paste."""
        advise = getattr(trainer, "resume_advice", None)
        text = advise(step) if callable(advise) else f"Continue from a checkpoint written before step {step}."
        return "No non-finite value reached the optimizer or a checkpoint. " + text


# --------------------------------------------------------------------------------------
# Helpers shared with replay
# --------------------------------------------------------------------------------------


_TRUE_PRECISIONS = {torch.float16: "16-true", torch.bfloat16: "bf16-true", torch.float64: "64-true"}
_MIXED_PRECISIONS = {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}


def infer_precision(model: nn.Module, autocast_dtype: Optional[torch.dtype] = None) -> str:
    """The Lightning Fabric precision a plain loop runs ``model`` in: the dtype holding most of
    its floating-point parameters ("16-true", "bf16-true", "64-true"), else, for float32
    parameters, the autocast dtype seen during the step ("16-mixed", "bf16-mixed"), else "32-true"."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    dtype = max(sizes, key=lambda d: sizes[d]) if sizes else torch.float32
    if dtype in _TRUE_PRECISIONS:
        return _TRUE_PRECISIONS[dtype]
    return _MIXED_PRECISIONS.get(autocast_dtype, "32-true") if autocast_dtype is not None else "32-true"


def persistent_buffers(model: nn.Module) -> list[tuple[str, Tensor]]:
    """(name, tensor) of the buffers that ``state_dict`` saves, named as in ``state_dict``."""
    out = []
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def nonfinite_grad_names(named_parameters: Any) -> list[str]:
    """Names of the parameters whose gradient has a NaN or Inf element (one host sync)."""
    names, flags = [], []
    for name, p in named_parameters:
        if p.grad is not None:
            names.append(name)
            flags.append(torch.isfinite(p.grad).all().to("cpu" if p.grad.device.type == "meta" else p.grad.device))
    if not flags:
        return []
    devices = {f.device for f in flags}
    first = next(iter(devices))
    finite = torch.stack([f.to(first) for f in flags]).tolist()
    return [n for n, ok in zip(names, finite) if not ok]


def largest_abs_grads(named_parameters: Any, k: int = 5) -> list[tuple[str, float]]:
    """The ``k`` parameters with the largest ``|gradient|`` element, largest first, as
    (name, value) pairs (one host sync; for the failure path and offline replay)."""
    names, maxima = [], []
    for name, p in named_parameters:
        if p.grad is not None and p.grad.numel():
            names.append(name)
            maxima.append(p.grad.detach().abs().amax().to("cpu", torch.float64))
    if not maxima:
        return []
    values = torch.stack(maxima).tolist()
    ranked = sorted(zip(names, values), key=lambda nv: -nv[1] if not math.isnan(nv[1]) else math.inf)
    return ranked[:k]


def _indices_to_storable(indices: Any) -> Optional[Tensor]:
    if indices is None:
        return None
    if isinstance(indices, Tensor):
        return cpu_copy(indices).long()
    try:
        return torch.as_tensor(list(indices), dtype=torch.long)
    except (TypeError, ValueError):
        return None


def _stabletrain_version() -> str:
    from stabletrain import __version__

    return __version__


# --------------------------------------------------------------------------------------
# The replay command shown in the error
# --------------------------------------------------------------------------------------


def _qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _import_spec(obj: Any, needs_no_args: bool) -> Optional[tuple[str, bool, str]]:
    """(file path or module name, whether it is a file, name) for :func:`importable_ref`, or None."""
    if _not_importable_reason(obj, needs_no_args) is not None:
        return None
    module = sys.modules[obj.__module__]
    source = getattr(module, "__file__", None)
    if source and source.endswith(".py"):
        return abs_path(source), True, obj.__qualname__
    return obj.__module__, False, obj.__qualname__


def _not_importable_reason(obj: Any, needs_no_args: bool) -> Optional[str]:
    """Why ``stabletrain replay --model/--step-fn`` cannot import (and build) ``obj``; None if it can."""
    qualname = getattr(obj, "__qualname__", "")
    module_name = getattr(obj, "__module__", None)
    what = qualname or type(obj).__qualname__
    if not qualname or module_name is None:
        return f"{what} has no importable name"
    if "<locals>" in qualname:
        return f"{what} is defined inside a function"
    if "<" in qualname:
        return f"{what} is not defined by a def or class statement"
    if "." in qualname:
        return f"{what} is nested in {qualname.rsplit('.', 1)[0]}, not defined at the top level of a file"
    module = sys.modules.get(module_name)
    if module is None or getattr(module, qualname, None) is not obj:
        return f"{what} is not found under its name in its module {module_name}"
    source = getattr(module, "__file__", None)
    if not (source and source.endswith(".py")) and module_name == "__main__":
        return f"{what} is defined in an interactive session, not in a file"
    if needs_no_args:
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            return f"the signature of {what} cannot be read"
        required = [
            p.name for p in sig.parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:
            return f"its constructor needs arguments: {', '.join(required)}"
    return None


def importable_ref(obj: Any, needs_no_args: bool) -> Optional[str]:
    """``file.py:Name`` (or ``package.module:Name``) that ``stabletrain replay --model`` can
    import, when ``obj`` is defined at the top level of a source file; else None. A file
    path is quoted for the shell.

    Args:
        obj: A class or function.
        needs_no_args: For a model class: also require a constructor without required arguments.
    """
    spec = _import_spec(obj, needs_no_args)
    if spec is None:
        return None
    target, is_file, name = spec
    return f"{shlex.quote(target) if is_file else target}:{name}"


def _custom_step_fn(step_fn: Any) -> bool:
    """A step function the replay command must name; replay finds the integrations' own by itself."""
    if step_fn is None or step_fn is default_step_fn:
        return False
    return not f"{getattr(step_fn, '__module__', '')}.".startswith(INTEGRATIONS_PACKAGE)


def no_replay_command_reason(model: Any, step_fn: Any = None) -> Optional[str]:
    """Why :func:`default_replay_command` gives a Python template instead of a shell
    command for your model (and step function); None when it gives a command."""
    if model is None:
        return "no model was given"
    why = _not_importable_reason(type(model), needs_no_args=True)
    if why is None and _custom_step_fn(step_fn):
        why = _not_importable_reason(step_fn, needs_no_args=False)
    return why


def default_replay_command(
    path: str | Path, *, model: Any = None, step_fn: Any = None, builtin: bool = False
) -> str:
    """How to replay the capture at ``path`` (a rank folder or the folder of ranks).

    Built-in models are rebuilt from the stored settings: ``stabletrain replay PATH``. For
    your own model the command names its class as ``file.py:Class`` (``--model``, and
    ``--step-fn`` for a step function) when the class is defined at the top level of a
    file and needs no constructor arguments. Paths are quoted for the shell, so the command
    works when pasted whatever characters they hold.

    Otherwise no command can rebuild the model, and the result is a Python template (several
    lines, not a shell command): the lines to complete follow a ``# FILL IN`` comment and
    hold ``...`` (:func:`no_replay_command_reason` says why there is no command).

    Example::

        default_replay_command("out/run/debug/nan_capture/rank0", model=MyModel())
        # 'stabletrain replay out/run/debug/nan_capture/rank0 --model train.py:MyModel'
    """
    target = shell_path(path)
    if builtin:
        return f"stabletrain replay {target}"
    custom_step = _custom_step_fn(step_fn)
    if no_replay_command_reason(model, step_fn) is None:
        model_ref = importable_ref(type(model), needs_no_args=True)
        step_ref = importable_ref(step_fn, needs_no_args=False) if custom_step else None
        return f"stabletrain replay {target} --model {model_ref}" + (f" --step-fn {step_ref}" if step_ref else "")
    return _replay_template(path, model, step_fn if custom_step else None)


def is_replay_template(text: str) -> bool:
    """Whether ``text`` (from :func:`default_replay_command`) is a Python template, not a command."""
    return text.startswith(_TEMPLATE_HEAD)


_TEMPLATE_HEAD = "import stabletrain\n"


def _replay_template(path: str | Path, model: Any, step_fn: Any) -> str:
    """Python that replays the capture once the ``# FILL IN`` lines are completed."""
    lines = ["import stabletrain"]
    cls = type(model) if model is not None else None
    model_spec = _import_spec(cls, needs_no_args=False) if cls is not None else None
    step_spec = _import_spec(step_fn, needs_no_args=False) if step_fn is not None else None
    if model_spec is not None or step_spec is not None:
        lines.append("from stabletrain.debug.replay import load_object  # imports a file without running its __main__ block")
    if model_spec is not None:
        target, _, name = model_spec
        lines.append(f"{name} = load_object({f'{target}:{name}'!r})")
        why = _not_importable_reason(cls, needs_no_args=True)
        if why is None:
            lines.append(f"model = {name}()")
        else:
            # The placeholder alone on its line: run unfilled, load_nan_capture says what to do.
            lines.append(f"# FILL IN: construct {name} as in training ({why}), e.g. model = {name}(...):")
            lines.append("model = ...")
    else:
        what = _qualified_name(cls) if cls is not None else "your model class"
        lines.append(f"# FILL IN: build the model as in training (an instance of {what}):")
        lines.append("model = ...")
    call = "model=model"
    if step_fn is not None:
        if step_spec is not None:
            target, _, name = step_spec
            lines.append(f"step_fn = load_object({f'{target}:{name}'!r})")
        else:
            lines.append(f"# FILL IN: the step function your loop computed the loss with ({_qualified_name(step_fn)}):")
            lines.append("step_fn = ...")
        call += ", step_fn=step_fn"
    lines.append(f"print(stabletrain.load_nan_capture({abs_path(path)!r}, {call}).replay())")
    return "\n".join(lines)
