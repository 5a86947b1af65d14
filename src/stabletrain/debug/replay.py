"""Load a NaN capture and rerun the failing step offline.

:func:`load_nan_capture` reads one rank's capture (its folder or its ``nan_capture.pt``) or
the folder of all ranks of a distributed run, safely: ``torch.load(weights_only=True)``,
so a file cannot run code, and every entry is checked before use.

:meth:`NaNCapture.replay` rebuilds the model (a built-in model from the stored settings,
your own from ``model=``), restores the parameters and buffers the step started from and
each microbatch's RNG states, reruns forward and backward over the saved microbatches in
the captured precision (or the one given), un-scales fp16 gradients with the captured loss
scale, and stops before clipping and the optimizer step. On the CPU the replay of a
deterministic failure gives bitwise the captured losses.

The building block underneath, for tools that dissect a step (``stabletrain diagnose``),
is :func:`forward_backward`: any subset of microbatches (of any ranks) and of the samples
within them, in any precision (``"64-true"`` included), inside a context manager of the
caller's (e.g. a ``TorchDispatchMode``), returning losses and per-parameter gradient
finiteness with the model and its gradients.

On the command line: ``stabletrain replay PATH`` (:mod:`stabletrain.cli.replay`).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

import stabletrain
from stabletrain.debug.grad_norm import compute_grad_norm
from stabletrain.debug.nan_capture import (
    FILE_NAME,
    FORMAT,
    INTEGRATIONS_PACKAGE,
    REASON_NORM_OVERFLOW,
    REASON_OTHER_RANK,
    VERSION,
    NaNCaptureError,
    default_step_fn,
    largest_abs_grads,
    nonfinite_grad_names,
    persistent_buffers,
)
from stabletrain.utils import imports
from stabletrain.utils.rng import get_rng_state, set_rng_state
from stabletrain.utils.text import MEASURED_DIGITS, fmt_list, fmt_number, json_float, shell_path
from stabletrain.utils.tree import bitwise_equal, leading_size, select_rows, to_device

__all__ = [
    "load_nan_capture",
    "NaNCapture",
    "RankCapture",
    "ReplayResult",
    "ForwardBackwardResult",
    "forward_backward",
    "precision_plugin",
    "REPLAY_PRECISIONS",
]

#: Precisions a replay can run in (Lightning Fabric's names).
REPLAY_PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed", "half": "16-true", "double": "64-true"}
_TRUE_DTYPES = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}

MicrobatchKey = tuple[int, int]  # (rank, micro_step)


# --------------------------------------------------------------------------------------
# Reading captures
# --------------------------------------------------------------------------------------


@dataclass
class RankCapture:
    """One rank's capture file, checked. Tensors are on the CPU.

    Attributes:
        path: The ``nan_capture.pt`` file.
        step, rank, world_size: Where the failure happened.
        reason: ``nonfinite_gradients``, ``nonfinite_loss``, ``gradient_norm_overflow``,
            ``skipped_steps`` or ``other_rank``.
        precision: The run's precision ("32-true", "bf16-mixed", ...).
        device: Device type the run trained on ("cpu", "cuda").
        loss_scale: fp16 GradScaler scale at the failing step, else None.
        gradient_accumulation_steps: Microbatches per optimizer step.
        params: Parameter values the step started from, by ``named_parameters`` name.
        buffers: Persistent buffers as they were before the step's first forward pass.
        microbatches: The step's microbatches as the model received them (None where a
            microbatch could not be stored safely).
        indices: Dataset indices of each microbatch's samples (LongTensor) or None.
        rng: RNG states before each microbatch's forward pass.
        losses: Each microbatch's loss (0-dim tensors), possibly fewer than microbatches
            when a plain loop did not call ``collect_loss``.
        nan_param_names: Parameters with a non-finite gradient at capture time.
        largest_gradients: With ``gradient_norm_overflow``: (name, largest ``|gradient|``)
            of the parameters with the largest gradient elements at capture time.
        settings: Resolved settings that rebuild a built-in model, or None.
        model_meta: The built-in task's ``model_meta``, or None.
        model_class: ``module.QualName`` of the model that was trained.
        raw: The whole dict as loaded.
    """

    path: Path
    step: int
    rank: int
    world_size: int
    reason: str
    precision: str
    device: str
    loss_scale: Optional[float]
    gradient_accumulation_steps: int
    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    microbatches: list[Any]
    indices: list[Optional[Tensor]]
    rng: list[dict[str, Any]]
    losses: list[Tensor]
    nan_param_names: list[str]
    settings: Optional[dict[str, Any]]
    model_meta: Optional[dict[str, Any]]
    model_class: str
    raw: dict[str, Any] = field(repr=False)
    largest_gradients: list[tuple[str, float]] = field(default_factory=list)
    #: Each microbatch's further arguments of the step function (a LightningModule's batch_idx).
    step_args: list[list[Any]] = field(default_factory=list)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    def microbatch_size(self, micro: int) -> int:
        """Samples in microbatch ``micro``: its dataset indices, else the first dimension of its
        first batched tensor.

        Raises:
            NaNCaptureError: The microbatch holds no batched tensor.
        """
        ix = self.indices[micro]
        if isinstance(ix, Tensor):
            return int(ix.numel())
        size = leading_size(self.microbatches[micro])
        if size is None:
            raise NaNCaptureError(f"cannot tell the size of microbatch {micro}: it holds no batched tensor", self.path)
        return size


_REQUIRED: dict[str, Any] = {
    "step": int,
    "rank": int,
    "world_size": int,
    "reason": str,
    "precision": str,
    "device": str,
    "gradient_accumulation_steps": int,
    "params": dict,
    "buffers": dict,
    "microbatches": list,
    "indices": list,
    "rng": list,
    "losses": list,
    "nan_param_names": list,
    "model_class": str,
}


def read_capture_file(path: str | Path) -> RankCapture:
    """Load and check one ``nan_capture.pt`` without running any code from it.

    Raises:
        NaNCaptureError: Missing, truncated or corrupt file; a file holding pickled
            objects (refused unread); a file from a newer format version; not a capture.
    """
    path = Path(path)
    if not path.is_file():
        raise NaNCaptureError(f"no NaN capture file at {path}", path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = _unpickler_detail(str(exc))
        if "Unsupported global" in detail:
            raise NaNCaptureError(
                f"refused to load {path}: it holds a Python object whose unpickling would run code "
                f"({detail}). A stabletrain capture holds only tensors, numbers, strings, lists and dicts; "
                "do not load this file with weights_only=False unless you trust where it came from",
                path,
            ) from None
        raise NaNCaptureError(
            f"cannot read {path}: the file is truncated or corrupt ({detail}); "
            "captures are written atomically, so this one was damaged after it was written or is not a capture",
            path,
        ) from None
    except Exception as exc:  # truncated zip, bad magic number, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NaNCaptureError(
            f"cannot read {path}: the file is truncated or corrupt ({type(exc).__name__}: {first}); "
            "captures are written atomically, so this one was damaged after it was written or is not a capture",
            path,
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise NaNCaptureError(
            f"{path} is not a stabletrain NaN capture (format {found!r}, expected {FORMAT!r}); "
            "captures are the nan_capture.pt files under <out>/debug/nan_capture/rank<N>/",
            path,
        )
    version = state.get("version")
    if not isinstance(version, int):
        raise NaNCaptureError(f"{path}: the capture has no valid format version (got {version!r})", path)
    if version > VERSION:
        raise NaNCaptureError(
            f"{path} was written by a newer stabletrain ({state.get('stabletrain_version', '?')}, capture format "
            f"version {version}); this stabletrain reads up to version {VERSION}: upgrade stabletrain to replay it",
            path,
        )
    problems = [
        f"{key} (expected {kind.__name__}, got {type(state.get(key)).__name__})"
        for key, kind in _REQUIRED.items()
        if not isinstance(state.get(key), kind)
    ]
    if not problems:
        n = len(state["microbatches"])
        if len(state["rng"]) != n or len(state["indices"]) != n or len(state["losses"]) > n:
            problems.append(
                f"per-microbatch entries disagree ({n} microbatches, {len(state['rng'])} RNG states, "
                f"{len(state['indices'])} index lists, {len(state['losses'])} losses)"
            )
        bad = [k for k, v in {**state["params"], **state["buffers"]}.items() if not isinstance(v, Tensor)]
        if bad:
            problems.append(f"params/buffers that are not tensors: {bad[:3]}")
        step_args = state.get("step_args", [[] for _ in range(n)])
        if not (isinstance(step_args, list) and len(step_args) == n and all(isinstance(a, list) for a in step_args)):
            problems.append(f"step_args (expected one list per microbatch, {n} in all)")
    if problems:
        raise NaNCaptureError(f"{path} is a damaged NaN capture: missing or invalid {'; '.join(problems)}", path)
    scale = state.get("loss_scale")
    return RankCapture(
        path=path,
        step=state["step"],
        rank=state["rank"],
        world_size=state["world_size"],
        reason=state["reason"],
        precision=state["precision"],
        device=state["device"],
        loss_scale=None if scale is None else float(scale),
        gradient_accumulation_steps=state["gradient_accumulation_steps"],
        params=state["params"],
        buffers=state["buffers"],
        microbatches=state["microbatches"],
        indices=state["indices"],
        rng=state["rng"],
        losses=state["losses"],
        nan_param_names=list(state["nan_param_names"]),
        settings=state.get("settings"),
        model_meta=state.get("model_meta"),
        model_class=state["model_class"],
        raw=state,
        largest_gradients=_largest_entries(state.get("largest_gradients")),
        step_args=state.get("step_args", [[] for _ in range(len(state["microbatches"]))]),
    )


def _largest_entries(value: Any) -> list[tuple[str, float]]:
    """The capture's ``largest_gradients`` (absent in older captures) as (name, value) pairs."""
    if not isinstance(value, list):
        return []
    return [
        (str(e["name"]), float(e["abs_max"]))
        for e in value
        if isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("abs_max"), (int, float))
    ]


