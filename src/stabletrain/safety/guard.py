"""The guard: decide on the device, every step, whether a step went non-finite.

:class:`StepGuard` checks, with device operations only, the losses and gradient norm before the
optimizer step (:meth:`~StepGuard.check_gradients`) and the parameters and optimizer state after it
(:meth:`~StepGuard.check_update`); its verdict reaches the host with reads the loop does anyway
(:meth:`~StepGuard.pending`, :meth:`~StepGuard.absorb`, :meth:`~StepGuard.raise_if_failed`), and names
are looked up only once a failure is known. See docs/blowups.md.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from stabletrain.debug.optimizer_damage import NORM_OVERFLOW_AT
from stabletrain.distributed.norms import local_tensor
from stabletrain.errors import StabletrainError
from stabletrain.utils.amp import scaler_found_inf

__all__ = ["StepGuard", "GuardFailure", "NonFiniteStepError", "scaler_found_inf", "finite_norms"]

#: Layout of the verdict vector (float64 on the device): the first bad step (-1: none), what was
#: bad at it (0/1 each), its mean loss and gradient norm, the fp16 skipped steps in a row, and
#: the last step before it whose loss and gradient norm were finite, with those values.
_STEP, _LOSS, _GRAD, _SKIP, _PARAMS, _STATE, _LOSS_VALUE, _GN_VALUE, _SKIP_RUN, _PREV, _PREV_LOSS, _PREV_GN = range(12)
_LEN = 12
VERDICT_LEN = _LEN
#: What can be non-finite, in the order of the flags above.
WHAT = ("loss", "gradient_norm", "skipped_steps", "parameters", "optimizer_state")

ORIGIN_GRADIENTS = "forward_backward"
ORIGIN_OPTIMIZER = "optimizer_step"
ORIGIN_SKIPPED = "skipped_steps"


class NonFiniteStepError(StabletrainError):
    """A step went non-finite and the guard stopped training; nothing damaged was saved.

    Attributes:
        step: The first step that went bad (numbered from 0).
        rank: The process raising (every rank raises at the same point).
        origin: ``"forward_backward"`` (non-finite loss or gradients, found before the
            optimizer step), ``"optimizer_step"`` (finite gradients, but the optimizer wrote
            non-finite parameters or state) or ``"skipped_steps"`` (fp16 loss scaling skipped
            ``max_skipped_steps`` steps in a row).
        nonfinite: What was non-finite: ``loss``, ``gradient_norm``, ``parameters``,
            ``optimizer_state``, ``skipped_steps``.
        param_names: Parameters holding NaN/Inf when training stopped.
        state_entries: Optimizer state entries holding NaN/Inf, as ``"<param>: <entry>"``.
        optimizer: The optimizer's class, e.g. ``torch.optim.AdamW``.
        stopped_at: The step at which training stopped (the first bad step, or the next
            point where the verdict could be read without slowing the steps in between).
        capture_path: A capture of the failing optimizer step for ``stabletrain diagnose``
            (written when ``debug_args.nancapture`` is on), else None.
        checkpoint: The newest healthy checkpoint, when there is one.
        command: A command to paste: continue from that checkpoint with nancapture on, or
            start again.
        other_rank: True on the ranks whose message is another rank's: when ranks fail together,
            every rank reports the message of the rank closest to the cause, and the command line
            prints it once, from that rank.
    """

    def __init__(self, message: str, failure: "GuardFailure", *, capture_path: Any = None,
                 checkpoint: Any = None, command: str = "", other_rank: bool = False):
        super().__init__(message)
        self.failure = failure
        self.step = failure.step
        self.rank = failure.rank
        self.origin = failure.origin
        self.nonfinite = list(failure.nonfinite)
        self.param_names = list(failure.param_names)
        self.state_entries = list(failure.state_entries)
        self.optimizer = failure.optimizer
        self.stopped_at = failure.stopped_at
        self.capture_path = capture_path
        self.checkpoint = checkpoint
        self.command = command
        self.other_rank = other_rank

    def __reduce__(self) -> Any:
        return (_rebuild_error, (str(self), self.failure, self.capture_path, self.checkpoint, self.command,
                                 self.other_rank))


def _rebuild_error(
    message: str, failure: "GuardFailure", capture: Any, checkpoint: Any, command: str, other_rank: bool = False
) -> NonFiniteStepError:
    return NonFiniteStepError(message, failure, capture_path=capture, checkpoint=checkpoint, command=command,
                              other_rank=other_rank)


@dataclass
class GuardFailure:
    """What the guard found, with the names it looked up once it knew (host values).

    ``step`` is -1 on a rank that found nothing itself and stops because another rank did
    (``other_rank_step`` then says which step that was).
    """

    step: int
    rank: int
    world_size: int
    origin: str
    nonfinite: list[str]
    loss: float
    gradient_norm: float
    stopped_at: int
    skipped_in_a_row: int = 0
    param_names: list[str] = field(default_factory=list)
    param_counts: dict[str, int] = field(default_factory=dict)
    state_entries: list[str] = field(default_factory=list)
    optimizer: str = ""
    explanation: str = ""
    gradients_elementwise_finite: Optional[bool] = None
    largest_name: str = ""
    largest_abs: float = math.nan
    other_rank_step: Optional[int] = None
    previous_step: int = -1
    previous_loss: float = math.nan
    previous_gradient_norm: float = math.nan
    #: With every value finite: the tensors whose float32 norm overflowed and tripped the check
    #: (:class:`stabletrain.debug.optimizer_damage.RangeTrip`).
    trips: list[Any] = field(default_factory=list)
    #: fp16 loss scaling: the GradScaler's scale when training stopped.
    loss_scale: Optional[float] = None
    #: An optimizer-step failure at the first optimizer step the guard checked, what it knows of the
    #: values before that step: ``"unchecked"`` (nothing checked them: the step may not be what
    #: damaged them) or ``"already"`` (checked before the step, they were out of range already: no
    #: step the guard watched did it). ``""`` otherwise: an earlier check passed.
    before: str = ""

    def _describe_trips(self, where: str, given: str) -> str:
        """Every value finite, but a norm the guard checks overflowed: name the tensor and its value."""
        limit = f"{NORM_OVERFLOW_AT:.2g}"
        # "so large, from finite gradients (...), that" but "so large (its loss ... not checked) that"
        given = f" {given}" if given.startswith("(") else f", {given},"
        weights = [t for t in self.trips if t.kind == "parameter"]
        state = [t for t in self.trips if t.kind != "parameter"]
        if weights or not state:
            name, value = (weights[0].name, weights[0].abs_max) if weights else (self.largest_name, self.largest_abs)
            why = (weights[0].overflow_text() if weights and weights[0].numel else
                   f"the guard's check takes the float32 L2 norm of the weights, which overflows once values pass "
                   f"about {limit}")
            head = self._whose(where, given, "made the weights so large", "the weights are so large",
                               "the weights were already so large")
            return (f"{head} that their float32 norm overflows: every value is still finite, but |w| reaches "
                    f"{_fmt(value)} in {name} ({why})")
        t = state[0]
        head = self._whose(where, given, "left optimizer state so large", "the optimizer state is so large",
                           "the optimizer state was already so large")
        return (f"{head} that its float32 norm overflows: every value is still finite, but {t.name} reaches "
                f"{_fmt(t.abs_max)} ({t.overflow_text()}); the weights stay smaller, |w| up to "
                f"{_fmt(self.largest_abs)} in {self.largest_name}")

    def _whose(self, where: str, given: str, did: str, now: str, was: str) -> str:
        """The head of an optimizer-step message. It says the step ``did`` it only when a check before
        the step passed; at the first step the guard checked it says what it knows (:attr:`before`)."""
        if self.before == "already":
            return f"Before the optimizer step of {where}, the first this guard checked, {was}"
        if self.before == "unchecked":
            return f"After the optimizer step of {where}, the first this guard checked, {now}{given}"
        return f"The optimizer step of {where} {did}{given}"

    def _describe_optimizer(self, where: str) -> str:
        """:meth:`describe` of a failure found after the optimizer step."""
        if math.isnan(self.loss) and math.isnan(self.gradient_norm):  # check_gradients was not called for it
            given = "(its loss and gradients were not checked)"
        else:
            given = f"from finite gradients (loss {_fmt(self.loss)}, gradient norm {_fmt(self.gradient_norm)})"
        if not self.param_names and not self.state_entries and (self.trips or self.largest_name):
            head = self._describe_trips(where, given)
        else:
            head = self._whose(where, f" {given}", "wrote non-finite values",
                               "the weights or the optimizer state hold non-finite values",
                               "the weights or the optimizer state already held non-finite values")
        parts = [head + "."]
        if self.before == "already":
            parts.append("What was out of range before that step came in so (the initial or loaded weights or "
                         "optimizer state), not from a step this guard watched.")
        elif self.before == "unchecked":
            parts.append("Nothing checked them before that step, so they may have come in so: the step is not "
                         "known to have done it.")
        if self.optimizer:
            parts.append(f"Optimizer: {self.optimizer}.")
        if self.param_names:
            parts.append(f"Parameters with NaN/Inf: {_counted(self.param_names, self.param_counts)}.")
        if self.state_entries:
            parts.append(f"Optimizer state with NaN/Inf: {_short(self.state_entries)}.")
        if self.explanation and self.before != "already":  # how a step did it: none did
            parts.append(self.explanation)
        return " ".join(parts)

    def describe(self) -> str:
        """One paragraph: what went non-finite, where, and what that means."""
        where = f"step {self.step} (rank {self.rank} of {self.world_size})"
        if self.step < 0:
            return (f"Another rank found a non-finite value at step {self.other_rank_step}; rank {self.rank} "
                    "stopped with it.")
        if self.origin == ORIGIN_OPTIMIZER:
            return self._describe_optimizer(where)
        if self.origin == ORIGIN_SKIPPED:
            scale = f" (now {_fmt(self.loss_scale)})" if self.loss_scale is not None else ""
            return (f"fp16 loss scaling skipped {self.skipped_in_a_row} steps in a row up to {where} "
                    "(debug_args.nancapture.max_skipped_steps): each time the scaled gradients held Inf/NaN, and "
                    f"the loss scale{scale} cannot recover.")
        what = []
        if "loss" in self.nonfinite:
            what.append(f"the loss is {_fmt(self.loss)}")
        if "gradient_norm" in self.nonfinite:
            if self.gradients_elementwise_finite:
                largest = (f" (the largest, |g| {_fmt(self.largest_abs)} in {self.largest_name}'s gradient; values "
                           f"past about {NORM_OVERFLOW_AT:.2g} overflow it)" if self.largest_name else "")
                what.append(f"the gradient norm is {_fmt(self.gradient_norm)}: every gradient element is finite, but "
                            f"so large that their float32 norm overflows{largest}")
            else:
                what.append(f"the gradient norm is {_fmt(self.gradient_norm)}")
        if not what:
            what.append("a value is non-finite")
        text = f"Non-finite {' and '.join(n.replace('_', ' ') for n in self.nonfinite)} at {where}: {', '.join(what)}."
        if self.param_names:
            text += f" Gradients with NaN/Inf: {_counted(self.param_names, {})}."
        return text


def finite_norms(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """L2 norm over all ``tensors`` as a float32 scalar on ``device``; non-finite exactly when
    an element is, or when elements beyond ~1e19 overflow float32's square. One fused
    ``torch._foreach_norm`` per (device, dtype), half types accumulated in float32."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for tensor in tensors:
        t = local_tensor(tensor)  # under FSDP2 this rank's shard; the verdict is agreed over ranks
        if t.is_floating_point() and t.numel():
            groups[(t.device, t.dtype)].append(t.detach())
    if not groups:
        return torch.zeros((), dtype=torch.float32, device=device)
    parts = []
    for (_, dtype), ts in groups.items():
        acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
        norms = torch._foreach_norm(ts, 2, dtype=acc) if acc is not None else torch._foreach_norm(ts, 2)
        parts.append(torch.linalg.vector_norm(torch.stack(norms).float()).to(device))
    return torch.linalg.vector_norm(torch.stack(parts)) if len(parts) > 1 else parts[0]


