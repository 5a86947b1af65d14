"""Finding attention and the output logits in code nobody here wrote: :class:`SignalProbes`.

A ``torch.overrides.TorchFunctionMode`` that is active only during the forward passes of logged
steps sees every call of a torch function, by the function object, whatever module calls it:

* ``F.scaled_dot_product_attention``: attention by definition; its logits are recomputed
  (:func:`~stabletrain.debug.mechanisms.attention.sdpa_stats`);
* a softmax over the last dimension (``torch.softmax``, ``F.softmax``, ``Tensor.softmax``,
  ``nn.Softmax``) of a tensor with at least 2 dimensions, while an attention module runs
  (:func:`~stabletrain.debug.mechanisms.attention.is_attention_module`): its input is the
  logits. Any other softmax (an output softmax, a gate) is not attention and is not counted;
* ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``): run with the mode still
  active inside it, so its own softmax (``need_weights=True``) or SDPA call
  (``need_weights=False``) is seen;
* ``F.cross_entropy`` and ``log_softmax`` outside attention modules: their input is the
  output logits (:mod:`~stabletrain.debug.mechanisms.logits`).

Each value is attributed to the innermost running attention module (for SDPA outside any, the
innermost running module), tracked with global module forward hooks registered only while the
probes run. The statistics are computed under ``torch.no_grad()`` with autocast off, on the
device, and never read back here. A probe that fails on a call it did not expect does not stop
training: the failure is recorded as a notice, once per function and module.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, redispatch_function
from torch.utils.hooks import RemovableHandle

from stabletrain.debug.mechanisms.attention import AttentionStats, is_attention_module, sdpa_stats, softmax_stats
from stabletrain.debug.mechanisms.logits import (
    LogitStats,
    cross_entropy_logits,
    log_softmax_logits,
    logit_stats,
)

SDPA = frozenset({F.scaled_dot_product_attention})
SOFTMAX = frozenset({torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax})
LOG_SOFTMAX = frozenset({torch.log_softmax, F.log_softmax, torch.Tensor.log_softmax, torch.special.log_softmax})
CROSS_ENTROPY = frozenset({F.cross_entropy})
MULTI_HEAD = F.multi_head_attention_forward


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


class SignalProbes(TorchFunctionMode):
    """The probes of one logged step (see the module docstring); :meth:`start` / :meth:`stop`
    bracket each forward pass, and the statistics accumulate over them (microbatches).

    Args:
        names: ``id(module) -> name`` for the model's modules; others are named ``:<their class>``.
        on_failure: Called with what failed when a probe fails on a call (training goes on).

    Attributes:
        attention: Module name -> its :class:`AttentionStats` of this step.
        logits: The output logits' :class:`LogitStats` of this step, or None.
    """

    def __init__(self, names: dict[int, str], on_failure: Callable[[str], None]):
        super().__init__()
        self.names = names
        self.on_failure = on_failure
        self.attention: dict[str, AttentionStats] = {}
        self.logits: Optional[LogitStats] = None
        self.running = False
        self._stack: list[nn.Module] = []
        self._hooks: list[RemovableHandle] = []
        self._failed: set[tuple[str, str]] = set()

    def reset(self) -> None:
        """Forget the statistics (a new step)."""
        self.attention = {}
        self.logits = None

    def start(self) -> None:
        """Probe the calls from now on (idempotent)."""
        if self.running:
            return
        self._stack.clear()
        self._hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._enter_module),
            nn.modules.module.register_module_forward_hook(self._leave_module, always_call=True),
        ]
        self.__enter__()
        self.running = True

    def stop(self) -> None:
        """Stop probing (idempotent)."""
        if not self.running:
            return
        self.running = False
        self.__exit__(None, None, None)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._stack.clear()

    # ------------------------------------------------------------------ module stack

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        self._stack.append(module)

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i] is module:
                del self._stack[i:]
                return

    def _name(self, module: Optional[nn.Module]) -> str:
        if module is None:
            return ""
        name = self.names.get(id(module))
        return name if name is not None else f":{type(module).__name__}"

    def _attention_module(self) -> Optional[nn.Module]:
        return next((m for m in reversed(self._stack) if is_attention_module(m)), None)

    # ------------------------------------------------------------------ the calls

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is MULTI_HEAD:
            # Inside it the mode would be off; keep it on so that its softmax or SDPA is seen.
            with self:
                return redispatch_function(func, types, args, kwargs)
        out = func(*args, **kwargs)
        if func in SDPA or func in SOFTMAX or func in LOG_SOFTMAX or func in CROSS_ENTROPY:
            self._observe(func, args, kwargs)
        return out

    def _observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        attention = self._attention_module()
        try:
            first = _arg(args, kwargs, 0, "input")
            if not isinstance(first, Tensor):
                return
            with torch.no_grad(), torch.autocast(first.device.type, enabled=False):
                if func in SDPA:
                    module = attention if attention is not None else (self._stack[-1] if self._stack else None)
                    self._add_attention(module, self._sdpa(args, kwargs))
                elif func in SOFTMAX:
                    if attention is not None and self._last_dim(first, _arg(args, kwargs, 1, "dim")):
                        self._add_attention(attention, softmax_stats(first.detach()))
                elif attention is None:
                    found = (cross_entropy_logits if func in CROSS_ENTROPY else log_softmax_logits)(args, kwargs)
                    if found is not None:
                        logits, dim, kept = found
                        stats = logit_stats(logits.detach(), dim, kept)
                        self.logits = stats if self.logits is None else self.logits.merge(stats)
        except Exception as exc:  # a probe must never stop training
            where = self._name(attention if attention is not None else (self._stack[-1] if self._stack else None))
            key = (getattr(func, "__name__", str(func)), where)
            if key not in self._failed:
                self._failed.add(key)
                self.on_failure(f"the probe of {key[0]} in {where or ':root'} failed ({type(exc).__name__}: {exc})")

    @staticmethod
    def _last_dim(x: Tensor, dim: Any) -> bool:
        return isinstance(dim, int) and x.ndim >= 2 and dim % x.ndim == x.ndim - 1

    @staticmethod
    def _sdpa(args: tuple[Any, ...], kwargs: dict[str, Any]) -> AttentionStats:
        query, key = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
        return sdpa_stats(
            query.detach(),
            key.detach(),
            attn_mask=_arg(args, kwargs, 3, "attn_mask"),
            is_causal=bool(_arg(args, kwargs, 5, "is_causal", False)),
            scale=_arg(args, kwargs, 6, "scale"),
            enable_gqa=bool(_arg(args, kwargs, 7, "enable_gqa", False)),
        )

    def _add_attention(self, module: Optional[nn.Module], stats: AttentionStats) -> None:
        name = self._name(module)
        old = self.attention.get(name)
        self.attention[name] = stats if old is None else old.merge(stats)
