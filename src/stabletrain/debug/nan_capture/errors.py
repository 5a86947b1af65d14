"""The two errors of nancapture, and why a capture was taken (see ``docs/nancapture.md``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from stabletrain.errors import NaNCaptureError as NaNCaptureError  # defined without torch; exported here
from stabletrain.errors import StabletrainError

#: Why a capture was taken: the ``reason`` entry of a capture file and ``NaNDetectedError.reason``.
REASON_GRADIENTS = "nonfinite_gradients"
REASON_LOSS = "nonfinite_loss"
REASON_SKIPPED = "skipped_steps"
REASON_OTHER_RANK = "other_rank"
REASON_NORM_OVERFLOW = "gradient_norm_overflow"


class NaNDetectedError(StabletrainError):
    """A training step produced non-finite gradients or losses; the step was captured.

    Raised before clipping and the optimizer step, so no non-finite value reached the
    parameters, the optimizer state or a checkpoint.

    Attributes:
        step: The optimizer step that failed (numbered from 0).
        rank: The process that raised (every rank raises at the same step).
        nan_param_names: Parameters whose gradient holds a NaN or Inf on this rank (empty
            for ``"gradient_norm_overflow"``: every element is finite).
        capture_path: The capture file, ``.../nan_capture/rank{rank}/nan_capture.pt``.
        reason: ``"nonfinite_gradients"``, ``"nonfinite_loss"``, ``"gradient_norm_overflow"``
            (every gradient element finite, but so large that the float32 gradient norm
            overflows), ``"skipped_steps"`` (fp16 loss scaling skipped ``max_skipped_steps``
            steps in a row) or ``"other_rank"``.
        replay_command: A shell command that replays the capture; or, when no command can
            rebuild your model (its class needs constructor arguments or is not defined at
            the top level of a file), a Python template with a line marked ``FILL IN``.
        other_rank: True on the ranks whose message is another rank's: when ranks fail together,
            every rank reports the message of the rank that saw the cause most directly (its own
            loss non-finite), and the command line prints it once, from that rank.

    Example::

        try:
            stabletrain.train(out="out/boom", debug_args={"nancapture": {"enabled": True}}, ...)
        except stabletrain.NaNDetectedError as err:
            result = stabletrain.load_nan_capture(err.capture_path).replay()
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        rank: int,
        nan_param_names: Sequence[str],
        capture_path: str | Path,
        reason: str = REASON_GRADIENTS,
        replay_command: str = "",
        other_rank: bool = False,
    ):
        super().__init__(message)
        self.step = step
        self.rank = rank
        self.nan_param_names = list(nan_param_names)
        self.capture_path = Path(capture_path)
        self.reason = reason
        self.replay_command = replay_command
        self.other_rank = other_rank

    def __reduce__(self) -> Any:
        # Picklable across processes despite the keyword-only constructor.
        fields = (self.step, self.rank, self.nan_param_names, str(self.capture_path), self.reason, self.replay_command,
                  self.other_rank)
        return (_rebuild_nan_detected_error, (str(self), *fields))


def _rebuild_nan_detected_error(
    message: str, step: int, rank: int, names: list[str], path: str, reason: str, command: str,
    other_rank: bool = False,
) -> NaNDetectedError:
    return NaNDetectedError(
        message, step=step, rank=rank, nan_param_names=names, capture_path=path, reason=reason, replay_command=command,
        other_rank=other_rank,
    )
