"""A loaded NaN capture: :func:`load_nan_capture` reads one rank's capture or every rank's (the files
are checked by :mod:`stabletrain.debug.nan_capture.format`), and :meth:`NaNCapture.replay` reruns the
failing step. See ``docs/nancapture.md``."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor, nn

import stabletrain
from stabletrain.debug.nan_capture import (
    FILE_NAME,
    INTEGRATIONS_PACKAGE,
    REASON_OTHER_RANK,
    NaNCaptureError,
    RankCapture,
    capture_files,
    read_capture_file,
)
from stabletrain.distributed.shards import SHARDS_FORMAT, SHARDS_VERSION, ShardError, reassemble, replicated_mismatches
from stabletrain.utils import imports
from stabletrain.utils.text import shell_path
from stabletrain.utils.tree import bitwise_equal

from .optimizer import replay_optimizer_step
from .rerun import ForwardBackwardResult, MicrobatchKey, forward_backward
from .result import RankOutcome, ReplayResult


def load_nan_capture(
    path: str | Path,
    model: Optional[nn.Module] = None,
    step_fn: Optional[Callable[[nn.Module, Any], Tensor]] = None,
) -> "NaNCapture":
    """Load a NaN capture for replay.

    Args:
        path: A rank folder (``out/run/debug/nan_capture/rank0``), its ``nan_capture.pt``,
            the folder of all ranks (``out/run/debug/nan_capture``), or the run folder.
            A sharded (FSDP) run's capture always loads every rank's folder (from a rank
            folder, its siblings): each rank holds only its shard of the parameters, and they
            are put back together into the full model here.
        model: Your own model (an instance of the class that was trained; its parameters
            and buffers are overwritten with the captured ones). Built-in models are rebuilt
            from the stored settings when this is None.
        step_fn: ``step_fn(model, batch) -> loss``; default: the step function of the
            stabletrain integration that took the capture (Lightning, Hugging Face Trainer),
            else ``model.training_step(batch)``.

    Returns:
        A :class:`NaNCapture`; call ``.replay()``.

    Raises:
        NaNCaptureError: Nothing found, or a file that cannot be used (see :func:`read_capture_file`);
            of a sharded run, a rank's file missing (named) or shards that do not fit together.

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
    parts = [read_capture_file(p) for p in capture_files(root)]
    if any(p.sharded for p in parts):
        parts = _all_rank_parts(root, parts)
    first = parts[0]
    problems = []
    for p in parts[1:]:
        for key in ("step", "world_size", "precision", "gradient_accumulation_steps"):
            if getattr(p, key) != getattr(first, key):
                problems.append(
                    f"{p.path}: {key} {getattr(p, key)!r} differs from {first.path}'s {getattr(first, key)!r}"
                )
    ranks = [p.rank for p in parts]
    if len(set(ranks)) != len(ranks):
        problems.append(f"the same rank appears twice: {ranks}")
    if problems:
        raise NaNCaptureError(
            f"the captures in {root} are not from one failing step (a stale capture of an older run?): "
            + "; ".join(problems),
            root,
        )
    mismatched: list[str] = []
    if first.sharded:
        parts, mismatched = _reassembled(root, parts)
    cap = NaNCapture(root, parts, model=model, step_fn=step_fn)
    cap.buffer_mismatches = mismatched
    return cap


def _all_rank_parts(root: Path, parts: list[RankCapture]) -> list[RankCapture]:
    """Every rank's capture of a sharded run: given one rank's folder or file, its siblings too.

    Raises:
        NaNCaptureError: A rank's file is missing (named), or the files mix sharded and unsharded runs.
    """
    first = parts[0]
    if len(parts) == 1 and first.world_size > 1:
        # One rank's folder (or its file) was given: the other ranks' folders are its siblings.
        try:
            parts = [read_capture_file(p) for p in capture_files(first.path.parent.parent)]
        except NaNCaptureError:
            pass  # not in a folder of ranks: the error below names the missing files
    unsharded = [str(p.path) for p in parts if not p.sharded]
    if unsharded:
        raise NaNCaptureError(
            f"the captures in {root} mix a sharded (FSDP) run with unsharded files ({', '.join(unsharded)}): "
            "a stale capture of an older run? Keep only the folders of one failing step",
            root,
        )
    have = {p.rank for p in parts}
    missing = [r for r in range(first.world_size) if r not in have]
    if missing:
        folder = first.path.parent.parent
        raise NaNCaptureError(
            f"this capture is of a sharded (FSDP) run of {first.world_size} processes: each rank wrote only its "
            f"shard of the parameters, and replay needs all of them. Missing: "
            + ", ".join(str(folder / f"rank{r}" / FILE_NAME) for r in missing)
            + f" (ranks {missing}); copy every rank's folder rank0..rank{first.world_size - 1} into {folder}",
            root,
        )
    return parts


