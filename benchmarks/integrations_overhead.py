"""What stabletrain's integrations cost: each framework with and without them, side by side.

Each framework trains the same model with its own loop, once without stabletrain and once
with it (gradient_norm logged, nancapture on, trend alerts on: the settings the integration
pages recommend while hunting a NaN), the variants alternating round by round from the same
initial weights, so that load changes on a shared machine hit both alike:

* PyTorch Lightning: ``Trainer.fit`` of the benchmark language model (built-in transformer,
  4 layers, dim 256, batch 16, 3.3M parameters; see ``benchmarks/common.py``) in a
  LightningModule, with and without ``StabletrainCallback``; a step is timed from one
  ``on_train_batch_start`` to the next.
* Hugging Face Trainer: ``Trainer.train`` of a GPT-2 of the same shape (random weights),
  with and without ``StabletrainCallback``; a step is timed from one ``on_step_begin`` to
  the next.
* Accelerate: the plain loop of ``examples/integrations/accelerate_example.py`` on the
  benchmark language model, with and without ``StepMonitor``, interleaved step by step.

Each fit's first two steps are warm-up and not counted. The ratio is the median step time
with / without (goal <= 1.05x). On a shared CPU step times scatter by 10-20%, more than the
callback costs, so the time spent in stabletrain's own calls (``StepTools``: begin_step,
before_forward, after_forward, before_last_backward, grads_final, end_step) is also summed
and shown per step and as a share of the step without it: the added cost without the noise.
Host synchronisations (``aten._local_scalar_dense``, what ``.item()`` does) are counted over
whole runs of the same steps with and without, and the difference divided by the steps
(goal <= 1 added per step).

    python benchmarks/integrations_overhead.py [--rounds 5] [--steps 8] [--clock wall|cpu] [--threads N] [--skip-step]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_model_and_batches, machine, median  # noqa: E402

from stabletrain.integrations.common import StepTools  # noqa: E402
from stabletrain.utils.sync import CountSyncs  # noqa: E402

# The mechanism signals (on by default since issue 20) are off here: this script measures the
# configuration its table documents; their cost is benchmarks/mechanism_signals.py's (one more
# host read per logged step in the integrations, tests/integrations/ count it).
NAN_ON = {"nancapture": {"enabled": True}, "mechanisms": {"enabled": False}}
#: More settings of the "with" variant (--skip-step).
EXTRA: dict[str, Any] = {}
LOG_EVERY = 10

#: Seconds spent in StepTools' per-step calls, and the steps begun, since the last reset.
OWN = {"seconds": 0.0, "steps": 0}
#: The clock: wall time, or CPU time of this process (``--clock cpu``; with ``--threads 1`` far
#: less disturbed by other processes on a loaded machine).
CLOCK: list[Callable[[], float]] = [time.perf_counter]


def _time_own_calls() -> None:
    """Wrap StepTools' per-step methods with a clock (observe runs inside grads_final: not wrapped)."""
    for name in ("begin_step", "before_forward", "after_forward", "before_last_backward", "grads_final", "end_step"):
        fn = getattr(StepTools, name)

        def timed(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            start = CLOCK[0]()
            try:
                return _fn(*args, **kwargs)
            finally:
                OWN["seconds"] += CLOCK[0]() - start
                OWN["steps"] += _name == "begin_step"

        setattr(StepTools, name, timed)


# ------------------------------------------------------------------------------ Lightning


def lightning_runner(base: torch.nn.Module, batches: list[Any]) -> Callable[[bool, int], list[float]]:
    import lightning.pytorch as L

    from stabletrain.integrations.lightning import StabletrainCallback

    class LitLM(L.LightningModule):
        def __init__(self, model: torch.nn.Module):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model.training_step(batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.stamps.append(CLOCK[0]())

        def on_train_end(self, trainer, pl_module):
            self.stamps.append(CLOCK[0]())

    def run(with_stabletrain: bool, steps: int) -> list[float]:
        clock = Clock()
        callbacks: list[Any] = [clock]
        if with_stabletrain:
            callbacks.insert(0, StabletrainCallback(debug_args=NAN_ON, **EXTRA))
        with tempfile.TemporaryDirectory() as out:
            trainer = L.Trainer(
                max_steps=steps, accelerator="cpu", devices=1, logger=L.loggers.CSVLogger(out),
                log_every_n_steps=LOG_EVERY, callbacks=callbacks, default_root_dir=out, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False,
            )
            loader = torch.utils.data.DataLoader(batches, batch_size=None)
            trainer.fit(LitLM(copy.deepcopy(base)), loader)
        return [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]

    return run


# -------------------------------------------------------------------- Hugging Face Trainer


def transformers_runner(batches: list[Any]) -> Callable[[bool, int], list[float]]:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from stabletrain.integrations.transformers import StabletrainCallback

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=256, n_layer=4, n_head=8,
                        bos_token_id=0, eos_token_id=0)
    base = GPT2LMHeadModel(config)
    rows = [{"input_ids": ids, "labels": ids} for b in batches for ids in b["input_ids"]]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.stamps.append(CLOCK[0]())

        def on_train_end(self, args, state, control, **kwargs):
            self.stamps.append(CLOCK[0]())

    def run(with_stabletrain: bool, steps: int) -> list[float]:
        clock = Clock()
        callbacks: list[Any] = [clock]
        if with_stabletrain:
            callbacks.insert(0, StabletrainCallback(debug_args=NAN_ON, **EXTRA))
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(
                output_dir=out, per_device_train_batch_size=16, max_steps=steps, logging_steps=LOG_EVERY, report_to=[],
                use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-4,
                train_sampling_strategy="sequential",
            )
            trainer = Trainer(model=copy.deepcopy(base), args=args, train_dataset=rows, callbacks=callbacks)
            trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its log lines, not timed work
            trainer.train()
        return [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]

    return run


# ----------------------------------------------------------------------------- Accelerate


def accelerate_steps(base: torch.nn.Module, batches: list[Any]) -> tuple[Callable[[], None], Callable[[], None], Any]:
    """One step of each variant: two Accelerators cannot coexist, so one prepares both copies."""
    from accelerate import Accelerator

    from stabletrain.integrations.accelerate import StepMonitor

    accelerator = Accelerator(cpu=True)
    out = tempfile.TemporaryDirectory()

    def make(with_stabletrain: bool) -> Callable[[], None]:
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = accelerator.prepare(model, optimizer)
        monitor = (StepMonitor(accelerator, model, out_dir=out.name, debug_args=NAN_ON, **EXTRA)
                   if with_stabletrain else None)
        data = itertools.cycle(batches)
        counter = itertools.count()

        def step() -> None:
            i = next(counter)
            batch = next(data)
            if monitor is not None:
                monitor.begin_step(i)
                monitor.collect_batch(batch)
            loss = accelerator.unwrap_model(model).training_step(batch)
            if monitor is not None:
                monitor.collect_loss(loss)
            accelerator.backward(loss)
            if monitor is not None:
                monitor.check(optimizer, read=i % LOG_EVERY == 0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if monitor is not None:
                monitor.end_step()

        return step

    return make(False), make(True), out


# ---------------------------------------------------------------------------------- main


def ratio_of(times: dict[bool, list[float]]) -> tuple[float, float, float]:
    without, with_ = median(times[False]), median(times[True])
    return with_ / without, with_ * 1e3, without * 1e3


def fits(run: Callable[[bool, int], list[float]], rounds: int, steps: int) -> dict[bool, list[float]]:
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for variant in ((False, True) if r % 2 == 0 else (True, False)):
            times[variant].extend(run(variant, steps)[2:])
    return times


def added_syncs(run: Callable[[bool, int], Any], steps: int) -> float:
    counts = {}
    for variant in (False, True):
        with CountSyncs() as syncs:
            run(variant, steps)
        counts[variant] = syncs.count
    return (counts[True] - counts[False]) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="fits per variant (Lightning, HF Trainer)")
    parser.add_argument("--steps", type=int, default=8, help="steps per fit, the first 2 not timed")
    parser.add_argument("--accelerate-steps", type=int, default=40, help="interleaved steps per variant (Accelerate)")
    parser.add_argument("--only", choices=["lightning", "transformers", "accelerate"], action="append")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--skip-step", action="store_true",
                        help="with = also on_instability skip_step (the decision, and the copy where it is needed)")
    ns = parser.parse_args()
    if ns.skip_step:
        EXTRA["on_instability"] = {"policy": "skip_step"}
    if ns.threads:
        torch.set_num_threads(ns.threads)
    CLOCK[0] = time.process_time if ns.clock == "cpu" else time.perf_counter
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    only = ns.only or ["lightning", "transformers", "accelerate"]
    base, batches = bench_model_and_batches(num_batches=8)
    print(f"machine: {machine()}, {ns.clock} clock; model: benchmark LM (3.3M parameters, batch 16, context 128)")
    print("with = gradient_norm logged every 10 steps + nancapture + trend alerts"
          + (" + on_instability skip_step" if ns.skip_step else ""))
    print(f"{'framework':<14}{'with ms/step':>14}{'without':>10}{'ratio':>8}{'quartiles':>16}"
          f"{'own ms/step':>13}{'own share':>11}{'+syncs/step':>13}")
    _time_own_calls()

    def report(name: str, times: dict[bool, list[float]], syncs: float) -> None:
        ratio, w, wo = ratio_of(times)
        per_round = sorted(a / b for a, b in zip(times[True], times[False]))
        q = (per_round[len(per_round) // 4], per_round[(3 * len(per_round)) // 4])
        own = 1e3 * OWN["seconds"] / max(1, OWN["steps"])
        print(f"{name:<14}{w:>14.1f}{wo:>10.1f}{ratio:>7.3f}x{f'{q[0]:.2f}-{q[1]:.2f}x':>16}"
              f"{own:>13.2f}{own / wo:>10.2%}{syncs:>13.2f}", flush=True)

    def fits_and_syncs(name: str, run: Callable[[bool, int], list[float]]) -> None:
        OWN.update(seconds=0.0, steps=0)
        times = fits(run, ns.rounds, ns.steps)
        own = dict(OWN)  # the counting runs below are slowed by the dispatch mode: not timed
        syncs = added_syncs(run, ns.steps)
        OWN.update(own)
        report(name, times, syncs)

    if "lightning" in only:
        fits_and_syncs("lightning", lightning_runner(base, batches))
    if "transformers" in only:
        fits_and_syncs("hf-trainer", transformers_runner(batches))
    if "accelerate" in only:
        plain, monitored, out = accelerate_steps(base, batches)
        OWN.update(seconds=0.0, steps=0)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(ns.accelerate_steps + 2):
            pair = ((False, plain), (True, monitored))
            for variant, step in (pair if i % 2 == 0 else pair[::-1]):
                start = CLOCK[0]()
                step()
                if i >= 2:
                    times[variant].append(CLOCK[0]() - start)
        own = dict(OWN)
        counts = {}
        for variant, step in ((False, plain), (True, monitored)):
            with CountSyncs() as syncs:
                for _ in range(LOG_EVERY):
                    step()
            counts[variant] = syncs.count
        OWN.update(own)
        report("accelerate", times, (counts[True] - counts[False]) / LOG_EVERY)
        out.cleanup()


if __name__ == "__main__":
    main()
