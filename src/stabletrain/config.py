"""All settings of ``stabletrain train``, defined once.

The Python API (``stabletrain.train(out=..., **settings)``) and the command line
(``stabletrain train key=value ...`` with dotted keys) validate against the same pydantic
models below. Unknown keys are rejected with a suggestion, and every problem is reported at
once in a single :class:`~stabletrain.errors.ConfigError`.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from stabletrain.errors import ConfigError

PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")
Precision = Literal["auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"]


def _refuse_booleans(what: str) -> BeforeValidator:
    def check(value: Any) -> Any:
        # pydantic reads true as 1 and false as 0: batch_size=true would train with batch size 1.
        if isinstance(value, bool):
            raise ValueError(f"expected {what}, not true/false")
        return value

    return BeforeValidator(check)


#: A whole number; true/false are refused. A float that is exactly whole (2.0, or 1e4 on the
#: command line, where JSON reads it as a float) is taken as that number; 2.5 is refused.
Int = Annotated[int, _refuse_booleans("a whole number")]
#: A number; true/false are refused.
Float = Annotated[float, _refuse_booleans("a number")]


class _Settings(BaseModel):
    """Base for every settings group: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )


# --------------------------------------------------------------------------------------
# Model and optimisation
# --------------------------------------------------------------------------------------


class ModelArgs(_Settings):
    """Optimiser, schedule and architecture settings (``model_args.*``)."""

    lr: Float = Field(1e-3, gt=0, description="Peak learning rate.")
    weight_decay: Float = Field(
        0.01, ge=0, description="Decoupled weight decay, applied to weights of 2 or more dimensions."
    )
    warmup_steps: Int = Field(50, ge=0, description="Linear learning-rate warmup, in optimizer steps.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warmup: cosine or linear to min_lr_ratio*lr, or constant."
    )
    min_lr_ratio: Float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr.")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    betas: tuple[Float, Float] = Field((0.9, 0.95), description="AdamW betas.")
    momentum: Float = Field(0.9, ge=0, lt=1, description="SGD momentum.")
    # Language model architecture.
    n_layers: Int = Field(2, ge=1, description="Language model: transformer blocks.")
    n_heads: Int = Field(4, ge=1, description="Language model: attention heads per block.")
    dim: Int = Field(128, ge=1, description="Language model: embedding width; a multiple of n_heads.")
    context_length: Int = Field(64, ge=2, description="Language model: tokens per training sample.")
    tokenizer: Literal["byte", "char"] = Field(
        "byte", description="Language model: byte-level (256 symbols) or character-level vocabulary."
    )
    dropout: Float = Field(0.1, ge=0, lt=1, description="Dropout probability (language model and built-in CNN).")
    # Image classification architecture.
    cnn_width: Int = Field(32, ge=1, description="Built-in CNN: channels of the first convolution.")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


#: model_args fields that only make sense for one built-in task; setting them for another is an error.
LANGUAGE_MODEL_ARGS = ("n_layers", "n_heads", "dim", "context_length", "tokenizer")
IMAGE_MODEL_ARGS = ("cnn_width",)


class NormalizeArgs(_Settings):
    mean: tuple[Float, Float, Float] = Field(
        (0.485, 0.456, 0.406), description="Per-channel mean subtracted from images in [0, 1]."
    )
    std: tuple[Float, Float, Float] = Field((0.229, 0.224, 0.225), description="Per-channel std divisor.")

    @field_validator("std")
    @classmethod
    def _std_positive(cls, v: tuple[float, float, float]) -> tuple[float, float, float]:
        if not all(s > 0 for s in v):
            raise ValueError(f"every std must be > 0, got {list(v)}")
        return v


class TransformArgs(_Settings):
    """Image preprocessing (``transform_args.*``)."""

    image_size: Int = Field(32, ge=8, description="Images are resized to image_size x image_size.")
    normalize: NormalizeArgs = Field(default_factory=NormalizeArgs, description="Input normalization.")


class DataArgs(_Settings):
    """Reading the training data (``data_args.*``)."""

    bad_images: Literal["error", "skip"] = Field(
        "error",
        description=(
            "Image folders: files that cannot be read as images (corrupt, truncated, empty). error: list them "
            "and stop before training; skip: train without them and list them in train.log."
        ),
    )


