"""LightningModules with faults planted at known places, for tests and ``stabletrain replay --model``.

``PairData(bad=i)``: sample ``i`` is a pair of identical points. ``SiameseLit`` embeds both
points and takes the Euclidean distance of the embeddings, ``sqrt(sum((a - b)**2))``: finite
in the forward pass (0 for identical points), but its gradient at 0 is ``inf * 0 = nan``.
So the first non-finite value is the gradient that the ``distance`` module's backward sends
to its inputs, in the step whose microbatch holds sample ``i``, and nowhere else.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

try:
    import lightning.pytorch as L
except ImportError:  # pragma: no cover
    import pytorch_lightning as L  # type: ignore[no-redef]


class PairDistance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a - b) ** 2).sum(-1).sqrt()


class SiameseLit(L.LightningModule):
    def __init__(self, lr: float = 0.05, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16))
        self.distance = PairDistance()
        # On the distances, not the embeddings: identical points stay identical, and the
        # replay must draw the same mask for the losses to be bitwise those of training.
        self.drop = nn.Dropout(dropout)
        self.lr = lr

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.drop(self.distance(self.embed(x), self.embed(y)))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self(batch["x"], batch["y"]), batch["target"])
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class PairData(Dataset):
    """``n`` pairs of 8-d points with target distance 1; pair ``bad`` (if any) is identical."""

    def __init__(self, n: int = 256, bad: int | None = None, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 8, generator=g)
        if bad is not None:
            self.y[bad] = self.x[bad]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "target": torch.tensor(1.0)}


class LinearLit(L.LightningModule):
    """Linear regression by SGD: at ``lr`` above 2 / (largest eigenvalue of the input
    covariance) the weights, loss and gradient norm grow geometrically: an explosion."""

    def __init__(self, lr: float = 0.01):
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.fc(batch["x"]), batch["target"].reshape(-1, 1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class RankSlices(torch.utils.data.Sampler):
    """Rank ``r`` of ``w`` reads samples ``r, r + w, r + 2w, ...`` in order (Lightning's own
    DistributedSampler shuffles training data)."""

    def __init__(self, n: int):
        self.n = n

    def _rank_world(self) -> tuple[int, int]:
        import torch.distributed as dist

        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def __iter__(self):
        rank, world = self._rank_world()
        return iter(range(rank, self.n, world))

    def __len__(self) -> int:
        rank, world = self._rank_world()
        return len(range(rank, self.n, world))


def ddp_main(out: str, bad: int = 29) -> None:
    """SiameseLit on 2 CPU processes (Lightning's DDP strategy, gloo) with nancapture on.

    Rank 1 reads the odd samples: with batch size 2 and 2 accumulation steps, sample 29 is
    rank 1's batch 7, row 0: step 3, micro step 1. Rank 0 never sees it."""
    torch.manual_seed(0)
    from stabletrain.integrations.lightning import StabletrainCallback

    trainer = L.Trainer(
        max_steps=8, accumulate_grad_batches=2, log_every_n_steps=1, accelerator="cpu", devices=2, strategy="ddp",
        callbacks=[StabletrainCallback(debug_args={"nancapture": {"enabled": True}})], default_root_dir=out,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False,
        use_distributed_sampler=False,
    )
    data = PairData(bad=bad)
    trainer.fit(SiameseLit(), torch.utils.data.DataLoader(data, batch_size=2, sampler=RankSlices(len(data))))


class AdamSiameseLit(SiameseLit):
    """SiameseLit under AdamW; on rank ``inf_rank``, after optimizer step ``inf_at``, an Inf in the first
    weight's ``exp_avg_sq`` (what a float16 ``g**2`` overflow leaves; every weight stays finite)."""

    def __init__(self, inf_rank: int, inf_at: int):
        super().__init__(dropout=0.0)
        self.inf_rank, self.inf_at = inf_rank, inf_at

    def configure_optimizers(self):
        from conftest import plant_exp_avg_sq_overflow  # tests/ (on the path under pytest, and in __main__ below)

        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if self.global_rank == self.inf_rank:  # the first parameter: embed.0.weight
            plant_exp_avg_sq_overflow(optimizer, at_step=self.inf_at)
        return optimizer


def ddp_guard_main(out: str) -> None:
    """AdamSiameseLit on 2 CPU processes (DDP, gloo), nancapture off, 8 steps: rank 1's optimizer state
    gets an Inf in the last step; the callback's check when training ends stops both ranks."""
    torch.manual_seed(0)
    from stabletrain.integrations.lightning import StabletrainCallback

    trainer = L.Trainer(
        max_steps=8, log_every_n_steps=1, accelerator="cpu", devices=2, strategy="ddp",
        callbacks=[StabletrainCallback()], default_root_dir=out, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, logger=False, use_distributed_sampler=False,
    )
    data = PairData()
    trainer.fit(AdamSiameseLit(inf_rank=1, inf_at=7),
                torch.utils.data.DataLoader(data, batch_size=2, sampler=RankSlices(len(data))))


class MomentumSiameseLit(SiameseLit):
    """SiameseLit under SGD with momentum: a skipped step must leave its state unchanged too."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class UnchangedSteps(L.Callback):
    """The steps whose update left every weight and momentum buffer bitwise as it was, and the
    weights at the end: written per rank to ``out/heal_rank{r}.pt`` when training ends."""

    def __init__(self, out: str):
        self.out, self.start, self.unchanged = out, {}, []

    def _now(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        state = [opt.state[p].get("momentum_buffer") for p in pl_module.parameters()]
        return [p.detach().clone() for p in pl_module.parameters()] + [s.clone() for s in state if s is not None]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start.setdefault(trainer.global_step, self._now(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        if step in self.start and step not in self.unchanged and trainer.global_step not in self.start:
            after = self._now(trainer, pl_module)
            if len(after) == len(self.start[step]) and all(torch.equal(a, b) for a, b in zip(self.start[step], after)):
                self.unchanged.append(step)

    def on_train_end(self, trainer, pl_module):
        heal = next(c for c in trainer.callbacks if hasattr(c, "recoveries"))
        torch.save({"recoveries": [(r["step"], r["trigger"], r["action"]) for r in heal.recoveries],
                    "unchanged": self.unchanged, "global_step": trainer.global_step,
                    "weights": [p.detach().clone() for p in pl_module.parameters()]},
                   f"{self.out}/heal_rank{trainer.global_rank}.pt")


def ddp_heal_main(out: str, bad: int = 29) -> None:
    """MomentumSiameseLit on 2 CPU processes (DDP, gloo) with ``on_instability`` skip_step: sample
    ``bad`` (rank 1's, step 3, micro step 1) makes the averaged gradient NaN on both ranks."""
    torch.manual_seed(0)
    from stabletrain.integrations.lightning import StabletrainCallback

    trainer = L.Trainer(
        max_steps=8, accumulate_grad_batches=2, log_every_n_steps=1, accelerator="cpu", devices=2, strategy="ddp",
        callbacks=[StabletrainCallback(on_instability={"policy": "skip_step"}), UnchangedSteps(out)],
        default_root_dir=out, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        logger=False, use_distributed_sampler=False,
    )
    data = PairData(bad=bad)
    trainer.fit(MomentumSiameseLit(), torch.utils.data.DataLoader(data, batch_size=2, sampler=RankSlices(len(data))))


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's fault planters
    if sys.argv[1] == "guard":
        ddp_guard_main(sys.argv[2])
    elif sys.argv[1] == "heal":
        ddp_heal_main(sys.argv[2])
    else:
        ddp_main(sys.argv[1])
