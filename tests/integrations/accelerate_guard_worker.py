"""Two processes (torchrun, gloo) of an Accelerate loop whose AdamW state gets an Inf after one optimizer
step, on one rank or both: every rank must stop at the same point with the same message. Run by
tests/integrations/test_accelerate.py; writes each rank's outcomes to ``<out>/rank<r>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate_example import Pairs, Siamese, step_fn

from stabletrain import NonFiniteStepError
from stabletrain.integrations.accelerate import StepMonitor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's fault planters
from conftest import plant_exp_avg_sq_overflow  # noqa: E402

# name: (nancapture, ranks whose state gets the Inf, after which step, steps run)
SCENARIOS = {
    "one_rank": (True, [1], 2, 6),
    "both_nancapture_off": (False, [0, 1], 2, 6),
    "last_step_off": (False, [0], 4, 5),
    "last_step_on": (True, [1], 4, 5),
}


def run(accelerator, out: Path, nancapture: bool, ranks: list[int], at: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = Siamese()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if accelerator.process_index in ranks:
        plant_exp_avg_sq_overflow(optimizer, at_step=at)
    loader = torch.utils.data.DataLoader(Pairs(bad=255), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = iter(loader)
    where, done = "", []
    try:
        with StepMonitor(accelerator, model, out_dir=out, step_fn=step_fn,
                         debug_args={"nancapture": {"enabled": nancapture}}) as monitor:
            for step in range(steps):
                where = f"step {step} check"
                monitor.begin_step(step)
                batch = next(batches)
                monitor.collect_batch(batch, indices=batch["index"])
                loss = step_fn(model, batch)
                monitor.collect_loss(loss)
                accelerator.backward(loss)
                monitor.check(optimizer)
                optimizer.step()
                optimizer.zero_grad()
                where = f"step {step} end_step"
                monitor.end_step()
                done.append(step)
            where = "close"
    except NonFiniteStepError as err:
        return {"raised_in": where, "done": done, "step": err.step, "stopped_at": err.stopped_at,
                "other_rank": err.other_rank, "entries": err.state_entries, "message": str(err)}
    return {"raised_in": None, "done": done}


def main(out: str) -> None:
    accelerator = Accelerator(cpu=True)
    results = {name: run(accelerator, Path(out) / name, *args) for name, args in SCENARIOS.items()}
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{accelerator.process_index}.json").write_text(json.dumps(results, indent=1))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