class TorchCompileArgs(_Settings):
    """``torch.compile`` (``torch_compile_args.*``). Off by default."""

    disable: bool = Field(True, description="Set to false to compile the model with torch.compile.")
    mode: Optional[str] = Field(None, description="torch.compile mode, e.g. 'reduce-overhead'.")
    backend: str = Field("inductor", description="torch.compile backend.")
    fullgraph: bool = Field(False, description="Require a single graph.")
    dynamic: Optional[bool] = Field(None, description="Dynamic shapes.")


# --------------------------------------------------------------------------------------
# Debugging tools
# --------------------------------------------------------------------------------------


class UnderflowOverflowArgs(_Settings):
    """Per-module abs min/max tracing that stops at the first non-finite value."""

    enabled: bool = Field(False, description="Turn the underflow/overflow monitor on.")
    max_frames_to_save: Int = Field(21, ge=1, description="Frames kept and written to the report.")
    trace_batch_nums: list[Int] = Field(
        default_factory=list, description="Steps at which every frame is written, without aborting."
    )
    abort_after_batch_num: Optional[Int] = Field(None, ge=0, description="Stop training after this step.")
    include_backward: bool = Field(True, description="Also trace gradients during the backward pass.")

    @field_validator("trace_batch_nums")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        bad = [b for b in v if b < 0]
        if bad:
            raise ValueError(f"step numbers must be >= 0, got {bad}")
        return sorted(set(v))


class NaNCaptureArgs(_Settings):
    """Capture the failing step when gradients go non-finite, for offline replay."""

    enabled: bool = Field(False, description="Turn NaN/Inf capture on.")
    max_skipped_steps: Int = Field(
        10,
        ge=1,
        description="Under fp16 loss scaling: capture after this many consecutive skipped steps.",
    )


class GuardArgs(_Settings):
    """The always-on guard (``guard.*``): a blow-up stops the run at once, nothing damaged is saved.

    Every step it decides on the device whether the loss and the gradient norm are finite
    (before the optimizer step) and whether the parameters and the optimizer state still are
    (after it); the flags are read where the loop reads values anyway (logged steps,
    checkpoints, nancapture's per-step read), so steps that are not logged pay no host
    synchronisation. Under fp16 loss scaling a step the GradScaler skips is not a failure;
    ``debug_args.nancapture.max_skipped_steps`` skipped steps in a row are.
    """

    enabled: bool = Field(
        True,
        description=(
            "Stop at the first step whose loss, gradient norm, parameters or optimizer state go non-finite "
            "(checkpoints are verified finite whatever this says)."
        ),
    )


class OnInstabilityArgs(_Settings):
    """What to do when a step goes non-finite or spikes (``on_instability.*``); see docs/self_healing.md.

    ``stop`` is the guard alone: the run stops at the first non-finite step. ``skip_step`` does
    not apply a bad step's update (decided on the device, no host sync); ``rollback`` restores
    the newest in-memory snapshot (taken every ``rollback_steps``) and skips the data since it.
    A step is bad when its loss or gradient norm is non-finite, when (after ``warmup`` good
    steps) its log loss lies more than ``zscore`` noise units above the mean of the last 5 good
    steps (the noise: the step-to-step scatter over the last ``window`` good steps) or its log
    gradient norm more than ``zscore`` standard deviations above the window's mean, or when the
    loss exceeds ``max_ratio`` times the largest loss seen.
    """

    policy: Literal["stop", "skip_step", "rollback"] = Field(
        "stop", description="stop (the guard alone), skip_step (drop the bad update) or rollback (to a snapshot)."
    )
    window: Int = Field(50, ge=2, description="Good steps in the rolling window of log loss and log gradient norm.")
    zscore: Float = Field(6.0, gt=0, description="Spike threshold: log loss this many noise units above the last 5 "
                                                 "good steps, or log gradient norm this many std above the window.")
    warmup: Int = Field(20, ge=2, description="Good steps seen before spikes are judged (non-finite values always are).")
    max_ratio: Float = Field(10.0, gt=1, description="A loss above this many times the largest loss seen is a spike.")
    min_std: Float = Field(0.05, ge=0, description="Floor of the noise and std of log values (a flat window would "
                                                   "make any wiggle a spike).")
    max_recoveries: Int = Field(10, ge=0, description="After this many recoveries the next bad step stops the run "
                                                      "with a capture.")
    rollback_steps: Int = Field(50, ge=1, description="rollback: keep an in-memory snapshot every this many steps.")
    diagnose: bool = Field(True, description="After training, run stabletrain diagnose on the first 5 recoveries' "
                                             "captures (never during training); the report shows the verdicts.")


