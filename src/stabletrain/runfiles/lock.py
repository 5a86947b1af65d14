"""The run lock: one process writes a run folder at a time.

``out/.lock`` is taken with ``fcntl.flock`` when training starts and removed when it ends. It
records the holder (``pid``, ``host``, ``started``, and a ``heartbeat`` time refreshed while the
run trains), so a second writer is refused with who holds the folder. The operating system
releases a ``flock`` when its process dies, SIGKILL included, so a lock left by a killed
process never blocks: the next start takes it over and says so.

Across hosts a network filesystem may not share ``flock``; there the record decides: a lock
written on another host whose heartbeat is newer than :data:`STALE_AFTER_S` is treated as held.
Readers (``report``, ``diagnose``, ``replay``) take no lock and work on a live run.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from stabletrain.errors import StabletrainError

LOCK_NAME = ".lock"
#: Seconds after its last heartbeat when another host's lock counts as left behind.
STALE_AFTER_S = 600.0
#: Seconds between heartbeats of a held lock (a rewrite of its record).
HEARTBEAT_S = 60.0


class RunLockedError(StabletrainError):
    """Another process is writing the run folder.

    Attributes:
        path: The lock file (``out/.lock``).
        pid: The holder's process id (None when its record cannot be read).
        host: The holder's host name.
        started: When the holder took the lock (ISO 8601, UTC).
    """

    def __init__(self, message: str, path: Path, pid: Optional[int], host: Optional[str], started: Optional[str]):
        super().__init__(message)
        self.path, self.pid, self.host, self.started = path, pid, host, started

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.path, self.pid, self.host, self.started))


@dataclass
class LockHolder:
    """What a lock file records about its holder."""

    pid: Optional[int]
    host: Optional[str]
    started: Optional[str]
    heartbeat: Optional[float]

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"


def read_holder(path: str | Path) -> Optional[LockHolder]:
    """The record of the lock file at ``path``; None when absent or unreadable (a torn write)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    pid = data.get("pid")
    beat = data.get("heartbeat")
    return LockHolder(pid if isinstance(pid, int) else None, data.get("host"), data.get("started"),
                      float(beat) if isinstance(beat, (int, float)) else None)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


class RunLock:
    """``out/.lock``, held from :meth:`acquire` to :meth:`release` (see the module docstring).

    Example::

        lock = RunLock("out/run").acquire()   # RunLockedError when another process holds it
        try:
            ...                               # train
        finally:
            lock.release()
    """

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.path = self.out / LOCK_NAME
        self._fd: Optional[int] = None
        self._last_beat = 0.0
        self._started = ""
        #: A sentence when :meth:`acquire` took over a lock left by a process that is gone.
        self.took_over: Optional[str] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        """Take the lock or raise :class:`RunLockedError` naming the holder and what to do."""
        import fcntl

        self.out.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise self._refusal(read_holder(self.path), "it holds the lock") from None
            # The file may have been removed (released) between our open and our flock: then
            # the lock we hold is on a file nobody else sees; open the new one.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = read_holder(self.path)
        if previous is not None and previous.host not in (None, socket.gethostname()):
            age = time.time() - (previous.heartbeat or 0.0)
            if age < STALE_AFTER_S:
                os.close(fd)
                raise self._refusal(previous, f"its last heartbeat was {age:.0f} s ago (a lock from another host "
                                              f"counts as left behind {STALE_AFTER_S:.0f} s after its last heartbeat)")
        self._fd = fd
        if previous is not None:
            self.took_over = (f"Took over the run lock {self.path} left by {previous.describe()}: "
                              f"{self._gone(previous)}")
        self._started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self._write()
        return self

    @staticmethod
    def _gone(holder: LockHolder) -> str:
        if holder.host == socket.gethostname() and holder.pid is not None and not _pid_alive(holder.pid):
            return "that process is no longer running (killed before it could release the lock)."
        if holder.host == socket.gethostname():
            return "it no longer holds the lock (killed before it could release it)."
        return f"its last heartbeat is over {STALE_AFTER_S:.0f} s old."

    def _refusal(self, holder: Optional[LockHolder], why: str) -> RunLockedError:
        who = holder.describe() if holder is not None else "another process (its record is unreadable)"
        message = (
            f"{self.out} is being written by {who}: {why}. Two processes writing one run would mix their "
            f"metrics and checkpoints. Wait for it to finish, or stop it"
            + (f" (kill {holder.pid} on {holder.host})" if holder is not None and holder.pid is not None else "")
            + f" and start again; or train into another out folder. Lock file: {self.path}"
        )
        h = holder or LockHolder(None, None, None, None)
        return RunLockedError(message, self.path, h.pid, h.host, h.started)

    def _write(self) -> None:
        assert self._fd is not None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": self._started,
                  "heartbeat": time.time()}
        data = (json.dumps(record) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        self._last_beat = time.monotonic()

    def heartbeat(self) -> None:
        """Refresh the record's heartbeat, at most every :data:`HEARTBEAT_S` seconds (cheap to call
        every step). A failed write (full disk) is left to the next one."""
        if self._fd is not None and time.monotonic() - self._last_beat >= HEARTBEAT_S:
            try:
                self._write()
            except OSError:
                pass

    def release(self) -> None:
        """Remove the lock file and let go of the lock; safe to call twice."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self._fd)  # closing releases the flock
        self._fd = None

    def __getstate__(self) -> dict[str, Any]:
        # A process started by pickling (a spawn launcher) does not hold the lock: its parent does.
        return {**self.__dict__, "_fd": None}

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
