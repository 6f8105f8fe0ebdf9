"""The run folder's lock: one run per run folder, from its start-up to its end.

Rank 0 holds an exclusive POSIX lock on RUN_DIR/.run.lock, which holds its pid, on the file descriptor
it opened. The kernel drops the lock when the process ends, however it ends, so the file a killed run
leaves behind locks nothing. A lock file removed or replaced while the run holds it (by hand, or by a
clean-up) would let a second launch lock a new file and run beside the first: `RunLock.lost` tells,
and the run folder checks it before every record and checkpoint it writes (`RunFolder.check_lock`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

from megatron_rl.config import ConfigError

logger = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"


def _lock_holder(fd: int) -> str:
    return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"


class RunLock:
    """An exclusive lock on a run folder, held by this process (see the module doc); `release` removes its file."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None
        for _ in range(10):  # another holder may remove the file between our open and our lock
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:  # a folder (or a file we may not write) where the lock file belongs
                raise ConfigError(
                    f"logging.run_dir = {str(run_dir)!r}: its lock file {self.path} cannot be opened "
                    f"({type(err).__name__}: {err.strerror or err}); remove {self.path} (a run folder's lock "
                    "is a file megatron-rl makes), or choose another logging.run_dir"
                ) from None
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = _lock_holder(fd)
                os.close(fd)
                if err.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
                    logger.warning(
                        "%s: the run folder cannot be locked (%s): make sure no other run uses it", self.path, err
                    )
                    return
                raise ConfigError(
                    f"logging.run_dir = {str(run_dir)!r} is in use by another run (pid {holder}, lock {self.path}): "
                    "wait for it to end, or choose another logging.run_dir"
                ) from None
            self._fd = fd
            if self.lost() is None:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return
            self._fd = None
            os.close(fd)
        raise ConfigError(f"{self.path}: could not be locked (removed and created again by other runs)")

    def lost(self) -> str | None:
        """Why this process no longer holds the run folder, or None: its lock file was removed, or
        replaced by another file (which another launch may have locked)."""
        if self._fd is None:
            return None
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return f"{self.path} was removed while this run (pid {os.getpid()}) held it"
        held = os.fstat(self._fd)
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY)
            holder = f"pid {_lock_holder(fd)}"
            os.close(fd)
        except OSError:
            holder = "unknown"
        return f"{self.path} was replaced while this run (pid {os.getpid()}) held it (the new one names {holder})"

    def release(self) -> None:
        """Remove the lock file, when it is still ours, and unlock (idempotent)."""
        if self._fd is None:
            return
        if self.lost() is None:
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None