def _reassembled(root: Path, parts: list[RankCapture]) -> tuple[list[RankCapture], list[str]]:
    """The sharded ranks' captures, each holding the full parameters put together from all ranks'
    shards (one dict, shared); and the buffers whose copies differ between ranks (FSDP does not
    synchronise buffers: each rank replays with its own)."""
    try:
        full = reassemble([_shard_dict(p, p.params, p.params_layout) for p in parts])
        mismatched = replicated_mismatches([_shard_dict(p, p.buffers, None) for p in parts])
        parts = [dataclasses.replace(p, params=full) for p in parts]
        if isinstance(parts[0].raw.get("optimizer_step"), dict) and "grads_shards" in parts[0].raw["optimizer_step"]:
            parts = _optimizer_step_reassembled(parts)
    except ShardError as exc:
        raise NaNCaptureError(f"cannot put the sharded capture in {root} back together: {exc}", root) from None
    return parts, mismatched


def _optimizer_step_reassembled(parts: list[RankCapture]) -> list[RankCapture]:
    """A sharded run's optimizer-step capture: the gradients and optimizer state of every rank put
    together (the form an unsharded capture holds), and what the re-run found non-finite on each rank
    joined, so that any rank's record reads as the whole step's."""
    entries = [p.raw["optimizer_step"] for p in parts]
    grads = reassemble([e["grads_shards"] for e in entries])
    flat = reassemble([e["state_shards"] for e in entries])
    state = {int(i): dict(st) for i, st in entries[0]["state_dict"]["state"].items()}
    for key, value in flat.items():
        index, name = key.split("/", 1)
        state.setdefault(int(index), {})[name] = value
    counts: dict[str, int] = {}
    for e in entries:
        for name, n in e["after"]["nonfinite_params"].items():
            counts[name] = counts.get(name, 0) + int(n)
    after = {"nonfinite_params": counts,
             "nonfinite_state": list(dict.fromkeys(x for e in entries for x in e["after"]["nonfinite_state"]))}
    joined = {**entries[0], "grads": grads, "after": after,
              "reproduced_in_rerun": bool(counts or after["nonfinite_state"]),
              "state_dict": {"state": state, "param_groups": entries[0]["state_dict"]["param_groups"]}}
    return [dataclasses.replace(p, raw={**p.raw, "optimizer_step": joined}) for p in parts]


def _shard_dict(part: RankCapture, tensors: dict[str, Tensor], layout: Optional[dict[str, Any]]) -> dict[str, Any]:
    """One rank's tensors in the form :func:`~stabletrain.distributed.local_shards` returns; without a
    layout, whole (replicated) tensors."""
    if layout is None:
        layout = {n: {"shape": list(t.shape), "offset": [0] * t.ndim, "sharded": False} for n, t in tensors.items()}
    return {"format": SHARDS_FORMAT, "version": SHARDS_VERSION, "rank": part.rank, "world_size": part.world_size,
            "tensors": tensors, "layout": layout}


