"""Two processes (torchrun, gloo) of an Accelerate loop with StepMonitor(on_instability=skip_step): sample
29 (a NaN gradient) is in rank 0's batch of step 7 only. Both ranks must skip that step's update and go on
with identical weights. Run by tests/integrations/test_accelerate.py; writes ``<out>/rank<r>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate_example import Pairs, Siamese, step_fn

from stabletrain.integrations.accelerate import StepMonitor


def main(out: Path) -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = Siamese()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Pairs(bad=29), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    changed = []
    with StepMonitor(accelerator, model, out_dir=out, step_fn=step_fn,
                     on_instability={"policy": "skip_step"}) as monitor:
        for step, batch in zip(range(10), loader):
            before = [p.detach().clone() for p in model.parameters()]
            monitor.begin_step(step)
            monitor.collect_batch(batch, indices=batch["index"])
            loss = step_fn(model, batch)
            monitor.collect_loss(loss)
            accelerator.backward(loss)
            monitor.check(optimizer)
            optimizer.step()
            optimizer.zero_grad()
            monitor.end_step()
            if any(not torch.equal(a, b) for a, b in zip(before, model.parameters())):
                changed.append(step)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank = accelerator.process_index
    (out / f"rank{rank}.json").write_text(json.dumps({
        "recoveries": monitor.recoveries, "changed": changed, "weights": weights.tolist(),
        "finite": bool(torch.isfinite(weights).all())}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