class DebugArgs(_Settings):
    """On-demand debugging tools (``debug_args.*``)."""

    underflow_overflow: UnderflowOverflowArgs = Field(default_factory=UnderflowOverflowArgs)
    nancapture: NaNCaptureArgs = Field(default_factory=NaNCaptureArgs)


# --------------------------------------------------------------------------------------
# Loggers
# --------------------------------------------------------------------------------------


class JsonlLoggerArgs(_Settings):
    enabled: bool = Field(True, description="Write out/metrics.jsonl (the report and trend alerts read it).")


class TensorBoardLoggerArgs(_Settings):
    enabled: Union[bool, Literal["auto"]] = Field(
        "auto",
        description=(
            "Write TensorBoard event files to out/tensorboard/ (view: tensorboard --logdir out/<run>); "
            "auto = on when the tensorboard package is installed."
        ),
    )


class MLflowLoggerArgs(_Settings):
    enabled: bool = Field(False, description="Log to MLflow (pip install \"stabletrain[mlflow]\").")
    experiment_name: str = Field("stabletrain", description="MLflow experiment; created when missing.")
    run_name: Optional[str] = Field(None, description="MLflow run name; default: the out folder's name.")
    tracking_uri: Optional[str] = Field(
        None,
        description=(
            "MLflow tracking URI; default: sqlite:///<out>/mlflow.db, a local database "
            "(view: mlflow ui --backend-store-uri sqlite:///<out>/mlflow.db)."
        ),
    )
    tags: dict[str, str] = Field(default_factory=dict, description="Tags set on the run.")


class WandbLoggerArgs(_Settings):
    enabled: bool = Field(False, description="Log to Weights & Biases (pip install \"stabletrain[wandb]\").")
    project: str = Field("stabletrain", description="W&B project.")
    name: Optional[str] = Field(None, description="W&B run name; default: the out folder's name.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "offline",
        description="online syncs live; offline writes out/wandb/ without network (upload later with wandb sync).",
    )


class LoggersArgs(_Settings):
    """Metric loggers (``loggers.*``). Every logger receives the same metrics at the same steps."""

    jsonl: JsonlLoggerArgs = Field(default_factory=JsonlLoggerArgs)
    tensorboard: TensorBoardLoggerArgs = Field(default_factory=TensorBoardLoggerArgs)
    mlflow: MLflowLoggerArgs = Field(default_factory=MLflowLoggerArgs)
    wandb: WandbLoggerArgs = Field(default_factory=WandbLoggerArgs)


# --------------------------------------------------------------------------------------
# Trend alerts
# --------------------------------------------------------------------------------------


class TrendAlertArgs(_Settings):
    """Live alerts on the trend of gradient_norm and loss (``trend_alerts.*``).

    They read the values already logged (no extra host synchronisation), so they are on by
    default. Windows count logged points (one every ``log_every_num_steps`` steps).
    """

    enabled: bool = Field(True, description="Warn once per exploding/vanishing/spike/plateau/NaN episode.")
    window: Int = Field(20, ge=3, description="Logged points in the reference band (median and MAD of log values).")
    persist: Int = Field(
        3, ge=2, description="Consecutive logged points a rise or fall must last to be exploding or vanishing."
    )
    explode_factor: Float = Field(
        10.0, gt=1, description="gradient_norm exploding: persistently this many times above its lowest level."
    )
    vanish_factor: Float = Field(
        100.0, gt=1, description="gradient_norm vanishing: persistently this many times below its highest level."
    )
    spike_factor: Float = Field(
        5.0, gt=1, description="gradient_norm spike: one point this many times above the band (ignored in warmup)."
    )
    loss_explode_factor: Float = Field(
        4.0, gt=1, description="loss exploding: persistently this many times above its lowest level."
    )
    loss_spike_factor: Float = Field(2.0, gt=1, description="loss spike: one point this many times above the band.")
    plateau_min_improvement: Float = Field(
        0.05,
        ge=0,
        lt=1,
        description="loss plateau: after window points, improved less than this fraction since the start, and flat.",
    )
    z: Float = Field(
        6.0, gt=0, description="A jump must also exceed z robust standard deviations (1.4826 x MAD) of the band."
    )


