"""The advisory lock on a run's work folder: one process works in it at a time.

``flock`` on ``FOLDER/lock``: the kernel drops the lock when its process dies
(a kill, a crash, a lost node), so a folder is never left locked by a process
that no longer runs, and nothing has to be cleaned up by hand.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import weakref
from pathlib import Path

LOCK_FILE = "lock"


class RunFolderLocked(OSError):
    """Another process works in this run's folder (the advisory lock is held)."""


class RunLock:
    """An advisory lock (``flock``) on ``FOLDER/lock``, held while a process works in a run's folder.

    The lock dies with its process (a kill frees it). ``acquire`` does not wait:
    a folder held by another process is refused at once, naming the holder
    (pid, host, command, since when). In one process a newer lock on the same
    folder takes the older one over (a run that raised and is retried in the
    same Python session). The lock file is created inside the folder and goes
    with it.
    """

    #: folder (resolved) -> the lock of this process that holds it
    _held: dict[str, "weakref.ref[RunLock]"] = {}

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.fd: int | None = None
        self._closer: weakref.finalize | None = None

    def _key(self) -> str:
        return os.path.realpath(self.folder)

    def acquire(self) -> "RunLock":
        import fcntl

        old = RunLock._held.get(self._key())
        old = old() if old is not None else None
        if old is not None and old.fd is not None:
            if self._is_current(old.fd):  # this process holds it already (a run that raised): take it over
                old._closer.detach()
                self._own(old.fd)
                old.fd = None
                return self
            old.release()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise RunFolderLocked(
                    f"{self.folder} is in use by another process ({self.holder()}); wait for it to finish, "
                    f"or stop it: its finished chunks stay, and --resume continues from them"
                ) from None
            if self._is_current(fd):  # else the folder was removed (the run finished) between open and lock
                break
            os.close(fd)
            if not self.folder.is_dir():
                raise FileNotFoundError(f"{self.folder} was removed by the run that held it")
        self._own(fd)
        info = json.dumps(
            {"pid": os.getpid(), "host": os.uname().nodename, "since": time.time(), "command": " ".join(sys.argv)[:300]}
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        return self

    def _is_current(self, fd: int) -> bool:
        """Whether ``fd`` is the lock file now at ``self.path`` (not one removed with its folder)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _own(self, fd: int) -> None:
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)  # a lock dropped without release() still closes
        self._register()

    def _register(self) -> None:
        key = self._key()
        # the table itself, not the class name: a lock collected at interpreter exit (a TrainingMonitor never
        # closed) may find the module's globals already cleared
        held = RunLock._held

        def forget(ref: "weakref.ref[RunLock]") -> None:
            if held.get(key) is ref:
                del held[key]

        held[key] = weakref.ref(self, forget)

    def moved_to(self, folder: str | os.PathLike) -> "RunLock":
        """The same held lock after its folder was renamed to ``folder``."""
        if RunLock._held.get(self._key(), lambda: None)() is self:
            del RunLock._held[self._key()]
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._register()
        return self

    def holder(self) -> str:
        """The process that holds the lock, in words (from what it wrote into the lock file)."""
        try:
            info = json.loads(self.path.read_text())
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
            return f"pid {info['pid']} on {info['host']}, since {since}: {info['command']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "a process that has not said which"

    def release(self) -> None:
        if self.fd is None:
            return
        if RunLock._held.get(self._key(), lambda: None)() is self:
            del RunLock._held[self._key()]
        self._closer()
        self.fd = None
