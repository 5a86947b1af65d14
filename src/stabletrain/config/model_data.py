"""Settings of the model, its optimizer and schedule, the data and torch.compile (see docs/training.md)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from stabletrain.config.types import Float, Int, SettingsGroup


class ModelArgs(SettingsGroup):
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
    eps: Float = Field(
        1e-8,
        gt=0,
        description=(
            "AdamW eps, added to sqrt(v_hat) in the update's denominator. Too large against the gradients' RMS "
            "and AdamW's updates shrink toward lr * m / eps (signals/adam_eps_fraction near 1)."
        ),
    )
    momentum: Float = Field(0.9, ge=0, lt=1, description="SGD momentum.")
    # Language model architecture.
    n_layers: Int = Field(2, ge=1, description="Language model: transformer blocks.")
    n_heads: Int = Field(4, ge=1, description="Language model: attention heads per block.")
    dim: Int = Field(128, ge=1, description="Language model: embedding width; a multiple of n_heads.")
    context_length: Int = Field(64, ge=2, description="Language model: tokens per training sample.")
    tokenizer: Literal["byte", "char"] = Field(
        "byte", description="Language model: byte-level (256 symbols) or character-level vocabulary."
    )
    qk_norm: bool = Field(
        False,
        description=(
            "Language model: LayerNorm of each head's queries and keys (over head_dim) before their dot product, "
            "against attention-logit growth (Dehghani et al. 2023; Wortsman et al. 2023)."
        ),
    )
    z_loss: Float = Field(
        0.0,
        ge=0,
        description=(
            "Language model: adds z_loss * mean(logsumexp(logits)^2) to the loss (PaLM's z-loss, e.g. 1e-4), "
            "against output-logit divergence; the logged loss includes it."
        ),
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
LANGUAGE_MODEL_ARGS = ("n_layers", "n_heads", "dim", "context_length", "tokenizer", "qk_norm", "z_loss")
IMAGE_MODEL_ARGS = ("cnn_width",)


class NormalizeArgs(SettingsGroup):
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


class TransformArgs(SettingsGroup):
    """Image preprocessing (``transform_args.*``)."""

    image_size: Int = Field(32, ge=8, description="Images are resized to image_size x image_size.")
    normalize: NormalizeArgs = Field(default_factory=NormalizeArgs, description="Input normalization.")


class DataArgs(SettingsGroup):
    """Reading the training data (``data_args.*``)."""

    bad_images: Literal["error", "skip"] = Field(
        "error",
        description=(
            "Image folders: files that cannot be read as images (corrupt, truncated, empty). error: list them "
            "and stop before training; skip: train without them and list them in train.log."
        ),
    )


class TorchCompileArgs(SettingsGroup):
    """``torch.compile`` (``torch_compile_args.*``). Off by default."""

    disable: bool = Field(True, description="Set to false to compile the model with torch.compile.")
    mode: Optional[str] = Field(None, description="torch.compile mode, e.g. 'reduce-overhead'.")
    backend: str = Field("inductor", description="torch.compile backend.")
    fullgraph: bool = Field(False, description="Require a single graph.")
    dynamic: Optional[bool] = Field(None, description="Dynamic shapes.")

