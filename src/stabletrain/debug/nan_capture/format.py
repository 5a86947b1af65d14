"""The capture file, ``<out>/debug/nan_capture/rank<N>/nan_capture.pt``: its schema, written and read here.

A capture holds only tensors, numbers, strings, lists, tuples and dicts, plus a format name and version,
so it loads with ``torch.load(weights_only=True)`` and never runs code; every entry is checked before use.
See ``docs/nancapture.md``.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import Tensor

from stabletrain.utils.io import atomic_torch_save
from stabletrain.utils.rng import storable_rng_state
from stabletrain.utils.text import fmt_list
from stabletrain.utils.tree import cpu_copy, leading_size, to_storable

from .errors import NaNCaptureError

#: The ``format`` entry of every capture file, and the newest ``version`` this code writes and reads.
FORMAT = "stabletrain.nan_capture"
VERSION = 2
#: The version of an unsharded capture (every parameter whole); version 2 marks a sharded one (FSDP2:
#: this rank's parameter shards, their ``params_layout`` and ``"sharded": True``), so that older readers
#: refuse a file they would read as a model. Unsharded captures keep version 1 and read anywhere.
UNSHARDED_VERSION = 1
FILE_NAME = "nan_capture.pt"


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


def write_capture_file(
    path: Path,
    *,
    step: int,
    rank: int,
    world_size: int,
    reason: str,
    precision: str,
    device: str,
    loss_scale: Optional[float],
    consecutive_skipped_steps: int,
    gradient_accumulation_steps: int,
    params: Iterable[tuple[str, Tensor]],
    buffers: Iterable[tuple[str, Tensor]],
    microbatches: Sequence[Any],
    indices: Sequence[Any],
    step_args: Sequence[Sequence[Any]],
    rng: Sequence[Any],
    losses: Sequence[Tensor],
    nan_param_names: Sequence[str],
    largest_gradients: Sequence[tuple[str, float]],
    settings: Optional[dict[str, Any]],
    model_meta: Optional[dict[str, Any]],
    model_class: str,
    step_fn: Optional[str],
    replay_command: str,
    extra: Optional[dict[str, Any]] = None,
    params_layout: Optional[dict[str, dict[str, Any]]] = None,
) -> Path:
    """Write one rank's capture to ``path`` atomically, converted to storable types (CPU tensors,
    RNG states as tensors); :func:`read_capture_file` reads it back. Returns ``path``.

    A microbatch that cannot be stored safely (an object other than tensors, numbers, strings and
    containers) is written as None, with the reason in the ``unstorable`` entry. ``extra`` adds entries
    (tensors, numbers, strings, lists, dicts only).

    With ``params_layout`` (the ``layout`` of :func:`stabletrain.distributed.local_shards`), ``params``
    are this rank's shards of a sharded model: the file is version 2, marked ``"sharded": True``, and
    replay needs every rank's file to put the parameters back together.

    Raises:
        NaNCaptureError: The file cannot be written.
    """
    batches, unstorable = storable_microbatches(microbatches)
    sharded = {} if params_layout is None else {"sharded": True, "params_layout": params_layout}
    state = {
        "format": FORMAT,
        "version": UNSHARDED_VERSION if params_layout is None else VERSION,
        "step": int(step),
        "rank": rank,
        "world_size": world_size,
        "reason": reason,
        "precision": precision,
        "device": device,
        "loss_scale": loss_scale,
        "consecutive_skipped_steps": consecutive_skipped_steps,
        "gradient_accumulation_steps": int(gradient_accumulation_steps),
        "params": {n: cpu_copy(p) for n, p in params},
        **sharded,
        "buffers": {n: cpu_copy(b) for n, b in buffers},
        "microbatches": batches,
        "unstorable": unstorable,
        "indices": [_indices_to_storable(ix) for ix in indices],
        # Absent in older captures; read as no arguments.
        "step_args": [to_storable(list(a), f"step_args of microbatch {i}") for i, a in enumerate(step_args)],
        "rng": [storable_rng_state(r) for r in rng],
        "losses": [cpu_copy(loss) for loss in losses],
        "nan_param_names": list(nan_param_names),
        # With gradient_norm_overflow: the parameters with the largest |gradient| element.
        "largest_gradients": [{"name": n, "abs_max": v} for n, v in largest_gradients],
        "settings": settings,
        "model_meta": model_meta,
        "model_class": model_class,
        "step_fn": step_fn,
        "replay_command": replay_command,
        "stabletrain_version": _stabletrain_version(),
        "torch_version": str(torch.__version__),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        **(extra or {}),
    }
    try:
        return atomic_torch_save(state, path)
    except OSError as exc:
        raise NaNCaptureError(f"cannot write the NaN capture to {path}: {exc}", path) from exc


def storable_microbatches(microbatches: Sequence[Any]) -> tuple[list[Any], list[str]]:
    """The microbatches as CPU copies of storable types (None where one cannot be stored safely),
    and why each unstorable one could not be."""
    batches, unstorable = [], []
    for i, b in enumerate(microbatches):
        try:
            batches.append(to_storable(b, f"microbatch {i}"))
        except TypeError as exc:
            batches.append(None)
            unstorable.append(str(exc))
    return batches, unstorable


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
# Reading
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
        sharded: The run was sharded (FSDP2, format version 2): as read from one file, ``params``
            holds this rank's shards and ``params_layout`` their places;
            :func:`stabletrain.load_nan_capture` replaces them by the full parameters of all ranks.
        params_layout: For a sharded capture, ``{name: {"shape", "offset", "sharded"}}`` of each
            parameter's shard; else None.
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
    sharded: bool = False
    params_layout: Optional[dict[str, dict[str, Any]]] = None

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
    state = _load_weights_only(path)
    _check_format_and_version(path, state)
    problems = schema_problems(state)
    if problems:
        raise NaNCaptureError(f"{path} is a damaged NaN capture: missing or invalid {'; '.join(problems)}", path)
    return _rank_capture(path, state)


def _load_weights_only(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of ``path``, its failures said as NaNCaptureError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
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


def _check_format_and_version(path: Path, state: Any) -> None:
    """A stabletrain capture of a format version this code reads, else NaNCaptureError."""
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


def schema_problems(state: dict[str, Any]) -> list[str]:
    """What is missing or invalid in a capture's entries (empty when it can be used)."""
    problems = [
        f"{key} (expected {kind.__name__}, got {type(state.get(key)).__name__})"
        for key, kind in _REQUIRED.items()
        if not isinstance(state.get(key), kind)
    ]
    if problems:
        return problems
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
    if state.get("sharded", False) or state.get("version") == VERSION:
        problems.extend(_layout_problems(state))
    return problems