# --------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------


class TrainSettings(_Settings):
    """Every setting of a training run. ``out`` is the only one without a default."""

    out: Path = Field(description="Output folder: metrics, logs, checkpoints, debug files.")
    task: Optional[Literal["language_model", "image_classification"]] = Field(
        None, description="Built-in task; inferred from model when omitted (default: language_model)."
    )
    model: Any = Field(
        None,
        description=(
            "'transformer' (language model), 'cnn' or 'torchvision/<name>' (images); "
            "from Python also an nn.Module with training_step(batch) -> loss."
        ),
    )
    data: Any = Field(
        None,
        description=(
            "Text file (language model) or image folder with one subfolder per class; "
            "from Python also a map-style Dataset. Default: generated built-in data."
        ),
    )
    steps: Int = Field(500, ge=1, description="Optimizer steps to train for.")
    batch_size: Int = Field(
        32, ge=1, description="Samples per optimizer step over all devices and accumulation steps."
    )
    gradient_accumulation_steps: Int = Field(1, ge=1, description="Microbatches per optimizer step.")
    model_args: ModelArgs = Field(default_factory=ModelArgs)
    transform_args: TransformArgs = Field(default_factory=TransformArgs)
    data_args: DataArgs = Field(default_factory=DataArgs)
    precision: Precision = Field(
        "auto", description="Numerical precision; auto = bf16-mixed on a GPU that supports it, else 32-true."
    )
    gradient_clip_val: Float = Field(0.0, ge=0, description="Clip the total gradient norm to this value; 0 = off.")
    log_every_num_steps: Int = Field(10, ge=1, description="Log metrics and the progress line every N steps.")
    gradient_norm_per_layer: bool = Field(
        False,
        description=(
            "Also log gradient_norm/<name> for every parameter and module, from the same per-parameter "
            "norms as gradient_norm, at the logging cadence."
        ),
    )
    checkpoint_every_num_steps: Int = Field(100, ge=1, description="Save checkpoints every N steps.")
    max_checkpoints_to_keep: Int = Field(
        3, ge=0, description="Periodic step_*.ckpt files kept besides last.ckpt; 0 keeps only last.ckpt."
    )
    resume_interrupted: bool = Field(False, description="Continue from out/checkpoints/last.ckpt.")
    resume_from: Optional[Path] = Field(
        None,
        description=(
            "Continue from this checkpoint file (e.g. out/checkpoints/step_000200.ckpt), with the same checks "
            "as resume_interrupted; metrics.jsonl continues and later rows of the same steps win."
        ),
    )
    overwrite: bool = Field(False, description="Start afresh in a non-empty out folder, replacing its outputs.")
    seed: Int = Field(0, ge=0, description="Random seed for initialisation, data order and dropout.")
    accelerator: str = Field("auto", description="cpu, cuda, gpu, mps or auto.")
    devices: Union[Int, str, list[Int]] = Field("auto", description="Devices per node: a count, a list or auto.")
    num_nodes: Int = Field(1, ge=1, description="Number of nodes.")
    strategy: str = Field("auto", description="Lightning Fabric strategy: auto, ddp, ddp_spawn, ...")
    num_workers: Union[Int, Literal["auto"]] = Field(
        "auto", description="DataLoader workers; auto = 0 for in-memory data, else up to 8."
    )
    torch_compile_args: TorchCompileArgs = Field(default_factory=TorchCompileArgs)
    debug_args: DebugArgs = Field(default_factory=DebugArgs)
    guard: GuardArgs = Field(default_factory=GuardArgs)
    on_instability: OnInstabilityArgs = Field(default_factory=OnInstabilityArgs)
    loggers: LoggersArgs = Field(default_factory=LoggersArgs)
    trend_alerts: TrendAlertArgs = Field(default_factory=TrendAlertArgs)
    callbacks: list[Any] = Field(
        default_factory=list, description="Python only: objects with on_* event methods (see stabletrain.events)."
    )

    @field_validator("out", mode="before")
    @classmethod
    def _out_given(cls, v: Any) -> Any:
        # Path("") is the current folder: an empty out= would train into wherever the command runs.
        if isinstance(v, str) and not v.strip():
            raise ValueError("empty; give an output folder, e.g. out=out/my_run (out=. for the current folder)")
        return v

    @field_validator("resume_from", mode="before")
    @classmethod
    def _resume_from_given(cls, v: Any) -> Any:
        # Path("") is the current folder, which is no checkpoint file; null means not resuming.
        if isinstance(v, str) and not v.strip():
            raise ValueError("empty; give a checkpoint file, e.g. resume_from=out/my_run/checkpoints/step_000200.ckpt, "
                             "or leave the setting out")
        return v

    @field_validator("num_workers")
    @classmethod
    def _workers(cls, v: Union[int, str]) -> Union[int, str]:
        if isinstance(v, int) and v < 0:
            raise ValueError(f"must be >= 0 or 'auto', got {v}")
        return v

    @field_validator("accelerator")
    @classmethod
    def _known_accelerator(cls, v: str) -> str:
        if v in COMMON_FABRIC_NAMES["accelerator"]:
            return v
        return _one_of(v, fabric_choices("accelerator"), "a Lightning Fabric accelerator")

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, v: str) -> str:
        # Fabric lower-cases strategy names; so do we, so that the names compare equal.
        if v.lower() in COMMON_FABRIC_NAMES["strategy"]:
            return v.lower()
        return _one_of(v.lower(), fabric_choices("strategy"), "a Lightning Fabric strategy")

    def to_json_dict(self) -> dict[str, Any]:
        """The settings as JSON-compatible data; Python objects are described by their type."""
        data = self.model_dump(mode="python", exclude={"callbacks", "model", "data"})
        data["out"] = str(self.out)
        data["model"] = _describe(self.model)
        data["data"] = _describe(self.data)
        data["callbacks"] = [_describe(c) for c in self.callbacks]
        return json.loads(json.dumps(data, default=str))


