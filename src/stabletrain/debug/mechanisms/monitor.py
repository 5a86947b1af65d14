"""The mechanism signals in any PyTorch loop: :class:`MechanismMonitor`.

It holds the probes (:mod:`~stabletrain.debug.mechanisms.probes`) and the optimizer statistics
(:mod:`~stabletrain.debug.mechanisms.updates`), arms them on the steps you log and gives the
``signals/...`` values of such a step as device scalars (:meth:`MechanismMonitor.device_values`,
for a loop that already reads values once per logged step) or as host floats in one read
(:meth:`MechanismMonitor.values`). Steps that are not logged cost an attribute check in the
optimizer's step hooks and nothing else. See docs/mechanisms.md.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from stabletrain.debug.mechanisms import keys
from stabletrain.debug.mechanisms.probes import SignalProbes
from stabletrain.debug.mechanisms.updates import UpdateStats

_log = logging.getLogger("stabletrain")


@dataclass(frozen=True)
class Notice:
    """Signals that are not measured, and why (``keys``: the key pattern; ``why``: the reason)."""

    keys: str
    why: str

    @property
    def text(self) -> str:
        return f"{self.why}: {self.keys} not measured"

    def to_dict(self) -> dict[str, str]:
        return {"keys": self.keys, "why": self.why}


class MechanismMonitor:
    """The ``signals/...`` of the steps you log, measured on the device (see docs/mechanisms.md).

    Args:
        model: The model (its module and parameter names are used in keys and messages).
        optimizer: The torch optimizer (unwrapped); without one, only the attention and
            output-logit signals are measured. It can also be given later (:meth:`set_optimizer`).
        probes: Look for attention and the output logits in the forward passes; turned off
            for a ``torch.compile``'d model (the probes run Python inside the forward).
        updates: Measure the relative update (keeps one copy of the parameters).
        report: Called once with each :class:`Notice` (what cannot be measured, and why);
            default: a warning on the ``stabletrain`` logger.
        model_name: How notices name the model; default: its class name.

    Example::

        monitor = MechanismMonitor(model, optimizer)
        for step, batch in enumerate(loader):
            log = step % 100 == 0
            monitor.begin_step(log=log)          # arms the probes for this step's forward passes
            loss = loss_fn(model(batch["x"]), batch["y"])
            loss.backward()
            optimizer.step()                     # the monitor's optimizer hooks measure the update
            optimizer.zero_grad()
            monitor.after_step()
            if log:
                print(step, monitor.values())    # one host read for all of them
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        probes: bool = True,
        updates: bool = True,
        report: Optional[Callable[[Notice], None]] = None,
        model_name: Optional[str] = None,
    ):
        self.model = model
        self.model_name = model_name or type(model).__name__
        self.report = report or (lambda notice: _log.warning("stabletrain signals: %s", notice.text))
        self.notices: list[Notice] = []
        self.armed = False
        self.step_ran = False
        self.update_rms_max_param: Optional[str] = None
        self._updates_wanted = updates
        self._module_names = {id(m): name for name, m in model.named_modules()}
        self._param_names = {id(p): name for name, p in model.named_parameters()}
        self.probes: Optional[SignalProbes] = None
        if probes and hasattr(model, "_orig_mod"):
            self.notice(f"{keys.ATTENTION_KEYS}, {keys.OUTPUT_KEYS}",
                        f"{self.model_name} is torch.compile'd: the probes run Python inside the forward, "
                        "which a compiled graph does not")
        elif probes:
            self.probes = SignalProbes(self._module_names, lambda text: self.notice("the signals of that call", text))
        self.updates: Optional[UpdateStats] = None
        self._hooks: list[RemovableHandle] = []
        self._values: Optional[dict[str, Tensor]] = None
        self._probed = False
        self._checked: set[str] = set()
        if optimizer is not None:
            self.set_optimizer(optimizer)

    # ------------------------------------------------------------------ setup

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Measure this optimizer's groups: its step hooks take the weights before and after."""
        for handle in self._hooks:
            handle.remove()
        self.updates = UpdateStats(optimizer, self._param_names, updates=self._updates_wanted)
        self._hooks = [optimizer.register_step_pre_hook(self._before_optimizer_step),
                       optimizer.register_step_post_hook(self._after_optimizer_step)]
        if not self._updates_wanted:
            self.notice(keys.UPDATE_KEYS, "updates=False (debug_args.mechanisms.updates=false)")

    @property
    def parameter_names(self) -> list[str]:
        """The parameters in the order ``signals/update_rms_argmax`` counts them."""
        return list(self.updates.names) if self.updates is not None else []

    @property
    def attention_modules(self) -> list[str]:
        """The attention modules measured on the last logged step."""
        return list(self.probes.attention) if self.probes is not None else []

    # ------------------------------------------------------------------ per step

    def begin_step(self, log: bool = True, *, probe: bool = True) -> None:
        """A step begins; ``log``: measure it. ``probe``: probe every torch call from now until
        :meth:`after_step` (a plain loop); False: only inside :meth:`probing` (a trainer that
        brackets its forward passes)."""
        self.stop_probe()
        self.armed, self.step_ran, self._values = bool(log), False, None
        if self.probes is not None:
            self.probes.reset()
        if self.updates is not None:
            self.updates.reset()
        if self.armed and probe:
            self.start_probe()

    def start_probe(self) -> None:
        """Probe from now on (on an armed step; idempotent)."""
        if self.armed and self.probes is not None:
            self.probes.start()
            self._probed = True

    def stop_probe(self) -> None:
        """Stop probing (idempotent)."""
        if self.probes is not None:
            self.probes.stop()

    @contextmanager
    def probing(self) -> Iterator[None]:
        """Probe the calls inside the block (a forward pass) on an armed step."""
        self.start_probe()
        try:
            yield
        finally:
            self.stop_probe()

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.armed and self.updates is not None:
            self.updates.before_step()

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.armed and self.updates is not None:
            self.step_ran = True
            self.updates.after_step()

    def after_step(self) -> None:
        """The step is over (after ``optimizer.step()``): stop probing and gather the step's
        values on the device. Nothing happens on a step that is not logged."""
        self.stop_probe()
        if not self.armed or self._values is not None:
            return
        values: dict[str, Tensor] = {}
        if self.probes is not None:
            values.update(self._probe_values())
        if self.updates is not None:
            values.update(self.updates.values())
        self._values = values
        self._check_found()

    def _probe_values(self) -> dict[str, Tensor]:
        assert self.probes is not None
        out: dict[str, Tensor] = {}
        maxes, entropies = [], []
        for module, stats in self.probes.attention.items():
            out[keys.module_key(keys.ATTN_LOGIT_MAX, module)] = stats.logit_max
            out[keys.module_key(keys.ATTN_ENTROPY, module)] = entropy = stats.entropy_mean()
            maxes.append(stats.logit_max)
            entropies.append(entropy)
        if maxes:
            device = maxes[0].device
            out[keys.ATTN_LOGIT_MAX] = torch.stack([m.to(device) for m in maxes]).amax()
            out[keys.ATTN_ENTROPY_MIN] = torch.stack([e.to(device) for e in entropies]).amin()
        if self.probes.logits is not None:
            out[keys.OUTPUT_LOGSUMEXP] = self.probes.logits.lse_mean()
            out[keys.OUTPUT_LOGIT_ABSMAX] = self.probes.logits.absmax
            out[keys.OUTPUT_LOGIT_MEAN] = self.probes.logits.logit_mean()
        return out

    def device_values(self) -> dict[str, Tensor]:
        """The ``signals/...`` of the last logged step as device scalars (empty when it was not
        logged), for a loop that reads them with its own values. ``signals/update_rms_argmax``
        is a position in :attr:`parameter_names`."""
        self.after_step()
        return dict(self._values or {})

    def values(self) -> dict[str, float]:
        """The ``signals/...`` of the last logged step as host floats: one host read."""
        device_values = self.device_values()
        if not device_values:
            return {}
        first = next(iter(device_values.values())).device
        host = torch.stack([v.float().reshape(()).to(first) for v in device_values.values()]).tolist()
        out = dict(zip(device_values, host))
        self.accept(out)
        return out

    def accept(self, values: dict[str, float]) -> None:
        """Host values of the step, read by the caller: names ``update_rms_argmax``'s tensor
        (:attr:`update_rms_max_param`)."""
        index = values.get(keys.UPDATE_RMS_ARGMAX)
        names = self.parameter_names
        if index is not None and index == index and 0 <= int(index) < len(names):
            self.update_rms_max_param = names[int(index)]

    # ------------------------------------------------------------------ what was not found

    def notice(self, keys_: str, why: str) -> None:
        """Name signals that are not measured, once: kept in :attr:`notices` and reported."""
        notice = Notice(keys_, why)
        if notice not in self.notices:
            self.notices.append(notice)
            self.report(notice)

    def _check_found(self) -> None:
        """After the first probed step: name what could not be found (once each)."""
        model = self.model_name
        if self.probes is not None and self._probed and "probes" not in self._checked:
            self._checked.add("probes")
            if not self.probes.attention:
                self.notice(keys.ATTENTION_KEYS,
                            f"no attention found in {model} (no scaled_dot_product_attention call, and no softmax "
                            "over the last dimension inside an attention module, in the forward pass)")
            if self.probes.logits is None:
                self.notice(keys.OUTPUT_KEYS,
                            f"no output logits found in {model} (no cross_entropy or log_softmax call outside "
                            "attention in the forward pass)")
        if "optimizer" not in self._checked:
            self._checked.add("optimizer")
            if self.updates is None:
                self.notice(f"{keys.WEIGHT_KEYS}, {keys.UPDATE_KEYS}, {keys.ADAM_KEYS}", "no optimizer given")
        if self.updates is not None and self.step_ran and "adam" not in self._checked:
            self._checked.add("adam")
            if not self.updates.is_adam_family():
                self.notice(keys.ADAM_KEYS, f"{type(self.updates.optimizer).__name__} keeps no exp_avg_sq "
                                             "(not an Adam-family optimizer)")

    # ------------------------------------------------------------------ cleanup

    def close(self) -> None:
        """Stop probing and remove the optimizer hooks (idempotent)."""
        self.stop_probe()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.armed = False

    def __enter__(self) -> "MechanismMonitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