def _unpickler_detail(message: str) -> str:
    """The useful part of torch's weights-only refusal, e.g. 'Unsupported global: GLOBAL os.system'."""
    _, sep, rest = message.partition("WeightsUnpickler error:")
    text = " ".join((rest if sep else message).split())
    text = text.split(" was not an allowed global")[0].split(" Check the documentation")[0]
    return text.strip() or "unreadable pickle"


def _capture_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise NaNCaptureError(f"no such file or folder: {path}", path)
    if (path / FILE_NAME).is_file():
        return [path / FILE_NAME]
    ranks = sorted(
        (int(d.name[4:]), d / FILE_NAME)
        for d in path.iterdir()
        if d.is_dir() and d.name.startswith("rank") and d.name[4:].isdigit() and (d / FILE_NAME).is_file()
    )
    if ranks:
        return [p for _, p in ranks]
    nested = path / "debug" / "nan_capture"
    if nested.is_dir():
        return _capture_files(nested)
    raise NaNCaptureError(
        f"no NaN capture in {path}: expected {path / FILE_NAME}, {path}/rank<N>/{FILE_NAME} or a run folder "
        f"with debug/nan_capture/ (captures are written when debug_args.nancapture.enabled=true and a step fails)",
        path,
    )


def load_nan_capture(
    path: str | Path,
    model: Optional[nn.Module] = None,
    step_fn: Optional[Callable[[nn.Module, Any], Tensor]] = None,
) -> "NaNCapture":
    """Load a NaN capture for replay.

    Args:
        path: A rank folder (``out/run/debug/nan_capture/rank0``), its ``nan_capture.pt``,
            the folder of all ranks (``out/run/debug/nan_capture``), or the run folder.
        model: Your own model (an instance of the class that was trained; its parameters
            and buffers are overwritten with the captured ones). Built-in models are rebuilt
            from the stored settings when this is None.
        step_fn: ``step_fn(model, batch) -> loss``; default: the step function of the
            stabletrain integration that took the capture (Lightning, Hugging Face Trainer),
            else ``model.training_step(batch)``.

    Returns:
        A :class:`NaNCapture`; call ``.replay()``.

    Raises:
        NaNCaptureError: Nothing found, or a file that cannot be used (see :func:`read_capture_file`).

    Example::

        cap = stabletrain.load_nan_capture("out/boom/debug/nan_capture/rank0")
        result = cap.replay()
        print(result.reproduced, result.nan_param_names, result.losses)
    """
    if model is not None and not isinstance(model, nn.Module):
        raise NaNCaptureError(
            f"model must be an instance of the torch.nn.Module class that was trained, got {type(model).__name__} "
            f"({model!r}); construct it as in training (complete the '# FILL IN' lines of a replay template)",
            path,
        )
    root = Path(path)
    parts = [read_capture_file(p) for p in _capture_files(root)]
    first = parts[0]
    problems = []
    for p in parts[1:]:
        for key in ("step", "world_size", "precision", "gradient_accumulation_steps"):
            if getattr(p, key) != getattr(first, key):
                problems.append(f"{p.path}: {key} {getattr(p, key)!r} differs from {first.path}'s {getattr(first, key)!r}")
    ranks = [p.rank for p in parts]
    if len(set(ranks)) != len(ranks):
        problems.append(f"the same rank appears twice: {ranks}")
    if problems:
        raise NaNCaptureError(
            f"the captures in {root} are not from one failing step (a stale capture of an older run?): " + "; ".join(problems),
            root,
        )
    return NaNCapture(root, parts, model=model, step_fn=step_fn)


