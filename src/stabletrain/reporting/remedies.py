"""``stabletrain.verify_remedies(run)``: the candidate remedies of a run re-run with the trainer,
ranked by measured outcome (see docs/remedies.md).

The planning, measuring and ranking live in :mod:`stabletrain.debug.remedies`; this module gives
them the runner that calls ``stabletrain.train`` (the explaining layer does not import the trainer)
and the commands that apply a remedy to the run.
"""

from __future__ import annotations

import contextlib
import copy
import io
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from stabletrain.config import TrainSettings
from stabletrain.debug.remedies import (
    FINAL_WINDOW,
    MECHANISMS,
    Candidate,
    Outcome,
    RemedyError,
    RemedyReport,
    RunOutput,
    RunRequest,
    StopAfter,
    candidate_notes,
    candidates_for,
    make_plan,
    verify,
)
from stabletrain.debug.remedies.candidates import name_of
from stabletrain.debug.remedies.plan import Plan, described_object
from stabletrain.errors import StabletrainError
from stabletrain.runfiles.commands import train_command
from stabletrain.safety.interrupts import TrainingInterrupted

__all__ = ["verify_remedies", "TrainerRunner", "remedy_command", "run_settings"]

#: settings.json keys that are not settings, or that say how the run started, not what it trains.
_NOT_SETTINGS = ("model_meta", "world_size", "out", "resume_interrupted", "resume_from", "overwrite", "callbacks")


def verify_remedies(
    run: Union[str, Path],
    *,
    start: Union[None, int, str, Path] = None,
    since_step: Optional[int] = None,
    until_step: Optional[int] = None,
    margin: Optional[int] = None,
    candidates: Optional[Sequence[Union[Candidate, Mapping[str, Any]]]] = None,
    mechanisms: Optional[Sequence[str]] = None,
    budget_steps: Optional[int] = None,
    budget_seconds: Optional[float] = None,
    model: Any = None,
    data: Any = None,
    final_window: int = FINAL_WINDOW,
    progress: Optional[Callable[[str], Any]] = print,
    write: bool = True,
) -> RemedyReport:
    """Try candidate remedies from a checkpoint of the run and rank them by measured outcome.

    The run's own settings (``settings.json``) are re-run from ``start`` with ``resume_from=`` (bitwise
    exact, in the run's data order; the optimizer keeps the new lr, eps, betas, clipping and warmup),
    once per candidate, through the failing stretch and a margin past it, into
    ``run/debug/remedies/<candidate>/`` (the run's own files are not touched). The run as it was is
    re-run too when its logged rows do not cover the stretch. Each re-run's console is captured in its
    folder (``console.txt``); one progress line per candidate goes to ``progress``.

    Args:
        run: A run folder written by ``stabletrain.train`` (settings.json, metrics.jsonl, checkpoints/).
        start: The checkpoint to start from (a file, or the step of one of the run's checkpoints), or 0
            for a fresh start; default: the newest checkpoint recorded healthy before the trouble, else step 0.
        since_step: The first logged step that shows the trouble (e.g. a mechanism's onset); default: the
            first non-finite step, alert or recovery in metrics.jsonl. The start is the newest healthy
            checkpoint holding fewer steps than this.
        until_step: The end of the failing stretch; default: the step the run went non-finite at, else its end.
        margin: Steps run past ``until_step`` (default max(10, half the stretch), when the run has steps left).
        candidates: What to try, in order: :class:`~stabletrain.debug.remedies.Candidate` objects or dicts of
            dotted overrides (``{"model_args.lr": 0.03}``); default :func:`~stabletrain.debug.remedies.candidates_for`.
        mechanisms: Mechanism ids the candidates are chosen and ordered for (``"attention_logit_growth"``,
            ``"adam_eps"``, ``"nonfinite"``, ...; :data:`~stabletrain.debug.remedies.MECHANISMS`); default: those
            the run's ``{"event": "mechanism", ...}`` rows name, and ``"nonfinite"`` when it went non-finite;
            none named: every candidate, in the generic order.
        budget_steps: Most optimizer steps in all re-runs; candidates that do not fit are listed as not tried.
        budget_seconds: Most wall time in all re-runs (checked before each, at the step time measured so far).
        model: For a run of your own model (settings.json says ``"<module.Class>"``): an ``nn.Module`` built as
            the run built it (copied for each re-run), or a function that builds one.
        data: For a run of your own dataset object: the dataset (or a function that returns it).
        final_window: Logged losses averaged into each candidate's final loss.
        progress: Called with each progress line (default ``print``); None for silence.
        write: Write ``run/debug/remedies/remedies.md`` and ``remedies.json``.

    Returns:
        A :class:`~stabletrain.debug.remedies.RemedyReport`: ``.ranked``, ``.best`` (None when no candidate beats
        the run as it was beyond the noise), ``.baseline``, ``.not_tried``, ``.to_markdown()``.

    Raises:
        RemedyError: The run folder lacks its files, the start is not a checkpoint of it, or the run trained a
            model or dataset object that settings.json cannot rebuild and none was given.

    Example::

        import stabletrain
        r = stabletrain.verify_remedies("out/boom", budget_steps=400)
        print(r)                      # Resume with model_args.lr=0.3 (verified: final loss ...)
        print(r.best.final_loss, [o.name for o in r.ranked])
    """
    plan = make_plan(run, start=start, since_step=since_step, until_step=until_step, margin=margin,
                     final_window=final_window)
    _require_objects(plan, model, data)
    if mechanisms is None:  # what the run's files name: its mechanism rows, and a non-finite stop
        known = [m for m in plan.mechanisms if m in MECHANISMS]
        mechanisms = (*known, *(("nonfinite",) if plan.failed_step is not None else ()))
    if candidates is None:
        chosen = candidates_for(plan.settings, mechanisms)
    else:
        chosen = [c if isinstance(c, Candidate) else Candidate(name_of(c), dict(c), "given") for c in candidates]
    notes = candidate_notes(plan.settings, mechanisms)
    if plan.start_checkpoint is None and model is not None:
        notes.append("a fresh start with your own model starts from the weights of the model given: build it as the "
                     "run built it (the same seed) for the re-runs to start where the run started")
    runner = TrainerRunner(plan, model=model, data=data)
    return verify(plan, chosen, runner, budget_steps=budget_steps, budget_seconds=budget_seconds, progress=progress,
                  notes=notes, command_for=lambda o: remedy_command(plan, o, model=model, data=data), write=write)


