"""Memory of a serving table: reserved regions, shared-memory files, the table header.

Why reserve: a table that grows must never copy its rows (a 10M × 64 table is 2.6 GB; the
copy would stall every reader and the writer). Rows live in one region reserved once for
up to :data:`RESERVE_BYTES` of virtual address space; the kernel commits pages only when
they are first written, so the reservation costs no memory, and rows never move.

* private tables: anonymous ``MAP_NORESERVE`` mappings (``MADV_HUGEPAGE`` where the host
  allows it: a random row gather then misses the TLB far less);
* shared tables: a file under ``/dev/shm`` mapped ``MAP_SHARED`` at a 2 MiB-aligned address
  (sparse: ``ftruncate`` to the reserved size, pages allocated as rows are written — ahead
  of the writer with ``posix_fallocate``, on a thread of its own (:mod:`.backer`), so a
  full tmpfs raises ``OSError`` instead of ``SIGBUS`` — and collapsed into huge pages
  where the kernel can: :mod:`.hugemap`).

Every table carries a 4 KiB header of int64 words (private tables in a small array, shared
ones at the start of their rows file) — the :data:`H_*` indices below. Readers of another
process find everything there: the layout, the publish counters of the seqlock
(``H_SEQ``/``H_PREP``, see :mod:`consumers.serving.core`), the current index generation and
per value copy the metadata of the state it holds (``H_META``).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from consumers.errors import ConsumerError
from consumers.serving import hugemap
from consumers.serving.access import check_fd, fix_file

__all__ = [
    "PAGE", "HEADER_BYTES", "RESERVE_BYTES", "MAGIC", "INDEX_MAGIC", "LAYOUT",
    "H_MAGIC", "H_LAYOUT", "H_DIM", "H_DTYPE", "H_ROWCAP", "H_INCARNATION", "H_PID",
    "H_CREATED_NS", "H_STATE", "H_NAME_LEN", "H_VERSION_BASE", "H_SEQ", "H_PREP", "H_IDX_GEN", "H_META",
    "M_LIVE", "M_APPLIED_NS", "M_SOURCE_NS", "M_HWM", "M_BATCHES", "NAME_OFFSET",
    "MAX_NAME_BYTES", "STATE_LIVE", "STATE_CLOSED", "STATE_SUPERSEDED", "DTYPE_CODES",
    "reserve", "reserve_array", "reservation_slots", "map_file", "header_array",
    "meta_word", "PrivateStorage",
]

log = logging.getLogger(__name__)

PAGE = 4096
_HUGE = 2 << 20
#: virtual address space reserved for the rows of one table (not memory: pages are
#: committed when written). Beyond it a table regrows by copying (logged; rare).
RESERVE_BYTES = 64 << 30
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux")
                         else 0)

HEADER_BYTES = PAGE
MAGIC = int.from_bytes(b"DSTABLE1", "little")
INDEX_MAGIC = int.from_bytes(b"DSINDEX1", "little")
LAYOUT = 1

H_MAGIC, H_LAYOUT, H_DIM, H_DTYPE, H_ROWCAP = 0, 1, 2, 3, 4
H_INCARNATION, H_PID, H_CREATED_NS, H_STATE, H_NAME_LEN = 5, 6, 7, 8, 9
# Added to H_SEQ to give readers a version that never goes back across daemon runs: the
# wall clock in µs when a daemon first shared the table (0 for a private table).
H_VERSION_BASE = 10
H_SEQ, H_PREP, H_IDX_GEN = 16, 17, 18  # own cache line: written on every publish
H_META = 24  # per value copy c: words H_META + 8 c + M_*
M_LIVE, M_APPLIED_NS, M_SOURCE_NS, M_HWM, M_BATCHES = 0, 1, 2, 3, 4
NAME_OFFSET = 512  # bytes: the table name, utf-8
MAX_NAME_BYTES = 1024

STATE_LIVE, STATE_CLOSED, STATE_SUPERSEDED = 1, 2, 3
DTYPE_CODES = {"f32": 0, "f16": 1}


def meta_word(copy: int, field: int) -> int:
    """Header word of metadata ``field`` (``M_*``) of value copy ``copy``."""
    return H_META + 8 * copy + field


def reserve(nbytes: int, *, huge: bool = False) -> np.ndarray:
    """A zeroed ``uint8 [nbytes]`` array over a fresh anonymous mapping that commits
    memory only where written. ``huge``: 2 MiB aligned and advised for transparent huge
    pages. The mapping is released when the last array referring to it is freed."""
    size = max(PAGE, int(nbytes)) + (_HUGE if huge else 0)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE,
                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # not supported here: 4 KiB pages
            pass
    a = np.frombuffer(m, np.uint8)
    off = (-a.ctypes.data) % _HUGE if huge else 0
    return a[off: off + max(PAGE, int(nbytes))][: int(nbytes)]


def reserve_array(count: int, dtype: np.dtype | type, *, huge: bool = False) -> np.ndarray:
    """A zeroed 1-D array of ``count`` items in reserved memory (see :func:`reserve`)."""
    dt = np.dtype(dtype)
    return reserve(count * dt.itemsize, huge=huge).view(dt)


def reservation_slots(row_bytes: int, capacity: int) -> int:
    """Row slots to reserve for rows of ``row_bytes``: :data:`RESERVE_BYTES` worth (at most
    2^31 - 1, the int32 slot range), never fewer than ``capacity + 1``."""
    return int(min((1 << 31) - 1, max(capacity + 1, RESERVE_BYTES // max(1, row_bytes))))


def map_file(path: Path, nbytes: int | None = None, *, create: bool = False,
             writable: bool = True, mode: int = 0o600, gid: Optional[int] = None,
             writers: Optional[frozenset[int]] = None) -> np.ndarray:
    """``uint8`` array over a ``MAP_SHARED`` mapping of file ``path`` (never through a link).

    ``create``: make the file (it must not exist) with size ``nbytes`` (sparse), ``mode``
    and group ``gid`` (None: the process's). Else map it whole. ``writers``: refuse (``ConsumerError`` naming the path)
    a file not owned by one of these uids or writable by group/other
    (:func:`~consumers.serving.access.check_fd`). The file descriptor is closed; the
    mapping stays until the array and its views are freed.
    """
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConsumerError(f"{path}: is a symbolic link; a shared table file must be "
                                "a plain file (another user may have planted it)") from e
        raise
    try:
        if writers is not None:
            check_fd(path, fd, writers)
        if create:
            fix_file(path, fd, mode, os.fstat(fd).st_gid if gid is None else gid)
            os.ftruncate(fd, int(nbytes or 0))
        size = os.fstat(fd).st_size
        if size == 0:
            raise OSError(f"{path}: empty file")
        return hugemap.map_file(fd, size, writable)  # 2 MiB-aligned: see hugemap
    finally:
        os.close(fd)


def header_array(buf: np.ndarray) -> np.ndarray:
    """The int64 header words at the start of ``buf`` (``uint8``, ≥ one page)."""
    return buf[:HEADER_BYTES].view(np.int64)


class PrivateStorage:
    """Memory of a table that only its own process reads: a header array, reserved rows
    (huge pages advised) and private index arrays.

    Args:
        dim, dtype: row width and storage dtype name (``"f32"``/``"f16"``).
        slots: row slots to reserve (shrunk, halving, when the host refuses the address
            space; see :func:`reservation_slots`).
        need: slots that must fit at least.
    """

    shared = False
    location = None

    def __init__(self, dim: int, dtype: np.dtype, slots: int, need: int = 1) -> None:
        self.hdr = np.zeros(HEADER_BYTES // 8, np.int64)
        row_bytes = dim * dtype.itemsize
        while True:
            try:
                buf = reserve(slots * row_bytes, huge=True)
                break
            except (OSError, ValueError, OverflowError):
                if slots // 2 < need:
                    raise
                slots //= 2  # the host limits address space (ulimit -v, overcommit=2)
        self.cap = slots
        self.rows = buf.view(dtype).reshape(slots, dim)
        self._tabs: dict[int, np.ndarray] = {}

    def new_index(self, gen: int, buckets: int, *, back: bool = False) -> np.ndarray:
        """Zeroed ``int64 [buckets, 2]`` for index generation ``gen`` (committed as written,
        or ahead with :meth:`back_index`; ``back`` is for shared storage)."""
        tab = reserve(buckets * 16, huge=buckets >= 1 << 16).view(np.int64).reshape(
            buckets, 2)
        self._tabs[gen] = tab
        return tab

    def back_index(self, gen: int, start: int, stop: int) -> None:
        """Fault in the pages of bytes ``[start, stop)`` of index ``gen`` now (one write per
        page), rather than all at once when a migration writes everywhere."""
        self._tabs[gen].reshape(-1).view(np.uint8)[start:stop:PAGE] = 0

    def drop_index(self, gen: int) -> None:
        """Index generation ``gen`` is retired (its memory goes with its last reader)."""
        self._tabs.pop(gen, None)

    def ensure_rows(self, slots: int) -> None:
        """Rows ``[0, slots)`` will be written (private memory: committed on write)."""

    def resized(self, slots: int) -> PrivateStorage:
        """A new, empty private storage of ``slots`` row slots (same row layout)."""
        return PrivateStorage(self.rows.shape[1], self.rows.dtype, slots, slots)