# --------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------


def normalize_precision(precision: Any) -> str:
    """Fabric's precision names; raises ValueError listing the valid ones."""
    text = _ALIASES.get(str(precision), str(precision))
    if text not in REPLAY_PRECISIONS:
        raise ValueError(f"precision: cannot replay in {precision!r}; valid: {', '.join(REPLAY_PRECISIONS)}")
    return text


def precision_plugin(precision: str, device_type: str, loss_scale: Optional[float] = None) -> Any:
    """The Lightning Fabric precision plugin the trainer runs ``precision`` with.

    Replay drives forward and backward through the same plugin (input conversion, autocast,
    output conversion, loss scaling) so that it computes what training computed. For
    ``"16-mixed"`` the GradScaler starts at ``loss_scale`` (the captured scale); unlike
    ``Fabric(precision="16-mixed")`` this also works on the CPU.
    """
    from lightning_fabric.plugins import (
        DoublePrecision,
        HalfPrecision,
        MixedPrecision,
        Precision,
    )

    precision = normalize_precision(precision)
    if precision == "32-true":
        return Precision()
    if precision == "64-true":
        return DoublePrecision()
    if precision == "bf16-mixed":
        return MixedPrecision("bf16-mixed", device_type)
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler(device_type, init_scale=float(loss_scale or 2.0**16))
        return MixedPrecision("16-mixed", device_type, scaler=scaler)
    return HalfPrecision(precision)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# The reusable core: forward and backward over chosen microbatches and samples
