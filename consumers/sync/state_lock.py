"""One writer per state dir: the daemon's lock, and who may own the state dir.

A :class:`~consumers.sync.daemon.SyncDaemon` takes :func:`lock_state_dir` before it reads
or writes anything there: an exclusive ``flock`` on ``<state_dir>/daemon.lock``, held while
the daemon lives (the kernel drops it when the process dies, also on SIGKILL; on NFS, Linux
maps ``flock`` to byte-range locks, so daemons on two hosts sharing the state dir exclude
each other where the filesystem's locks work). A second daemon refuses at start with
:class:`~consumers.errors.ConsumerError` naming the holder (pid, host) that the lock file
records.

The lock file is created ``0600`` by the daemon's user, without following a link
(``O_NOFOLLOW``), and is refused when another user owns it: no other local user can open
it, so none can hold it (a read-only ``flock`` by anyone else would block every restart).

:func:`check_owner`: a state dir owned by another user is refused (that user could plant
links and files there for the daemon to write through) unless the caller says otherwise
(``SyncOptions.state_dir_any_owner``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
import weakref
from pathlib import Path
from typing import Optional

from consumers.errors import ConsumerError

__all__ = ["LOCK_FILE", "StateLock", "lock_state_dir", "check_owner"]

log = logging.getLogger(__name__)

#: name of the lock file in the state dir
LOCK_FILE = "daemon.lock"


def check_owner(state_dir: Path, *, any_owner: bool = False) -> None:
    """Refuse (``ConsumerError`` naming the path and both uids) a state dir that is not a
    directory owned by this process's user, unless ``any_owner``."""
    try:
        st = os.lstat(state_dir)
    except OSError as e:
        raise ConsumerError(f"state_dir {state_dir}: cannot stat it: {e}") from e
    if stat.S_ISLNK(st.st_mode):  # a link we did not make is fine only when asked for
        st = os.stat(state_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise ConsumerError(f"state_dir {state_dir}: expected a directory")
    uid = os.geteuid()
    if st.st_uid != uid and not any_owner:
        raise ConsumerError(
            f"state_dir {state_dir}: owned by uid {st.st_uid}, this daemon runs as uid {uid}; "
            "refusing a state dir another user controls (it could plant links there); "
            "use a state dir of this user, or state_dir_any_owner / --state-dir-any-owner")


class StateLock:
    """The held lock of one state dir; :meth:`release` (or garbage collection) drops it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: Optional[int] = fd
        self._final = weakref.finalize(self, os.close, fd)

    @property
    def held(self) -> bool:
        """True until :meth:`release`."""
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: a later daemon reuses it."""
        if self._fd is not None:
            self._fd = None
            self._final()


def _holder(fd: int) -> str:
    """What the lock file says about its holder (pid, host, since)."""
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode() or "{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"pid {int(info['pid'])} on host {info['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown (it has not written the lock file yet)"


def _open(path: Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConsumerError(f"{path}: is a symbolic link; the daemon's lock file must "
                                "be a plain file it created (remove the link)") from e
        raise ConsumerError(f"{path}: cannot open the state dir's lock file: {e}") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise ConsumerError(f"{path}: expected a plain file owned by uid {os.geteuid()}, "
                            f"found one of uid {st.st_uid}; remove it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.fchmod(fd, 0o600)  # nobody else may open it, hence nobody else may hold it
    return fd


def lock_state_dir(state_dir: Path) -> StateLock:
    """Take the one-writer lock of ``state_dir`` (an existing directory); raises
    ``ConsumerError`` naming the holder when another process holds it."""
    path = Path(state_dir) / LOCK_FILE
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise ConsumerError(f"{path}: cannot lock the state dir: {e}") from e
        raise ConsumerError(f"state_dir {state_dir}: in use by another deltastream-sync "
                            f"({holder}; lock {path}); one daemon per state dir") from None
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.time()}).encode()
    try:  # who holds it, for the message of the next one; a full disk must not stop us
        os.ftruncate(fd, 0)
        os.pwrite(fd, info + b"\n", 0)
    except OSError as e:
        log.warning("%s: cannot record this daemon as the holder (%s); locked anyway", path, e)
    log.debug("state dir %s locked (%s)", state_dir, path)
    return StateLock(path, fd)
