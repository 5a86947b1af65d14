"""What makes a checkpoint healthy, measured when it is written and recorded in it.

:func:`verify_tensors` checks in one fused device pass that every tensor of a state is finite
(else it is not written); :class:`HealthTracker` judges a written one healthy from the run's
own history (open trend episodes, the last step's loss and gradient norm, weight growth below
:data:`WEIGHT_GROWTH`) and records the verdict as ``state["health"]``, read back by
:func:`stabletrain.runfiles.checkpoint.newest_healthy`. See docs/blowups.md ("Healthy" is measured and recorded).
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch
from torch import Tensor

from stabletrain.config import TrendAlertArgs
from stabletrain.distributed.norms import dtensor_type, local_tensor
from stabletrain.safety.guard import finite_norms

if TYPE_CHECKING:
    from stabletrain.debug.mechanisms.rules import MechanismDetector

#: A weight norm this many times the one at the start of the run is a divergence, not learning.
WEIGHT_GROWTH = 100.0


# --------------------------------------------------------------------------------------
# Finite or not: the device pass at every checkpoint
# --------------------------------------------------------------------------------------


def _floating(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj] if obj.is_floating_point() and obj.numel() else []
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _floating(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _floating(v)]
    return []


def verify_tensors(state: Mapping[str, Any], device: torch.device, rank: Optional[int] = None) -> Tensor:
    """``[model_bad, optimizer_bad, scaler_bad, weight_norm]`` as a float64 device vector, no
    host sync: each flag is 1 when that part holds a NaN/Inf (or values whose float32 norm
    overflows); ``weight_norm`` is the L2 norm of the model's floating tensors.

    ``rank``: ``state`` holds this rank's shards (FSDP2 DTensors, a sharded checkpoint): the
    flags are then this rank's, and the last entry is this rank's share of the *squared* weight
    norm (its shards, plus the unsharded tensors, which every rank holds whole, on rank 0 only):
    summed over the ranks (one all-reduce) they give the whole model's, with nothing gathered.
    """
    tensors = _floating(state.get("model", {}))
    model = finite_norms(tensors, device)
    optimizer = finite_norms(_floating((state.get("optimizer") or {}).get("state", {})), device)
    scaler = finite_norms(_floating(state.get("scaler") or {}), device)
    flags = [~torch.isfinite(x) for x in (model, optimizer, scaler)]
    if rank is None:
        return torch.stack([*(f.double() for f in flags), model.double()])
    dt = dtensor_type()
    shards = [t for t in tensors if dt is not None and isinstance(t, dt)]
    whole = [t for t in tensors if not (dt is not None and isinstance(t, dt))] if rank == 0 else []
    square = finite_norms(shards, device).double() ** 2 + finite_norms(whole, device).double() ** 2
    return torch.stack([*(f.double() for f in flags), square])


def nonfinite_entries(state: Mapping[str, Any], param_names: Optional[list[str]] = None, limit: int = 8) -> list[str]:
    """Which entries of a checkpoint state hold NaN/Inf (host reads: for the failure path). Of a
    sharded state, this rank's shards only: :func:`stabletrain.utils.dist.gather_names` joins the ranks'."""
    found: list[str] = []
    for name, t in (state.get("model") or {}).items():
        if isinstance(t, Tensor) and t.is_floating_point() and not bool(torch.isfinite(local_tensor(t)).all()):
            found.append(f"model {name}")
    for index, entry in ((state.get("optimizer") or {}).get("state") or {}).items():
        for key, t in entry.items():
            if isinstance(t, Tensor) and t.is_floating_point() and not bool(torch.isfinite(local_tensor(t)).all()):
                known = param_names and isinstance(index, int) and index < len(param_names)
                who = param_names[index] if known else index  # type: ignore[index]
                found.append(f"optimizer state {key} of {who}")
    for key, t in (state.get("scaler") or {}).items():
        if isinstance(t, (int, float)) and not math.isfinite(float(t)):
            found.append(f"scaler {key}")
    return found[:limit] + ([f"... ({len(found) - limit} more)"] if len(found) > limit else [])


# --------------------------------------------------------------------------------------
# Healthy or not: the run's own history
# --------------------------------------------------------------------------------------


class HealthTracker:
    """Keeps the run's logged history and judges each checkpoint by it (host floats only).

    Args:
        settings: The trend thresholds (``trend_alerts``); defaults when None.
        warmup_steps: lr warmup; spikes during it do not count.
    """

    def __init__(self, settings: Optional[TrendAlertArgs] = None, warmup_steps: int = 0,
                 mechanisms: Optional["MechanismDetector"] = None):
        from stabletrain.debug.trends import TrendDetector

        self.args = settings or TrendAlertArgs()
        self.detector = TrendDetector(self.args, warmup_steps=warmup_steps)
        #: The rules that name a silent instability in the logged signals: a checkpoint written after one
        #: began is not healthy (docs/mechanisms.md). None: not judged.
        self.mechanisms = mechanisms
        self.recent: dict[str, deque[float]] = {s: deque(maxlen=self.args.window) for s in ("loss", "gradient_norm")}
        self._steps: dict[str, deque[int]] = {s: deque(maxlen=self.args.window) for s in self.recent}  # of recent's
        self.initial_weight_norm: Optional[float] = None
        #: The recovery whose spike is still open: ``{"step", "trigger", "reference", "calm"}``; None when none is.
        self.spike: Optional[dict[str, Any]] = None

    def note_recovery(self, step: int, trigger: str) -> None:
        """A step the self-healing skipped or rolled back: the episode stays open until the loss is
        back at or below the highest of the logged losses before it (their window: the run's own
        noise) for ``trend_alerts.persist`` logged steps in a row; a checkpoint or snapshot taken
        before that is not healthy."""
        self.forget(step)
        if self.spike is not None:  # still the same episode: keep its reference from before it
            self.spike.update(step=step, trigger=trigger, calm=0)
            return
        ref = max(self.recent["loss"]) if self.recent["loss"] else None
        self.spike = {"step": step, "trigger": trigger, "reference": ref, "calm": 0, "first": step,
                      "window": len(self.recent["loss"])}

    def forget(self, step: int) -> None:
        """Drop the values logged for ``step``, a step the self-healing skipped: its loss (the spike
        itself) is not the run's level, and must not become the level an episode returns to."""
        for signal, values in self.recent.items():
            kept = [(s, v) for s, v in zip(self._steps[signal], values) if s != step]
            values.clear()
            values.extend(v for _, v in kept)
            self._steps[signal].clear()
            self._steps[signal].extend(s for s, _ in kept)

    @property
    def spike_open(self) -> bool:
        return self.spike is not None

    def resume(self, health: Mapping[str, Any]) -> None:
        """Continue from the ``health`` entry of the checkpoint a run resumes from, once its logged
        rows are observed again: the weight norm at the start of the run, and the spike episode
        that was still open when it was written (:meth:`assess` records it as ``open_spike``)."""
        if isinstance(health.get("initial_weight_norm"), float):
            self.initial_weight_norm = health["initial_weight_norm"]
        spike = health.get("open_spike")
        self.spike = dict(spike) if isinstance(spike, Mapping) else None

    def observe(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Feed one logged step (``loss``, ``gradient_norm``, the ``signals/...``)."""
        self.detector.update(step, metrics)
        if self.mechanisms is not None:
            self.mechanisms.update(step, metrics)
        for signal, values in self.recent.items():
            v = metrics.get(signal)
            if isinstance(v, (int, float)) and math.isfinite(v):
                values.append(float(v))
                self._steps[signal].append(int(step))
        self._settle(step, metrics.get("loss"))

    def _settle(self, step: int, loss: Any) -> None:
        spike = self.spike
        if spike is None or step <= spike["step"] or not isinstance(loss, (int, float)):
            return
        ref = spike["reference"]
        calm = math.isfinite(loss) and (ref is None or loss <= ref)
        spike["calm"] = spike["calm"] + 1 if calm else 0
        spike["last_loss"] = float(loss)
        if spike["calm"] >= self.args.persist:
            self.spike = None

    def assess(
        self, step: int, *, last_step: int, loss: float, gradient_norm: float, weight_norm: float,
        scaler_skipped: bool = False,
    ) -> dict[str, Any]:
        """The ``health`` entry of the checkpoint holding ``step`` completed steps.

        Args:
            step: Steps done (the checkpoint's ``step``).
            last_step: The step whose ``loss`` and ``gradient_norm`` are given (``step - 1``).
            loss, gradient_norm: That step's values, read at the checkpoint.
            weight_norm: L2 norm of the model's floating tensors in the checkpoint.
            scaler_skipped: The fp16 GradScaler skipped that step on its own (its scaled gradients
                overflowed; no update): its non-finite gradient norm is the scaler's rule, not a
                sign of a sick state.
        """
        if self.initial_weight_norm is None and math.isfinite(weight_norm):
            self.initial_weight_norm = weight_norm
        problems = []
        for e in self.detector.open_episodes():
            if e.kind in ("exploding", "nonfinite") or (e.kind == "spike" and not e.tolerated):
                problems.append(f"{e.describe()} (still open at step {self.detector.last_step})")
        if self.spike is not None:
            sp = self.spike
            since = f"step {sp['first']}" + (f" (the latest at step {sp['step']})" if sp["step"] != sp["first"] else "")
            level = (f"at or below {_f(sp['reference'])}, the highest of the {sp['window']} logged losses before it, "
                     if sp["reference"] is not None else "finite ")
            now = f" (now {_f(sp['last_loss'])})" if sp.get("last_loss") is not None else ""
            problems.append(f"the {sp['trigger']} episode the self-healing recovered from at {since} is still open: "
                            f"the loss has not been {level}for {self.args.persist} logged steps in a row{now}")
        for m in self.mechanisms.found if self.mechanisms is not None else ():
            if m.start_step < step and (m.end_step is None or step - 1 <= m.end_step):
                where = f" in {m.where}" if m.where else ""
                problems.append(f"{m.name}{where} began at step {m.start_step} (named at step {m.detected_step}): "
                                f"{m.evidence}")
        reference: dict[str, Optional[float]] = {}
        limits = {"loss": self.args.loss_explode_factor, "gradient_norm": self.args.explode_factor}
        skip = scaler_skipped and math.isfinite(loss) and not math.isfinite(gradient_norm)
        for signal, value in (("loss", loss), ("gradient_norm", gradient_norm)):
            ref = median(self.recent[signal]) if self.recent[signal] else None
            reference[signal] = ref
            if last_step < 0 or math.isnan(value) or (skip and signal == "gradient_norm"):
                continue  # no step ran in this process yet, or no update: nothing to hold against
            if not math.isfinite(value):
                problems.append(f"{signal} at step {last_step} is {value}")
            elif ref is not None and ref > 0 and value > limits[signal] * ref:
                problems.append(f"{signal} at step {last_step} is {value:.3g}, {value / ref:.3g}x the median "
                                f"{ref:.3g} of the last {len(self.recent[signal])} logged values "
                                f"(limit {limits[signal]:g}x)")
        start = self.initial_weight_norm
        if start is not None and start > 0 and weight_norm > WEIGHT_GROWTH * start:
            problems.append(f"the weight norm is {weight_norm:.3g}, {weight_norm / start:.3g}x its {start:.3g} at the "
                            f"start of the run (limit {WEIGHT_GROWTH:g}x)")
        healthy = not problems
        pending = self.mechanisms.pending_since() if self.mechanisms is not None else None
        if healthy:
            values = _values_text(last_step, loss, gradient_norm, skip, limits) if any(reference.values()) else ""
            parts = ["every tensor finite", values, "no exploding or non-finite episode open",
                     "no mechanism named in the signals" if self.mechanisms is not None else ""]
            why = "; ".join(p for p in parts if p)
        else:
            why = "; ".join(problems)
        return {
            "healthy": healthy,
            "finite": True,
            "why": why,
            "problems": problems,
            "step": int(step),
            "last_step": int(last_step),
            "loss": _jf(loss),
            "gradient_norm": _jf(gradient_norm),
            "weight_norm": _jf(weight_norm),
            "initial_weight_norm": None if start is None else _jf(start),
            "reference": {k: (None if v is None else _jf(v)) for k, v in reference.items()},
            # A mechanism rule held once and may name one that began at this step: rotation keeps a checkpoint
            # from before it until the rule decides (docs/mechanisms.md).
            "pending_since": pending if healthy else None,
            "open_spike": None if self.spike is None else dict(self.spike),  # a resume carries it on
        }


def _values_text(last_step: int, loss: float, gradient_norm: float, scaler_skipped: bool,
                 limits: dict[str, float]) -> str:
    """The last step's values in a healthy checkpoint's ``why`` ("" before any step ran)."""
    if last_step < 0:
        return ""
    if scaler_skipped:
        return (f"loss {_f(loss)} at step {last_step} within {limits['loss']:g}x of the recent logged median; the "
                "fp16 GradScaler skipped that step (its scaled gradients overflowed: no update)")
    return (f"loss {_f(loss)} and gradient_norm {_f(gradient_norm)} at step {last_step} within "
            f"{limits['loss']:g}x / {limits['gradient_norm']:g}x of the recent logged medians")


def _f(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def _jf(x: float) -> Any:
    return x if math.isfinite(x) else str(x)


