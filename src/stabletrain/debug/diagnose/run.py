"""The orchestrator: :func:`diagnose` loads a capture, replays and classifies it, searches the culprit data,
traces it, checks the weights, and builds the :class:`~stabletrain.debug.diagnose.result.Diagnosis` once from
those parts. See ``docs/diagnose.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from stabletrain.debug.diagnose.actions import next_actions
from stabletrain.debug.diagnose.classify import classify
from stabletrain.debug.diagnose.damage import earlier_damage
from stabletrain.debug.diagnose.explain import cause_explanation, probable_cause, summary
from stabletrain.debug.diagnose.locate import locate, nonfinite_inputs, origin, out_of_range_inputs
from stabletrain.debug.diagnose.result import Diagnosis
from stabletrain.debug.diagnose.run_signals import RunDiagnosis, diagnose_run, is_run_without_capture, mechanisms_before
from stabletrain.debug.diagnose.search import isolate, not_searched
from stabletrain.debug.diagnose.types import HUGE_WEIGHT, Evidence
from stabletrain.debug.diagnose.weights import history, nonfinite_buffers, param_stats, run_folder, weights_report
from stabletrain.debug.nan_capture import (
    REASON_GRADIENTS,
    REASON_LOSS,
    REASON_NORM_OVERFLOW,
    REASON_OTHER_RANK,
    REASON_SKIPPED,
)
from stabletrain.debug.optimizer_step import REASON_OPTIMIZER_STEP, OptimizerStepDiagnosis, diagnose_optimizer_step
from stabletrain.debug.remedies.record import current_record
from stabletrain.debug.replay import NaNCapture, load_nan_capture, normalize_precision
from stabletrain.utils.io import atomic_write_text

FILE_MD = "diagnosis.md"
FILE_JSON = "diagnosis.json"


def diagnose(
    capture: Union[str, Path, NaNCapture],
    *,
    model: Optional[nn.Module] = None,
    step_fn: Optional[Callable[[nn.Module, Any], Tensor]] = None,
    device: Optional[Union[str, torch.device]] = None,
    write: bool = True,
    huge_weight: float = HUGE_WEIGHT,
    max_subset_replays: int = 64,
    verified: bool = True,
) -> Union[Diagnosis, OptimizerStepDiagnosis, RunDiagnosis]:
    """Diagnose a NaN capture offline: which op, which module, which sample, and why.

    A run folder without a capture (the run never went non-finite) gets
    :func:`~stabletrain.debug.diagnose.run_signals.diagnose_run`: the mechanisms its logged signals show
    (attention-logit growth, the Adam eps regime, ...; docs/mechanisms.md) and where to go back to.

    A capture of the guard's (``reason == "optimizer_step"``: finite gradients, the optimizer
    step wrote NaN/Inf) gets :func:`~stabletrain.debug.optimizer_step.diagnose_optimizer_step`:
    the step replayed from the captured state and the reason (eps, dtype range).

    Args:
        capture: A loaded :class:`~stabletrain.debug.replay.NaNCapture`, or a path that
            :func:`~stabletrain.load_nan_capture` accepts (rank folder, ``nan_capture.pt``,
            folder of all ranks, run folder), or a run folder without a capture.
        model: Your own model, for a capture of one (as for ``load_nan_capture``).
        step_fn: ``step_fn(model, batch) -> loss``, if the model has no ``training_step``.
        device: Where to replay; default: the captured device type when available, else CPU.
        write: Write ``diagnosis.md`` and ``diagnosis.json`` next to the capture.
        huge_weight: The weight magnitude counted as huge (see :data:`~stabletrain.debug.diagnose.HUGE_WEIGHT`).
        max_subset_replays: Upper bound on subset replays while searching for the culprit data.
        verified: Quote the run's last verification of remedies (``diagnose`` or ``report --verify``) while
            its metrics.jsonl is unchanged since: the verified remedy first among the next actions, the
            others marked tried (with what was measured) or not.

    Returns:
        A :class:`Diagnosis`; ``print(d)`` shows the account, ``d.to_dict()`` the same for machines.

    Raises:
        NaNCaptureError: The capture cannot be read or its model cannot be rebuilt.

    Example::

        d = stabletrain.diagnose("out/boom/debug/nan_capture/rank0")
        print(d)                                  # also in out/boom/debug/nan_capture/rank0/diagnosis.md
        print(d.cause, d.finding.op, d.finding.module, d.data.dataset_indices)
    """
    if not isinstance(capture, NaNCapture) and is_run_without_capture(Path(capture)):
        return diagnose_run(capture, write=write, verified=verified)  # never went non-finite: what its signals say
    timings: dict[str, float] = {}
    clock = PhaseTimer(timings)
    with clock("load"):
        cap = _load(capture, model, step_fn)
        if cap.reason == REASON_OPTIMIZER_STEP:  # the guard's capture: the optimizer step did it
            step = diagnose_optimizer_step(cap, device=None if device is None else torch.device(device), write=write)
            return _quoting(step, run_folder(cap) if verified else None)
    dev = torch.device(device) if device is not None else cap.default_device()
    ev, out = _gather(cap, dev, clock, huge_weight, max_subset_replays)
    return _quoting(_conclude(cap, ev, out, write), out if verified else None)


def _quoting(diag: Any, out: Optional[Path]) -> Any:
    """``diag`` with the next actions of the run's current verification (the verified remedy first, its own
    marked tried or not), its files written again; unchanged without one."""
    record = current_record(out) if out is not None else None
    return diag if record is None else with_next_actions(diag, record.next_actions(diag.next_actions))


def with_next_actions(diag: Any, actions: list[str]) -> Any:
    """A diagnosis (of a capture, an optimizer step or a run's signals) with ``actions`` as its next
    actions; its ``diagnosis.md`` and ``.json``, if it wrote them, are written again to say the same."""
    changed = dataclasses.replace(diag, next_actions=actions)
    if diag.files:
        md, js = (Path(f) for f in diag.files)
        atomic_write_text(changed.to_markdown() + "\n", md)
        atomic_write_text(json.dumps(changed.to_dict(), indent=2) + "\n", js)
    return changed


def _gather(cap: NaNCapture, dev: torch.device, clock: PhaseTimer, huge_weight: float,
            max_subset_replays: int) -> tuple[Evidence, Optional[Path]]:
    """Every piece of evidence, each phase timed: weights and inputs, replays, the culprit data and its
    trace, checkpoints and the logged history. Also returns the run folder (None when not found)."""
    with clock("load"):
        replay_model = cap.get_model()
        precision = normalize_precision(cap.precision)
    with clock("weights"):
        stats, bad_buffers = param_stats(cap), nonfinite_buffers(cap)
        bad_inputs, out_of_range = nonfinite_inputs(cap), out_of_range_inputs(cap, precision)
    with clock("replays"):
        replayed = classify(cap, precision, dev)
    finding, traced_on = None, None
    if replayed.reproducible:
        with clock("bisect"):
            data = isolate(cap, replayed.first, replay_model, precision, dev, max_subset_replays, bad_inputs,
                           out_of_range)
        with clock("trace"):
            finding, traced_on = locate(cap, replay_model, data, precision, dev)
    else:
        data = not_searched(bad_inputs, out_of_range)
    with clock("checkpoints"):
        out = run_folder(cap)
        weights = weights_report(stats, bad_buffers, huge_weight, out / "checkpoints" if out is not None else None,
                                 set(cap.ranks[0].params), set(cap.ranks[0].buffers))
        logged = history(out)
        if weights.nonfinite:
            weights.damage = earlier_damage(out, cap.step)
    ev = Evidence(
        path=str(cap.path), step=cap.step, ranks=[r.rank for r in cap.ranks], world_size=cap.world_size,
        precision=precision, loss_scale=cap.loss_scale,
        reason=leading_reason([r.reason for r in cap.ranks]),
        model_class=cap.ranks[0].model_class, device=str(dev), cause=replayed.cause,
        deterministic=replayed.deterministic, matches_capture=replayed.matches_capture, replays=replayed.replays,
        reproduces_in=replayed.reproduces_in, finding=finding, traced_on=traced_on,
        origin=origin(finding, data, weights, precision, traced_on), data=data, weights=weights, history=logged,
        timings=clock.timings, mechanisms=mechanisms_before(out, cap.step),
    )
    return ev, out


#: Of several ranks' reasons, the one that says why, first: a non-finite loss on one rank is what the
#: averaging of gradients over ranks (DDP) turns into non-finite gradients on every rank; a rank that
#: found nothing itself stopped with the others (other_rank).
_REASON_ORDER = (REASON_LOSS, REASON_SKIPPED, REASON_NORM_OVERFLOW, REASON_GRADIENTS, REASON_OTHER_RANK)


def leading_reason(reasons: list[str]) -> str:
    """The reason that explains the step, of the ranks' ``reasons``."""
    return min(reasons, key=lambda r: _REASON_ORDER.index(r) if r in _REASON_ORDER else len(_REASON_ORDER) - 1)


def _conclude(cap: NaNCapture, ev: Evidence, out: Optional[Path], write: bool) -> Diagnosis:
    """The :class:`Diagnosis`, built once from the evidence and its prose; written next to the capture
    (``diagnosis.md`` and ``diagnosis.json``) when ``write``."""
    files = _files(cap) if write else []
    diag = Diagnosis.of(ev, cause_explanation=cause_explanation(ev, cap), summary=summary(ev, cap),
                        probable_cause=probable_cause(ev, cap), next_actions=next_actions(ev, cap, out),
                        files=[str(f) for f in files])
    if write:
        md, js = files
        atomic_write_text(diag.to_markdown() + "\n", md)
        atomic_write_text(json.dumps(diag.to_dict(), indent=2) + "\n", js)
    return diag


def _load(capture: Union[str, Path, NaNCapture], model: Optional[nn.Module],
          step_fn: Optional[Callable[[nn.Module, Any], Tensor]]) -> NaNCapture:
    """The capture, with your model and step function when given."""
    if not isinstance(capture, NaNCapture):
        return load_nan_capture(capture, model=model, step_fn=step_fn)
    if model is not None:
        capture.model = model
    if step_fn is not None:
        capture.step_fn = step_fn
    return capture


def _files(cap: NaNCapture) -> list[Path]:
    """diagnosis.md and diagnosis.json next to the capture: in the rank folder, or for several
    ranks in the folder holding them."""
    first = cap.ranks[0].path.parent
    folder = first if len(cap.ranks) == 1 else first.parent
    return [folder / FILE_MD, folder / FILE_JSON]


class PhaseTimer:
    """``with timer("phase"):`` adds the seconds spent inside to ``timings["phase"]``."""

    def __init__(self, timings: dict[str, float]):
        self.timings = timings

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - start
