"""The trainer callback :class:`MechanismAlerts`: the rules of :mod:`~stabletrain.debug.mechanisms.rules` on every
logged row, each mechanism named once, live, on the console and in ``metrics.jsonl``. See docs/mechanisms.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from stabletrain.config import MechanismArgs
from stabletrain.debug.mechanisms.rules import Mechanism, MechanismDetector, RuleContext, published_fixes
from stabletrain.events import TrainerLike


class MechanismAlerts:
    """Trainer callback: names a mechanism as soon as its rule holds (``on_log``: host floats already read, no
    extra host synchronisation).

    Each one is printed once, with its numbers, its published fixes (marked as not verified on this run) and
    the newest healthy checkpoint from before it began, and recorded in ``metrics.jsonl`` as
    ``{"event": "mechanism", "id": ..., "start_step": ..., ...}`` (:meth:`Mechanism.to_event`); ``stabletrain
    report``, ``diagnose`` and the checkpoints' health read that row.

    Args:
        settings: ``debug_args.mechanisms``; default: the trainer's.

    Attributes:
        detector: The :class:`MechanismDetector` while training.
        named: The mechanisms named so far.
    """

    def __init__(self, settings: Optional[MechanismArgs] = None):
        self._settings = settings
        self.detector: Optional[MechanismDetector] = None
        self.context = RuleContext()
        self.named: list[Mechanism] = []

    def on_train_start(self, trainer: TrainerLike) -> None:
        s = trainer.settings
        self.context = RuleContext.from_settings(trainer.resolved_settings())
        self.detector = MechanismDetector(self._settings or s.debug_args.mechanisms, self.context)
        if s.resume_interrupted or getattr(s, "resume_from", None) is not None:
            self._replay_history(Path(trainer.out) / "metrics.jsonl", before_step=trainer.step)

    def _replay_history(self, path: Path, before_step: int) -> None:
        """After a resume, the rules continue from the rows already logged (their alerts already given)."""
        from stabletrain.runfiles.history import logged_rows_before

        if self.detector is None:
            return
        for step, row in logged_rows_before(path, before_step):
            self.detector.update(step, row)

    def on_log(self, trainer: TrainerLike, *, step: int, metrics: dict[str, float]) -> None:
        if self.detector is None:
            self.on_train_start(trainer)
        assert self.detector is not None
        for m in self.detector.update(step, metrics):
            self.named.append(m)
            trainer.log_event(m.to_event())  # first: the newest healthy checkpoint below reads it
            trainer.console.info(alert_text(m, self.context, _checkpoint_line(trainer, m), out=trainer.out))
        for m in self.detector.closed_now:
            trainer.log_event(m.end_event(step))
            trainer.console.info(f"Mechanism: {m.end_event(step)['message']}.")


def alert_text(m: Mechanism, context: Optional[RuleContext] = None, checkpoint: str = "",
               out: Optional[Path] = None) -> str:
    """The alert as printed: the mechanism, its fixes (not verified), where to go back to and, for a run of
    stabletrain's trainer (``out``), the command that verifies the fixes. A mechanism named again after it
    closed is one line: its fixes were printed the first time."""
    if m.episode > 1:
        return f"WARNING mechanism again (the {_ordinal(m.episode)} time): {m.describe()}."
    lines = [f"WARNING mechanism: {m.describe()}."]
    if m.follows:
        lines.append("  next: treat the first mechanism's cause; this one most likely goes with it")
    else:
        fixes = published_fixes(m.id, context)
        if fixes:
            lines.append(f"  next (the published fix, not verified on this run; {m.info.reference}): "
                         + "; or ".join(fixes))
    if checkpoint:
        lines.append(f"  {checkpoint}")
    if out is not None and not m.follows:
        from stabletrain.utils.text import shell_path

        lines.append(f"  verify the fixes on this run (after it, or from another shell): stabletrain diagnose "
                     f"{shell_path(out)} --verify")
    return "\n".join(lines)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _checkpoint_line(trainer: Any, m: Mechanism) -> str:
    """The newest healthy checkpoint written before the mechanism began, as a sentence."""
    find = getattr(trainer, "healthy_checkpoint", None)
    if not callable(find):
        return ""
    best = find()
    if best is None:
        from stabletrain.runfiles.checkpoint import checkpoint_dir, none_healthy_before

        out = getattr(trainer, "out", None)
        why = (none_healthy_before(checkpoint_dir(out), m.start_step) if out is not None
               else f"no checkpoint from before step {m.start_step} is healthy")
        return f"{why}: a fix starts over from step 0"
    return f"the newest healthy checkpoint from before it: {best.path} (step {best.step})"
