"""Run by tests/debug/test_underflow_overflow.py: two DDP ranks on the CPU, where only
rank 1's samples of step 2 are bad. Each rank writes what it raised to <out>/error_rank{r}.json.

    python ddp_underflow_overflow_script.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import stabletrain
from stabletrain.data.loader import ResumableBatchSampler

SAMPLES, BATCH, BAD_STEP = 64, 8, 2


class Square(nn.Module):
    def forward(self, x):
        return x * x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16))
        self.square = Square()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.square(self.body(x)))

    def training_step(self, batch):
        return nn.functional.mse_loss(self(batch["x"]), batch["y"])


class Data(Dataset):
    """Samples in ``bad`` are scaled by 1e25: finite, but their square overflows float32."""

    def __init__(self, bad):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 4, generator=g)
        self.bad = set(bad)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"x": self.x[i] * (1e25 if i in self.bad else 1.0), "y": torch.zeros(1)}


def rank1_samples_of_step(step: int) -> list[int]:
    """The loader's order is deterministic: the samples rank 1 gets at ``step``."""
    return ResumableBatchSampler(SAMPLES, BATCH // 2, seed=0, rank=1, world_size=2).epoch_batches(0)[step]


if __name__ == "__main__":
    out = Path(sys.argv[1])
    try:
        stabletrain.train(
            out=out, model=Net(), data=Data(rank1_samples_of_step(BAD_STEP)), devices=2, strategy="ddp",
            accelerator="cpu", batch_size=BATCH, steps=8, log_every_num_steps=1, num_workers=0,
            model_args={"lr": 1e-3, "warmup_steps": 0}, debug_args={"underflow_overflow": {"enabled": True}},
        )
    except stabletrain.UnderflowOverflowError as exc:
        record = {k: getattr(exc, k) for k in ("step", "rank", "detected_by", "phase", "module", "tensor", "value")}
        record["report_path"] = str(exc.report_path)
        record["message"] = str(exc)
        (out / f"error_rank{exc.rank}.json").write_text(json.dumps(record))
        sys.exit(3)
