"""NaNCaptureMonitor: stop at the first non-finite optimizer step of any PyTorch loop and capture it.

Detection costs one host synchronisation per step and copies neither the batch nor the parameters;
what counts as a failure, the cost and the plain-loop wiring are in ``docs/nancapture.md``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from stabletrain.debug.grad_norm import GradNorm, compute_grad_norm
from stabletrain.distributed.norms import is_dtensor
from stabletrain.distributed.shards import local_shards
from stabletrain.utils.amp import scale_value, scaler_found_inf
from stabletrain.utils.dist import any_rank as dist_any_rank
from stabletrain.utils.dist import leading_message, rank_and_world_size
from stabletrain.utils.rng import raw_rng_state
from stabletrain.utils.text import MEASURED_DIGITS, fmt_list, fmt_number
from stabletrain.utils.tree import detached_copy, leading_size, named_tensors

from .commands import default_replay_command, is_replay_template, no_replay_command_reason, qualified_name
from .errors import (
    REASON_GRADIENTS,
    REASON_LOSS,
    REASON_NORM_OVERFLOW,
    REASON_OTHER_RANK,
    REASON_SKIPPED,
    NaNDetectedError,
)
from .format import FILE_NAME, write_capture_file
from .model_state import infer_precision, largest_abs_grads, nonfinite_grad_names, persistent_buffers


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
        #: The reason of the capture whose message is being written (for :attr:`advice`).
        self.last_reason = ""
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

    @property
    def loss_nonfinite(self) -> Optional[bool]:
        """Whether a loss of the step collected so far is non-finite (a host read; None: no loss)."""
        if not self._losses:
            return None
        return not all(bool(torch.isfinite(x).all()) for x in self._losses)

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

    def nonfinite_samples(self) -> list[int]:
        """Dataset indices of the samples of this step, among the microbatches held, whose data
        holds a NaN or an Inf (a tensor of only 0 and -inf, an additive mask, is not counted);
        samples of a microbatch collected without indices are left out. One host read per
        floating-point tensor: call it on a failure path, not every step."""
        found: list[int] = []
        for batch, ix in zip(self._batches, self._indices):
            n = leading_size(batch)
            if ix is None or n is None:
                continue
            index = ix.reshape(-1).tolist() if isinstance(ix, Tensor) else list(ix)
            bad = torch.zeros(n, dtype=torch.bool)
            for _, t in named_tensors(batch):
                if not t.is_floating_point() or t.ndim == 0 or t.shape[0] != n or not t.numel():
                    continue
                with torch.no_grad():
                    finite = torch.isfinite(t)
                    if bool(finite.all()) or bool(((t == 0) | torch.isneginf(t)).all()):
                        continue
                    bad |= ~finite.reshape(n, -1).all(1).cpu()
            found.extend(int(index[row]) for row in torch.nonzero(bad).flatten().tolist() if row < len(index))
        return found

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
            found_inf = scaler_found_inf(self.scaler, device)
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

    def _raise(self, gn: GradNorm) -> None:
        # The rare path: host reads are fine from here on.
        losses = [loss.float().cpu() for loss in self._losses]
        loss_bad = [i for i, loss in enumerate(losses) if not bool(torch.isfinite(loss))]
        total = float(gn.total)
        skipped = int(self._skipped) if self._skipped is not None else 0
        # Elementwise: a non-finite float32 norm alone does not mean a non-finite element. Under FSDP2
        # both reads below are collectives over the shards, global on every rank, so they depend only
        # on global facts (the norm), never on this rank's own losses.
        names = nonfinite_grad_names(self.model.named_parameters())
        overflow = not names and not math.isfinite(total)
        largest = largest_abs_grads(self.model.named_parameters()) if overflow else []
        if loss_bad:
            reason = REASON_LOSS
        elif self.scaler is not None and skipped >= self.max_skipped_steps:
            reason = REASON_SKIPPED
        elif names:
            reason = REASON_GRADIENTS
        elif overflow:
            reason = REASON_NORM_OVERFLOW
        else:
            reason = REASON_OTHER_RANK
        if reason != REASON_NORM_OVERFLOW:
            largest = []
        path = self._write(names, reason, skipped, largest)
        message = self._message(names, reason, skipped, losses, path, largest)
        leader = self.rank
        if self.world_size > 1:
            # The ranks fail together, each with what it saw: a rank whose own loss is finite sees only the
            # NaN gradients averaged in from another's. Every rank reports the message of the rank closest
            # to the cause, so that they never name two causes for one step.
            level = 2 if loss_bad else (0 if reason == REASON_OTHER_RANK else 1)
            message, leader = leading_message(level, message)
        raise NaNDetectedError(
            message,
            step=int(self.step),  # type: ignore[arg-type]
            rank=self.rank,
            nan_param_names=names,
            capture_path=path,
            reason=reason,
            replay_command=self.replay_command,
            other_rank=leader != self.rank,
        )

    def _write(self, names: list[str], reason: str, skipped: int, largest: list[tuple[str, float]],
               params: Optional[dict[str, Tensor]] = None, extra: Optional[dict[str, Any]] = None) -> Path:
        scale = None
        if self.scaler is not None:
            scale = scale_value(self.scaler)
            scale = float(self.scaler.get_scale()) if scale is None else scale
        named = params.items() if params is not None else self.model.named_parameters()
        layout = None
        if any(is_dtensor(p) for p in self.model.parameters()):
            # FSDP2: this rank's shards (1/world_size of the model), no collective; replay reassembles them.
            shards = local_shards(named, self.rank, self.world_size)
            named, layout = shards["tensors"].items(), shards["layout"]
        return write_capture_file(
            self.capture_path,
            step=int(self.step),  # type: ignore[arg-type]
            rank=self.rank,
            world_size=self.world_size,
            reason=reason,
            precision=self.precision,
            device=next((p.device.type for p in self.model.parameters()), "cpu"),
            loss_scale=scale,
            consecutive_skipped_steps=skipped,
            gradient_accumulation_steps=int(self.gradient_accumulation_steps or len(self._batches)),
            params=named,
            params_layout=layout,
            buffers=self._buffers,
            microbatches=self._batches,
            indices=self._indices,
            step_args=self._step_args,
            rng=self._rng,
            losses=self._losses,
            nan_param_names=names,
            largest_gradients=largest,
            settings=self.settings,
            model_meta=self.model_meta,
            model_class=qualified_name(type(self.model)),
            step_fn=None if self.step_fn is None else qualified_name(self.step_fn),
            replay_command=self.replay_command,
            extra=extra,
        )

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
            self.last_reason = reason  # the advice depends on why (skipped fp16 steps: the precision)
            lines.append(self.advice(int(self.step)))  # type: ignore[arg-type]
        return "\n".join(lines)

    def _scale_text(self) -> str:
        scale = scale_value(self.scaler)
        return "?" if scale is None else fmt_number(scale, MEASURED_DIGITS)
