"""stabletrain's tools in the Hugging Face ``Trainer``: :class:`StabletrainCallback`.

``Trainer(..., callbacks=[StabletrainCallback(debug_args=...)])`` wraps this model instance's
``forward`` (the batch, RNG states and the loss, before ``logging_nan_inf_filter`` can hide it) and
decides at the end of the last microbatch's backward, before the Trainer clips; no Trainer
subclass is needed. See docs/integrations/hf_trainer.md.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from stabletrain import NaNCaptureError
from stabletrain.integrations.common import Settings, StepTools, dist_rank_and_world, parse_tool_settings
from stabletrain.integrations.healing import parse_on_instability
from stabletrain.utils.io import atomic_torch_save
from stabletrain.utils.text import shell_path

_log = logging.getLogger("stabletrain")

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError(
        "stabletrain.integrations.transformers needs transformers: pip install \"stabletrain[transformers]\""
    ) from None

__all__ = ["StabletrainCallback", "replay_step", "model_from_meta"]

#: Names the capture stores for replay (see stabletrain/debug/replay/capture.py).
_BUILDER = "stabletrain.integrations.transformers:model_from_meta"


def _loss_of(output: Any) -> Optional[Tensor]:
    """The loss a Hugging Face model returned (``ModelOutput.loss``, a dict's ``"loss"``, or
    the first element of a tuple when it is a scalar), else None."""
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, Tensor) and loss.numel() == 1 else None


def _grad_target(output: Any, loss: Optional[Tensor]) -> Optional[Tensor]:
    """A tensor the step's backward pass goes through: the loss, else the first output that
    requires a gradient (a loss computed by the Trainer from the logits)."""
    if loss is not None and loss.requires_grad:
        return loss
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, Tensor) and v.requires_grad), None)


def replay_step(model: nn.Module, batch: Any) -> Tensor:
    """``model(**batch)``'s loss: the step function replay and diagnose use for captures of
    :class:`StabletrainCallback` (found by name in the capture)."""
    loss = _loss_of(model(**batch))
    if loss is None:
        raise NaNCaptureError(
            f"{type(model).__name__}(**batch) returned no loss during replay: the Trainer computed it outside the "
            "model (label smoothing, compute_loss_func, a compute_loss override); replay with "
            "load_nan_capture(path, step_fn=my_step_fn) where my_step_fn(model, batch) computes that loss"
        )
    return loss


def model_from_meta(meta: Mapping[str, Any]) -> nn.Module:
    """A fresh model of the captured class and config (random weights; replay then loads
    the captured ones), as ``AutoModelFor...from_config`` builds it. Only classes that the
    ``transformers`` package exports are rebuilt."""
    import transformers

    path = str(meta.get("model_class", ""))
    name = path.rsplit(".", 1)[-1]
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and f"{cls.__module__}.{cls.__qualname__}" == path):
        raise NaNCaptureError(
            f"the captured model class {path} is not one of transformers' own classes, so it cannot be rebuilt "
            "from its config here; pass the model: load_nan_capture(path, model=MyModel(config)) "
            "(stabletrain replay PATH --model file.py:build_model)"
        )
    model_cls: Any = cls
    config = model_cls.config_class.from_dict(json.loads(meta["config"]))
    attn = meta.get("attn_implementation")
    return model_cls._from_config(config, **({"attn_implementation": attn} if attn else {}))


def _precision(args: Any, model: nn.Module) -> str:
    if getattr(args, "fp16", False):
        return "16-mixed"
    if getattr(args, "bf16", False):
        return "bf16-mixed"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {torch.bfloat16: "bf16-true", torch.float16: "16-true", torch.float64: "64-true"}.get(dtype, "32-true")


#: Written into each ``checkpoint-N`` folder of the Trainer (rank 0) with ``on_instability`` skip_step: the
#: spike detector's window and the recoveries, read back when the Trainer resumes from that folder.
STATE_FILE = "stabletrain_callback.pt"


class StabletrainCallback(TrainerCallback):
    """stabletrain's gradient norm, mechanism signals, underflow_overflow, nancapture and trend
    alerts in a Hugging Face ``Trainer`` (see the module docstring for how, given the Trainer's limits).

    On each logged step the mechanism signals (``signals/...``, docs/mechanisms.md) are read
    once after the optimizer step and added to the Trainer's log row in ``on_log``: callbacks
    after this one and ``state.log_history`` see them. The Trainer calls its ``report_to``
    callbacks before those you pass; to have the signals in them too, move this callback first:
    ``trainer.callback_handler.callbacks.insert(0, trainer.pop_callback(StabletrainCallback))``.

    Args:
        debug_args: The ``debug_args`` settings of ``stabletrain train`` (a dict or
            ``stabletrain.config.DebugArgs``).
        trend_alerts: The ``trend_alerts`` settings (a dict or ``TrendAlertArgs``); on by default.
        out_dir: Where ``debug/`` goes; default ``TrainingArguments(output_dir)``.
        guard: After each optimizer step, check that the optimizer state is still finite, and
            raise ``NonFiniteStepError`` naming the entries if not (one process).
        on_instability: ``stabletrain train``'s ``on_instability`` settings (a dict): with
            ``{"policy": "skip_step"}`` the update of a non-finite or spiking step is not applied
            (the Trainer's own ``optimizer.step()`` leaves the weights and state as they were),
            each recovery logged and kept in :attr:`recoveries`; past ``max_recoveries`` training
            stops with ``RecoveryLimitError``. Leave nancapture off with it (it stops first).

    Attributes:
        tools: The run's :class:`~stabletrain.integrations.common.StepTools` while training.
        alerts: Every trend alert of the run, as ``{"event": "trend_alert", ...}`` rows.
        gradient_norms: ``{step: gradient_norm}`` for every step whose norm was read on the
            host (every step with nancapture on, else the logging steps), steps from 0.
        recoveries: With ``on_instability`` skip_step, every skipped step as the
            ``{"event": "recovery", ...}`` rows of ``stabletrain train`` (known a step after it).
    """

    def __init__(self, *, debug_args: Settings = None, trend_alerts: Settings = None,
                 out_dir: Optional[Union[str, Path]] = None, guard: bool = True, on_instability: Settings = None):
        self.debug_args, self.trend_alerts = parse_tool_settings(debug_args, trend_alerts)
        self.on_instability = parse_on_instability(on_instability)
        self.recoveries: list[dict[str, Any]] = []
        self.guard = guard
        self.out_dir = out_dir
        self.tools: Optional[StepTools] = None
        self.alerts: list[dict[str, Any]] = []
        self.gradient_norms: dict[int, float] = {}
        self._model: Optional[nn.Module] = None
        self._forward_before: Any = None
        self._optimizer: Any = None
        self._bad_loss: Optional[Tensor] = None
        self._signals: dict[str, float] = {}
        self._loss_scale = 1.0

    # ------------------------------------------------------------------ setup and teardown

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self._close()
        rank, world = dist_rank_and_world()
        out = Path(self.out_dir if self.out_dir is not None else args.output_dir)
        folder = out / "debug" / "nan_capture"
        config = getattr(model, "config", None)
        meta = {
            "builder": _BUILDER,
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "config": config.to_json_string() if config is not None else "{}",
            "attn_implementation": getattr(config, "_attn_implementation", None),
        }
        self.tools = StepTools(
            model,
            framework="transformers",
            out_dir=out,
            debug_args=self.debug_args,
            trend_alerts=self.trend_alerts,
            rank=rank,
            world_size=world,
            scaler=getattr(optimizer, "scaler", None),  # Accelerate's AcceleratedOptimizer holds it
            precision=_precision(args, model),
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            step_fn=replay_step,
            model_meta=meta,
            # The model is rebuilt from the stored class and config: no --model needed.
            replay_command=f"stabletrain replay {shell_path(folder / f'rank{rank}' if world == 1 else folder)}",
            warmup_steps=args.get_warmup_steps(state.max_steps) if state.max_steps > 0 else 0,
            lr=args.learning_rate,
            clipping=args.max_grad_norm > 0,
            optimizer=optimizer,  # its torch optimizer, for the mechanism signals, the guard and skip_step
            guard=self.guard,
            on_instability=self.on_instability,
        )
        self.alerts = self.tools.alerts
        if self.tools.healing is not None and state.global_step > 0:
            self._resume_healing(Path(args.output_dir) / f"checkpoint-{state.global_step}" / STATE_FILE)
        self.recoveries = self.tools.healing.recoveries if self.tools.healing is not None else []
        self._optimizer = optimizer
        # What the Trainer's compute_loss multiplies a loss normalised over all ranks' tokens by.
        shared = bool(getattr(args, "average_tokens_across_devices", False)) and world > 1
        self._loss_scale = float(world if shared else 1)
        self._wrap(model)

    def _resume_healing(self, path: Path) -> None:
        """A resumed Trainer: skip_step's state from the checkpoint folder it resumes from (the one of its
        step in ``output_dir``), or a warning that it starts afresh."""
        assert self.tools is not None and self.tools.healing is not None
        if not path.is_file():
            _log.warning("on_instability: resumed at step %s without %s: skip_step's spike detector and its count "
                         "towards max_recoveries start afresh", path.parent.name.split("-")[-1], path)
            return
        self.tools.healing.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After the Trainer wrote ``checkpoint-N``: skip_step's state beside it (rank 0)."""
        if self.tools is None or self.tools.healing is None or not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            atomic_torch_save(self.tools.healing.state_dict(), folder / STATE_FILE)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tools is not None:
            self.tools.finish()  # the last optimizer step's check, which no later step's read carries
        self._close()

    def _wrap(self, model: nn.Module) -> None:
        """Put a wrapper around this instance's ``forward`` (the Trainer has no hook that sees
        the batch). Not ``functools.wraps``: Accelerate unwraps ``__wrapped__`` chains when it
        strips its own autocast wrapper."""
        self._model = model
        self._forward_before = model.__dict__.get("forward")  # Accelerate's autocast wrapper, if any
        original = model.forward
        signature = inspect.signature(original)
        tools = self.tools
        assert tools is not None, "the wrapper is put on after the step tools exist"

        def forward(*args: Any, **kwargs: Any) -> Any:
            if tools is None or tools.closed or not tools.in_step or not (model.training and torch.is_grad_enabled()):
                return original(*args, **kwargs)
            if args:  # the Trainer passes keywords; a positional call is stored by parameter name
                bound = signature.bind_partial(*args, **kwargs)
                args, kwargs = (), dict(bound.arguments)
            if kwargs.get("num_items_in_batch") is not None:  # None: the Trainer divides by the steps itself
                # The model normalises the loss over the whole accumulated batch: the Trainer
                # does not divide it by the accumulation steps, and so neither does replay. The
                # step's loss is the sum of the microbatches' (times the processes, when they
                # share the token count), as the Trainer logs it.
                tools.loss_sum_scale = self._loss_scale
                if tools.nan is not None:
                    tools.nan.gradient_accumulation_steps = 1
            tools.before_forward(dict(kwargs))
            output = original(**kwargs)
            loss = _loss_of(output)
            tools.after_forward(loss)
            if loss is not None and tools.detector is not None and tools.nan is None:
                bad = ~torch.isfinite(loss.detach())
                self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad
            if (tools.nan is not None or tools.uo is not None or tools.healing is not None) and _last_microbatch():
                tools.before_last_backward()
                target = _grad_target(output, loss)
                if target is not None:
                    _when_backward_ends(target, self._end_of_backward)
            return output

        forward.__doc__ = original.__doc__
        model.forward = forward
        tools.add_cleanup(self._unwrap)  # also when a decision raises out of Trainer.train()

    def _unwrap(self) -> None:
        if self._model is not None:
            if self._forward_before is not None:
                self._model.forward = self._forward_before
            else:
                self._model.__dict__.pop("forward", None)
            self._model = None

    def _close(self) -> None:
        self._unwrap()
        if self.tools is not None:
            self.tools.close()

    # ------------------------------------------------------------------ the step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tools is not None and not self.tools.closed:
            self._signals = {}
            self.tools.begin_step(state.global_step, log_signals=_will_log(args, state))

    def _end_of_backward(self) -> None:
        """The step's last backward pass has finished (DDP's reduction included); the Trainer
        has not clipped yet. Decides on every rank; raises there."""
        tools = self.tools
        if tools is None or tools.closed or not tools.in_step or tools.decided:
            return
        values = tools.grads_final(self._optimizer)
        if values.gradient_norm is not None:
            self.gradient_norms[values.step] = values.gradient_norm

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Only when the backward hook could not run (no output of the model required a
        # gradient): decide now, on the clipped gradients.
        tools = self.tools
        if tools is not None and not tools.closed and tools.in_step and not tools.decided \
                and (tools.nan is not None or tools.uo is not None or tools.healing is not None):
            self._end_of_backward()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tools = self.tools
        if tools is None or tools.closed or not tools.in_step:
            return
        # {} unless on_step_begin foresaw a logged step: decided there, so that this callback
        # may also run before the Trainer's DefaultFlowCallback (see the class docstring).
        self._signals = tools.read_signals()
        if tools.end_step():
            control.should_training_stop = True

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict[str, float]] = None,
               **kwargs: Any) -> None:
        tools = self.tools
        if logs is not None and self._signals and "train_runtime" not in logs:
            # The step's mechanism signals join the row: callbacks after this one and
            # state.log_history (trainer_state.json) get them.
            logs.update(self._signals)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self._signals)
            self._signals = {}
        if tools is None or tools.detector is None or not logs or "loss" not in logs or "train_runtime" in logs:
            return
        step = state.global_step - 1  # the Trainer counts completed steps; stabletrain numbers them from 0
        loss = float(logs["loss"])
        if self._bad_loss is not None:
            # The Trainer's logging_nan_inf_filter replaced a non-finite microbatch loss.
            if bool(self._bad_loss):
                loss = float("nan")
            self._bad_loss = None
        norm = self.gradient_norms.get(step, logs.get("grad_norm"))
        tools.observe(step, gradient_norm=None if norm is None else float(norm), loss=loss)


def _will_log(args: Any, state: Any) -> bool:
    """Whether the Trainer logs the step that begins now (its DefaultFlowCallback's rule, one step
    ahead: ``global_step`` counts completed steps)."""
    after = state.global_step + 1
    if after == 1 and args.logging_first_step:
        return True
    return args.logging_strategy == "steps" and after % max(1, int(state.logging_steps)) == 0


def _last_microbatch() -> bool:
    """Whether the Trainer will step the optimizer after this microbatch's backward pass: it
    sets Accelerate's shared gradient state before each microbatch."""
    from accelerate.state import GradientState

    return bool(GradientState().sync_gradients)


def _when_backward_ends(tensor: Tensor, fn: Any) -> None:
    """Run ``fn`` once the backward pass through ``tensor`` has finished.

    The tensor's gradient hook fires early in backward; it queues a callback for the end of
    the pass, which queues ``fn`` once more: DDP queues its gradient reduction while backward
    runs, so the second queueing puts ``fn`` after it (the autograd engine runs callbacks
    queued by callbacks, in order).
    """
    engine = torch.autograd.Variable._execution_engine

    def hook(grad: Tensor) -> None:
        engine.queue_callback(lambda: engine.queue_callback(fn))

    tensor.register_hook(hook)
