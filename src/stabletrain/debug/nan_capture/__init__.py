"""nancapture: stop at the first non-finite step and capture it for offline replay.

``monitor`` decides after every step and writes the capture, ``format`` is the capture file (its schema,
written and read), ``commands`` the replay command shown in the error, ``model_state`` what is read from
the model, ``errors`` the two errors and the capture reasons, ``callback`` wires the monitor into
``stabletrain.train``. The manual is ``docs/nancapture.md``; replay is :mod:`stabletrain.debug.replay`.
"""

from .callback import NaNCaptureCallback
from .commands import (
    INTEGRATIONS_PACKAGE,
    default_replay_command,
    default_step_fn,
    importable_ref,
    is_replay_template,
    no_replay_command_reason,
    qualified_name,
)
from .errors import (
    REASON_GRADIENTS,
    REASON_LOSS,
    REASON_NORM_OVERFLOW,
    REASON_OTHER_RANK,
    REASON_SKIPPED,
    NaNCaptureError,
    NaNDetectedError,
)
from .format import (
    FILE_NAME,
    FORMAT,
    UNSHARDED_VERSION,
    VERSION,
    RankCapture,
    capture_files,
    read_capture_file,
    recovery_captures,
    schema_problems,
    write_capture_file,
)
from .model_state import infer_precision, largest_abs_grads, nonfinite_grad_names, persistent_buffers
from .monitor import NaNCaptureMonitor

#: The tool's public names first; the rest are the building blocks replay, diagnose and the guard use.
__all__ = [
    "NaNCaptureMonitor",
    "NaNDetectedError",
    "NaNCaptureError",
    "NaNCaptureCallback",
    "FORMAT",
    "VERSION",
    "UNSHARDED_VERSION",
    "FILE_NAME",
    "REASON_GRADIENTS",
    "REASON_LOSS",
    "REASON_NORM_OVERFLOW",
    "REASON_OTHER_RANK",
    "REASON_SKIPPED",
    "RankCapture",
    "read_capture_file",
    "write_capture_file",
    "capture_files",
    "recovery_captures",
    "schema_problems",
    "INTEGRATIONS_PACKAGE",
    "default_step_fn",
    "default_replay_command",
    "no_replay_command_reason",
    "is_replay_template",
    "importable_ref",
    "qualified_name",
    "infer_precision",
    "persistent_buffers",
    "nonfinite_grad_names",
    "largest_abs_grads",
]
