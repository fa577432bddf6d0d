"""What a ``kvroute serve --workers N`` supervisor leaves in the machine while it runs, stamped with its
pid and swept by the next one when it died without cleaning up (SIGKILL, OOM kill, power cut of a VM).

A supervisor owns, for its lifetime:

- a **run folder** ``$TMPDIR/kvroute-run-PID-XXXX/`` holding the admin journal
  (:mod:`kvroute.server.sync.journal`), a lock file ``owner.lock`` held with ``flock`` while it is alive
  (the kernel drops the lock when the process dies, however it dies; a recycled pid does not fool it)
  and ``resources.json``, the names of its shared-memory segments and semaphore, written *before* they
  are created;
- the load table's **shared-memory segments** ``/dev/shm/kvroute-PID-XXXX-counts`` and ``-urls``
  (:class:`~kvroute.server.state.loadtable.LoadTable`);
- the table's **semaphore** (a ``multiprocessing`` lock, ``/dev/shm/sem.mp-...``).

It removes them on every exit it sees. :func:`sweep` (run at the start of the next supervisor) removes
the ones of every run folder whose lock it can take: the owner is dead. A folder whose lock is held is
left alone (another supervisor is running). Nothing here runs on an event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PREFIX", "RunFiles", "sweep"]

log = logging.getLogger("kvroute.server")

PREFIX = "kvroute-run-"
"""Run folders are ``PREFIX + PID + '-' + random`` under the temp dir."""

_SHM_DIR = Path("/dev/shm")


def _unlink_shm(name: str) -> bool:
    """Remove POSIX shared memory ``name`` (as ``SharedMemory`` names it); True if it was there."""
    try:
        os.unlink(_SHM_DIR / name.lstrip("/"))
    except FileNotFoundError:
        return False
    except OSError:
        return False
    return True


def _unlink_sem(name: str) -> bool:
    """Remove POSIX semaphore ``name`` (``/mp-...``); True if it was there."""
    try:
        import _multiprocessing

        _multiprocessing.sem_unlink(name)
    except (OSError, AttributeError, ImportError):
        return False
    return True


@dataclass
class RunFiles:
    """One supervisor's run folder (module docstring); :meth:`create` makes it and takes its lock."""

    folder: Path
    shm_names: tuple[str, ...] = ()
    semaphores: tuple[str, ...] = ()
    _lock_fd: int | None = field(default=None, repr=False)

    @classmethod
    def create(cls, tmpdir: str | None = None) -> RunFiles:
        folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=tmpdir))
        fd = os.open(folder / "owner.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours alone: the folder is new
        os.write(fd, f"{os.getpid()}\n".encode())
        run = cls(folder, _lock_fd=fd)
        run._save()
        return run

    @property
    def journal(self) -> str:
        """The admin journal's path."""
        return str(self.folder / "admin-journal.jsonl")

    def shm_prefix(self) -> str:
        """A fresh name prefix for this run's shared memory: ``kvroute-PID-XXXX``."""
        return f"kvroute-{os.getpid()}-{secrets.token_hex(4)}"

    def record(self, shm: tuple[str, ...] = (), semaphores: tuple[str, ...] = ()) -> None:
        """Add names to ``resources.json`` (before the segments are created: a crash in between
        leaves a name to sweep that may not exist, never a segment without its name)."""
        self.shm_names = (*self.shm_names, *shm)
        self.semaphores = (*self.semaphores, *semaphores)
        self._save()

    def _save(self) -> None:
        tmp = self.folder / "resources.json.tmp"
        tmp.write_text(json.dumps({"pid": os.getpid(), "shm": self.shm_names, "semaphores": self.semaphores}))
        os.replace(tmp, self.folder / "resources.json")

    def remove(self) -> None:
        """The normal exit: remove what is left of the shared memory (the table unlinked it already,
        most likely) and the folder, and drop the lock. The semaphore is left to ``multiprocessing``,
        which unlinks it when the lock object goes."""
        _release(self.folder, self.shm_names, ())
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _release(folder: Path, shm: tuple[str, ...] | list[str], semaphores: tuple[str, ...] | list[str]) -> int:
    n = sum(_unlink_shm(s) for s in shm) + sum(_unlink_sem(s) for s in semaphores)
    shutil.rmtree(folder, ignore_errors=True)
    return n


def sweep(tmpdir: str | None = None) -> list[str]:
    """Remove the run folders (and their shared memory and semaphores) of supervisors that are dead:
    those whose ``owner.lock`` can be taken. Returns the folders removed; logs one line per folder."""
    root = Path(tmpdir or tempfile.gettempdir())
    removed = []
    for folder in sorted(root.glob(f"{PREFIX}*")):
        lock = folder / "owner.lock"
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue  # not a run folder (or being created): leave it
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its supervisor is alive
            try:
                res = json.loads((folder / "resources.json").read_text())
                shm, sems = list(res.get("shm", ())), list(res.get("semaphores", ()))
            except (OSError, ValueError, AttributeError):
                shm, sems = [], []
            n = _release(folder, shm, sems)
            removed.append(str(folder))
            log.warning(
                "removed the leftovers of a dead kvroute supervisor: %s (%d shared-memory objects)", folder, n
            )
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    return removed
