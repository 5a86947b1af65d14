"""stabletrain in PyTorch Lightning: gradient_norm, nancapture with replay, trend alerts.

A Siamese network learns distances between pairs of points. Sample 29 is a pair of identical
points: the distance is 0, finite, but its gradient (of a square root at 0) is NaN. With
batch size 4 and 2 accumulation steps it is in step 3, micro step 1, row 1. The callback
stops training there, before clipping and the optimizer step, and captures the step; the
capture replays with the LightningModule's own training_step.

    python examples/integrations/lightning_example.py out/lightning
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from stabletrain import NaNDetectedError, load_nan_capture
from stabletrain.integrations.lightning import StabletrainCallback


class PairDistance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a - b) ** 2).sum(-1).sqrt()  # its gradient at a == b is inf * 0 = nan


class SiameseLit(L.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16))
        self.distance = PairDistance()
        self.drop = nn.Dropout(0.1)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        d = self.drop(self.distance(self.embed(batch["x"]), self.embed(batch["y"])))
        loss = nn.functional.mse_loss(d, batch["target"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Pairs(Dataset):
    def __init__(self, n: int = 256, bad: int = 29):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)
        self.y[bad] = self.x[bad]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "target": torch.tensor(1.0)}


def main(out: str) -> int:
    torch.manual_seed(0)
    trainer = L.Trainer(
        max_steps=20, accumulate_grad_batches=2, gradient_clip_val=1.0, log_every_n_steps=1,
        callbacks=[StabletrainCallback(debug_args={"nancapture": {"enabled": True}})],
        logger=L.loggers.CSVLogger(out, name="csv"), default_root_dir=out, accelerator="cpu", devices=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    try:
        trainer.fit(SiameseLit(), DataLoader(Pairs(), batch_size=4))
    except NaNDetectedError as err:
        with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("gradient_norm")]
        print("logged:", ", ".join(f"step {r['step']} gradient_norm {float(r['gradient_norm']):.4f}" for r in rows))
        print(f"\nNaNDetectedError: {err}\n")
        print(load_nan_capture(err.capture_path, model=SiameseLit()).replay())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out/lightning"))
