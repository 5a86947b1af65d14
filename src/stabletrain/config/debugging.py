"""Settings of the debugging tools: underflow_overflow, nancapture, the mechanism signals, the guard,
on_instability, trend alerts.

See docs/underflow_overflow.md, docs/nancapture.md, docs/mechanisms.md, docs/self_healing.md and
docs/trend_alerts.md.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from stabletrain.config.types import Float, Int, SettingsGroup


class UnderflowOverflowArgs(SettingsGroup):
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


class NaNCaptureArgs(SettingsGroup):
    """Capture the failing step when gradients go non-finite, for offline replay."""

    enabled: bool = Field(False, description="Turn NaN/Inf capture on.")
    max_skipped_steps: Int = Field(
        10,
        ge=1,
        description="Under fp16 loss scaling: capture after this many consecutive skipped steps.",
    )


class GuardArgs(SettingsGroup):
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


class OnInstabilityArgs(SettingsGroup):
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
    warmup: Int = Field(
        20, ge=2, description="Good steps seen before spikes are judged (non-finite values always are)."
    )
    max_ratio: Float = Field(10.0, gt=1, description="A loss above this many times the largest loss seen is a spike.")
    min_std: Float = Field(0.05, ge=0, description="Floor of the noise and std of log values (a flat window would "
                                                   "make any wiggle a spike).")
    max_recoveries: Int = Field(10, ge=0, description="After this many recoveries the next bad step stops the run "
                                                      "with a capture.")
    rollback_steps: Int = Field(50, ge=1, description="rollback: keep an in-memory snapshot every this many steps.")
    diagnose: bool = Field(True, description="After training, run stabletrain diagnose on the first 5 recoveries' "
                                             "captures (never during training); the report shows the verdicts.")


class MechanismArgs(SettingsGroup):
    """The mechanism signals (``debug_args.mechanisms.*``): ``signals/...`` keys on logged steps.

    Measured on logged steps only, on the device, and read with the step's one host read: the
    max attention logit and attention entropy of each attention module, the output logits'
    log-partition and max |logit|, per parameter group the weight RMS and the relative update,
    and for Adam-family optimizers the fraction of second moments below eps. See docs/mechanisms.md.
    """

    enabled: bool = Field(True, description="Measure the signals/... keys on logged steps (docs/mechanisms.md).")
    updates: bool = Field(
        True,
        description=(
            "Measure signals/update_rms/* and signals/update_rms_max: keeps one copy of the trainable "
            "parameters (their own dtype, this rank's shard) to compare the weights before and after a logged step."
        ),
    )
    probes: bool = Field(
        True,
        description=(
            "Measure signals/attn_* and signals/output_*: probes follow the torch calls of a logged step's forward "
            "pass. Under torch.compile a logged step's forward then runs eagerly (the probes are Python a compiled "
            "graph does not run); false keeps every step compiled, without these keys."
        ),
    )
    alerts: bool = Field(
        True,
        description="Name a mechanism (attention-logit growth, the Adam eps regime, ...) in a live alert when the "
        "rules below find it in the logged signals (docs/mechanisms.md#mechanisms).",
    )
    persist: Int = Field(2, ge=1, description="Consecutive logged points a rule must hold to name a mechanism.")
    attn_logit_limit: Float = Field(
        50.0, gt=0, description="Attention-logit growth: the largest attention logit of a module at least this ..."
    )
    attn_entropy_floor: Float = Field(
        0.1, gt=0, description="... while its mean attention entropy is at most this many nats (one-hot attention)."
    )
    eps_fraction: Float = Field(
        0.5, gt=0, le=1, description="Adam eps regime: at least this fraction of second moments below eps ..."
    )
    eps_update_ratio: Float = Field(
        0.1, gt=0, description="... and every group's update RMS at most this fraction of the lr (Adam's normalised "
        "update is about lr)."
    )
    runaway_update: Float = Field(
        0.3, gt=0, description="Runaway updates: a group's relative update (signals/update_rms) at least this ..."
    )
    runaway_growth: Float = Field(
        2.0, gt=1, description="... with its weight RMS this many times its first logged value ..."
    )
    runaway_loss_rise: Float = Field(
        0.2, gt=0, description="... and the loss this fraction above its lowest logged value."
    )
    logit_mean_limit: Float = Field(
        20.0, gt=0, description="Output-logit divergence: signals/output_logit_mean (the logits' common level, which "
        "the softmax ignores) at least this far from 0 and from its first logged value."
    )
    stale_update_jump: Float = Field(
        10.0, gt=1, description="Stale second moment (Adam): signals/update_rms_max this many times its median over "
        "the last window of logged points, with a loss spike, after a stable stretch."
    )
    window: Int = Field(10, ge=3, description="Logged points of the reference median of the stale-second-moment rule.")


class DebugArgs(SettingsGroup):
    """On-demand debugging tools (``debug_args.*``), and the mechanism signals (on by default)."""

    underflow_overflow: UnderflowOverflowArgs = Field(default_factory=UnderflowOverflowArgs)
    nancapture: NaNCaptureArgs = Field(default_factory=NaNCaptureArgs)
    mechanisms: MechanismArgs = Field(default_factory=MechanismArgs)



class TrendAlertArgs(SettingsGroup):
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

