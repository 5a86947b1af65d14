"""The reusable core of replay: forward and backward over chosen microbatches (of any ranks) and samples of a
captured step, in any precision, inside a context of the caller's. See ``docs/nancapture.md``."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Mapping, Optional, Protocol, Sequence, Union

import torch
from torch import Tensor, nn

from stabletrain.debug.grad_norm import compute_grad_norm
from stabletrain.debug.nan_capture import (
    REASON_NORM_OVERFLOW,
    NaNCaptureError,
    RankCapture,
    default_step_fn,
    largest_abs_grads,
    nonfinite_grad_names,
    persistent_buffers,
)
from stabletrain.utils.rng import get_rng_state, set_rng_state
from stabletrain.utils.text import fmt_list
from stabletrain.utils.tree import select_rows, to_device

from .precision import normalize_precision, precision_plugin, replay_dtype

MicrobatchKey = tuple[int, int]  # (rank, micro_step)

class ReplayableCapture(Protocol):
    """What :func:`forward_backward` needs of a capture (a :class:`~stabletrain.debug.replay.NaNCapture`);
    a Protocol, so that this module does not import the class that calls it."""

    step_fn: Optional[Callable[..., Tensor]]

    @property
    def precision(self) -> str: ...

    @property
    def loss_scale(self) -> Optional[float]: ...

    @property
    def world_size(self) -> int: ...

    @property
    def gradient_accumulation_steps(self) -> int: ...

    def microbatch_keys(self, which: Optional[Iterable[Union[int, MicrobatchKey]]] = None) -> list[MicrobatchKey]: ...

    def microbatch_key(self, key: Union[int, MicrobatchKey]) -> MicrobatchKey: ...

    def rank_capture(self, rank: int) -> RankCapture: ...

    def default_device(self) -> torch.device: ...

    def get_model(self) -> nn.Module: ...



@dataclass
class ForwardBackwardResult:
    """What :func:`forward_backward` computed.

    Attributes:
        microbatches: The (rank, micro_step) pairs run, in order.
        losses: Each one's loss as the model returned it (after Fabric's output conversion,
            before division by the accumulation steps), detached, on the CPU.
        grad_finite: Parameter name -> whether its gradient is all finite (parameters
            without a gradient are left out).
        nonfinite_param_names: The names whose gradient is not finite, in model order.
        gradient_norm: L2 norm over all gradients (float32 accumulation), as training logs it.
            It is inf, with every element finite, when the gradients are too large for a float32
            norm (``gradient_norm_overflow``).
        model: The model, holding the parameters the step started from and the gradients
            in ``.grad`` (un-scaled under fp16; over several ranks averaged as DDP does,
            while one rank's microbatches alone give that rank's local gradient).
        precision: The precision used.
        largest_gradients: When the gradient norm overflows: (name, largest ``|gradient|``)
            of the parameters with the largest gradient elements, largest first; else empty.
    """

    microbatches: list[MicrobatchKey]
    losses: list[Tensor]
    grad_finite: dict[str, bool]
    nonfinite_param_names: list[str]
    gradient_norm: float
    model: nn.Module
    precision: str
    largest_gradients: list[tuple[str, float]] = field(default_factory=list)

    @property
    def loss_values(self) -> list[float]:
        return [float(loss) for loss in self.losses]

    @property
    def finite(self) -> bool:
        """True when every loss and every gradient element is finite (the gradient norm may
        still overflow: see :attr:`gradient_norm_overflow`)."""
        return not self.nonfinite_param_names and all(math.isfinite(v) for v in self.loss_values)

    @property
    def gradient_norm_overflow(self) -> bool:
        """Every gradient element is finite, but the gradient norm is not (float32 overflow)."""
        return not self.nonfinite_param_names and not math.isfinite(self.gradient_norm)

    def reproduces(self, reason: str) -> bool:
        """Whether this replay fails the way a capture taken for ``reason`` did.

        A non-finite loss or gradient element always counts. For ``gradient_norm_overflow``
        (every element finite at capture time) so does a gradient norm that overflows again:
        that is the failure training saw. For the other reasons it does not, since they
        were non-finite values, not an overflowing norm.
        """
        if not self.finite:
            return True
        return reason == REASON_NORM_OVERFLOW and self.gradient_norm_overflow


def forward_backward(
    capture: ReplayableCapture,
    *,
    microbatches: Optional[Iterable[Union[int, MicrobatchKey]]] = None,
    rows: Optional[Mapping[Union[int, MicrobatchKey], Sequence[int]]] = None,
    precision: Optional[str] = None,
    device: Optional[Union[str, torch.device]] = None,
    context: Optional[Union[ContextManager[Any], Callable[[], ContextManager[Any]]]] = None,
    model: Optional[nn.Module] = None,
    step_fn: Optional[Callable[[nn.Module, Any], Tensor]] = None,
    backward: bool = True,
) -> ForwardBackwardResult:
    """Rerun forward and backward of chosen microbatches of a captured step, from the
    captured state; the building block of :meth:`NaNCapture.replay` and of diagnosis.

    Each call starts afresh: parameters and persistent buffers are restored to the values
    the step started from, gradients are cleared, and before each microbatch's forward
    pass the RNG states (torch CPU/CUDA, NumPy, Python) are set to the captured ones, so
    dropout draws the same masks. Each loss is divided by the gradient-accumulation steps
    before backward, as in training (a subset therefore yields the partial sum of the
    step's gradient). Microbatches of several ranks are combined as DDP does: each rank's
    gradient is accumulated separately, then they are averaged. Under ``"16-mixed"`` the
    loss is scaled by the captured loss scale and the gradients un-scaled at the end, as
    the GradScaler does in training. Nothing is clipped and no optimizer steps. The
    global RNG states are put back afterwards.

    Args:
        capture: A loaded :class:`NaNCapture`.
        microbatches: Which microbatches to run, as ``(rank, micro_step)`` pairs, or plain
            ``micro_step`` ints for a single-rank capture; default: all, rank by rank.
        rows: Optional ``{microbatch: [row, ...]}``: run only these samples (positions
            within the microbatch, 0-based; ``capture.ranks[i].indices`` maps them to
            dataset indices). Every tensor in the batch whose first dimension is the
            microbatch size is indexed. Keys as in ``microbatches``.
        precision: "32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true" or
            "16-true"; default: the captured precision. Parameters are converted (and
            restored from the captured values) accordingly.
        device: Where to run; default: the captured device type when available, else CPU.
        context: A context manager (e.g. a ``TorchDispatchMode`` or a
            ``torch.utils.module_tracker.ModuleTracker``), or a function returning one,
            entered once around all forward and backward passes.
        model: Overrides the capture's model (see :meth:`NaNCapture.get_model`).
        step_fn: Overrides the capture's ``step_fn(model, batch) -> loss``.
        backward: False runs the forward passes only, under ``torch.no_grad()`` (about a
            third of the cost): enough to tell whether a loss is non-finite. No gradients
            are computed, so ``grad_finite`` is empty and ``finite`` reflects the losses.

    Returns:
        A :class:`ForwardBackwardResult` with the losses, the finiteness of every
        parameter's gradient and the model holding the gradients.

    Example::

        cap = stabletrain.load_nan_capture("out/boom/debug/nan_capture/rank0")
        # microbatch 1 alone, only its samples 0 and 3, in float64, counting aten ops:
        with CountOps() as counter:  # any TorchDispatchMode
            res = forward_backward(cap, microbatches=[1], rows={1: [0, 3]}, precision="64-true", context=counter)
        print(res.loss_values, res.nonfinite_param_names)
    """
    keys = capture.microbatch_keys(microbatches)
    row_map = {capture.microbatch_key(k): list(v) for k, v in (rows or {}).items()}
    prec = normalize_precision(precision or capture.precision)
    dev = torch.device(device) if device is not None else capture.default_device()
    model = model if model is not None else capture.get_model()
    fn = _step_function(model, step_fn or capture.step_fn)
    plugin = precision_plugin(prec, dev.type, capture.loss_scale)
    run = _Run(capture, model, fn, plugin, replay_dtype(prec, capture.precision), dev, row_map, backward)
    saved_rng = get_rng_state()
    try:
        model.to(dev)
        if run.float_dtype is not None:  # e.g. the float32 replay of a .half() model runs in float32
            model.to(run.float_dtype)
        model.train()
        grad_mode = torch.enable_grad() if backward else torch.no_grad()
        with grad_mode, _entered(context):
            run_keys, losses = run.all_ranks(_by_rank(keys))
            _unscale(plugin, model)
    finally:
        set_rng_state(saved_rng)
    return _result(model, run_keys, losses, prec)


def _step_function(model: nn.Module, step_fn: Optional[Callable[..., Tensor]]) -> Callable[..., Tensor]:
    """The step function to call: the one given, else ``model.training_step`` (which must exist)."""
    fn = step_fn or default_step_fn
    if fn is default_step_fn and not callable(getattr(model, "training_step", None)):
        raise NaNCaptureError(
            f"{type(model).__name__} has no training_step(batch) -> loss; pass step_fn=my_step_fn "
            "(the function your loop computed the loss with) to load_nan_capture"
        )
    return fn


def _entered(context: Any) -> ContextManager[Any]:
    """The caller's context manager (or the one its factory returns); a null context without one."""
    if context is None:
        return contextlib.nullcontext()
    return context if hasattr(context, "__enter__") else context()


def _by_rank(keys: Sequence[MicrobatchKey]) -> dict[int, list[int]]:
    by_rank: dict[int, list[int]] = {}
    for rank, micro in keys:
        by_rank.setdefault(rank, []).append(micro)
    return by_rank


@dataclass
class _Run:
    """One :func:`forward_backward` call's settings, and its steps: each rank, each microbatch."""

    capture: ReplayableCapture
    model: nn.Module
    fn: Callable[..., Tensor]
    plugin: Any
    float_dtype: Optional[torch.dtype]
    device: torch.device
    row_map: dict[MicrobatchKey, list[int]]
    backward: bool

    def all_ranks(self, by_rank: dict[int, list[int]]) -> tuple[list[MicrobatchKey], list[Tensor]]:
        """Every rank's microbatches from the captured state; over several ranks the gradients are combined
        as DDP does: each rank's accumulated separately, then averaged. Returns the keys run and the losses."""
        combined = len(by_rank) > 1
        summed: dict[str, Tensor] = {}
        run_keys: list[MicrobatchKey] = []
        losses: list[Tensor] = []
        for rank, micros in by_rank.items():
            part = self.capture.rank_capture(rank)
            load_state(self.model, part, self.float_dtype, self.device)
            for micro in micros:
                losses.append(self.microbatch(part, rank, micro))
                run_keys.append((rank, micro))
            if combined:
                self._take_rank_gradient(summed)
        if combined:
            for name, p in self.model.named_parameters():
                p.grad = summed.get(name)
        return run_keys, losses

    def microbatch(self, part: RankCapture, rank: int, micro: int) -> Tensor:
        """Forward (and backward) of one microbatch with its captured RNG states; its loss, detached, on the CPU."""
        batch = part.microbatches[micro]
        if batch is None:
            reason = "; ".join(part.raw.get("unstorable", [])) or "it could not be stored"
            raise NaNCaptureError(f"microbatch {micro} of rank {rank} is not in the capture: {reason}", part.path)
        if (rank, micro) in self.row_map:
            batch = select_rows(batch, self.row_map[(rank, micro)], part.microbatch_size(micro))
        batch = to_device(batch, self.device)
        set_rng_state(part.rng[micro])
        with self.plugin.forward_context():
            loss = self.fn(self.model, self.plugin.convert_input(batch), *part.step_args[micro])
        loss = self.plugin.convert_output(loss)
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            raise NaNCaptureError(
                f"the step function must return a scalar loss tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
            )
        if self.backward:
            # Divided by the accumulation steps, as in training: a subset yields a partial sum of the gradient.
            self.plugin.backward(loss / self.capture.gradient_accumulation_steps, self.model)
        return loss.detach().to("cpu", copy=True)

    def _take_rank_gradient(self, summed: dict[str, Tensor]) -> None:
        """Add this rank's gradient to ``summed`` as DDP does (divided by the world size), and clear it."""
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                g = p.grad / self.capture.world_size
                summed[name] = summed[name] + g if name in summed else g
                p.grad = None


def _unscale(plugin: Any, model: nn.Module) -> None:
    """Under ``"16-mixed"``: un-scale the gradients with the plugin's GradScaler, as training does."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        params = [p for p in model.parameters() if p.grad is not None]
        if params:
            scaler.unscale_(torch.optim.SGD(params, lr=0.0))


def _result(model: nn.Module, run_keys: list[MicrobatchKey], losses: list[Tensor], prec: str) -> ForwardBackwardResult:
    names = nonfinite_grad_names(model.named_parameters())
    bad = set(names)
    grad_finite = {n: n not in bad for n, p in model.named_parameters() if p.grad is not None}
    total = _grad_norm(model)
    # Only when every element is finite and the norm still is not: which ones are so large.
    largest = largest_abs_grads(model.named_parameters()) if not names and not math.isfinite(total) else []
    return ForwardBackwardResult(
        microbatches=run_keys,
        losses=losses,
        grad_finite=grad_finite,
        nonfinite_param_names=names,
        gradient_norm=total,
        model=model,
        precision=prec,
        largest_gradients=largest,
    )


def _grad_norm(model: nn.Module) -> float:
    """L2 norm over all gradients; float32 accumulation as in training, float64 for float64 gradients."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    if any(g.dtype == torch.float64 for g in grads):
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()).cpu() for g in grads])))
    return float(compute_grad_norm((str(i), p) for i, p in enumerate(model.parameters())).total)


