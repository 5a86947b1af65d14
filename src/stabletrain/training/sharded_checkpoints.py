"""The trainer's sharded checkpoints (``checkpoint_format=sharded``, FSDP2): each rank writes its
own shards, nothing is gathered, and a checkpoint folder is used only once it is complete.

A save, on every rank at the same point (after the state was verified finite and its health
recorded, :meth:`stabletrain.safety.net.SafetyNet.verify`):

1. the previous asynchronous write, if any, is finished first (one write at a time);
2. rank 0 checks the free space for all ranks' shards and creates ``.NAME.tmp/``; the ranks agree;
3. every rank writes its shards into it (:func:`stabletrain.distributed.dcp.write_shards`), at once
   or, with ``checkpoint_async``, in a background thread after copying them to host memory;
4. once the write has finished everywhere, rank 0 writes ``meta.pt`` (the rest of the state and
   its health) and renames the folder into place (:func:`stabletrain.runfiles.checkpoint.commit_sharded`).

An asynchronous write is committed at the end of the step in which rank 0 sees it finished, at
the next save, at the end of training and before any stop message names a checkpoint. See
docs/distributed.md ("Sharded checkpoints").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from stabletrain.runfiles.checkpoint import begin_sharded, commit_sharded, sharded_target
from stabletrain.safety.write_failures import is_write_failure, write_failed_error


@dataclass
class _Pending:
    """An asynchronous write on its way: its future, and what rank 0 commits once it is done."""

    future: Any
    meta: dict[str, Any]
    periodic: bool


class ShardedCheckpoints:
    """Owned by a :class:`~stabletrain.training.loop.Trainer` with ``checkpoint_layout == "sharded"``."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.pending: Optional[_Pending] = None
        self._group: Any = None  # the background writes' own process group (gloo)
        #: Seconds each save held the training loop (the write itself, or only the copy when async).
        self.blocking_s: list[float] = []

    def save(self, state: dict[str, Any], periodic: bool, final: bool) -> Optional[Path]:
        """Write ``state`` (verified, with its ``health``; :meth:`finish` called before it was
        taken): every rank calls it. Returns ``last.ckpt`` on rank 0 once committed, None on the
        other ranks or while an asynchronous write runs."""
        import time

        t = self.trainer
        start = time.perf_counter()
        shards = {"model": state.pop("model"), "optimizer": state.pop("optimizer")}
        meta = state
        from stabletrain.distributed.dcp import local_tensors

        local = sum(x.numel() * x.element_size() for x in local_tensors(shards))
        nbytes = int(t.fabric.all_reduce(torch.tensor(float(local), device=t.fabric.device), reduce_op="sum"))
        if t.is_rank_zero:
            try:
                begin_sharded(meta, t.out, periodic, nbytes)
            except OSError as exc:
                if not is_write_failure(exc):
                    raise
                t.write_failure = exc
        self._agree_on_failure()  # also the barrier: the temporary folder exists before anyone writes
        tmp, _ = sharded_target(t.out, int(meta["step"]), periodic)
        asynchronous = bool(t.settings.checkpoint_async) and not final
        future = self._write(shards, tmp, asynchronous)
        if future is not None:
            self.pending = _Pending(future, meta, periodic)
            self.blocking_s.append(time.perf_counter() - start)
            return None
        path = None
        if t.is_rank_zero:
            path = self._commit_here(meta, periodic)
        self._agree_on_failure()
        self.blocking_s.append(time.perf_counter() - start)
        return path

    def _write(self, shards: dict[str, Any], tmp: Path, asynchronous: bool) -> Any:
        from stabletrain.distributed.dcp import write_shards

        t = self.trainer
        if asynchronous and self._group is None and t.world_size > 1:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        try:
            return write_shards(shards, tmp, asynchronous=asynchronous,
                                process_group=self._group if asynchronous else None)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if not self._note_failure(exc):
                raise
        self._agree_on_failure()
        return None  # not reached: the agreement raises

    def _commit_here(self, meta: dict[str, Any], periodic: bool) -> Optional[Path]:
        """Rank 0: write meta.pt and rename the folder into place; a failed write becomes the run's."""
        t = self.trainer
        try:
            return commit_sharded(meta, t.out, periodic, keep=t.settings.max_checkpoints_to_keep)
        except OSError as exc:
            if not is_write_failure(exc):
                raise
            t.write_failure = t.write_failure or exc
            return None

    def _agree_on_failure(self) -> None:
        t = self.trainer
        failed = t.write_failure is not None
        if t.world_size > 1:
            failed = t.max_over_ranks(float(failed)) > 0
        if failed:
            raise write_failed_error(t, t.write_failure)

    def _note_failure(self, exc: BaseException) -> bool:
        """A failed DCP write (reported the same on every rank): this rank's own OSError becomes
        the trainer's ``write_failure``; True when the failure is a write failure on some rank
        (every rank then stops at the agreement), False for anything else (raise it)."""
        t = self.trainer
        own = _own_error(exc, t.rank)
        if own is not None and is_write_failure(own):
            t.write_failure = t.write_failure or own  # type: ignore[assignment]
            return True
        failures = getattr(exc, "failures", None) or {}
        return any(is_write_failure(_unwrap(e)) for e in failures.values())

    def _settle(self, p: _Pending) -> None:
        """The finished write ``p``: rank 0 commits it; a failure becomes ``write_failure``."""
        try:
            p.future.result()
        except BaseException as exc:
            if not self._note_failure(exc):
                raise
            return
        if self.trainer.is_rank_zero:
            self._commit_here(p.meta, p.periodic)

    def poll(self) -> None:
        """End of a step, before the ranks agree on it: settle an asynchronous write that has
        finished (on rank 0 its future completes only once every rank's shards and DCP's index are
        on disk). No collective: a failure is the trainer's ``write_failure``, agreed on by
        ``SafetyNet.end_of_step`` like any other."""
        p = self.pending
        if p is not None and p.future.done():
            self.pending = None
            self._settle(p)

    def finish(self) -> None:
        """Wait for the asynchronous write on its way and settle it; every rank calls it at the same
        point (before the next save's state is taken, at the end of training), and with
        ``checkpoint_async`` the ranks then agree on its outcome."""
        p = self.pending
        self.pending = None
        if p is not None:
            self._settle(p)
        if self.trainer.settings.checkpoint_async:
            self._agree_on_failure()

    def close(self) -> None:
        """At exit or before a stop message names a checkpoint: wait for a write still running (its
        state was verified before it started) and commit it. No collective: safe on a failure path."""
        p = self.pending
        self.pending = None
        if p is None:
            return
        try:
            p.future.result()
        except BaseException:
            return  # the run ends with its own error; the temporary folder is removed at the next start
        if self.trainer.is_rank_zero:
            try:
                commit_sharded(p.meta, self.trainer.out, p.periodic, keep=self.trainer.settings.max_checkpoints_to_keep)
            except OSError:
                pass


def _unwrap(entry: Any) -> Any:
    """DCP's failure entries are ``(exception, traceback)`` pairs."""
    return entry[0] if isinstance(entry, tuple) and entry else entry


def _own_error(exc: BaseException, rank: int) -> Optional[BaseException]:
    if isinstance(exc, OSError):
        return exc
    failures = getattr(exc, "failures", None)
    if failures and rank in failures:
        return _unwrap(failures[rank])
    return None