def optimizer_state_tensors(optimizer: Any) -> list[Tensor]:
    """The floating tensors of an optimizer's per-parameter state (moments, buffers)."""
    if optimizer is None:
        return []
    out = []
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, Tensor) and v.is_floating_point() and v.numel():
                out.append(v)
    return out


#: ``Tensor.numpy`` as torch defines it, for the host mirror's view (see StepGuard.__init__).
_HOST_VIEW = torch.Tensor.numpy


class StepGuard:
    """Decides on the device whether each step is finite; usable in any PyTorch loop.

    Args:
        model: The module trained (its parameter names appear in errors).
        optimizer: The optimizer, for the check after its step (state and parameters); None
            checks the parameters only.
        scaler: The fp16 ``torch.amp.GradScaler``, if any.
        max_skipped_steps: With a scaler: this many skipped steps in a row are a failure.
        rank: This process's rank (for messages).
        world_size: Number of processes.
        check_update: Check parameters and optimizer state after each optimizer step.
        check_parameters: With ``check_update``, the parameters too (False: the optimizer state
            only, as the integrations do: a parameter gone non-finite shows in the next forward
            pass, an Inf in Adam's ``exp_avg_sq`` with finite weights in nothing else).

    Example::

        guard = StepGuard(model, optimizer)
        ...
        guard.check_gradients(step, grad_norm_total, losses=[loss])
        optimizer.step()
        guard.check_update(step)
        guard.raise_if_failed(sync=False)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any = None,
        *,
        scaler: Any = None,
        max_skipped_steps: int = 10,
        rank: int = 0,
        world_size: int = 1,
        check_update: bool = True,
        check_parameters: bool = True,
    ):
        if max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps must be >= 1, got {max_skipped_steps}")
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if (scaler is not None and getattr(scaler, "is_enabled", lambda: True)()) else None
        self.max_skipped_steps = int(max_skipped_steps)
        self.rank, self.world_size = int(rank), int(world_size)
        self.do_check_update = check_update
        self.check_parameters = check_parameters
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._state = self._fresh()
        self._skip_run = torch.zeros((), dtype=torch.int64, device=self.device)
        #: Steps the GradScaler skipped so far (device int64; fp16 loss scaling only).
        self.skipped_total = torch.zeros((), dtype=torch.int64, device=self.device)
        #: L2 norm of the parameters after the last checked optimizer step (device float32).
        self.weight_norm = torch.full((), math.nan, dtype=torch.float32, device=self.device)
        # The last check_gradients' loss, gradient norm and skip run; an update checked before any
        # (a plain loop that only calls check_update) has no loss or norm, and no skipped steps.
        self._last_values = torch.tensor([math.nan, math.nan, 0.0], dtype=torch.float64, device=self.device)
        self._known: Optional[list[float]] = None
        # A host mirror of the verdict, read as a NumPy array: plain host memory. On the CPU it is
        # refreshed by a CPU copy (there is no device to wait for); on a GPU by an asynchronous
        # copy into pinned memory, read only once its event says it landed.
        self._event: Any = None
        if self.device.type == "cuda":
            self._mirror = torch.empty(_LEN, dtype=torch.float64, pin_memory=True)
            self._event = torch.cuda.Event()
        else:
            self._mirror = torch.empty(_LEN, dtype=torch.float64)
        # A view of the same host memory, taken once: not a copy nor a wait on any device, so
        # taken with Tensor.numpy as imported (CountSyncs counts .numpy() calls as host copies).
        self._host = _HOST_VIEW(self._mirror)
        self._mirror.copy_(self._state)
        # The first optimizer step checked may find values out of range that were so before it (a
        # model or optimizer state loaded so). The first check_gradients, which runs before that
        # step, also checks what check_update will: (its step, [parameters, state] on the device),
        # read only on a failure.
        self._first_update: Optional[int] = None
        self._before_first: Optional[tuple[int, Tensor]] = None

    def state_dict(self) -> dict[str, Tensor]:
        """What a resumed run continues counting from: ``skipped_steps`` (the steps the fp16
        GradScaler skipped so far, logged under that key) and ``skipped_in_a_row`` (towards
        ``max_skipped_steps``). Device tensors, copied, not read: a checkpoint writes them."""
        return {"skipped_steps": self.skipped_total.clone(), "skipped_in_a_row": self._skip_run.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the counts of :meth:`state_dict`; a key that is missing (a checkpoint written
        before they were kept) leaves its count at 0."""
        for key, attr in (("skipped_steps", "skipped_total"), ("skipped_in_a_row", "_skip_run")):
            if key in state:
                setattr(self, attr, torch.as_tensor(state[key], dtype=torch.int64).reshape(()).to(self.device))

    def _fresh(self) -> Tensor:
        state = torch.zeros(_LEN, dtype=torch.float64, device=self.device)
        state[_STEP] = state[_PREV] = -1
        state[_PREV_LOSS] = state[_PREV_GN] = math.nan
        return state

    # ------------------------------------------------------------------ device checks

    def check_gradients(self, step: int, grad_norm: Tensor, losses: Sequence[Tensor] = (),
                        skip: Optional[Tensor] = None) -> None:
        """Record whether this step's losses and gradient norm are finite (no host sync).

        Call it once the gradients are final (after un-scaling under fp16) and before the
        optimizer step. ``skip``: a device bool, true when the step's update is skipped
        (``on_instability``): its non-finite loss or gradients are then not a failure.
        """
        gn = grad_norm.detach().reshape(()).float().to(self.device)
        grad_bad = ~torch.isfinite(gn)
        flags = torch.zeros(5, dtype=torch.bool, device=self.device)
        if self.scaler is not None:
            found = scaler_found_inf(self.scaler, self.device)
            skipped = grad_bad if found is None else found
            self._skip_run = torch.where(skipped, self._skip_run + 1, torch.zeros_like(self._skip_run))
            self.skipped_total = self.skipped_total + skipped.long()
            flags[2] = self._skip_run >= self.max_skipped_steps
            # A non-finite norm the scaler did not skip: finite gradients whose norm overflows.
            if found is not None:
                flags[1] = grad_bad & ~skipped
        else:
            flags[1] = grad_bad
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            stacked = torch.stack([x.detach().reshape(()).float().to(self.device) for x in losses])
            flags[0] = ~torch.isfinite(stacked).all()
            loss = stacked.mean()
        if skip is not None:  # a skipped update harms nothing: the healer records it instead
            flags[0] = flags[0] & ~skip
            flags[1] = flags[1] & ~skip
        self._record(step, flags, loss, gn)
        self.check_before(step)

    def check_before(self, step: int) -> None:
        """Before the optimizer step of ``step``: check the parameters and the optimizer state as
        :meth:`check_update` will, once, before the first step checked (no host sync). Should
        that step's check fail, its message then says whether they were out of range already
        (no step did it) or went so in that step. :meth:`check_gradients` calls it."""
        if self._before_first is None and self._first_update is None and self.do_check_update:
            self._before_first = (step, self._update_flags()[0])

    def _update_flags(self) -> tuple[Tensor, Tensor]:
        """``([parameters bad, optimizer state bad], parameter norm)`` on the device: bad is a
        NaN/Inf or a float32 norm that overflows; the norm is NaN when parameters are not checked."""
        flags = torch.zeros(2, dtype=torch.bool, device=self.device)
        params = torch.full((), math.nan, dtype=torch.float32, device=self.device)
        if self.check_parameters:
            params = finite_norms(self.model.parameters(), self.device)
            flags[0] = ~torch.isfinite(params)
        state = optimizer_state_tensors(self.optimizer)
        if state:
            flags[1] = ~torch.isfinite(finite_norms(state, self.device))
        return flags, params

    def check_update(self, step: int) -> None:
        """Record whether the parameters and the optimizer state are finite after the
        optimizer step of ``step`` (no host sync)."""
        if not self.do_check_update:
            return
        if self._first_update is None:
            self._first_update = step
        flags = torch.zeros(5, dtype=torch.bool, device=self.device)
        flags[3:], params = self._update_flags()
        if self.check_parameters:
            self.weight_norm = params
        nan = torch.full((), math.nan, dtype=torch.float32, device=self.device)
        self._record(step, flags, nan, nan, keep_values=True)

    def _record(self, step: int, flags: Tensor, loss: Tensor, gn: Tensor, keep_values: bool = False) -> None:
        state = self._state
        ok_before = state[_STEP] < 0
        new = flags.any() & ok_before
        step_t = torch.full((1,), float(step), dtype=torch.float64, device=self.device)
        values = torch.cat([loss.double().reshape(1), gn.double().reshape(1), self._skip_run.double().reshape(1)])
        if keep_values:  # the optimizer-step check: the step's loss and norm were recorded before it
            values = self._last_values
        else:
            self._last_values = values
        candidate = torch.cat([step_t, flags.double(), values, state[_PREV:]])
        updated = torch.where(new, candidate, state)
        if not keep_values:  # remember the last step whose loss and gradient norm were finite
            good = ok_before & ~new & torch.isfinite(loss) & torch.isfinite(gn)
            prev = torch.cat([step_t, loss.double().reshape(1), gn.double().reshape(1)])
            updated = torch.cat([updated[:_PREV], torch.where(good, prev, updated[_PREV:])])
        self._state = updated
        self._publish()

    def _publish(self) -> None:
        """Refresh the host mirror: a CPU copy on the CPU; on a GPU an asynchronous copy into
        pinned memory, started only when the previous one has landed (its buffer is free)."""
        if self._event is None:
            if self.device.type == "cpu":
                self._mirror.copy_(self._state)
            return
        if self._event.query():
            self._mirror.copy_(self._state, non_blocking=True)
            self._event.record()

    # ------------------------------------------------------------------ reading the verdict

    def pending(self) -> Tensor:
        """The verdict as a device vector, to stack into a read the loop does anyway."""
        return self._state

    def absorb(self, host: Sequence[float]) -> None:
        """Take back the host values of :meth:`pending` read with something else."""
        self._known = [float(v) for v in host]

    def visible(self) -> Optional[list[float]]:
        """The verdict if the host can have it without waiting for the device: always on the
        CPU; on a GPU once the last asynchronous copy has landed."""
        if self._known is not None and self._known[_STEP] >= 0:
            return self._known
        if self.device.type == "cpu" or (self._event is not None and self._event.query()):
            return [float(v) for v in self._host]  # host memory, already filled
        return None

    def read(self) -> list[float]:
        """The verdict, waiting for the device (one host synchronisation)."""
        self._known = self._state.tolist()
        return self._known

    def failed(self, sync: bool = True) -> bool:
        """Whether a step went bad (``sync=False``: only if known without waiting)."""
        host = self.read() if sync else self.visible()
        return host is not None and host[_STEP] >= 0

    def raise_if_failed(self, sync: bool = True, stopped_at: Optional[int] = None,
                        next_steps: Optional[str] = None) -> None:
        """Raise :class:`NonFiniteStepError` if a step went bad.

        Args:
            sync: Read the verdict (one host sync); False only uses what is already known.
            stopped_at: The step at which the loop stops, for the message.
            next_steps: The message's last line, instead of the plain loop's advice (except for
                values out of range before the first step checked, which no step did).
        """
        host = self.read() if sync else self.visible()
        if host is None or host[_STEP] < 0:
            return
        failure = self.failure(host, stopped_at=stopped_at)
        # A caller's advice is about fixing the failing step: when no step did it, the plain advice says so.
        advice = next_steps if next_steps is not None and failure.before != "already" else next_steps_text(failure)
        raise NonFiniteStepError(failure.describe() + "\n" + advice, failure)

    # ------------------------------------------------------------------ the failure path

    def _before(self, step: int, after: Sequence[bool]) -> str:
        """:attr:`GuardFailure.before` of an optimizer-step failure at ``step`` whose check found
        ``after`` ([parameters, optimizer state] bad); a host read."""
        if step != self._first_update:
            return ""
        if self._before_first is None or self._before_first[0] != step:
            return "unchecked"
        was = self._before_first[1].tolist()
        return "already" if any(w and a for w, a in zip(was, after)) else ""

    def failure(self, host: Sequence[float], stopped_at: Optional[int] = None,
                other_rank_step: Optional[int] = None) -> GuardFailure:
        """The :class:`GuardFailure` of verdict ``host``, with names looked up (host reads)."""
        step = int(host[_STEP])
        flags = [bool(host[i]) for i in (_LOSS, _GRAD, _SKIP, _PARAMS, _STATE)]
        nonfinite = [w for w, f in zip(WHAT, flags) if f]
        if step < 0:
            origin = ORIGIN_GRADIENTS
        elif flags[3] or flags[4]:
            origin = ORIGIN_OPTIMIZER if not (flags[0] or flags[1]) else ORIGIN_GRADIENTS
        elif flags[2]:
            origin = ORIGIN_SKIPPED
        else:
            origin = ORIGIN_GRADIENTS
        failure = GuardFailure(
            step=step, rank=self.rank, world_size=self.world_size, origin=origin, nonfinite=nonfinite,
            loss=host[_LOSS_VALUE], gradient_norm=host[_GN_VALUE],
            stopped_at=step if stopped_at is None else stopped_at, skipped_in_a_row=int(host[_SKIP_RUN]),
            other_rank_step=other_rank_step, previous_step=int(host[_PREV]), previous_loss=host[_PREV_LOSS],
            previous_gradient_norm=host[_PREV_GN],
        )
        if step < 0:
            return failure
        if origin == ORIGIN_SKIPPED and self.scaler is not None:
            from stabletrain.utils.amp import scale_value

            failure.loss_scale = scale_value(self.scaler)
        if origin == ORIGIN_OPTIMIZER:
            from stabletrain.debug.optimizer_damage import describe_optimizer_damage

            describe_optimizer_damage(failure, self.model, self.optimizer)
            failure.before = self._before(step, flags[3:])
        elif "gradient_norm" in nonfinite:
            # Under FSDP2: this rank's gradient shards only.
            bad = [n for n, p in self.model.named_parameters()
                   if p.grad is not None and not bool(torch.isfinite(local_tensor(p.grad)).all())]
            have_grads = any(p.grad is not None for p in self.model.parameters())
            if have_grads and failure.stopped_at == step:
                failure.param_names = bad
                failure.gradients_elementwise_finite = not bad
                if not bad:  # name the gradient that made the norm overflow
                    sizes = {n: float(local_tensor(p.grad).abs().max()) for n, p in self.model.named_parameters()
                             if p.grad is not None and local_tensor(p.grad).numel()}
                    if sizes:
                        failure.largest_name = max(sizes, key=lambda n: sizes[n])
                        failure.largest_abs = sizes[failure.largest_name]
        return failure