def load_state(
    model: nn.Module, part: RankCapture, float_dtype: Optional[torch.dtype], device: torch.device
) -> None:
    """Put the captured parameters and buffers into ``model`` (on ``device``, floats in ``float_dtype``)
    and clear the gradients.

    Raises:
        NaNCaptureError: The model does not match the capture (names or shapes).
    """
    params = dict(model.named_parameters())
    buffers = dict(persistent_buffers(model))
    missing = [n for n in part.params if n not in params] + [n for n in part.buffers if n not in buffers]
    extra = [n for n in params if n not in part.params] + [n for n in buffers if n not in part.buffers]
    if missing or extra:
        raise NaNCaptureError(
            f"the model does not match the capture (trained: {part.model_class}, given: "
            f"{type(model).__module__}.{type(model).__qualname__}): "
            + (f"the capture has {fmt_list(missing)} that the model lacks; " if missing else "")
            + (f"the model has {fmt_list(extra)} that the capture lacks; " if extra else "")
            + "pass an instance of the model class that was trained",
            part.path,
        )
    shapes = [n for n, p in params.items() if p.shape != part.params[n].shape]
    if shapes:
        n = shapes[0]
        raise NaNCaptureError(
            f"the model does not match the capture: {n} has shape {tuple(params[n].shape)} in the model and "
            f"{tuple(part.params[n].shape)} in the capture ({len(shapes)} such parameters); construct the model "
            "with the settings it was trained with",
            part.path,
        )
    with torch.no_grad():
        for table, values in ((params, part.params), (buffers, part.buffers)):
            for name, t in table.items():
                src = values[name]
                dtype = float_dtype if (float_dtype is not None and src.is_floating_point()) else src.dtype
                t.data = src.to(device=device, dtype=dtype, copy=True)
    for p in params.values():
        p.grad = None
