"""Dense versions shared with model servers in other processes: one immutable file per version.

Where: ``<shm root>/dense/shard-<s>.dense`` (the shm root of the state dir:
:func:`~consumers.serving.shm.shm_root`), with the modes and group of the state dir's other
shared files (:mod:`consumers.serving.access`). Layout, little-endian::

    0   8 bytes   magic b"DSDENSE1"
    8   u64       length L of the JSON header
    16  L bytes   {"model", "shard", "epoch", "step", "ts", "tensors": [[name, shape,
                  byte offset], …]}
    …   float32 tensors, each 64-byte aligned, row-major

Why one file per version: the writer fills a new file under a temp name and renames it over
``shard-<s>.dense`` (an atomic replace on one filesystem). A reader maps the file it opened
and keeps that inode until it calls :meth:`DenseReader.refresh`, so every array it hands
out belongs to one version, whole — never a mix of two, whatever the writer does meanwhile.
The arrays are zero-copy read-only views of the mapping; torch-free.

Readers trust only what the state dir's owner (or root) wrote: directories and the file
must be theirs, carry no group/other write bit and not be links
(:func:`~consumers.serving.access.check_dir` / ``check_fd``).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Optional

import numpy as np

from consumers.errors import ConsumerError
from consumers.serving.access import (
    access_of,
    check_dir,
    check_fd,
    fix_file,
    make_dir,
    writers_of,
)
from consumers.serving.dense_view import DenseView
from consumers.serving.shm import SHM_ENV, shm_root

__all__ = ["DenseReader", "share_dense", "remove_dense", "dense_file", "dense_left"]

log = logging.getLogger(__name__)

MAGIC = b"DSDENSE1"
_ALIGN = 64
_NAME_RE = re.compile(r"^shard-\d+\.dense(\.tmp-\d+)?$")


def dense_file(state_dir: os.PathLike | str, shard: int,
               shm_dir: Optional[os.PathLike | str] = None) -> Path:
    """The shared file of shard ``shard``'s dense version of ``state_dir``."""
    return shm_root(state_dir, shm_dir) / "dense" / f"shard-{int(shard)}.dense"


