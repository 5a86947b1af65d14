"""The exceptions of underflow_overflow: the data of a failure, and the stop asked for by
``abort_after_batch_num``. See ``docs/underflow_overflow.md`` (Who is blamed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from stabletrain.errors import StabletrainError

from .records import module_label
from .render import abort_message, bystander_message, failure_message

__all__ = ["UnderflowOverflowError", "UnderflowOverflowAbort"]


#: What to do after an UnderflowOverflowError, whoever raised it.
NEXT_STEPS = (
    "Next: read the report (the culprit frame is last); replay the step offline to find the op and the sample: "
    "debug_args.nancapture.enabled=true (NaNCaptureMonitor in a plain loop), then stabletrain diagnose on the "
    "capture; if the module runs in float16 or bfloat16, rule reduced precision in or out with precision=32-true; "
    "continue from the newest healthy checkpoint (resume_from=) once fixed."
)
#: The same when the trainer has said where to continue, just above it.
NEXT_STEPS_ADVISED = NEXT_STEPS.replace(
    "continue from the newest healthy checkpoint (resume_from=) once fixed.",
    "continue as said above once fixed.")


class UnderflowOverflowError(StabletrainError):
    """A non-finite value appeared; training stopped.

    Attributes:
        step: The step (``set_step``) during which it appeared.
        rank: The rank raising this error.
        detected_by: The ranks that found a non-finite value (``[rank]`` on one process).
        phase: ``"forward"`` or ``"backward"`` (None on a rank that found nothing itself).
        module: Path of the culprit module in the user's own names (``""`` is the model
            itself); None on a rank that found nothing itself.
        module_type: Class name of the culprit module.
        tensor: Which tensor went bad: a weight name, ``input[i]``, ``output[k]``,
            ``output['key']``, ``<child> input[i]`` for a value made between two child
            modules, ``grad of ...`` in backward, or ``loss``.
        value: ``"nan"``, or ``"inf"`` for an infinity of either sign.
        explanation: One sentence on how the culprit was chosen.
        log_path: This rank's log, ``underflow_overflow_rank{rank}.log`` (also ``report_path``).
        rows: Rows of the batch (samples of the microbatch) whose values in that tensor are
            non-finite, when it has the batch as first dimension and was still held when the
            decision was made; None when unknown.
    """

    def __init__(
        self,
        *,
        step: int,
        rank: int,
        detected_by: Sequence[int],
        log_path: Path,
        phase: Optional[str] = None,
        module: Optional[str] = None,
        module_type: Optional[str] = None,
        tensor: Optional[str] = None,
        value: Optional[str] = None,
        explanation: str = "",
        rows: Optional[list[int]] = None,
    ):
        self.step = step
        self.rank = rank
        self.detected_by = list(detected_by)
        self.log_path = Path(log_path)
        self.phase = phase
        self.module = module
        self.module_type = module_type
        self.tensor = tensor
        self.value = value
        self.explanation = explanation
        self.rows = rows
        if module is not None:
            where = module_label(module, module_type)
            msg = failure_message(step, rank, phase, where, tensor, value, explanation, rows, self.log_path)
        else:
            msg = bystander_message(step, rank, self.detected_by, phase, self.log_path)
        self._finding = msg
        #: Where to continue, when the trainer said (:meth:`add_advice`); "" otherwise.
        self.advice = ""
        super().__init__(msg + "\n" + NEXT_STEPS)

    def add_advice(self, advice: str) -> None:
        """Put where to continue (the trainer's newest healthy checkpoint and command) between the
        finding and the next steps, in the message."""
        self.advice = advice
        self.args = (f"{self._finding}\n{advice}\n{NEXT_STEPS_ADVISED}",)

    @property
    def report_path(self) -> Path:
        """The same as :attr:`log_path` (the name the docs use)."""
        return self.log_path


class UnderflowOverflowAbort(StabletrainError):
    """``abort_after_batch_num`` was reached (raised by a standalone monitor's ``set_step``).

    Attributes:
        step: The last step that ran.
        log_path: The log holding the traced steps.
    """

    def __init__(self, step: int, log_path: Path):
        self.step = step
        self.log_path = Path(log_path)
        super().__init__(abort_message(step, self.log_path))