def _require_objects(plan: Plan, model: Any, data: Any) -> None:
    """RemedyError naming what to pass when the run trained Python objects settings.json cannot rebuild."""
    missing = []
    if described_object(plan.settings.get("model")) and model is None:
        missing.append(f"its own model ({plan.settings['model']}): pass model= (an nn.Module built as the run built "
                       "it, or a function that builds one), or --model file.py:Class on the command line")
    if described_object(plan.settings.get("data")) and data is None:
        missing.append(f"its own dataset ({plan.settings['data']}): pass data= (the dataset, or a function that "
                       "returns it), or --data file.py:NAME on the command line")
    if missing:
        raise RemedyError(f"{plan.run} trained " + "; and ".join(missing) + ". settings.json describes such objects "
                          "but cannot rebuild them.")


def _build(obj: Any) -> Any:
    """A fresh copy of a model or dataset given as an object (deep-copied) or a function (called)."""
    from torch import nn

    if isinstance(obj, nn.Module):
        return copy.deepcopy(obj)
    if callable(obj) and not hasattr(obj, "__getitem__"):
        return obj()
    return obj


def run_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword settings of ``stabletrain.train`` from a run's settings.json: those that differ from the
    defaults (settings.json lists every setting, and a built-in task refuses another task's settings when
    given), without how the run started (out, resume, overwrite), the callbacks, or what the trainer added
    (model_meta, world_size)."""
    kept = {k: v for k, v in settings.items() if k not in _NOT_SETTINGS and k in TrainSettings.model_fields}
    if kept.get("task") == "custom":  # resolved for a model object; not a value of the setting
        kept.pop("task")
    defaults = _flatten(TrainSettings(out=Path(".")).to_json_dict())
    result: dict[str, Any] = {}
    for key, value in _flatten(kept).items():
        if key not in defaults or defaults[key] != value:
            _set(result, key, copy.deepcopy(value))
    return result


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _set(settings: dict[str, Any], dotted: str, value: Any) -> None:
    node = settings
    *parents, last = dotted.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


class TrainerRunner:
    """Makes each re-run of :func:`verify_remedies` with ``stabletrain.train``, in this process.

    The run's settings with the candidate's overrides; only jsonl logging (TensorBoard, MLflow and W&B
    would record every re-run as a run of their own), nancapture and underflow_overflow off (they do not
    change the training, and their files are the run's debugging, not the verification's); one device as
    the run had; the console captured.
    """

    def __init__(self, plan: Plan, model: Any = None, data: Any = None):
        self.plan = plan
        self.model = copy.deepcopy(model) if _is_module(model) else model  # pristine: the caller may train it on
        self.data = data
        self.base = run_settings(plan.settings)

    def settings_for(self, request: RunRequest) -> dict[str, Any]:
        s = copy.deepcopy(self.base)
        for key, value in request.candidate.overrides.items():
            _set(s, key, value)
        _set(s, "loggers.jsonl.enabled", True)
        for logger in ("tensorboard", "mlflow", "wandb"):
            _set(s, f"loggers.{logger}.enabled", False)
        _set(s, "debug_args.nancapture.enabled", False)
        _set(s, "debug_args.underflow_overflow.enabled", False)
        s["devices"] = 1
        if described_object(self.plan.settings.get("model")):
            s["model"] = _build(self.model)
        if described_object(self.plan.settings.get("data")):
            s["data"] = _build(self.data)
        s["callbacks"] = [StopAfter(request.end_step)] if request.end_step < self.plan.steps else []
        if request.resume_from is not None:
            s["resume_from"] = request.resume_from
        return s

    def __call__(self, request: RunRequest) -> RunOutput:
        from stabletrain.runfiles.history import read_run
        from stabletrain.training.loop import train

        settings = self.settings_for(request)
        captured = io.StringIO()
        error: Optional[str] = None
        start = time.perf_counter()
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            try:
                train(out=request.out, **settings)
            except TrainingInterrupted:  # the user's Ctrl-C or SIGTERM stops the verification
                raise
            except StabletrainError as exc:
                error = f"{type(exc).__name__}: {_one_line(str(exc))}"
        seconds = time.perf_counter() - start
        metrics = request.out / "metrics.jsonl"
        history = read_run(metrics) if metrics.is_file() else None
        return RunOutput(rows=history.rows if history else [], events=history.events if history else [],
                         seconds=seconds, console=captured.getvalue(), error=error)


def _is_module(obj: Any) -> bool:
    try:
        from torch import nn
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(obj, nn.Module)


def _one_line(text: str, limit: int = 400) -> str:
    """``text`` on one line (a ConfigError lists its problems on several), at most ``limit`` characters."""
    joined = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


def remedy_command(plan: Plan, outcome: Outcome, model: Any = None, data: Any = None) -> Optional[str]:
    """The command that applies ``outcome``'s candidate to the run: resume the run from the verification's
    checkpoint with the change, or, for a candidate tried from step 0, a new run in ``<run>_<candidate>``
    (``stabletrain.runfiles.commands.train_command``; the Python call for a run of your own objects)."""
    base = run_settings(plan.settings)
    for key in ("model", "data"):
        if described_object(base.get(key)):
            base[key] = (model if key == "model" else data) or object()
    model_name = base.get("model")
    if base.get("task") == "language_model" and model_name in (None, "transformer"):
        base.pop("task")  # the default task: the command need not say it
    try:
        settings = TrainSettings.model_validate({**base, "out": plan.run})
    except Exception:  # a settings.json of another version: no command rather than a wrong one
        return None
    overrides = dict(outcome.candidate.overrides)
    if outcome.from_step > 0 and plan.start_checkpoint is not None:
        return train_command(settings, resume_from=plan.start_checkpoint, extra=overrides, from_invocation=False)
    fresh = settings.model_copy(update={"out": plan.run.parent / f"{plan.run.name}_{outcome.candidate.slug}"})
    return train_command(fresh, extra=overrides, from_invocation=False)