class NaNCapture:
    """A loaded NaN capture: one rank's, or every rank's of a distributed run.

    Attributes:
        path: What was loaded.
        ranks: One :class:`RankCapture` per rank found, by rank.
        model: Your model, when given; else a built-in one is rebuilt on first use.
        step_fn: ``step_fn(model, batch) -> loss``, when given.
        sharded: The run was sharded (FSDP2): every rank's file was read and each rank's
            ``params`` is the full model, put together from their shards.
        buffer_mismatches: Of a sharded run, the buffers whose copies differ between ranks
            (FSDP does not synchronise buffers; each rank's microbatches replay with its own).
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
        #: Sharded (FSDP) captures: buffers whose copies differ between ranks; each rank replays with its own.
        self.buffer_mismatches: list[str] = []

    # ------------------------------------------------------------------ facts

    @property
    def sharded(self) -> bool:
        return self.ranks[0].sharded

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
        keys = [self.microbatch_key(k) for k in which]
        for rank, micro in keys:
            n = self.rank_capture(rank).num_microbatches
            if not 0 <= micro < n:
                raise IndexError(f"microbatch {micro} of rank {rank}: the capture holds micro steps 0..{n - 1}")
        return keys

    def microbatch_key(self, key: Union[int, MicrobatchKey]) -> MicrobatchKey:
        """``key`` as a (rank, micro_step) pair: a plain int names a microbatch of a single-rank capture."""
        if isinstance(key, tuple):
            return int(key[0]), int(key[1])
        if len(self.ranks) != 1:
            raise ValueError(
                f"microbatch {key!r}: this capture holds ranks {[r.rank for r in self.ranks]}; "
                "use (rank, micro_step) pairs"
            )
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
                f"or on the command line: stabletrain replay {shell_path(self.path)} "
                f"--model {_model_spec(self.ranks[0].raw, cls)}",
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
        the optimizer step, except for an optimizer-step capture (``reason="optimizer_step"``):
        its optimizer step is replayed too, from the captured state, and ``reproduced`` says
        whether it fails the guard's check again (:attr:`ReplayResult.optimizer_step`).

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
        per_rank = self._ranks_alone(precision, device) if len(self.ranks) > 1 else []
        captured = [loss for r in self.ranks for loss in r.losses]
        bitwise: Optional[bool] = None
        if len(captured) == len(full.losses) and captured:
            bitwise = all(bitwise_equal(a, b.to(a.device)) for a, b in zip(full.losses, captured))
        indices = []
        for rank, micro in full.microbatches:
            ix = self.rank_capture(rank).indices[micro]
            indices.append(ix.tolist() if isinstance(ix, Tensor) else None)
        dev = torch.device(device) if device is not None else self.default_device()
        reproduced = full.reproduces(self.reason)
        outcome = None
        entry = self.ranks[0].raw.get("optimizer_step")
        if isinstance(entry, dict) and len(self.ranks) == 1:
            dtype = None if precision is None or full.precision == self.precision else _param_dtype(full.precision)
            outcome = replay_optimizer_step(self.get_model(), self.ranks[0], entry, dev, dtype)
            bad_in_training = set(entry["after"]["nonfinite_params"]) | set(entry["after"]["nonfinite_state"])
            if bad_in_training:
                same = set(outcome.nonfinite_params) == set(entry["after"]["nonfinite_params"])
                reproduced = outcome.nonfinite and same
            else:  # every value was finite in training: the check's norm overflowed
                reproduced = not outcome.nonfinite and bool(outcome.trips)
            reproduced = reproduced and outcome.rebuilt
        return ReplayResult(
            optimizer_step=outcome,
            captured_device=str(self.ranks[0].device),
            reproduced=reproduced,
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

    def _ranks_alone(
        self, precision: Optional[str], device: Optional[Union[str, torch.device]]
    ) -> list[RankOutcome]:
        """Each rank's microbatches replayed alone: whose data reproduces the failure by itself."""
        outcomes = []
        for part in self.ranks:
            keys = [(part.rank, m) for m in range(part.num_microbatches)]
            alone = forward_backward(self, microbatches=keys, precision=precision, device=device)
            outcomes.append(
                RankOutcome(part.rank, alone.reproduces(self.reason), alone.nonfinite_param_names, alone.loss_values)
            )
        return outcomes

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


def _model_spec(raw: dict[str, Any], cls: str) -> str:
    """The ``--model`` value the training run printed (kept in the capture's replay command), else
    a placeholder naming the class."""
    import shlex

    command = raw.get("replay_command") or ""
    try:
        words = shlex.split(command) if not command.startswith("import ") else []
    except ValueError:
        words = []
    if "--model" in words[:-1]:
        return shell_path(words[words.index("--model") + 1])
    return f"path/to/file.py:{cls.rsplit('.', 1)[-1]}"


def load_object(spec: str) -> Any:
    """``path/to/file.py:Name`` or ``package.module:Name`` -> the object, for ``--model`` and
    ``--step-fn`` and the replay templates of :func:`~stabletrain.debug.nan_capture.default_replay_command`
    (see :func:`stabletrain.utils.imports.load_object`; errors are :class:`NaNCaptureError`)."""
    return imports.load_object(spec, error=NaNCaptureError)


def _param_dtype(precision: str) -> Optional[torch.dtype]:
    """The dtype the weights and optimizer state are held in under ``precision`` (mixed
    precisions keep float32 weights)."""
    return {"16-true": torch.float16, "bf16-true": torch.bfloat16, "64-true": torch.float64}.get(
        precision, torch.float32)