def _layout_problems(state: dict[str, Any]) -> list[str]:
    """What is wrong with a sharded (version 2) capture's ``sharded`` flag and ``params_layout``."""
    if state.get("sharded") is not True:
        return [f"sharded (expected True in a version {VERSION} capture, got {state.get('sharded')!r})"]
    layout = state.get("params_layout")
    if not isinstance(layout, dict):
        return [f"params_layout (expected dict, got {type(layout).__name__})"]
    if set(layout) != set(state["params"]):
        differ = sorted(set(layout) ^ set(state["params"]))
        return [f"params_layout (its names differ from params': {fmt_list(differ)})"]
    bad = [
        name for name, lay in layout.items()
        if not (isinstance(lay, dict) and isinstance(lay.get("shape"), list) and isinstance(lay.get("offset"), list)
                and isinstance(state["params"][name], Tensor)
                and len(lay["shape"]) == len(lay["offset"]) == state["params"][name].ndim
                and isinstance(lay.get("sharded"), bool))
    ]
    return [f"params_layout entries (need shape, offset and sharded per parameter): {fmt_list(bad)}"] if bad else []


def _rank_capture(path: Path, state: dict[str, Any]) -> RankCapture:
    """The checked ``state`` as a :class:`RankCapture`; optional entries absent in older captures default."""
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
        sharded=bool(state.get("sharded", False)),
        params_layout=state.get("params_layout"),
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


def capture_files(path: Path) -> list[Path]:
    """The capture files at ``path``: a file, a rank folder, the folder of ranks (in rank order) or a run folder.

    Raises:
        NaNCaptureError: None found.
    """
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
        return capture_files(nested)
    recoveries = recovery_captures(path)
    if recoveries:
        return capture_files(recoveries[-1])  # the newest recovery (stabletrain diagnose lists the others)
    raise NaNCaptureError(
        f"no NaN capture in {path}: expected {path / FILE_NAME}, {path}/rank<N>/{FILE_NAME} or a run folder "
        f"with debug/nan_capture/ (captures are written when debug_args.nancapture.enabled=true and a step fails) "
        f"or debug/recoveries/ (written by on_instability.policy=skip_step or rollback at each recovery)",
        path,
    )


def recovery_captures(run: Path) -> list[Path]:
    """The capture folders the self-healing wrote under ``run/debug/recoveries/`` (``step<N>``,
    ``step<N>_r<k>`` when a step number came back), oldest first (by the time they were written)."""
    root = Path(run) / "debug" / "recoveries"
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        files = sorted(d.glob(f"rank*/{FILE_NAME}")) if d.is_dir() else []
        if files:
            found.append((min(f.stat().st_mtime for f in files), d.name, d))
    return [d for _, _, d in sorted(found)]

