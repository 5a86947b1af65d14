"""The Hugging Face Trainer on two processes (torchrun, DDP, gloo, CPU), nancapture on, a tiny GPT-2:

* ``guard``: AdamW's state gets an Inf on rank 1 after optimizer step 2 (every weight stays finite).
  Both ranks must stop at step 3's check with rank 1's message.
* ``nan``: sample 29 holds the planted token whose 1e30 embedding row makes a LayerNorm NaN (8 steps: an
  epoch, every sample once). Both
  ranks must stop at the step whose batch holds it, each writing its capture.
* ``heal`` (run alone: ``hf_guard_worker.py OUT heal``): the same sample, read in order (rank 1's
  step 3), with ``on_instability`` skip_step and nancapture off: both ranks skip that step's update
  and only it, and go on to the end.

Run by tests/integrations/test_transformers.py; writes each rank's outcomes to ``<out>/rank<r>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from hf_models import TokenData, causal_lm
from transformers import Trainer, TrainerCallback, TrainingArguments

from stabletrain import NaNDetectedError, NonFiniteStepError
from stabletrain.integrations.transformers import StabletrainCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's fault planters
from conftest import plant_exp_avg_sq_overflow  # noqa: E402


class PlantInf(TrainerCallback):
    """On rank 1, after optimizer step 2: an Inf in the first weight's ``exp_avg_sq``."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if torch.distributed.get_rank() == 1:
            plant_exp_avg_sq_overflow(getattr(optimizer, "optimizer", optimizer), at_step=2)


class StepLosses(Trainer):
    """What each step's training_step returns on this rank (one microbatch per step here): the step's
    loss as the Trainer counts it, its model's share times the processes."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_losses.append(float(loss))
        return loss


def run(out: Path, scenario: str) -> dict:
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=8, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3, disable_tqdm=True,
                             ddp_backend="gloo", seed=0)
    callback = StabletrainCallback(debug_args={"nancapture": {"enabled": True}})
    guard = scenario == "guard"
    trainer = StepLosses(model=causal_lm(planted=not guard), args=args, train_dataset=TokenData(bad=None if guard else 29),
                         callbacks=[PlantInf()] * guard + [callback])
    trainer.step_losses = []
    outcome: dict = {"raised": None}
    try:
        trainer.train()
    except NonFiniteStepError as err:
        outcome = {"raised": "NonFiniteStepError", "step": err.step, "stopped_at": err.stopped_at,
                   "other_rank": err.other_rank, "entries": err.state_entries, "message": str(err),
                   "loss": err.failure.loss}
    except NaNDetectedError as err:
        outcome = {"raised": "NaNDetectedError", "step": err.step, "reason": err.reason, "message": str(err),
                   "capture": str(err.capture_path)}
    outcome["step_losses"] = trainer.step_losses
    torch.distributed.barrier()  # both ranks' captures are written before either goes on
    return outcome


class Unchanged(TrainerCallback):
    """The steps whose optimizer step left every weight bitwise as it was."""

    def __init__(self):
        self.start, self.steps = None, []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.start = [p.detach().clone() for p in model.parameters()]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if all(torch.equal(a, p) for a, p in zip(self.start, model.parameters())):
            self.steps.append(state.global_step - 1)


def heal(out: Path) -> dict:
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=8, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3, disable_tqdm=True,
                             ddp_backend="gloo", seed=0, train_sampling_strategy="sequential")
    callback = StabletrainCallback(on_instability={"policy": "skip_step"})
    unchanged = Unchanged()  # after the callback: it sees the weights once a copy is put back
    trainer = Trainer(model=causal_lm(), args=args, train_dataset=TokenData(bad=29), callbacks=[callback, unchanged])
    trainer.train()
    named = dict(trainer.model.named_parameters())
    digest = {n: float(p.double().sum()) for n, p in named.items() if "wte" not in n}  # wte holds the planted row
    return {"recoveries": [[r["step"], r["trigger"], r["action"]] for r in callback.recoveries],
            "unchanged": unchanged.steps, "global_step": trainer.state.global_step, "weights": digest}


def main(out: str, scenarios: tuple[str, ...] = ("guard", "nan")) -> None:
    transformers.utils.logging.set_verbosity_error()
    results = {name: heal(Path(out) / name) if name == "heal" else run(Path(out) / name, name) for name in scenarios}
    rank = torch.distributed.get_rank()
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2:]) or ("guard", "nan"))
