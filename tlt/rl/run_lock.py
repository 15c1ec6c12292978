"""One run directory, one run: `RunLock` holds an exclusive lock on <run dir>/run.lock while a run lives.

The lock is a POSIX record lock (fcntl.lockf) on that file: the kernel drops it when its process ends, however it
ends (a SIGKILL, a crash), so a dead run's lock never blocks the next one, and processes the run forks (reward
workers) do not inherit it. The file stays (deleting a lock file races with the next locker); it names the holder
(pid, host, start time) for the error a second run gets. Works across hosts where the file system supports POSIX
locks (local disks, NFSv4). A POSIX lock is its process's: within one process a second RunLock on the same
directory is granted, and closing any descriptor of the file drops it, so nothing else in the process opens it.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from tlt.schema import UserError

LOCK_FILE = "run.lock"


class RunDirInUse(UserError):
    """Another live process holds the run directory."""


class RunLock:
    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        """Take the lock, or RunDirInUse naming the live run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            raise RunDirInUse(f"trainer.default_local_dir: {self.path.parent} is in use by a live run "
                              f"({self.holder()}): wait for it to end or stop it, or give this run another "
                              "trainer.experiment_name") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def holder(self) -> str:
        """Who the lock file says holds it (written by the holder once it has the lock)."""
        try:
            info = json.loads(self.path.read_text())
            return f"pid {info['pid']} on {info['host']}, since {info['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "its holder has not written its name yet"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None

    __del__ = release  # a run object dropped (its process may go on) lets go of its directory

    @property
    def held(self) -> bool:
        return self._fd is not None