# --------------------------------------------------------------------------------------


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
    capture: "NaNCapture",
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
    row_map = {capture._key(k): list(v) for k, v in (rows or {}).items()}
    prec = normalize_precision(precision or capture.precision)
    dev = torch.device(device) if device is not None else capture.default_device()
    model = model if model is not None else capture.get_model()
    fn = step_fn or capture.step_fn or default_step_fn
    if fn is default_step_fn and not callable(getattr(model, "training_step", None)):
        raise NaNCaptureError(
            f"{type(model).__name__} has no training_step(batch) -> loss; pass step_fn=my_step_fn "
            "(the function your loop computed the loss with) to load_nan_capture"
        )
    plugin = precision_plugin(prec, dev.type, capture.loss_scale)
    float_dtype = _float_dtype(prec, capture.precision)
    by_rank: dict[int, list[int]] = {}
    for rank, micro in keys:
        by_rank.setdefault(rank, []).append(micro)
    combined = len(by_rank) > 1
    world = capture.world_size
    accum = capture.gradient_accumulation_steps
    losses: list[Tensor] = []
    run_keys: list[MicrobatchKey] = []
    saved_rng = get_rng_state()
    try:
        model.to(dev)
        if float_dtype is not None:  # e.g. the float32 replay of a .half() model runs in float32
            model.to(float_dtype)
        model.train()
        summed: dict[str, Tensor] = {}
        ctx = context() if (context is not None and not hasattr(context, "__enter__")) else context
        grad_mode = torch.enable_grad() if backward else torch.no_grad()
        with grad_mode, (ctx if ctx is not None else contextlib.nullcontext()):
            for rank, micros in by_rank.items():
                part = capture.rank_capture(rank)
                _load_state(model, part, float_dtype, dev)
                for micro in micros:
                    batch = part.microbatches[micro]
                    if batch is None:
                        reason = "; ".join(part.raw.get("unstorable", [])) or "it could not be stored"
                        raise NaNCaptureError(f"microbatch {micro} of rank {rank} is not in the capture: {reason}", part.path)
                    if (rank, micro) in row_map:
                        batch = select_rows(batch, row_map[(rank, micro)], part.microbatch_size(micro))
                    batch = to_device(batch, dev)
                    set_rng_state(part.rng[micro])
                    with plugin.forward_context():
                        loss = fn(model, plugin.convert_input(batch), *part.step_args[micro])
                    loss = plugin.convert_output(loss)
                    if not isinstance(loss, Tensor) or loss.ndim != 0:
                        raise NaNCaptureError(
                            f"the step function must return a scalar loss tensor, got {type(loss).__name__}"
                            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
                        )
                    losses.append(loss.detach().to("cpu", copy=True))
                    run_keys.append((rank, micro))
                    if backward:
                        plugin.backward(loss / accum, model)
                if combined:
                    # DDP divides each rank's gradient by the world size and sums them.
                    for name, p in model.named_parameters():
                        if p.grad is not None:
                            g = p.grad / world
                            summed[name] = summed[name] + g if name in summed else g
                            p.grad = None
            if combined:
                for name, p in model.named_parameters():
                    p.grad = summed.get(name)
            scaler = getattr(plugin, "scaler", None)
            if scaler is not None:
                params = [p for p in model.parameters() if p.grad is not None]
                if params:
                    scaler.unscale_(torch.optim.SGD(params, lr=0.0))
    finally:
        set_rng_state(saved_rng)
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


