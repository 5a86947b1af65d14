"""Deterministic, resumable, sharded loading of microbatches with their dataset indices.

The trainer needs three things a stock DataLoader does not give together:

* the dataset index of every sample (debugging tools report which samples broke a step),
* an exact data position for resume, without replaying the loader,
* the same order on every run with the same seed, independent of the global RNG.

The order is a per-epoch permutation drawn from ``seed + epoch`` by a private generator.
Each rank takes ``perm[rank::world_size]`` (truncated so every rank has the same number of
samples) and cuts it into microbatches, dropping the incomplete last one. The position is
simply the number of microbatches a rank has consumed.

Quarantined samples (``exclude``: found bad by the self-healing, see docs/self_healing.md) are
replaced in every permutation, in place, by kept samples, so an epoch keeps its number of
microbatches, a position keeps its meaning and the other samples keep their places. Without
exclusions the order is the same as before.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate


class IndexedDataset(Dataset):
    """Wraps a dataset so that item ``i`` is ``(i, dataset[i])``."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]


def collate_indexed(items: list[tuple[int, Any]]) -> tuple[torch.Tensor, Any]:
    """Batch ``(index, sample)`` pairs into ``(LongTensor of indices, batched samples)``."""
    indices = torch.tensor([i for i, _ in items], dtype=torch.long)
    return indices, default_collate([s for _, s in items])


def samples_needed(microbatch_size: int, world_size: int) -> int:
    """Fewest samples :class:`ResumableBatchSampler` accepts: one full microbatch on every rank.

    Incomplete microbatches are dropped and every rank gets ``num_samples // world_size``
    samples, so an epoch holds at least one microbatch exactly when
    ``num_samples // world_size >= microbatch_size``, i.e. ``num_samples >= microbatch_size * world_size``.
    A step with gradient accumulation may take its microbatches from consecutive epochs.

    Example::

        samples_needed(microbatch_size=8, world_size=2)  # 16
    """
    return microbatch_size * world_size


class ResumableBatchSampler(Sampler[list[int]]):
    """Endless stream of microbatches of dataset indices for one rank.

    Args:
        num_samples: Dataset length.
        microbatch_size: Samples per microbatch on this rank.
        seed: Base seed; epoch ``e`` uses the permutation drawn from ``seed + e``.
        rank: This process's rank.
        world_size: Number of processes.
        start: Microbatches this rank already consumed (the resume position).
        exclude: Dataset indices never to yield (quarantined samples).
    """

    def __init__(
        self, num_samples: int, microbatch_size: int, seed: int, rank: int = 0, world_size: int = 1, start: int = 0,
        exclude: Iterable[int] = (),
    ):
        self.num_samples = num_samples
        self.microbatch_size = microbatch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start = start
        self.exclude = frozenset(int(i) for i in exclude)
        self.per_rank = num_samples // world_size
        self.batches_per_epoch = self.per_rank // microbatch_size
        if num_samples < samples_needed(microbatch_size, world_size):
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one microbatch of "
                f"{microbatch_size} per rank on {world_size} rank(s)"
            )

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All microbatches of one epoch for this rank."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_samples, generator=g)
        if self.exclude:
            perm = _without(perm, self.exclude)
        mine = perm[self.rank :: self.world_size][: self.per_rank]
        n = self.batches_per_epoch * self.microbatch_size
        return mine[:n].view(self.batches_per_epoch, self.microbatch_size).tolist()

    def position(self, microbatches_consumed: int) -> tuple[int, int]:
        """(epoch, microbatch within the epoch) after consuming that many microbatches."""
        return divmod(microbatches_consumed, self.batches_per_epoch)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, offset = self.position(self.start)
        while True:
            for batch in self.epoch_batches(epoch)[offset:]:
                yield batch
            epoch, offset = epoch + 1, 0

    def __len__(self) -> int:  # DataLoader asks; the stream is endless
        return 2**62


def _without(perm: torch.Tensor, exclude: frozenset[int]) -> torch.Tensor:
    """``perm`` with each ``exclude`` index replaced in place by a kept sample (the permutation's
    first ones, in order): every other sample keeps its position, so a quarantine decided in the
    middle of an epoch changes only the batches that held a quarantined sample."""
    bad = torch.isin(perm, torch.tensor(sorted(exclude), dtype=perm.dtype))
    keep = perm[~bad]
    if not len(keep):
        raise ValueError(f"every one of the {len(perm)} samples is quarantined: no data is left to train on")
    n = int(bad.sum())
    out = perm.clone()
    out[bad] = keep.repeat(-(-n // len(keep)))[:n]
    return out


def build_loader(
    dataset: Dataset,
    microbatch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    start: int,
    num_workers: int,
    pin_memory: bool = False,
    exclude: Iterable[int] = (),
) -> tuple[DataLoader, ResumableBatchSampler]:
    """A DataLoader yielding ``(indices, batch)`` from the given position on, never the ``exclude`` indices."""
    sampler = ResumableBatchSampler(len(dataset), microbatch_size, seed, rank, world_size, start,  # type: ignore[arg-type]
                                    exclude=exclude)
    loader = DataLoader(
        IndexedDataset(dataset),
        batch_sampler=sampler,
        collate_fn=collate_indexed,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # A private generator: creating the iterator must not draw from the global RNG,
        # or a resumed run would see different dropout masks than an uninterrupted one.
        generator=torch.Generator().manual_seed(seed),
    )
    return loader, sampler
