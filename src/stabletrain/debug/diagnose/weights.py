"""Before or during the step: the weights and buffers the step started from, the run's checkpoints searched
for the newest healthy one when they were already bad, and the run's last logged metrics.
See ``docs/diagnose.md``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from stabletrain.debug.diagnose.types import ParamStat, WeightsReport
from stabletrain.debug.op_trace import is_additive_mask
from stabletrain.debug.replay import NaNCapture


def param_stats(cap: NaNCapture) -> list[ParamStat]:
    """The magnitude of every floating-point parameter at the start of the step."""
    # DDP keeps the parameters equal on every rank: the first rank's are everyone's.
    return [param_stat(name, p) for name, p in cap.ranks[0].params.items() if p.is_floating_point() and p.numel()]


def nonfinite_buffers(cap: NaNCapture) -> list[str]:
    """The buffers of any rank that hold NaN/Inf not there on purpose."""
    return sorted({name for part in cap.ranks for name, b in part.buffers.items() if bad_buffer(b)})


def weights_report(stats: list[ParamStat], buffers: list[str], threshold: float,
                   checkpoints: Optional[Path], names: set[str], buffer_names: set[str]) -> WeightsReport:
    """Whether the parameters ``stats`` and the ``buffers`` that are non-finite were healthy at the
    start of the step; when not, the ``checkpoints`` folder (if any) is searched for a healthy state
    of the parameters ``names`` and buffers ``buffer_names``."""
    nonfinite = [s for s in stats if s.nonfinite]
    largest = sorted(stats, key=lambda s: -s.abs_max if math.isfinite(s.abs_max) else 0.0)[:5]
    top = max((s.abs_max for s in stats if math.isfinite(s.abs_max)), default=0.0)
    # A NaN in a buffer (running statistics) at the start of the step is damage from earlier
    # steps just as much as a NaN in a weight: the forward pass that updated it did it.
    status = "nonfinite" if (nonfinite or buffers) else ("huge" if top >= threshold else "healthy")
    scanned: list[dict[str, Any]] = []
    if status != "healthy" and checkpoints is not None:
        scanned = scan_checkpoints(checkpoints, threshold, names, buffer_names)
    return WeightsReport(status, float(threshold), largest, nonfinite, buffers, scanned, healthy_checkpoint(scanned))


def bad_buffer(b: Tensor) -> bool:
    """A buffer holding NaN/Inf that is not there on purpose (an additive mask of 0 and -inf is)."""
    return b.is_floating_point() and b.numel() > 0 and not bool(torch.isfinite(b).all()) and not is_additive_mask(b)


def param_stat(name: str, p: Tensor) -> ParamStat:
    """The largest magnitude and the RMS of ``p``'s finite values, and how many are not finite."""
    x = p.detach()
    finite = torch.isfinite(x)
    n_bad = int(finite.numel() - finite.sum())
    vals = x[finite] if n_bad else x
    if not vals.numel():
        return ParamStat(name, list(p.shape), math.nan, math.nan, n_bad)
    abs_max = float(vals.abs().max())
    rms = float(torch.linalg.vector_norm(vals, dtype=torch.float64)) / math.sqrt(vals.numel())
    return ParamStat(name, list(p.shape), abs_max, rms, n_bad)


def run_folder(cap: NaNCapture) -> Optional[Path]:
    """``out`` for a capture at ``out/debug/nan_capture/rank{N}/nan_capture.pt``."""
    f = cap.ranks[0].path.resolve()
    if len(f.parents) > 3 and f.parents[1].name == "nan_capture" and f.parents[2].name == "debug":
        return f.parents[3]
    return None


def scan_checkpoints(folder: Path, threshold: float, names: set[str], buffer_names: set[str]) -> list[dict[str, Any]]:
    """Each checkpoint of ``folder`` (one per step, oldest first) with its largest weight and whether its
    weights are finite and below ``threshold`` and its buffers finite: ``{"path", "step", "abs_max", "healthy"}``."""
    if not folder.is_dir():
        return []
    from stabletrain.runfiles.checkpoint import CheckpointError, is_checkpoint, load_checkpoint

    seen: dict[int, dict[str, Any]] = {}
    files = sorted(folder.glob("step_*.ckpt")) + [folder / "last.ckpt"]
    for path in files:
        if not is_checkpoint(path):
            continue
        try:
            state = load_checkpoint(path, optimizer=False)  # the weights are what is scanned
        except CheckpointError:
            continue
        step = int(state.get("step", -1))
        if step not in seen:
            seen[step] = _checkpoint_health(path, step, state.get("model", {}), threshold, names, buffer_names)
            health = state.get("health") if isinstance(state.get("health"), dict) else None
            # The health the run recorded (finite, and no instability under way) decides too;
            # the magnitude rule alone stands in for checkpoints of older versions without it.
            if health is not None:
                seen[step]["healthy"] = seen[step]["healthy"] and bool(health.get("healthy"))
                seen[step]["why"] = str(health.get("why", ""))
    return [seen[s] for s in sorted(seen)]


