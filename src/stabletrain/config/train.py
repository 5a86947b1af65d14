"""``TrainSettings``: every setting of a run, its groups nested (see docs/training.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator

from stabletrain.config.debugging import DebugArgs, GuardArgs, OnInstabilityArgs, TrendAlertArgs
from stabletrain.config.logger_args import LoggersArgs
from stabletrain.config.model_data import DataArgs, ModelArgs, TorchCompileArgs, TransformArgs
from stabletrain.config.types import (
    COMMON_FABRIC_NAMES,
    Float,
    Int,
    Precision,
    SettingsGroup,
    fabric_choices,
    is_fsdp1_variant,
    one_of,
)


class TrainSettings(SettingsGroup):
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
    checkpoint_format: Literal["auto", "full", "sharded"] = Field(
        "auto",
        description=(
            "full: one file, the whole state gathered on rank 0; sharded (strategy=fsdp only): a folder in which "
            "every rank writes its own shards (torch.distributed.checkpoint), nothing gathered; auto: sharded under "
            "strategy=fsdp, else full (docs/distributed.md)."
        ),
    )
    checkpoint_async: bool = Field(
        False,
        description=(
            "Sharded checkpoints only: write them in a background thread while training goes on (each rank first "
            "copies its shards to host memory); the state is verified finite before the write starts."
        ),
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
    strategy: str = Field(
        "auto", description="Lightning Fabric strategy: auto, ddp, ddp_spawn, ...; fsdp (or fsdp2) shards the model "
        "with FSDP2 (docs/distributed.md)")
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
        return one_of(v, fabric_choices("accelerator"), "a Lightning Fabric accelerator")

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, v: str) -> str:
        # Fabric lower-cases strategy names; so do we, so that the names compare equal.
        if is_fsdp1_variant(v.lower()):
            raise ValueError(
                f"{v!r} is one of Lightning Fabric's FSDP1 variants, which stabletrain does not run: FSDP1's flat "
                "parameters hide the per-parameter gradients every debugging tool reads, and it refuses the CPU. "
                "Use strategy=fsdp (FSDP2, fully_shard, on CPU and GPU); see docs/distributed.md"
            )
        if v.lower() in COMMON_FABRIC_NAMES["strategy"]:
            return v.lower()
        return one_of(v.lower(), fabric_choices("strategy"), "a Lightning Fabric strategy")

    def to_json_dict(self) -> dict[str, Any]:
        """The settings as JSON-compatible data; Python objects are described by their type."""
        data = self.model_dump(mode="python", exclude={"callbacks", "model", "data"})
        data["out"] = str(self.out)
        data["model"] = _describe(self.model)
        data["data"] = _describe(self.data)
        data["callbacks"] = [_describe(c) for c in self.callbacks]
        return json.loads(json.dumps(data, default=str))



def _describe(obj: Any) -> Any:
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"