def _float_dtype(target: str, captured: str) -> Optional[torch.dtype]:
    """The dtype floating parameters get for a replay in ``target``; None keeps the captured dtypes."""
    if target in _TRUE_DTYPES:
        return _TRUE_DTYPES[target]
    if target == "32-true":  # whatever the parameters were stored in: 32-true computes in float32
        return torch.float32
    if captured in _TRUE_DTYPES:  # a half/double run replayed in 32-bit or mixed precision
        return torch.float32
    return None


def _load_state(model: nn.Module, part: RankCapture, float_dtype: Optional[torch.dtype], device: torch.device) -> None:
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


# --------------------------------------------------------------------------------------
# The loaded capture and its replay
# --------------------------------------------------------------------------------------


@dataclass
class RankOutcome:
    """A replay of one rank's microbatches alone (multi-rank captures)."""

    rank: int
    reproduced: bool
    nan_param_names: list[str]
    losses: list[float]


@dataclass
class ReplayResult:
    """What :meth:`NaNCapture.replay` found.

    Attributes:
        reproduced: True when the replay fails again the way the captured step did: a
            non-finite loss or gradient element, or, for a ``gradient_norm_overflow``
            capture (every element finite), a float32 gradient norm that overflows again
            (see :meth:`ForwardBackwardResult.reproduces`).
        nan_param_names: Parameters whose replayed gradient is non-finite.
        losses: Replayed loss of each microbatch (rank by rank in a multi-rank replay).
        step: The captured optimizer step.
        precision: The precision the replay ran in; ``captured_precision`` the run's.
        device: Where the replay ran.
        captured_losses: The losses training saw, in the same order.
        losses_bitwise_equal: Whether each replayed loss has exactly the captured bits
            (NaN counts as equal to NaN); None when the capture holds no losses.
        captured_nan_param_names: What training reported.
        gradient_norm: L2 norm of the replayed gradient.
        gradient_norm_overflow: Every replayed gradient element is finite but their norm is not.
        largest_gradients: With ``gradient_norm_overflow``: (name, largest ``|gradient|``)
            of the parameters with the largest replayed gradient elements.
        reason: Why the step was captured (of several ranks: the one that failed).
        microbatches: (rank, micro_step) of each loss.
        ranks: Ranks replayed; ``missing_ranks``: ranks of the run without a capture here.
        per_rank: For several ranks, each rank's microbatches replayed alone.
        path: What was loaded.
    """

    reproduced: bool
    nan_param_names: list[str]
    losses: list[float]
    step: int
    precision: str
    captured_precision: str
    device: str
    captured_losses: list[float]
    losses_bitwise_equal: Optional[bool]
    captured_nan_param_names: list[str]
    gradient_norm: float
    microbatches: list[MicrobatchKey]
    ranks: list[int]
    world_size: int
    missing_ranks: list[int]
    reason: str
    per_rank: list[RankOutcome]
    path: str
    sample_indices: list[Optional[list[int]]] = field(default_factory=list)
    gradient_norm_overflow: bool = False
    largest_gradients: list[tuple[str, float]] = field(default_factory=list)

    @property
    def ranks_reproducing_alone(self) -> list[int]:
        """Ranks whose data alone reproduces the failure (multi-rank replays)."""
        return [o.rank for o in self.per_rank if o.reproduced]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; non-finite numbers become the strings "nan", "inf", "-inf"."""
        return {
            "reproduced": self.reproduced,
            "step": self.step,
            "nan_param_names": self.nan_param_names,
            "losses": [json_float(x) for x in self.losses],
            "captured_losses": [json_float(x) for x in self.captured_losses],
            "losses_bitwise_equal": self.losses_bitwise_equal,
            "captured_nan_param_names": self.captured_nan_param_names,
            "gradient_norm": json_float(self.gradient_norm),
            "gradient_norm_overflow": self.gradient_norm_overflow,
            "largest_gradients": [{"name": n, "abs_max": json_float(v)} for n, v in self.largest_gradients],
            "precision": self.precision,
            "captured_precision": self.captured_precision,
            "device": self.device,
            "microbatches": [{"rank": r, "micro_step": m} for r, m in self.microbatches],
            "sample_indices": self.sample_indices,
            "ranks": self.ranks,
            "world_size": self.world_size,
            "missing_ranks": self.missing_ranks,
            "reason": self.reason,
            "ranks_reproducing_alone": self.ranks_reproducing_alone,
            "per_rank": [
                {"rank": o.rank, "reproduced": o.reproduced, "nan_param_names": o.nan_param_names,
                 "losses": [json_float(x) for x in o.losses]}
                for o in self.per_rank
            ],
            "path": self.path,
        }

    def __str__(self) -> str:
        return self.to_text()

    def to_text(self) -> str:
        """The human-readable account ``stabletrain replay`` prints."""
        ranks = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {', '.join(map(str, self.ranks))}"
        prec = self.precision + (" (as captured)" if self.precision == self.captured_precision else f" (captured in {self.captured_precision})")
        lines = [
            f"Replayed step {self.step} from {self.path}",
            f"  {ranks} of world size {self.world_size}, {len(self.microbatches)} microbatch(es), precision {prec}, device {self.device}",
        ]
        if self.missing_ranks:
            lines.append(
                f"  warning: no capture of rank(s) {', '.join(map(str, self.missing_ranks))}: the gradient is not the full DDP gradient"
            )
        largest = "largest |gradient|: " + ", ".join(
            f"{n} {fmt_number(v, MEASURED_DIGITS)}" for n, v in self.largest_gradients
        )
        if self.reproduced:
            if self.nan_param_names:
                what = f"non-finite gradients in {len(self.nan_param_names)} parameter(s): {fmt_list(self.nan_param_names, 8)}"
            elif any(not math.isfinite(x) for x in self.losses):
                what = "non-finite loss (gradients finite)"
            else:
                what = f"gradient norm overflow: every gradient element is finite, but the float32 gradient norm overflows ({largest})"
            lines.append(f"  reproduced: YES - {what}")
        elif self.gradient_norm_overflow:
            lines.append(f"  reproduced: NO - no loss or gradient element is non-finite as in training, though the float32 "
                         f"gradient norm overflows ({largest})")
        else:
            lines.append("  reproduced: NO - every replayed loss and gradient is finite"
                         + (", and so is the gradient norm" if self.reason == REASON_NORM_OVERFLOW else ""))
        lines.append(f"  gradient_norm: {fmt_number(self.gradient_norm, MEASURED_DIGITS)}")
        lines.append("  microbatch  rank  loss (replay)     loss (captured)   samples")
        for i, ((rank, micro), loss) in enumerate(zip(self.microbatches, self.losses)):
            cap = fmt_number(self.captured_losses[i], MEASURED_DIGITS) if i < len(self.captured_losses) else "-"
            samples = self.sample_indices[i] if i < len(self.sample_indices) else None
            shown = "-" if samples is None else fmt_list(samples, 6)
            lines.append(f"  {micro:<10}  {rank:<4}  {fmt_number(loss, MEASURED_DIGITS):<16}  {cap:<16}  {shown}")
        if self.losses_bitwise_equal is True:
            lines.append("  losses: bitwise equal to the captured ones")
        elif self.losses_bitwise_equal is False:
            why = " (expected: replayed in another precision)" if self.precision != self.captured_precision else (
                " (nondeterministic kernels, a different device or library version, or state the capture does not hold)"
            )
            lines.append(f"  losses: differ from the captured ones{why}")
        if self.per_rank:
            for o in self.per_rank:
                state = "non-finite -> reproduces the failure alone" if o.reproduced else "finite"
                lines.append(f"  rank {o.rank}'s microbatches alone: {state}")
            alone = self.ranks_reproducing_alone
            if alone:
                lines.append(f"  -> the data of rank(s) {', '.join(map(str, alone))} alone reproduces the NaN")
            elif self.reproduced:
                lines.append("  -> no single rank's data reproduces it alone: only their combination does")
        if not self.reproduced and self.precision != self.captured_precision:
            lines.append(
                f"  In {self.precision} this step is finite: the failure comes from the range or rounding of "
                f"{self.captured_precision} arithmetic (replay without --precision to see it fail)."
            )
        elif not self.reproduced:
            lines.append(
                "  The captured state and data do not produce the failure here. Suspects: nondeterministic GPU kernels "
                "or hardware faults (replay on the original device), or an effect outside the model's forward and "
                "backward (a callback or hook that changed gradients, memory corruption)."
            )
        return "\n".join(lines)


class NaNCapture:
    """A loaded NaN capture: one rank's, or every rank's of a distributed run.

    Attributes:
        path: What was loaded.
        ranks: One :class:`RankCapture` per rank found, by rank.
        model: Your model, when given; else a built-in one is rebuilt on first use.
        step_fn: ``step_fn(model, batch) -> loss``, when given.
    """

    def __init__(
        self,
        path: Path,
        ranks: list[RankCapture],
        model: Optional[nn.Module] = None,
        step_fn: Optional[Callable[[nn.Module, Any], Tensor]] = None,
    ):
        self.path = Path(path)
        self.ranks = sorted(ranks, key=lambda r: r.rank)
        self.model = model
        self.step_fn = step_fn or _integration_object(self.ranks[0], self.ranks[0].raw.get("step_fn"))

    # ------------------------------------------------------------------ facts

    @property
    def step(self) -> int:
        return self.ranks[0].step

    @property
    def rank(self) -> Optional[int]:
        """The rank, for a single-rank capture; None when several are loaded."""
        return self.ranks[0].rank if len(self.ranks) == 1 else None

    @property
    def world_size(self) -> int:
        return self.ranks[0].world_size

    @property
    def precision(self) -> str:
        return self.ranks[0].precision

    @property
    def loss_scale(self) -> Optional[float]:
        return self.ranks[0].loss_scale

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.ranks[0].gradient_accumulation_steps

    @property
    def settings(self) -> Optional[dict[str, Any]]:
        return self.ranks[0].settings

    @property
    def reason(self) -> str:
        """Why the step was captured; of several ranks, the reason of one that failed (the
        others stopped with it: ``other_rank``)."""
        return next((r.reason for r in self.ranks if r.reason != REASON_OTHER_RANK), self.ranks[0].reason)

    @property
    def missing_ranks(self) -> list[int]:
        have = {r.rank for r in self.ranks}
        return [r for r in range(self.world_size) if r not in have]

    @property
    def nan_param_names(self) -> list[str]:
        """Every rank's reported names, in first-seen order."""
        return list(dict.fromkeys(n for r in self.ranks for n in r.nan_param_names))

    def rank_capture(self, rank: int) -> RankCapture:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(f"rank {rank} is not in this capture (ranks: {[r.rank for r in self.ranks]})")

    def microbatch_keys(self, which: Optional[Iterable[Union[int, MicrobatchKey]]] = None) -> list[MicrobatchKey]:
        """All (rank, micro_step) pairs, or ``which`` normalised and checked."""
        if which is None:
            return [(r.rank, m) for r in self.ranks for m in range(r.num_microbatches)]
        keys = [self._key(k) for k in which]
        for rank, micro in keys:
            n = self.rank_capture(rank).num_microbatches
            if not 0 <= micro < n:
                raise IndexError(f"microbatch {micro} of rank {rank}: the capture holds micro steps 0..{n - 1}")
        return keys

    def _key(self, key: Union[int, MicrobatchKey]) -> MicrobatchKey:
        if isinstance(key, tuple):
            return int(key[0]), int(key[1])
        if len(self.ranks) != 1:
            raise ValueError(f"microbatch {key!r}: this capture holds ranks {[r.rank for r in self.ranks]}; use (rank, micro_step) pairs")
        return self.ranks[0].rank, int(key)

    def default_device(self) -> torch.device:
        if self.ranks[0].device == "cuda" and torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")

    # ------------------------------------------------------------------ model

    def build_model(self) -> nn.Module:
        """A fresh built-in model from the stored settings (state not yet restored).

        Raises:
            NaNCaptureError: The capture is of your own model; pass ``model=`` to load_nan_capture.
        """
        settings = self.settings
        meta = self.ranks[0].model_meta or {}
        builder = _integration_object(self.ranks[0], meta.get("builder")) if not settings else None
        if builder is not None:
            # A framework integration's capture (e.g. a Hugging Face model rebuilt from its config).
            return builder(meta)
        if not settings or settings.get("task") in (None, "custom"):
            cls = self.ranks[0].model_class
            raise NaNCaptureError(
                f"this capture is of your own model ({cls}), which cannot be rebuilt from settings: "
                f"pass it, e.g. load_nan_capture({str(self.path)!r}, model={cls.rsplit('.', 1)[-1]}()), "
                f"or on the command line: stabletrain replay {shell_path(self.path)} --model path/to/file.py:{cls.rsplit('.', 1)[-1]}",
                self.path,
            )
        from stabletrain.config import settings_from_resolved
        from stabletrain.tasks import build_model

        try:
            run_settings = settings_from_resolved(settings)
            return build_model(run_settings, dict(self.ranks[0].model_meta or {}))
        except Exception as exc:
            raise NaNCaptureError(
                f"cannot rebuild the model of {self.path} from its stored settings: {type(exc).__name__}: {exc}",
                self.path,
            ) from None

    def get_model(self) -> nn.Module:
        """The model replays run on: the one given, else a rebuilt built-in one (cached)."""
        if self.model is None:
            self.model = self.build_model()
        return self.model

    # ------------------------------------------------------------------ replay

    def forward_backward(self, **kwargs: Any) -> ForwardBackwardResult:
        """:func:`forward_backward` on this capture."""
        return forward_backward(self, **kwargs)

    def replay(
        self,
        fabric: Any = None,
        precision: Optional[str] = None,
        device: Optional[Union[str, torch.device]] = None,
    ) -> ReplayResult:
        """Rerun the captured step's forward and backward passes; stop before clipping and
        the optimizer step.

        Args:
            fabric: A Lightning Fabric whose precision and device to use.
            precision: Overrides the precision ("32-true", "64-true", "bf16-mixed",
                "16-mixed", "bf16-true", "16-true"); default: the captured one.
            device: Overrides the device; default: the captured device type when
                available, else the CPU.

        Returns:
            A :class:`ReplayResult`. For several ranks, it also holds each rank's
            microbatches replayed alone (``per_rank``, ``ranks_reproducing_alone``).

        Example::

            result = stabletrain.load_nan_capture("out/boom/debug/nan_capture/rank0").replay()
            assert result.reproduced, result
        """
        if fabric is not None:
            precision = precision or getattr(fabric.strategy.precision, "precision", None)
            device = device if device is not None else fabric.device
        full = forward_backward(self, precision=precision, device=device)
        per_rank = []
        if len(self.ranks) > 1:
            for part in self.ranks:
                alone = forward_backward(
                    self, microbatches=[(part.rank, m) for m in range(part.num_microbatches)], precision=precision, device=device
                )
                per_rank.append(RankOutcome(part.rank, alone.reproduces(self.reason), alone.nonfinite_param_names, alone.loss_values))
        captured = [loss for r in self.ranks for loss in r.losses]
        bitwise: Optional[bool] = None
        if len(captured) == len(full.losses) and captured:
            bitwise = all(bitwise_equal(a, b.to(a.device)) for a, b in zip(full.losses, captured))
        indices = []
        for rank, micro in full.microbatches:
            ix = self.rank_capture(rank).indices[micro]
            indices.append(ix.tolist() if isinstance(ix, Tensor) else None)
        dev = torch.device(device) if device is not None else self.default_device()
        return ReplayResult(
            reproduced=full.reproduces(self.reason),
            nan_param_names=full.nonfinite_param_names,
            losses=full.loss_values,
            step=self.step,
            precision=full.precision,
            captured_precision=self.precision,
            device=str(dev),
            captured_losses=[float(x) for x in captured],
            losses_bitwise_equal=bitwise,
            captured_nan_param_names=self.nan_param_names,
            gradient_norm=full.gradient_norm,
            microbatches=full.microbatches,
            ranks=[r.rank for r in self.ranks],
            world_size=self.world_size,
            missing_ranks=self.missing_ranks,
            reason=self.reason,
            per_rank=per_rank,
            path=str(self.path),
            sample_indices=indices,
            gradient_norm_overflow=full.gradient_norm_overflow,
            largest_gradients=full.largest_gradients,
        )

    def diagnose(self, **kwargs: Any) -> stabletrain.Diagnosis:
        """:func:`stabletrain.diagnose` on this capture: which op, module and sample, and why.
        Writes ``diagnosis.md`` and ``diagnosis.json`` next to the capture unless ``write=False``.

        Example::

            print(stabletrain.load_nan_capture("out/boom/debug/nan_capture/rank0").diagnose())
        """
        # Through the package's public name: replay sits below diagnose and never imports it.
        return stabletrain.diagnose(self, **kwargs)

    def __repr__(self) -> str:
        return (
            f"NaNCapture(path={str(self.path)!r}, step={self.step}, ranks={[r.rank for r in self.ranks]}, "
            f"world_size={self.world_size}, precision={self.precision!r}, reason={self.reason!r})"
        )


def _integration_object(part: RankCapture, name: Any) -> Any:
    """The step function or model builder a capture names, when it is one of stabletrain's
    integrations (``stabletrain.integrations.<framework>.<name>`` or ``...:<name>``); else None.
    Names outside that package are never imported: loading a capture runs no foreign code."""
    if not isinstance(name, str) or not name.startswith(INTEGRATIONS_PACKAGE):
        return None
    module, sep, attr = name.partition(":")
    if not sep:
        module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise NaNCaptureError(
            f"{part.path} was captured through {module}, which cannot be imported here ({type(exc).__name__}: {exc}); "
            "install the framework it was trained with (pip install \"stabletrain[lightning]\", "
            "\"stabletrain[transformers]\" or \"stabletrain[accelerate]\")",
            part.path,
        ) from None


def load_object(spec: str) -> Any:
    """``path/to/file.py:Name`` or ``package.module:Name`` -> the object, for ``--model`` and
    ``--step-fn`` and the replay templates of :func:`~stabletrain.debug.nan_capture.default_replay_command`
    (see :func:`stabletrain.utils.imports.load_object`; errors are :class:`NaNCaptureError`)."""
    return imports.load_object(spec, error=NaNCaptureError)