#: Names every Lightning Fabric 2.x accepts, so that these settings are checked without importing
#: Fabric (and torch, seconds on a cold start); any other name is looked up in Fabric's registries.
COMMON_FABRIC_NAMES: dict[str, frozenset[str]] = {
    "accelerator": frozenset(("auto", "cpu", "cuda", "gpu", "mps", "tpu")),
    "strategy": frozenset(
        ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true", "dp", "fsdp",
         "deepspeed")
    ),
}


def fabric_choices(setting: Literal["accelerator", "strategy"]) -> list[str]:
    """The names Lightning Fabric accepts for ``accelerator`` or ``strategy``, ``auto`` first.

    Example::

        fabric_choices("accelerator")  # ['auto', 'cpu', 'cuda', 'gpu', 'mps', 'tpu']
    """
    # Imported here: only a non-default value needs Fabric's registries.
    if setting == "accelerator":
        from lightning_fabric.accelerators import ACCELERATOR_REGISTRY

        names = [*ACCELERATOR_REGISTRY.available_accelerators(), "gpu"]
    else:
        from lightning_fabric.strategies import STRATEGY_REGISTRY

        names = list(STRATEGY_REGISTRY.available_strategies())
    return ["auto", *sorted(set(names) - {"auto"})]


def _one_of(value: str, choices: list[str], what: str) -> str:
    if value in choices:
        return value
    close = difflib.get_close_matches(value, choices, n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"not {what}{hint} Valid choices: {', '.join(choices)}")


#: Keys that settings.json and checkpoints add to the settings; not settings themselves.
RESOLVED_ONLY_KEYS = ("world_size", "model_meta")


def settings_from_resolved(resolved: dict[str, Any], **overrides: Any) -> TrainSettings:
    """Rebuild :class:`TrainSettings` from a run's resolved settings (settings.json, a checkpoint).

    Python objects that were only described (a custom model or dataset, callbacks) cannot be
    restored; they come back as None/[] unless given in ``overrides``.
    """
    data = {k: v for k, v in resolved.items() if k not in RESOLVED_ONLY_KEYS}
    for key in ("model", "data"):
        if isinstance(data.get(key), str) and data[key].startswith("<"):
            data[key] = None
    data["callbacks"] = []
    data.update(overrides)
    return load_settings(data)


def _describe(obj: Any) -> Any:
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"


# --------------------------------------------------------------------------------------
# Validation with readable errors
# --------------------------------------------------------------------------------------


