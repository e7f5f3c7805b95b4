"""The files of a shared serving table, and who may create, replace or remove them.

Where: ``<shm dir>/deltastream-<h>/<table>-<t>/`` with ``<h>`` a hash of the state dir's
real path and ``<t>`` a hash of the table name (the readable part of the name is kept in
front). The shm dir is ``/dev/shm`` unless the writer and its readers are given another
(``shm_dir=``, or ``DELTASTREAM_SHM_DIR`` in the environment of both: :func:`shm_base`),
e.g. a tmpfs mounted with huge pages (see :mod:`consumers.serving.mounts`); without
``/dev/shm`` (not Linux) and none given, ``<state_dir>/shm/<table>-<t>/``. Readers compute
the same place from the state dir, the table name and the shm dir (:func:`table_dir`).

In a table directory::

    lock                 flock'ed by the one writing process while it lives (0600)
    current              "<incarnation>": the incarnation readers should map
    <inc>.rows           header page + rows (sparse; see consumers.serving.memory)
    <inc>.idx-<gen>      header page + the id index buckets of generation <gen>

An *incarnation* is one writer's table (a daemon run). A restarted daemon writes a new
one, points ``current`` at it, marks the previous one superseded (readers reopen) and
removes its files. A daemon killed with SIGKILL leaves its files, consistent (every
publish is one store): readers keep reading the last state; the next writer of that table
removes them. A writer removes only files named as above whose header carries
deltastream's magic — never anything else. Modes, group, and what readers verify:
:mod:`consumers.serving.access`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import time
import weakref
from pathlib import Path
from typing import Optional

import numpy as np

from consumers.errors import ConsumerError
from consumers.serving import hugemap
from consumers.serving.access import Access, access_of, check_fd, fix_file, make_dir
from consumers.serving.backer import Backer, allocate
from consumers.serving.memory import (
    DTYPE_CODES,
    H_CREATED_NS,
    H_INCARNATION,
    H_LAYOUT,
    H_MAGIC,
    H_NAME_LEN,
    H_PID,
    H_STATE,
    H_VERSION_BASE,
    HEADER_BYTES,
    INDEX_MAGIC,
    LAYOUT,
    MAGIC,
    MAX_NAME_BYTES,
    NAME_OFFSET,
    STATE_CLOSED,
    STATE_LIVE,
    STATE_SUPERSEDED,
    header_array,
    map_file,
)
from consumers.serving.mounts import huge_pages

# where the tables live: consumers.serving.shm_place (imported from here before)
from consumers.serving.shm_place import (
    SHM_BASE,
    SHM_ENV,
    derived_root,
    planted_root,
    shm_base,
    shm_root,
    table_dir,
)

__all__ = ["SharedStorage", "table_dir", "shm_root", "shm_base", "derived_root", "planted_root", "read_current",
           "remove_tables",
           "left_behind",
           "rows_file", "index_file", "SHM_BASE", "SHM_ENV"]

log = logging.getLogger(__name__)

_FILE_RE = re.compile(r"^([0-9a-f]{16})\.(rows|idx-\d{6,})$")
_hinted: set[Path] = set()  # shm dirs the 4 KiB-page hint was logged for
#: rows backed ahead of the writer (consumers.serving.backer): a quarter of what it has
#: written, at least one 2 MiB block and at most this many bytes
_AHEAD_MAX = 64 << 20


def rows_file(dir: Path, inc: str) -> Path:
    """The header + rows file of incarnation ``inc``."""
    return dir / f"{inc}.rows"


def index_file(dir: Path, inc: str, gen: int) -> Path:
    """The index file of generation ``gen`` of incarnation ``inc``."""
    return dir / f"{inc}.idx-{gen:06d}"


def read_current(dir: Path, writers: Optional[frozenset[int]] = None) -> Optional[str]:
    """The incarnation ``dir/current`` names, or None. ``writers``: refuse
    (``ConsumerError``) a pointer not written by one of these uids (see
    :func:`~consumers.serving.access.check_fd`)."""
    try:
        fd = os.open(dir / "current", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if writers is not None:
            check_fd(dir / "current", fd, writers)
        text = os.read(fd, 64).decode(errors="replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return text if re.fullmatch(r"[0-9a-f]{16}", text) else None


def _is_ours(path: Path) -> bool:
    """True when ``path`` is a table file deltastream wrote (name and magic)."""
    if not _FILE_RE.match(path.name) or path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            word = int.from_bytes(f.read(8), "little")
    except OSError:
        return False
    return word in (MAGIC, INDEX_MAGIC)


def _remove_ours(paths: list[Path]) -> None:
    for p in paths:
        if _is_ours(p):
            try:
                p.unlink()
            except OSError as e:
                log.warning("cannot remove %s: %s", p, e)
        elif p.exists():
            log.warning("%s does not look like a deltastream table file; left alone", p)


class _Files:
    """What a finalizer needs to clean up (no reference to the storage object)."""

    def __init__(self, dir: Path, inc: str, access: Access) -> None:
        self.dir, self.inc, self.access = dir, inc, access
        self.lock_fd: Optional[int] = None
        self.gens: set[int] = set()
        self.backer = Backer(dir.name)
        self.closed = False

    def paths(self) -> list[Path]:
        return [rows_file(self.dir, self.inc)] + [index_file(self.dir, self.inc, g)
                                                  for g in sorted(self.gens)]

    def cleanup(self) -> None:
        """Remove our files (and ``current`` when it names us); release the lock."""
        if self.closed:
            return
        self.closed = True
        self.backer.close()
        if read_current(self.dir) == self.inc:
            try:
                (self.dir / "current").unlink()
            except OSError:
                pass
        _remove_ours(self.paths())
        if self.lock_fd is not None:
            # unlink while holding the lock: a writer that opened the old file notices
            # (its inode is no longer the path's) and takes a fresh one
            try:
                (self.dir / "lock").unlink()
            except OSError:
                pass
            os.close(self.lock_fd)
            for d in (self.dir, self.dir.parent):  # only when nothing else is left there
                try:
                    d.rmdir()
                except OSError:
                    break
        self.lock_fd = None


class SharedStorage:
    """Memory of a table shared with reader processes: one incarnation's files."""

    shared = True

    def __init__(self, state_dir: Path, location: Path, files: _Files, buf: np.ndarray,
                 dim: int, dtype: np.dtype, slots: int, shm_dir: Optional[Path]) -> None:
        self.state_dir, self.location, self._f = state_dir, location, files
        self.shm_dir = shm_dir  # where it lives (None: in the state dir)
        self.hdr = header_array(buf)
        self.cap = slots
        self.rows = buf[HEADER_BYTES: HEADER_BYTES + slots * dim * dtype.itemsize].view(
            dtype).reshape(slots, dim)
        self._buf = buf
        self._row_bytes = dim * dtype.itemsize
        self._backed = HEADER_BYTES  # bytes of the rows file backed by allocated pages
        self._asked = HEADER_BYTES  # ... that the backer was asked to back
        self._indexes: dict[int, np.ndarray] = {}  # index files by generation, mapped
        self._final = weakref.finalize(self, files.cleanup)
        files.backer.add("rows", rows_file(location, files.inc), buf, HEADER_BYTES)

    @property
    def incarnation(self) -> str:
        """This writer's incarnation id (16 hex digits)."""
        return self._f.inc

    @property
    def huge_blocks(self) -> int:
        """2 MiB blocks of this incarnation's files collapsed into huge pages (hugemap)."""
        return self._f.backer.huge_blocks

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._f.closed

    @classmethod
    def create(cls, state_dir: os.PathLike | str, name: str, dim: int, dtype: str,
               slots: int, need: int, *, lock_fd: Optional[int] = None,
               shm_dir: Optional[os.PathLike | str] = None) -> SharedStorage:
        """A new incarnation of shared table ``name`` of ``state_dir`` with ``slots`` row
        slots reserved (at least ``need``), under ``shm_dir`` (see :func:`shm_base`). Takes
        the table's writer lock (``lock_fd``: already held, for a regrow). Readers see it
        after :meth:`publish`."""
        raw = name.encode()
        if len(raw) > MAX_NAME_BYTES:
            raise ValueError(f"name: shared table names are at most {MAX_NAME_BYTES} bytes "
                             f"of utf-8, got {len(raw)}")
        base = shm_base(shm_dir)
        Path(state_dir).mkdir(parents=True, exist_ok=True)  # its owner is the writer
        location = table_dir(state_dir, name, base)  # (its owner decides what is planted)
        if base is not None and base not in _hinted and huge_pages(base) is False and \
                not hugemap.collapsing():
            _hinted.add(base)
            log.info("%s is a tmpfs without huge pages: lookups of random ids pay a page "
                     "walk per row; a tmpfs mounted with huge=within_size given as the shm "
                     "dir (--shm-dir, %s) makes them up to 2x faster", base, SHM_ENV)
        access = access_of(state_dir)  # no more readable than the state dir
        make_dir(location.parent, access)
        make_dir(location, access)
        files = _Files(location, f"{secrets.randbits(63):016x}", access)
        files.lock_fd = lock_fd if lock_fd is not None else _lock(location)
        try:
            if lock_fd is None:
                _remove_stale(location)
            np_dtype = np.dtype({"f32": "<f4", "f16": "<f2"}[dtype])
            path = rows_file(location, files.inc)
            while True:
                try:
                    buf = map_file(path, HEADER_BYTES + slots * dim * np_dtype.itemsize,
                                   create=True, mode=access.file_mode, gid=access.gid)
                    break
                except (OSError, OverflowError, ValueError):
                    path.unlink(missing_ok=True)
                    if slots // 2 < need:
                        raise
                    slots //= 2
            out = cls(Path(os.path.realpath(os.fspath(state_dir))), location, files, buf, dim,
                      np_dtype, slots, base)
        except BaseException:
            files.cleanup()
            raise
        h = out.hdr
        h[H_LAYOUT], h[H_INCARNATION] = LAYOUT, int(files.inc, 16)
        h[H_PID], h[H_CREATED_NS], h[H_STATE] = os.getpid(), time.time_ns(), STATE_LIVE
        # A later daemon run starts its versions above every state of this one, as long as
        # it publishes fewer than one state per µs and the clock does not step back.
        h[H_VERSION_BASE] = time.time_ns() // 1000
        buf[NAME_OFFSET: NAME_OFFSET + len(raw)] = np.frombuffer(raw, np.uint8)
        h[H_NAME_LEN] = len(raw)
        h[3] = DTYPE_CODES[dtype]
        h[H_MAGIC] = MAGIC  # last: a file without it is not (yet) a table
        return out

    def huge_pages(self) -> Optional[bool]:
        """Whether the table's memory is in huge pages: blocks were collapsed, or the
        filesystem gives them (:mod:`consumers.serving.mounts`); None when unknown."""
        return True if self.huge_blocks else huge_pages(self.location)

    def matches(self, state_dir: os.PathLike | str,
                shm_dir: Optional[os.PathLike | str] = None) -> bool:
        """True when this storage is the shared table of ``state_dir`` under ``shm_dir``."""
        return Path(os.path.realpath(os.fspath(state_dir))) == self.state_dir and \
            self.location.parent == shm_root(state_dir, shm_dir)

    def new_index(self, gen: int, buckets: int, *, back: bool = False) -> np.ndarray:
        """Zeroed ``int64 [buckets, 2]`` in the new file ``<inc>.idx-<gen>``, sparse. The
        backer starts allocating its pages at once; they must be allocated (waited for with
        :meth:`back_index`, or ``back``) before they are written — a full /dev/shm then
        fails with OSError, not with SIGBUS on a write."""
        path = index_file(self.location, self._f.inc, gen)
        nbytes = HEADER_BYTES + buckets * 16
        try:
            buf = map_file(path, nbytes, create=True, mode=self._f.access.file_mode,
                           gid=self._f.access.gid)
        except FileExistsError:
            raise
        except OSError:
            path.unlink(missing_ok=True)  # created here (O_EXCL) or not at all
            raise
        self._f.gens.add(gen)
        self._indexes[gen] = buf
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                allocate(fd, 0, HEADER_BYTES)
            finally:
                os.close(fd)
            h = header_array(buf)
            h[1], h[2], h[3] = gen, buckets, int(self._f.inc, 16)
            h[0] = INDEX_MAGIC
            # from byte 0: the header's block is collapsed too (no reader uses the file yet)
            self._f.backer.add(("idx", gen), path, buf, 0)
            self._f.backer.want(("idx", gen), nbytes if back else 0, nbytes)
        except BaseException:  # created here (O_EXCL), maybe before its magic: remove it
            self._f.backer.drop(("idx", gen))
            self._indexes.pop(gen, None)
            self._f.gens.discard(gen)
            path.unlink(missing_ok=True)
            raise
        return buf[HEADER_BYTES:].view(np.int64).reshape(buckets, 2)

    def back_index(self, gen: int, start: int, stop: int) -> None:
        """Bytes ``[start, stop)`` of the buckets of index ``gen`` (not published yet)
        allocated, and the rest of the 2 MiB blocks they touch, collapsed into huge pages
        (:mod:`consumers.serving.hugemap`): waits for the backer while it is behind."""
        end = -(-(HEADER_BYTES + stop) // hugemap.BLOCK) * hugemap.BLOCK
        self._f.backer.want(("idx", gen), min(self._indexes[gen].nbytes, end), 0)

    def drop_index(self, gen: int) -> None:
        """Remove the index file of generation ``gen`` (readers that mapped it keep it)."""
        self._indexes.pop(gen, None)
        self._f.backer.drop(("idx", gen))
        if gen in self._f.gens:
            self._f.gens.discard(gen)
            _remove_ours([index_file(self.location, self._f.inc, gen)])

    def ensure_rows(self, slots: int) -> None:
        """Back rows ``[0, slots)`` with allocated pages (waiting for the backer while it is
        behind), and have the backer go on ahead of them: a full /dev/shm raises OSError
        here instead of SIGBUS on the write."""
        need = HEADER_BYTES + slots * self._row_bytes
        ahead = min(_AHEAD_MAX, max(hugemap.BLOCK, need // 4))
        if need <= self._backed and need + ahead <= self._asked:
            return  # (asked is block-aligned: a new ask about once per 2 MiB block)
        # to a 2 MiB boundary: every block but the first is collapsed into a huge page
        # before any row in it is written (hugemap)
        self._asked = min(self._buf.nbytes,
                          -(-(need + ahead) // hugemap.BLOCK) * hugemap.BLOCK)
        self._backed = self._f.backer.want("rows", need, self._asked)

    def resized(self, slots: int) -> SharedStorage:
        """A new incarnation with ``slots`` row slots (a regrow), holding this one's lock."""
        name = bytes(self.hdr.view(np.uint8)[NAME_OFFSET: NAME_OFFSET + int(
            self.hdr[H_NAME_LEN])]).decode()
        dtype = "f16" if self.rows.dtype == np.float16 else "f32"
        out = SharedStorage.create(self.state_dir, name, self.rows.shape[1], dtype, slots,
                                   slots, lock_fd=self._f.lock_fd,
                                   shm_dir=self.shm_dir)
        self._f.lock_fd = None
        out.publish()  # the caller copies the contents first: see TableCore.restorage
        return out

    def publish(self) -> None:
        """Point readers at this incarnation; retire the previous one (mark superseded so
        its readers reopen, remove its files)."""
        prev = read_current(self.location)
        tmp = self.location / f"current.tmp-{os.getpid()}"
        tmp.unlink(missing_ok=True)  # ours: the lock is held
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     self._f.access.file_mode)
        try:
            fix_file(tmp, fd, self._f.access.file_mode, self._f.access.gid)
            os.write(fd, (self._f.inc + "\n").encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.location / "current")
        if prev is not None and prev != self._f.inc:
            _supersede(self.location, prev)

    def close(self) -> None:
        """Mark closed for readers, remove this incarnation's files, release the lock."""
        if not self._f.closed:
            self.hdr[H_STATE] = STATE_CLOSED
            self._final()  # runs files.cleanup once


def _lock(location: Path) -> int:
    """flock ``location/lock`` (the one writer of this table); ConsumerError if held."""
    path = location / "lock"
    for _ in range(100):
        try:  # 0600 and ours: nobody else can open it, so nobody else can hold it
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW |
                         getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            raise ConsumerError(f"{path}: cannot open the table's writer lock: {e}") from e
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise ConsumerError(f"{path}: the table's lock file belongs to uid {st.st_uid}; "
                                "remove it")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)  # written by an older version
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            break
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # its holder removed it on close: lock the new one
    else:
        raise ConsumerError(f"{path}: cannot take the table's writer lock")
    inc = read_current(location)
    pid = None
    if inc is not None:
        try:
            pid = int(header_array(map_file(rows_file(location, inc), writable=False))[H_PID])
        except (OSError, ValueError):
            pass
    raise ConsumerError(f"{location}: this table is already shared by another live process "
                        f"(pid {pid}); one writer per table and state dir")


def _supersede(location: Path, inc: str) -> None:
    """Tell readers of incarnation ``inc`` to reopen, then remove its files."""
    path = rows_file(location, inc)
    if _is_ours(path):
        try:
            header_array(map_file(path))[H_STATE] = STATE_SUPERSEDED
        except OSError as e:
            log.warning("cannot mark %s superseded: %s", path, e)
    _remove_ours([p for p in location.iterdir() if p.name.startswith(inc + ".")])


def _remove_stale(location: Path) -> None:
    """Files of incarnations whose writer is gone (we hold the lock), except the one
    ``current`` names: readers keep reading it until the new one is published."""
    keep = read_current(location)
    stale = [p for p in location.iterdir()
             if _FILE_RE.match(p.name) and p.name[:16] != keep]
    if stale:
        log.info("%s: removing %d files of earlier writers", location, len(stale))
    _remove_ours(stale)
    for p in location.glob("current.tmp-*"):  # a pointer a crashed writer never renamed
        if re.fullmatch(r"current\.tmp-\d+", p.name) and p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)


def remove_tables(state_dir: os.PathLike | str,
                  shm_dir: Optional[os.PathLike | str] = None) -> int:
    """Remove the shared tables of ``state_dir`` that no process writes (a reset: what
    they hold is no longer the state): their files deltastream wrote, marked closed first
    so readers that mapped them know; anything else is left, with its directory. Returns
    the tables removed."""
    root = shm_root(state_dir, shm_dir)
    try:
        dirs = [d for d in root.iterdir() if re.fullmatch(r"[A-Za-z0-9_.-]{1,48}-[0-9a-f]{8}",
                                                          d.name)]
    except OSError:
        return 0
    done = 0
    for d in dirs:
        st = os.lstat(d)
        if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.geteuid():
            continue
        try:
            files = _Files(d, read_current(d) or "0" * 16, access_of(state_dir))
            files.lock_fd = _lock(d)
        except ConsumerError as e:  # a live writer (not this daemon's state any more)
            log.warning("reset: %s", e)
            continue
        if _is_ours(rows_file(d, files.inc)):
            try:
                header_array(map_file(rows_file(d, files.inc)))[H_STATE] = STATE_CLOSED
            except OSError as e:
                log.warning("cannot mark %s closed: %s", rows_file(d, files.inc), e)
        if (d / "current").is_file() and not (d / "current").is_symlink():
            (d / "current").unlink()  # then no incarnation is kept
        _remove_stale(d)
        files.cleanup()  # the lock, and the directories when nothing else is left
        done += 1
    if done:
        log.info("reset: removed the shared files of %d tables of %s", done, state_dir)
    return done


def left_behind(state_dir: os.PathLike | str,
                shm_dir: Optional[os.PathLike | str] = None) -> list[Path]:
    """Table dirs of ``state_dir`` whose ``current`` incarnation a writer left behind
    without stopping cleanly (killed): readers may still serve it, and its state may be
    newer than the writer's last checkpoint."""
    root = shm_root(state_dir, shm_dir)
    try:
        dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.is_symlink())
    except OSError:
        return []
    out = []
    for d in dirs:
        inc = read_current(d)
        if inc is not None and _is_ours(rows_file(d, inc)):
            out.append(d)
    return out
