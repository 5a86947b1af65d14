"""stabletrain in a Hugging Face Accelerate loop: gradient norm, nancapture, trend alerts.

A Siamese network learns distances between pairs of points. Sample 29 is a pair of identical
points: the distance is 0, finite, but its gradient (of a square root at 0) is NaN. The
monitor stops every process at that step, before clipping and the optimizer step, and each
process writes its capture; the main process then replays them all.

    python examples/integrations/accelerate_example.py out/accelerate                  # 1 process
    torchrun --nproc_per_node 2 examples/integrations/accelerate_example.py out/accelerate   # 2 (gloo)
    accelerate launch --cpu --num_processes 2 examples/integrations/accelerate_example.py out/accelerate
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset

from stabletrain import NaNDetectedError, load_nan_capture
from stabletrain.integrations.accelerate import StepMonitor


class PairDistance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a - b) ** 2).sum(-1).sqrt()  # its gradient at a == b is inf * 0 = nan


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16))
        self.distance = PairDistance()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.drop(self.distance(self.embed(x), self.embed(y)))


def step_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"], batch["y"]), batch["target"])


class Pairs(Dataset):
    def __init__(self, n: int = 256, bad: int = 29):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)
        self.y[bad] = self.x[bad]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "target": torch.tensor(1.0), "index": i}


def main(out: str, steps: int = 12) -> int:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = Siamese()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Pairs(), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    monitor = StepMonitor(accelerator, model, out_dir=out, step_fn=step_fn, lr=0.05, clipping=True,
                          debug_args={"nancapture": {"enabled": True}})
    batches = iter(loader)
    try:
        for step in range(steps):
            monitor.begin_step(step)
            for _ in range(accelerator.gradient_accumulation_steps):
                batch = next(batches)
                with accelerator.accumulate(model):
                    monitor.collect_batch(batch, indices=batch["index"])  # just before the forward pass
                    loss = step_fn(model, batch)
                    monitor.collect_loss(loss)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        values = monitor.check(optimizer, read=True)  # pre-clip, unscaled; raises on every rank
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
            monitor.end_step()
            if accelerator.is_main_process:
                print(f"step {step} | loss {values.loss:.4f} | grad_norm {values.gradient_norm:.4f}")
    except NaNDetectedError as err:
        accelerator.wait_for_everyone()  # every rank raised at this step and wrote its capture
        if accelerator.is_main_process:
            print(f"NaNDetectedError: {err}\n")
            capture = load_nan_capture(err.capture_path.parent.parent if accelerator.num_processes > 1
                                       else err.capture_path, model=Siamese(), step_fn=step_fn)
            print(capture.replay())
        accelerator.wait_for_everyone()  # a launcher stops the other ranks when one exits with an error
        return 1
    finally:
        monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out/accelerate"))
