"""``stabletrain.train(strategy="fsdp")`` on 2 CPU processes with an optimizer that writes Inf into rank 1's
shard only, at its 4th step (a function of the optimizer state: a re-run from a checkpoint does it again).
Rank 0's shards stay finite: only rank 1's guard sees the damage. Rank 1 also builds its model with other
weights (as an unseeded script would): the trainer trains rank 0's, broadcast before sharding.

    python fsdp_optimizer_fault.py OUT

Each rank writes ``OUT/result_rank{r}.json``: how its run ended.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
from torch import nn

import stabletrain

FAULT_STEP = 3  # the optimizer's 4th step
DAMAGED = "body.2.weight"


class RankOneBrokenAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        out = super().step(closure)
        import torch.distributed as dist

        first = self.param_groups[0]["params"][0]
        if float(self.state[first]["step"]) == FAULT_STEP + 1 and dist.get_rank() == 1:
            for group in self.param_groups:
                for p in group["params"]:
                    if getattr(p, "_name", "") == DAMAGED:
                        with torch.no_grad():
                            p.to_local().view(-1)[0] = math.inf
                            self.state[p]["exp_avg"].to_local().view(-1)[0] = math.nan
        return out


class Regression(nn.Module):
    def __init__(self, offset: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        with torch.no_grad():
            for p in self.parameters():
                p.add_(offset)

    def training_step(self, batch):
        return nn.functional.mse_loss(self.body(batch["x"]), batch["y"].expand(-1, 2))

    def configure_optimizer(self, args):
        for name, p in self.named_parameters():  # the parameters are FSDP2's DTensors by now
            p._name = name
        return RankOneBrokenAdamW(self.parameters(), lr=args.lr)


class LinearData(torch.utils.data.Dataset):
    def __init__(self, n: int = 64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def main() -> None:
    out = sys.argv[1]
    result: dict = {}
    try:
        offset = 1.0 if os.environ.get("LOCAL_RANK", "0") == "1" else 0.0  # Fabric sets it for the process it starts
        stabletrain.train(out=out, model=Regression(offset), data=LinearData(), strategy="fsdp", accelerator="cpu", devices=2,
                          steps=10, batch_size=16, log_every_num_steps=1, checkpoint_every_num_steps=2,
                          num_workers=0, debug_args={"nancapture": {"enabled": True}},
                          model_args={"lr": 0.01, "warmup_steps": 0})
        result["ended"] = "done"
    except Exception as exc:  # noqa: BLE001 (the test reads how each rank ended)
        result.update(ended=type(exc).__name__, message=str(exc), step=getattr(exc, "step", None),
                      origin=getattr(exc, "origin", None), param_names=getattr(exc, "param_names", None),
                      state_entries=getattr(exc, "state_entries", None),
                      capture=str(getattr(exc, "capture_path", "") or ""))
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", "0"))
    Path(out, f"result_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