def _checkpoint_health(path: Path, step: int, model: dict[str, Any], threshold: float, names: set[str],
                       buffer_names: set[str]) -> dict[str, Any]:
    values = [t for n, t in model.items() if n in names and isinstance(t, Tensor) and t.is_floating_point()]
    # Buffers count for health only when finite or not: running statistics may be large legitimately.
    buffers = [t for n, t in model.items() if n in buffer_names and isinstance(t, Tensor) and t.is_floating_point()]
    finite = all(bool(torch.isfinite(t).all()) for t in values)
    top = max((float(t.detach().abs().max()) for t in values if t.numel()), default=0.0) if finite else math.inf
    buffers_finite = not any(bad_buffer(t) for t in buffers)
    return {"path": str(path), "step": step, "abs_max": top, "healthy": finite and buffers_finite and top < threshold}


def healthy_checkpoint(checkpoints: list[dict[str, Any]]) -> Optional[str]:
    """The newest healthy checkpoint of :func:`scan_checkpoints`' list, as a path."""
    healthy = [c for c in checkpoints if c["healthy"]]
    if not healthy:
        return None
    best = healthy[-1]
    # Prefer the periodic file: last.ckpt is overwritten by the next run.
    same = [c for c in checkpoints if c["step"] == best["step"]]
    return same[0]["path"]


def history(out: Optional[Path], last: int = 5) -> list[dict[str, Any]]:
    """The run's ``last`` logged metrics rows (step, loss, gradient_norm, lr), when ``out/metrics.jsonl`` exists."""
    path = out / "metrics.jsonl" if out is not None else None
    if path is None or not path.is_file():
        return []
    from stabletrain.loggers.jsonl import read_metrics

    try:
        rows, _ = read_metrics(path)
    except OSError:
        return []
    keep = ("step", "loss", "gradient_norm", "lr")
    return [{k: r[k] for k in keep if k in r} for r in rows[-last:]]


#: Adam-type updates move a weight by about lr per step (m / sqrt(v) is about 1 in size, at most a
#: few); this margin over that bound keeps the test below on the safe side.
ADAM_STEP_MARGIN = 10.0


def huge_from_start(cap: NaNCapture, weights: WeightsReport, rows: list[dict[str, Any]]) -> str:
    """Evidence that the huge weights at the start of the step were not grown by training (an
    initialisation or loaded weights put them there), as a clause; empty when there is none.

    Evidence: the step is step 0 (no update has run); an Adam-type optimizer at a known lr that
    cannot carry a weight that far in the steps run (each update is about lr in size); or the
    run's logged rows before the step, all finite and without a rise.
    """
    from stabletrain.debug import advice

    if weights.status != "huge" or not weights.largest:
        return ""
    top = weights.largest[0]
    step = cap.step
    if any(c.get("healthy") or c.get("abs_max", math.inf) < weights.threshold for c in weights.checkpoints):
        return ""  # an earlier checkpoint of the run held them below the threshold: they grew in training
    if step == 0:
        return "the step is step 0: no optimizer step had run, so the initialisation or the loaded weights hold them"
    settings = cap.settings or {}
    meta = cap.ranks[0].model_meta or {}
    found = settings.get("model_args")
    model_args: dict[str, Any] = found if isinstance(found, dict) else {}
    lr = advice.positive(model_args.get("lr")) or advice.positive(meta.get("lr"))
    optimizer = model_args.get("optimizer") or meta.get("optimizer")
    if lr is not None and advice.optimizer_family(optimizer) == "adam":
        reach = 1.0 + ADAM_STEP_MARGIN * lr * step
        if top.abs_max > 100 * reach:
            return (f"{advice.optimizer_label(optimizer)} moves a weight by about lr = {lr:g} per step, so {step} "
                    f"step(s) cannot carry one from its initial scale to {top.abs_max:.3g}")
    before = [r for r in rows if isinstance(r.get("step"), int) and r["step"] < step and "loss" in r]
    if len(before) >= 3 and all(isinstance(r["loss"], (int, float)) and math.isfinite(r["loss"]) for r in before):
        losses = [float(r["loss"]) for r in before]
        if max(losses) <= advice.LOSS_RISE * min(losses) and min(losses) > 0:
            return (f"the logged rows show no growth (loss {min(losses):.4g} to {max(losses):.4g} over steps "
                    f"{before[0]['step']}-{before[-1]['step']})")
    return ""
