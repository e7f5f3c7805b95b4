"""Run a function as another local user (uid/gid 65534) in a forked child: the hostile
local user of the security tests. Needs root (tests skip with the reason otherwise)."""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

#: the other user's uid and gid (nobody/nogroup)
NOBODY = 65534


def need_root() -> None:
    """Skip the calling test unless it runs as root (needed to become another user)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test becomes another user (uid 65534) with setuid")


@contextmanager
def as_nobody(fn: Callable[[], Any]) -> Iterator[Any]:
    """Fork; the child becomes uid/gid 65534 and calls ``fn``; yields what it returned
    (or the exception it raised, as an exception instance) while the child lives on
    holding whatever ``fn`` opened; the child is killed on exit."""
    need_root()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out: Any = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the parent
                out = e
            try:
                data = pickle.dumps(out)
            except Exception:  # noqa: BLE001
                data = pickle.dumps(RuntimeError(repr(out)))
            os.write(w, data)
            os.close(w)
            signal.pause()
        finally:
            os._exit(0)
    os.close(w)
    try:
        chunks = []
        while True:
            b = os.read(r, 65536)
            if not b:
                break
            chunks.append(b)
        os.close(r)
        yield pickle.loads(b"".join(chunks))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def open_dir(parent: str = "/tmp") -> str:
    """A new directory under ``parent`` that every user can traverse (mode 0755, the path
    to it too), so only the modes deltastream sets decide what another user reads."""
    import tempfile

    d = tempfile.mkdtemp(prefix="ds-open-", dir=parent)
    os.chmod(d, 0o755)
    return d


def shared_lock_attempt(path: Any) -> Callable[[], str]:
    """For :func:`as_nobody`: open ``path`` read-only and take a shared ``flock`` on it
    without waiting; returns ``"held"`` (raises if either is refused)."""
    def attempt() -> str:
        import fcntl

        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return "held"
    return attempt
