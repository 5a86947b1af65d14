"""Load a NaN capture and rerun the failing step offline: ``stabletrain.load_nan_capture(path).replay()``,
or ``stabletrain replay PATH`` on the command line.

``capture`` loads captures (:class:`NaNCapture`, :func:`load_nan_capture`), ``rerun`` is the building
block :func:`forward_backward` (any microbatches and samples, any precision, inside a caller's context),
``precision`` the precisions a replay runs in, ``result`` the :class:`ReplayResult`. The manual is
``docs/nancapture.md``.
"""

from stabletrain.debug.nan_capture import RankCapture, read_capture_file

from .capture import NaNCapture, load_nan_capture, load_object
from .precision import REPLAY_PRECISIONS, normalize_precision, precision_plugin, replay_dtype
from .rerun import ForwardBackwardResult, MicrobatchKey, ReplayableCapture, forward_backward, load_state
from .result import RankOutcome, ReplayResult

#: The tool's public names first; the rest are the building blocks diagnose and the command line use.
__all__ = [
    "load_nan_capture",
    "NaNCapture",
    "RankCapture",
    "ReplayResult",
    "ForwardBackwardResult",
    "forward_backward",
    "precision_plugin",
    "REPLAY_PRECISIONS",
    "RankOutcome",
    "MicrobatchKey",
    "ReplayableCapture",
    "read_capture_file",
    "normalize_precision",
    "replay_dtype",
    "load_state",
    "load_object",
]