def load_settings(settings: dict[str, Any]) -> TrainSettings:
    """Validate a settings dict; raise one ConfigError listing every problem."""
    try:
        return TrainSettings(**settings)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, TrainSettings)) from None


def partial_settings(settings: dict[str, Any]) -> tuple[Optional[TrainSettings], list[str]]:
    """The settings without the values pydantic rejects, and the dotted keys of those values.

    Each rejected value is left out, so its setting falls back to its default, and the rest
    is validated again. The checks that do not read a rejected setting can then still run,
    so that one error lists every mistake. Returns ``(None, keys)`` when the rest still does
    not validate (e.g. ``out`` is missing).

    Example::

        partial_settings({"out": "o", "steps": 0, "model_args": {"lr": 0.1, "lrr": 1}})
        # (TrainSettings(out='o', steps=500, model_args=ModelArgs(lr=0.1, ...), ...), ['steps', 'model_args.lrr'])
    """
    data = _copy_dicts(settings)
    rejected: list[str] = []
    while True:
        try:
            return TrainSettings(**data), rejected
        except ValidationError as exc:
            dropped = [key for err in exc.errors() if (key := _drop(data, err["loc"])) is not None]
            if not dropped:
                return None, rejected
            rejected.extend(dropped)


def _copy_dicts(data: Any) -> Any:
    """A copy of the nested dicts, sharing their other values (models, datasets, callbacks)."""
    return {k: _copy_dicts(v) for k, v in data.items()} if isinstance(data, dict) else data


def _drop(data: dict[str, Any], loc: tuple[Any, ...]) -> Optional[str]:
    """Delete the deepest key of ``loc`` present in the nested dicts; its dotted path, or None."""
    node: Any = data
    path: list[str] = []
    parent: dict[str, Any] = data
    for part in loc:
        if not (isinstance(node, dict) and part in node):
            break  # e.g. a union member's name, or an index into a list
        parent, node = node, node[part]
        path.append(str(part))
    if not path:
        return None
    del parent[path[-1]]
    return ".".join(path)


