"""underflow_overflow: name the first module whose values go non-finite, in the forward and the
backward pass, and write its last frames to ``<out_dir>/underflow_overflow_rank{rank}.log``.

``stats`` measures tensors on the device, ``records`` keeps what the hooks saw, ``monitor`` hooks
the model and decides, ``attribution`` says who made the value, ``render`` writes the log and
the messages, ``callback`` wires the monitor into ``stabletrain.train``. The manual is
``docs/underflow_overflow.md``.
"""

from .callback import SCALER_PATIENCE, UnderflowOverflowCallback, check_settings
from .errors import UnderflowOverflowAbort, UnderflowOverflowError
from .monitor import UnderflowOverflowMonitor
from .render import log_path
from .stats import tensor_stats

__all__ = [
    "UnderflowOverflowMonitor",
    "UnderflowOverflowError",
    "UnderflowOverflowAbort",
    "UnderflowOverflowCallback",
    "log_path",
    "tensor_stats",
    "SCALER_PATIENCE",
    "check_settings",
]