def _layout(tensors: Mapping[str, np.ndarray], head: dict) -> tuple[bytes, list, int]:
    """(JSON header, tensor entries, data start) with every tensor 64-byte aligned."""
    entries, off = [], 0
    for name in sorted(tensors):
        a = tensors[name]
        entries.append([name, list(a.shape), off])
        off += -(-a.size * 4 // _ALIGN) * _ALIGN
    raw = json.dumps({**head, "tensors": entries}, sort_keys=True).encode()
    start = -(-(16 + len(raw)) // _ALIGN) * _ALIGN
    return raw, entries, start


def share_dense(state_dir: os.PathLike | str, model: str, view: Any,
                shm_dir: Optional[os.PathLike | str] = None) -> Path:
    """Share the complete dense version ``view`` (a ``DenseView``) of ``model``: written
    whole under a temp name, then renamed over the shard's file. Returns the file."""
    path = dense_file(state_dir, view.shard, shm_dir)
    access = access_of(state_dir)
    make_dir(path.parent.parent, access)
    make_dir(path.parent, access)
    head = {"model": model, "shard": view.shard, "epoch": view.epoch, "step": view.step,
            "ts": view.ts}
    raw, entries, start = _layout(view.tensors, head)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, access.file_mode)
    try:
        fix_file(tmp, fd, access.file_mode, access.gid)
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(MAGIC + len(raw).to_bytes(8, "little") + raw)
            for name, _shape, off in entries:
                f.seek(start + off)
                f.write(np.ascontiguousarray(view.tensors[name], "<f4").tobytes())
            f.truncate(max(f.tell(), start))
        os.rename(tmp, path)  # the switch: readers opening now get the whole new version
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return path


def remove_dense(state_dir: os.PathLike | str,
                 shm_dir: Optional[os.PathLike | str] = None) -> int:
    """Remove the shared dense files of ``state_dir`` (a reset, a clean stop): only names
    this module writes whose content starts with its magic, then its dir and the state
    dir's shm dir when nothing else is left in them. Returns the files removed."""
    dir = shm_root(state_dir, shm_dir) / "dense"
    done = 0
    try:
        paths = [p for p in dir.iterdir() if _NAME_RE.match(p.name)]
    except OSError:
        return 0
    for p in paths:
        if p.is_symlink() or not p.is_file():
            continue
        with open(p, "rb") as f:
            if f.read(8) != MAGIC:
                log.warning("%s does not look like a deltastream dense file; left alone", p)
                continue
        p.unlink(missing_ok=True)
        done += 1
    for d in (dir, dir.parent):  # only when nothing else is left there
        try:
            d.rmdir()
        except OSError:
            break
    return done


def dense_left(state_dir: os.PathLike | str,
               shm_dir: Optional[os.PathLike | str] = None) -> bool:
    """True when shared dense files of ``state_dir`` exist (an earlier daemon's: readers
    may hold a version newer than this daemon's checkpoint)."""
    try:
        return any(_NAME_RE.match(p.name) and ".tmp-" not in p.name
                   for p in (shm_root(state_dir, shm_dir) / "dense").iterdir())
    except OSError:
        return False


class DenseReader:
    """Read-only, zero-copy access to the dense version a daemon shares. Use :meth:`open`.

    :meth:`current` is the version mapped (a :class:`~consumers.serving.dense_view.DenseView`,
    one version whole, its arrays read-only views of the file); ``model`` the model's name;
    ``reader[name]``, ``reader.version`` read it. :meth:`refresh` moves to a newer one.
    """

    def __init__(self, path: Path, writers: frozenset[int]) -> None:
        self.path, self._writers = path, writers
        self._map(path)

    def _map(self, path: Path) -> None:
        for d in (path.parent.parent, path.parent):
            check_dir(d, self._writers)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            check_fd(path, fd, self._writers)
            st = os.fstat(fd)
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if mm[:8] != MAGIC:
            raise ConsumerError(f"{path}: not a deltastream dense file")
        n = int.from_bytes(mm[8:16], "little")
        head = json.loads(mm[16:16 + n])
        start = -(-(16 + n) // _ALIGN) * _ALIGN
        tensors = {}
        for name, shape, off in head["tensors"]:
            count = int(np.prod(shape, dtype=np.int64))
            tensors[name] = np.frombuffer(mm, np.float32, count, start + off).reshape(shape)
        cur = DenseView(head["shard"], head["epoch"], head["step"], head["ts"],
                        MappingProxyType(tensors))
        self.model = head["model"]
        self._cur, self._key = cur, (st.st_dev, st.st_ino)  # one version, taken whole

    def current(self) -> DenseView:
        """The version mapped now (take it once to read several tensors of one version
        while another thread may :meth:`refresh`)."""
        return self._cur

    @classmethod
    def open(cls, state_dir: os.PathLike | str, shard: int = 0, *, timeout: float = 0.0,
             shm_dir: Optional[os.PathLike | str] = None) -> DenseReader:
        """Open shard ``shard``'s dense version shared by the daemon of ``state_dir``;
        wait up to ``timeout`` s for one. Raises :class:`ConsumerError` when none is
        shared there (or a file another user planted)."""
        path = dense_file(state_dir, shard, shm_dir)
        deadline = time.monotonic() + max(0.0, float(timeout))
        while True:
            try:
                return cls(path, writers_of(state_dir))
            except FileNotFoundError:
                pass
            if time.monotonic() >= deadline:
                raise ConsumerError(f"no shared dense version of shard {shard} for state dir "
                                    f"{state_dir} (looked for {path}); is its daemon running "
                                    "with share_tables / --share-tables, and given the same "
                                    f"shm dir (shm_dir / --shm-dir / {SHM_ENV})?")
            time.sleep(0.05)

    @property
    def version(self) -> tuple[int, int]:
        """(epoch, step) of the version mapped."""
        return self._cur.version

    def __getitem__(self, name: str) -> np.ndarray:
        return self._cur.tensors[name]

    def names(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._cur.tensors)

    def refresh(self) -> bool:
        """Map the newest version if the writer switched since; True when it did. Arrays
        taken before stay valid and keep the old version (whole)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (st.st_dev, st.st_ino) == self._key:
            return False
        try:
            self._map(self.path)
        except FileNotFoundError:  # replaced again meanwhile: the next call maps it
            return False
        return True

    def __repr__(self) -> str:
        return f"DenseReader({str(self.path)!r}, version={self.version})"