def _format_validation_error(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    problems = []
    # A value that fits no member of a union (devices=true) fails once per member; one line per setting.
    by_setting: dict[tuple[str, ...], list[Any]] = {}
    for err in exc.errors():
        key = tuple(p for p in _setting_loc(root, err["loc"]) if not isinstance(p, int))
        by_setting.setdefault(key, []).append(err)
    for names, errs in by_setting.items():
        err = next((e for e in errs if e["type"] == "value_error"), errs[0])  # our own checks say most
        loc = [str(p) for p in (_setting_loc(root, err["loc"]) if len(errs) == 1 else names)]
        where = ".".join(loc) or "settings"
        if err["type"] == "extra_forbidden":
            parent = _model_at(root, err["loc"][:-1])
            hint = ""
            if parent is not None:
                close = difflib.get_close_matches(loc[-1], list(parent.model_fields), n=1, cutoff=0.5)
                if close:
                    prefix = ".".join(loc[:-1] + [close[0]])
                    hint = f" Did you mean '{prefix}'?"
                else:
                    valid = ", ".join(parent.model_fields)
                    hint = f" Valid keys here: {valid}."
            problems.append(f"{where}: unknown setting.{hint}")
            continue
        if err["type"] == "missing":
            problems.append(f"{where}: required setting is missing.")
            continue
        msg = err["msg"]
        if len(errs) > 1 and err["type"] != "value_error":
            annotation = _annotation_at(root, names)
            if annotation is not None:
                msg = f"Input should be {_type_name(annotation)}"
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        problems.append(f"{where}: {msg} (got {err.get('input')!r})")
    return problems


def _setting_loc(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """``loc`` without pydantic's names of union members (``function-before[...]``, ``str``):
    the setting's names, with list positions (ints) and unknown keys kept."""
    model: Any = root
    parts: list[Any] = []
    for part in loc:
        if isinstance(model, type) and issubclass(model, BaseModel):
            parts.append(str(part))
            field = model.model_fields.get(str(part))
            model = field.annotation if field is not None else None
        elif isinstance(part, int):
            parts.append(part)
    return tuple(parts)


def _annotation_at(root: type[BaseModel], loc: tuple[str, ...]) -> Any:
    model: Any = root
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        model = model.model_fields[part].annotation
    return model


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> Optional[type[BaseModel]]:
    """The settings model class found by following ``loc`` from ``root``."""
    model: Any = root
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        model = field.annotation
    if isinstance(model, type) and issubclass(model, BaseModel):
        return model
    return None


# --------------------------------------------------------------------------------------
# Command line: dotted key=value pairs
# --------------------------------------------------------------------------------------

#: Settings that only make sense from Python.
PYTHON_ONLY = ("callbacks",)


def parse_cli_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["model_args.lr=0.01", "out=out/x"]`` into a nested dict.

    Values are parsed as JSON where possible (numbers, true/false, null, lists, objects);
    anything else is kept as a string, so ``precision=bf16-mixed`` needs no quoting. A setting
    given twice is an error (the last value would silently win), and so is a group given whole
    and by key (``model_args={"lr": 1} model_args.lr=2``).
    """
    result: dict[str, Any] = {}
    problems = []
    given: list[tuple[tuple[str, ...], str, Any]] = []  # (key parts, argument, value) of the valid arguments
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep or not key:
            problems.append(f"{arg!r}: expected key=value, e.g. model_args.lr=0.01")
            continue
        parts = key.split(".")
        if any(not p for p in parts):
            problems.append(f"{arg!r}: malformed key {key!r}")
            continue
        given.append((tuple(parts), arg, _parse_value(raw)))
    repeats = _repeated_keys(given)
    problems.extend(repeats)
    if repeats:
        raise ConfigError(problems)
    for key_parts, _, value in given:
        node = result
        for i, p in enumerate(key_parts[:-1]):
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                problems.append(f"{'.'.join(key_parts)}: {'.'.join(key_parts[: i + 1])} was already given a value, "
                                "it cannot also have sub-keys")
                break
            node = child
        else:
            node[key_parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    return result


def _repeated_keys(given: list[tuple[tuple[str, ...], str, Any]]) -> list[str]:
    """One line per setting given more than once: the same key, or a group and keys inside it."""
    problems = []
    done: set[int] = set()
    for i, (parts, _, _) in enumerate(given):
        if i in done:
            continue
        # The shortest key that is a prefix of this one, or of which it is a prefix, heads the cluster.
        related = [j for j, (other, _, _) in enumerate(given) if _nested(parts, other)]
        head = min(related, key=lambda j: len(given[j][0]))
        cluster = [j for j, (other, _, _) in enumerate(given) if _nested(given[head][0], other)]
        done.update(cluster)
        if len(cluster) < 2:
            continue
        key = ".".join(given[head][0])
        args = [given[j][1] for j in cluster]
        listed = ", ".join(args)
        if all(given[j][0] == given[head][0] for j in cluster):
            problems.append(f"{key}: given {len(args)} times ({listed}); give each setting once")
        elif isinstance(given[head][2], dict):
            problems.append(f"{key}: given as a whole and by key ({listed}); give the group once, or only its keys")
        else:
            problems.append(f"{key}: was given a value and sub-keys ({listed}); a setting cannot also have sub-keys")
    return problems


def _nested(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _parse_value(raw: str) -> Any:
    lowered = raw.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def settings_help(model: type[BaseModel] = TrainSettings, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, description) for every setting, depth first."""
    rows = []
    for name, field in model.model_fields.items():
        if name in PYTHON_ONLY:
            continue
        dotted = prefix + name
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(settings_help(ann, dotted + "."))
            continue
        default = "required" if field.is_required() else _default_repr(field.get_default(call_default_factory=True))
        rows.append((dotted, _type_name(ann), default, field.description or ""))
    return rows


def _type_name(ann: Any) -> str:
    """A readable type: ``float``, ``one of cosine|linear|constant``, ``int or null``."""
    if get_origin(ann) is Annotated:
        return _type_name(get_args(ann)[0])
    origin = get_origin(ann)
    args = get_args(ann)
    if ann is Any:
        return "str"
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin is Union:
        parts = [_type_name(a) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return text + " or null" if type(None) in args else text
    if origin in (list, tuple):
        inner = sorted({_type_name(a) for a in args if a is not Ellipsis})
        return f"{origin.__name__}[{', '.join(inner)}]" + (f" of {len(args)}" if origin is tuple else "")
    if origin is dict:
        return "dict"
    if ann is Path:
        return "path"
    return getattr(ann, "__name__", str(ann))


def _default_repr(value: Any) -> str:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value, default=str)
