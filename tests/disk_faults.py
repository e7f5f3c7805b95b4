"""Make a directory behave like a full (ENOSPC) or read-only (EROFS) disk, in-process;
or run a process in a mount namespace of its own, where it may mount a real small tmpfs
(:func:`mount_namespace`).

Root ignores file modes, so ``chmod`` cannot make a read-only state directory in CI; and a
size-limited filesystem needs mount rights. This wraps the OS-level entry points every
writer goes through — ``open``/``io.open`` for writing, ``os.open`` with write flags,
``os.mkdir``, ``os.rename``/``os.replace``, ``os.unlink``/``os.rmdir`` — and raises the
chosen ``OSError`` for paths under ``root`` while :attr:`DiskFault.active`. Reads still work.
A full disk lets renames and removals through (they need no space); a read-only one
refuses them too.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import sys
from pathlib import Path

import pytest

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def mount_namespace() -> list[str]:
    """The command prefix that runs a process in a private mount namespace (as root, or
    as root of a user namespace), or skip the test."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs unshare(1) on Linux")
    return ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]


class DiskFault:
    """Install with :meth:`install` (a pytest ``monkeypatch``); toggle :attr:`active`."""

    def __init__(self, root: Path, code: int = errno.ENOSPC) -> None:
        self.root = str(Path(root).resolve())
        self.code = code
        self.active = False
        self.hits = 0  #: operations refused

    def _under(self, path) -> bool:
        try:
            p = os.path.abspath(os.fspath(path))
        except TypeError:
            return False  # a file descriptor
        return p == self.root or p.startswith(self.root + os.sep)

    def _refuse(self, path) -> None:
        self.hits += 1
        raise OSError(self.code, os.strerror(self.code), os.fspath(path))

    def install(self, monkeypatch) -> DiskFault:
        real_open, real_os_open = builtins.open, os.open
        fault = self

        def fopen(file, mode="r", *a, **k):
            if fault.active and any(c in mode for c in "wax+") and fault._under(file):
                fault._refuse(file)
            return real_open(file, mode, *a, **k)

        def osopen(path, flags, *a, **k):
            if fault.active and flags & _WRITE_FLAGS and fault._under(path):
                fault._refuse(path)
            return real_os_open(path, flags, *a, **k)

        def guard(real, *, space_free: bool):
            def op(src, *a, **k):
                paths = [src] + [x for x in a[:1] if isinstance(x, (str, os.PathLike))]
                if fault.active and any(fault._under(p) for p in paths) and not (
                        space_free and fault.code == errno.ENOSPC):
                    fault._refuse(src)
                return real(src, *a, **k)
            return op

        monkeypatch.setattr(builtins, "open", fopen)
        monkeypatch.setattr(io, "open", fopen)
        monkeypatch.setattr(os, "open", osopen)
        monkeypatch.setattr(os, "mkdir", guard(os.mkdir, space_free=False))
        for name in ("rename", "replace", "unlink", "rmdir"):
            monkeypatch.setattr(os, name, guard(getattr(os, name), space_free=True))
        return self
