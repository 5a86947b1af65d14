"""The result of ``NaNCapture.replay()``: what was replayed, whether it failed again, and its text
and JSON forms (``stabletrain replay`` prints them). See ``docs/nancapture.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from stabletrain.debug.nan_capture import REASON_NORM_OVERFLOW
from stabletrain.utils.text import MEASURED_DIGITS, fmt_list, fmt_number, json_float, shell_path

from .optimizer import OptimizerStepOutcome
from .rerun import MicrobatchKey


@dataclass
class RankOutcome:
    """A replay of one rank's microbatches alone (multi-rank captures)."""

    rank: int
    reproduced: bool
    nan_param_names: list[str]
    losses: list[float]


@dataclass
class ReplayResult:
    """What :meth:`NaNCapture.replay` found.

    Attributes:
        reproduced: True when the replay fails again the way the captured step did: a
            non-finite loss or gradient element, or, for a ``gradient_norm_overflow``
            capture (every element finite), a float32 gradient norm that overflows again
            (see :meth:`ForwardBackwardResult.reproduces`).
        nan_param_names: Parameters whose replayed gradient is non-finite.
        losses: Replayed loss of each microbatch (rank by rank in a multi-rank replay).
        step: The captured optimizer step.
        precision: The precision the replay ran in; ``captured_precision`` the run's.
        device: Where the replay ran.
        captured_losses: The losses training saw, in the same order.
        losses_bitwise_equal: Whether each replayed loss has exactly the captured bits
            (NaN counts as equal to NaN); None when the capture holds no losses.
        captured_nan_param_names: What training reported.
        gradient_norm: L2 norm of the replayed gradient.
        gradient_norm_overflow: Every replayed gradient element is finite but their norm is not.
        largest_gradients: With ``gradient_norm_overflow``: (name, largest ``|gradient|``)
            of the parameters with the largest replayed gradient elements.
        reason: Why the step was captured (of several ranks: the one that failed).
        microbatches: (rank, micro_step) of each loss.
        ranks: Ranks replayed; ``missing_ranks``: ranks of the run without a capture here.
        per_rank: For several ranks, each rank's microbatches replayed alone.
        path: What was loaded.
        optimizer_step: For an optimizer-step capture (``reason="optimizer_step"``), what the
            optimizer step replayed from the captured state left behind; ``reproduced`` is then
            about it (forward and backward were finite in training).
    """

    reproduced: bool
    nan_param_names: list[str]
    losses: list[float]
    step: int
    precision: str
    captured_precision: str
    device: str
    captured_losses: list[float]
    losses_bitwise_equal: Optional[bool]
    captured_nan_param_names: list[str]
    gradient_norm: float
    microbatches: list[MicrobatchKey]
    ranks: list[int]
    world_size: int
    missing_ranks: list[int]
    reason: str
    per_rank: list[RankOutcome]
    path: str
    sample_indices: list[Optional[list[int]]] = field(default_factory=list)
    gradient_norm_overflow: bool = False
    largest_gradients: list[tuple[str, float]] = field(default_factory=list)
    optimizer_step: Optional[OptimizerStepOutcome] = None
    #: The device type the run trained on (``"cpu"``, ``"cuda"``), as captured.
    captured_device: str = ""

    @property
    def ranks_reproducing_alone(self) -> list[int]:
        """Ranks whose data alone reproduces the failure (multi-rank replays)."""
        return [o.rank for o in self.per_rank if o.reproduced]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; non-finite numbers become the strings "nan", "inf", "-inf"."""
        return {
            "reproduced": self.reproduced,
            "step": self.step,
            "nan_param_names": self.nan_param_names,
            "losses": [json_float(x) for x in self.losses],
            "captured_losses": [json_float(x) for x in self.captured_losses],
            "losses_bitwise_equal": self.losses_bitwise_equal,
            "captured_nan_param_names": self.captured_nan_param_names,
            "gradient_norm": json_float(self.gradient_norm),
            "gradient_norm_overflow": self.gradient_norm_overflow,
            "largest_gradients": [{"name": n, "abs_max": json_float(v)} for n, v in self.largest_gradients],
            "precision": self.precision,
            "captured_precision": self.captured_precision,
            "device": self.device,
            "microbatches": [{"rank": r, "micro_step": m} for r, m in self.microbatches],
            "sample_indices": self.sample_indices,
            "ranks": self.ranks,
            "world_size": self.world_size,
            "missing_ranks": self.missing_ranks,
            "reason": self.reason,
            "ranks_reproducing_alone": self.ranks_reproducing_alone,
            "per_rank": [
                {"rank": o.rank, "reproduced": o.reproduced, "nan_param_names": o.nan_param_names,
                 "losses": [json_float(x) for x in o.losses]}
                for o in self.per_rank
            ],
            "path": self.path,
            "optimizer_step": None if self.optimizer_step is None else {
                "optimizer": self.optimizer_step.optimizer,
                "rebuilt": self.optimizer_step.rebuilt,
                "nonfinite_params": self.optimizer_step.nonfinite_params,
                "nonfinite_state": self.optimizer_step.nonfinite_state,
                "beyond_checked_range": [{"name": t.name, "kind": t.kind, "abs_max": json_float(t.abs_max)}
                                         for t in self.optimizer_step.trips],
            },
        }

    def __str__(self) -> str:
        return self.to_text()

    def to_text(self) -> str:
        """The human-readable account ``stabletrain replay`` prints."""
        if self.optimizer_step is not None:
            return "\n".join([*self._head_lines(), *self._optimizer_lines(), *self._loss_lines()])
        return "\n".join([
            *self._head_lines(), self._verdict_line(), *self._loss_lines(), *self._rank_lines(), *self._why_lines()
        ])

    def _head_lines(self) -> list[str]:
        ranks = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {', '.join(map(str, self.ranks))}"
        as_captured = self.precision == self.captured_precision
        prec = self.precision + (" (as captured)" if as_captured else f" (captured in {self.captured_precision})")
        lines = [
            f"Replayed step {self.step} from {self.path}",
            f"  {ranks} of world size {self.world_size}, {len(self.microbatches)} microbatch(es), "
            f"precision {prec}, device {self.device}",
        ]
        if self.missing_ranks:
            lines.append(
                f"  warning: no capture of rank(s) {', '.join(map(str, self.missing_ranks))}: "
                "the gradient is not the full DDP gradient"
            )
        return lines

    def _optimizer_lines(self) -> list[str]:
        o = self.optimizer_step
        assert o is not None
        fb = ("forward and backward give finite gradients, as in training (gradient norm "
              f"{fmt_number(self.gradient_norm, MEASURED_DIGITS)})")
        if not o.rebuilt:
            return [f"  reproduced: NO - not attempted: {o.optimizer} is not a torch.optim optimizer, so its step "
                    f"cannot be rebuilt from the capture; {fb}",
                    f"  This capture is about the optimizer step: stabletrain diagnose {shell_path(self.path)} "
                    "reports what the re-run in training found."]
        if o.nonfinite:
            what = ("NaN/Inf in " + fmt_list([f"{n} ({c:,})" for n, c in o.nonfinite_params.items()], 8)
                    if o.nonfinite_params else "every parameter finite")
            if o.nonfinite_state:
                what += "; optimizer state with NaN/Inf: " + fmt_list(o.nonfinite_state, 8)
        elif o.trips:
            t = o.trips[0]
            what = (f"every value finite, but {t.name} ({t.kind}) reaches {fmt_number(t.abs_max, MEASURED_DIGITS)}: "
                    f"beyond the range the guard's check accepts (its float32 L2 norm overflows)")
        else:
            name, value = o.largest_param
            what = (f"every value finite and within the checks' range (|w| up to "
                    f"{fmt_number(value, MEASURED_DIGITS)} in {name})")
        head = "YES" if self.reproduced else "NO"
        lines = [f"  reproduced: {head} - the optimizer step ({o.optimizer}) replayed from the captured state: {what}",
                 f"  {fb}"]
        if not self.reproduced:
            lines.append("  The optimizer step replayed here does not fail the way training saw it: run stabletrain "
                         f"diagnose {shell_path(self.path)} to compare it with the re-run in training.")
        return lines

    def _verdict_line(self) -> str:
        largest = "largest |gradient|: " + ", ".join(
            f"{n} {fmt_number(v, MEASURED_DIGITS)}" for n, v in self.largest_gradients
        )
        if self.reproduced:
            if self.nan_param_names:
                what = (
                    f"non-finite gradients in {len(self.nan_param_names)} parameter(s): "
                    f"{fmt_list(self.nan_param_names, 8)}"
                )
            elif any(not math.isfinite(x) for x in self.losses):
                what = "non-finite loss (gradients finite)"
            else:
                what = (
                    "gradient norm overflow: every gradient element is finite, but the float32 gradient norm "
                    f"overflows ({largest})"
                )
            return f"  reproduced: YES - {what}"
        if self.gradient_norm_overflow:
            return (
                "  reproduced: NO - no loss or gradient element is non-finite as in training, though the float32 "
                f"gradient norm overflows ({largest})"
            )
        return "  reproduced: NO - every replayed loss and gradient is finite" + (
            ", and so is the gradient norm" if self.reason == REASON_NORM_OVERFLOW else ""
        )

    def _loss_lines(self) -> list[str]:
        lines = [
            f"  gradient_norm: {fmt_number(self.gradient_norm, MEASURED_DIGITS)}",
            "  microbatch  rank  loss (replay)     loss (captured)   samples",
        ]
        for i, ((rank, micro), loss) in enumerate(zip(self.microbatches, self.losses)):
            cap = fmt_number(self.captured_losses[i], MEASURED_DIGITS) if i < len(self.captured_losses) else "-"
            samples = self.sample_indices[i] if i < len(self.sample_indices) else None
            shown = "-" if samples is None else fmt_list(samples, 6)
            lines.append(f"  {micro:<10}  {rank:<4}  {fmt_number(loss, MEASURED_DIGITS):<16}  {cap:<16}  {shown}")
        if self.losses_bitwise_equal is True:
            lines.append("  losses: bitwise equal to the captured ones")
        elif self.losses_bitwise_equal is False:
            why = " (expected: replayed in another precision)" if self.precision != self.captured_precision else (
                " (nondeterministic kernels, a different device or library version, or state the capture does not hold)"
            )
            lines.append(f"  losses: differ from the captured ones{why}")
        return lines

    def _rank_lines(self) -> list[str]:
        if not self.per_rank:
            return []
        lines = []
        for o in self.per_rank:
            state = "non-finite -> reproduces the failure alone" if o.reproduced else "finite"
            lines.append(f"  rank {o.rank}'s microbatches alone: {state}")
        alone = self.ranks_reproducing_alone
        if alone:
            lines.append(f"  -> the data of rank(s) {', '.join(map(str, alone))} alone reproduces the NaN")
        elif self.reproduced:
            lines.append("  -> no single rank's data reproduces it alone: only their combination does")
        return lines

    def _why_lines(self) -> list[str]:
        if self.reproduced:
            return []
        if self.precision != self.captured_precision:
            return [
                f"  In {self.precision} this step is finite: the failure comes from the range or rounding of "
                f"{self.captured_precision} arithmetic (replay without --precision to see it fail)."
            ]
        if self.captured_device == "cpu" and self.device.startswith("cpu"):
            # Replayed where it ran, from the same state and data: no GPU kernel or device to suspect.
            return [
                "  The captured state and data do not produce the failure here, on the CPU it ran on: the forward "
                "and backward of these inputs are finite. Suspects: an effect outside them (a callback or hook that "
                "changed gradients or weights, code run between steps, state the capture does not hold); "
                f"stabletrain diagnose {shell_path(self.path)} compares the capture with the run."
            ]
        return [
            "  The captured state and data do not produce the failure here. Suspects: nondeterministic GPU kernels "
            "or hardware faults (replay on the original device), or an effect outside the model's forward and "
            "backward (a callback or hook that changed gradients, memory corruption)."
        ]