# --------------------------------------------------------------------------------------
# Names and reasons, on the failure path
# --------------------------------------------------------------------------------------


def next_steps_text(failure: GuardFailure) -> str:
    """The plain-loop advice (the trainer adds checkpoints and pasteable commands)."""
    if failure.origin == ORIGIN_OPTIMIZER and failure.before == "already":
        return ("Next: check the weights and optimizer state the run started from (initialisation, or the "
                "checkpoint loaded): they were out of range before the first optimizer step.")
    if failure.origin == ORIGIN_OPTIMIZER and failure.before == "unchecked":
        return ("Next: call guard.check_gradients (or guard.check_before) before the optimizer step too: it checks "
                "the weights and optimizer state before the first step, so a failure there says whether that step "
                "did it. If it did, fix the optimizer step and restart from weights saved before it.")
    if failure.origin == ORIGIN_OPTIMIZER:
        return ("Next: fix the optimizer step (see above); restart from weights saved before this step. "
                "stabletrain diagnose replays the step offline from a capture (debug_args.nancapture in the trainer).")
    return ("Next: turn on debug_args.nancapture.enabled=true (or NaNCaptureMonitor in a plain loop) for a capture "
            "of that step, then stabletrain diagnose on it.")


def _fmt(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def _short(items: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def _counted(names: Sequence[str], counts: dict[str, int], limit: int = 6) -> str:
    text = ", ".join(f"{n} ({counts[n]:,})" if n in counts else n for n in names[:limit])
    return f"{len(names)}: " + text + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")



def join_rank_failures(failure: GuardFailure) -> GuardFailure:
    """Under FSDP2 each rank reads only its own shards: every rank's failure, joined on every rank
    (collective: ``all_gather_object``; every rank must call it at the same point, which the guard's
    agreed stop is). See :func:`joined_failure`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return failure
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, failure)
    return joined_failure(failure, parts)


def joined_failure(own: GuardFailure, parts: Sequence[GuardFailure]) -> GuardFailure:
    """``own`` (this rank's failure) with what every rank's ``parts`` found: the names (parameters,
    gradients, optimizer state) of all ranks in rank order, counts summed; the step, origin and
    values of ``own`` when this rank found the failure, else of the lowest rank that did; ``rank``
    and ``stopped_at`` stay this rank's. A rank that found nothing itself then describes the
    failure the others found instead of "another rank found ..."."""
    found = [p for p in parts if p.step >= 0]
    if not found:
        return own
    base = own if own.step >= 0 else found[0]
    joined = GuardFailure(**{f: getattr(base, f) for f in base.__dataclass_fields__})
    joined.rank, joined.other_rank_step, joined.stopped_at = own.rank, None, own.stopped_at
    joined.nonfinite = [w for w in WHAT if any(w in p.nonfinite for p in found)]
    joined.param_names = list(dict.fromkeys(n for p in found for n in p.param_names))
    joined.param_counts = {}
    for p in found:
        for name, count in p.param_counts.items():
            joined.param_counts[name] = joined.param_counts.get(name, 0) + count
    joined.state_entries = list(dict.fromkeys(e for p in found for e in p.state_entries))
    joined.explanation = base.explanation or next((p.explanation for p in found if p.explanation), "")
    joined.trips = sorted({t.name: t for p in found for t in p.trips}.values(), key=lambda t: -t.abs_max)
    checked = [p.gradients_elementwise_finite for p in found if p.gradients_elementwise_finite is not None]
    joined.gradients_elementwise_finite = all(checked) if checked else None
    largest = max((p for p in found if p.largest_name), key=lambda p: p.largest_abs, default=None)
    if largest is not None:
        joined.largest_name, joined.largest_abs = largest.largest_name, largest.largest_abs
    return joined
