"""TableReader: read a serving table that another process (the sync daemon) writes.

A model server runs several worker processes; each opens the daemon's tables by state dir
and table name and looks rows up in the daemon's shared memory, without a copy and without
a lock (numpy only — no torch, no Kafka client)::

    from consumers.serving import TableReader

    emb = TableReader.open("/var/lib/deltastream/ranker", "user", timeout=30)
    rows = emb.lookup(ids)               # float32 [len(ids), dim]; unknown ids -> zeros
    rows, info = emb.read(ids, out=buf)  # + what was read: info.version, info.applied_at,
                                         #   info.freshness_s (trainer ts of the newest rows)

Every lookup reads one published state of the table (never a torn row, never half a
batch): it retries when the writer overtook it, it never waits for the writer (see
:mod:`consumers.serving.core`). The daemon must share its tables
(``SyncDaemon(share_tables=True)``, ``deltastream-sync --share-tables``, or
:meth:`ServingTable.share`).

Restarts: a daemon that restarts writes a new incarnation of the table and marks the old
one superseded; a daemon that stops marks it closed; a reader then switches to the
current incarnation on its next lookup (it checks the ``current`` pointer at most every
:data:`RECHECK_S` seconds otherwise, which also catches a daemon killed with SIGKILL and
restarted). Until a new incarnation exists the reader keeps serving the last state it has
— complete and consistent, as every publish is a single store — and :meth:`info` says the
writer is gone.

One reader object per thread (a lookup updates the reader's mappings); open as many as
needed, they share the memory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import numpy as np

from consumers.errors import ConsumerError
from consumers.sched_policy import set_thread_policy, thread_policy
from consumers.serving import accel, hugemap
from consumers.serving.access import check_dir, writers_of
from consumers.serving.id_index import as_ids
from consumers.serving.lookup import read_rows
from consumers.serving.memory import (
    DTYPE_CODES,
    H_DIM,
    H_DTYPE,
    H_IDX_GEN,
    H_INCARNATION,
    H_LAYOUT,
    H_MAGIC,
    H_NAME_LEN,
    H_PID,
    H_PREP,
    H_ROWCAP,
    H_SEQ,
    H_STATE,
    H_VERSION_BASE,
    HEADER_BYTES,
    INDEX_MAGIC,
    LAYOUT,
    M_APPLIED_NS,
    M_LIVE,
    M_SOURCE_NS,
    MAGIC,
    NAME_OFFSET,
    PAGE,
    STATE_CLOSED,
    STATE_LIVE,
    STATE_SUPERSEDED,
    header_array,
    map_file,
    meta_word,
)
from consumers.serving.shm import (
    SHM_ENV,
    index_file,
    planted_root,
    read_current,
    rows_file,
    table_dir,
)
from consumers.serving.stop_mark import STOP_GRACE_S, stopped_at

__all__ = ["TableReader", "ReadInfo", "open_table", "RECHECK_S"]

log = logging.getLogger(__name__)

#: seconds between checks of the ``current`` pointer while the writer looks alive
RECHECK_S = 0.2
#: seconds between looks of the warmer thread for pages to map (see :class:`_Warmer`)
WARM_S = 0.005
#: seconds the warmer's C loop follows the rows file before it looks at Python's side again
FOLLOW_S = 0.05
_WARM_BYTES = 8 << 20  # warmed per look at most
#: niceness the warmer thread adds to itself: lookups preempt it
WARM_NICE = 10
_DTYPES = {code: np.dtype({"f32": "<f4", "f16": "<f2"}[name])
           for name, code in DTYPE_CODES.items()}
_STATES = {STATE_LIVE: "live", STATE_CLOSED: "closed", STATE_SUPERSEDED: "superseded"}


@dataclass(frozen=True)
class ReadInfo:
    """What a read saw.

    Attributes:
        version: version of the published state read: one more per apply, and never
            lower than a version an earlier daemon run published (a shared table's
            versions start at the wall clock in µs when its daemon first shared it).
        incarnation: id of the writer's incarnation (changes when the daemon restarts).
        rows: ids present in that state.
        applied_at: unix time (s) that state was published; None before the first apply.
        source_ts: trainer wall clock (unix s) of the newest batch applied so far; None
            when unknown.
        writer: ``"live"``, ``"closed"`` (stopped cleanly), ``"superseded"`` (a newer
            incarnation exists) or ``"dead"`` (:meth:`TableReader.info` only: the writing
            process is gone).
    """

    version: int
    incarnation: str
    rows: int
    applied_at: Optional[float]
    source_ts: Optional[float]
    writer: str

    @property
    def age_s(self) -> Optional[float]:
        """Seconds since that state was published (None before the first apply)."""
        return None if self.applied_at is None else max(0.0, time.time() - self.applied_at)

    @property
    def freshness_s(self) -> Optional[float]:
        """Seconds between the trainer reading the newest rows applied and now (None when
        unknown): how stale the served model is."""
        return None if self.source_ts is None else max(0.0, time.time() - self.source_ts)


class _Mapped:
    """One incarnation's mappings: header, rows, and the index generations in use."""

    def __init__(self, dir: Path, inc: str, name: str, writers: frozenset[int]) -> None:
        self.writers = writers  # uids trusted to have written the files
        buf = map_file(rows_file(dir, inc), writable=False, writers=writers)
        hdr = header_array(buf)
        if int(hdr[H_MAGIC]) != MAGIC or int(hdr[H_LAYOUT]) != LAYOUT \
                or f"{int(hdr[H_INCARNATION]):016x}" != inc:
            raise ConsumerError(f"{rows_file(dir, inc)}: not a deltastream table of layout "
                                f"{LAYOUT} (magic, layout or incarnation differ)")
        got = bytes(buf[NAME_OFFSET: NAME_OFFSET + int(hdr[H_NAME_LEN])]).decode(
            errors="replace")
        if got != name:
            raise ConsumerError(f"{rows_file(dir, inc)}: holds table {got!r}, not {name!r}")
        self.dir, self.inc, self.hdr, self.buf = dir, inc, hdr, buf
        self.dim, self.dtype = int(hdr[H_DIM]), _DTYPES[int(hdr[H_DTYPE])]
        cap = int(hdr[H_ROWCAP])
        self.rows = buf[HEADER_BYTES: HEADER_BYTES + cap * self.dim * self.dtype.itemsize
                        ].view(self.dtype).reshape(cap, self.dim)
        self.tabs: dict[int, np.ndarray] = {}  # index generation -> buckets (mapped)
        for _ in range(100):  # map the current index now: a reader always holds one
            if self.tab_of(int(hdr[H_IDX_GEN])) is not None:
                break
        else:
            raise FileNotFoundError(f"{dir}: the index of incarnation {inc} is gone")

    def tab_of(self, gen: int) -> Optional[np.ndarray]:
        """The buckets of index generation ``gen`` (mapped on first use); None when its
        file is gone (the writer moved on: read the header again). Safe from the reader's
        warmer thread too (dict operations are atomic)."""
        tab = self.tabs.get(gen)
        if tab is not None:
            return tab
        path = index_file(self.dir, self.inc, gen)
        try:
            buf = map_file(path, writable=False, writers=self.writers)
        except FileNotFoundError:
            return None
        h = header_array(buf)
        if int(h[0]) != INDEX_MAGIC or int(h[1]) != gen:
            raise ConsumerError(f"{path}: not index generation {gen} of a deltastream table")
        buckets = int(h[2])
        tab = buf[HEADER_BYTES: HEADER_BYTES + buckets * 16].view(np.int64).reshape(buckets, 2)
        self.tabs[gen] = tab
        return tab

    def prune(self, gen: int) -> None:
        """Unmap index generations before ``gen`` (from the warmer thread: an unmap of a
        big mapping takes milliseconds, which no lookup should wait for)."""
        for old in [g for g in list(self.tabs) if g < gen]:
            self.tabs.pop(old, None)


class _Warmer(threading.Thread):
    """Maps the pages a reader will need before a lookup needs them.

    A lookup that touches a page of the shared table for the first time takes a page
    fault (tens of microseconds each on some hosts, hundreds per lookup right after the
    table grew or its index migrated). This thread reads one byte per page of what the
    writer has allocated: rows as the table grows, and the next index generation as soon
    as its file is complete — before the writer switches to it. It also unmaps retired
    index generations (milliseconds for a big one: not in a lookup).

    It must not hold the GIL for long, nor often: it runs niced, and a warmer preempted
    while it holds the GIL keeps the lookups of its process waiting until it runs again.
    With the C extension it follows the rows file in one call that releases the GIL
    (:func:`native.warm_follow`) and comes back to Python only for the index (a new
    generation to map, or to unmap) and every :data:`FOLLOW_S`; without it, it looks from
    Python every :data:`WARM_S` (every millisecond while the table grows).
    """

    def __init__(self, reader: TableReader) -> None:
        super().__init__(name=f"warm {reader.name}", daemon=True)
        self._reader = weakref.ref(reader)
        self._done: dict[tuple[str, str], int] = {}  # (incarnation, what) -> bytes warmed
        nat = accel.native
        self._follow = getattr(nat, "warm_follow", None) if accel.native_enabled() else None

    def run(self) -> None:
        _lower_priority(WARM_NICE)
        while True:
            r = self._reader()
            if r is None or r._m is None:
                return
            m = r._m
            del r
            try:
                busy = self._warm(m)
                if not busy and self._follow is not None:
                    if self._follow_rows(m) != "next":
                        continue  # it followed the rows until something changed: look now
                    busy = True  # the next index generation is complete: warm it
            except (OSError, ValueError, ConsumerError) as e:
                log.debug("warming %s: %s", m.dir, e)
                busy = False
            time.sleep(0.001 if busy else WARM_S)

    def _warm(self, m: _Mapped) -> bool:
        """Warm up to :data:`_WARM_BYTES` more (the rows only without the C loop); True
        when there is more to do now."""
        budget = _WARM_BYTES
        if self._follow is None:
            st = os.stat(rows_file(m.dir, m.inc))  # the writer allocates rows from the front
            allocated = min(st.st_blocks * 512, st.st_size)
            allocated -= allocated % hugemap.BLOCK  # see native_warm.c: whole blocks only
            budget -= self._touch(m.inc, "rows", m.buf, allocated, budget)
        gen = int(m.hdr[H_IDX_GEN])
        m.prune(gen - 1)
        for g in (gen, gen + 1):
            path = index_file(m.dir, m.inc, g)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                if g > gen:  # a migration the writer abandoned: let its memory go
                    m.tabs.pop(g, None)
                continue
            if st.st_blocks * 512 < st.st_size:
                continue  # still being allocated by the writer: not yet
            tab = m.tab_of(g)
            if tab is not None and budget > 0:
                budget -= self._touch(m.inc, f"idx-{g}", tab.reshape(-1).view(np.uint8),
                                      tab.nbytes, budget)
        return budget <= 0

    def _follow_rows(self, m: _Mapped) -> str:
        """Warm the rows as the writer allocates them, without the GIL, until the index
        generation changes (returns ``"gen"``), the next one is complete and not warmed
        yet (``"next"``) or :data:`FOLLOW_S` passed (``"timeout"``)."""
        gen = int(m.hdr[H_IDX_GEN])
        tab = m.tabs.get(gen + 1)
        warmed = tab is not None and self._done.get((m.inc, f"idx-{gen + 1}"), 0) >= tab.nbytes
        key = (m.inc, "rows")
        assert self._follow is not None
        done, why = self._follow(m.buf, rows_file(m.dir, m.inc),
                                 None if warmed else index_file(m.dir, m.inc, gen + 1),
                                 m.hdr, H_IDX_GEN, gen, self._done.get(key, 0), PAGE,
                                 hugemap.BLOCK, _WARM_BYTES, FOLLOW_S, 0.001, WARM_S)
        self._done[key] = done
        if why == "gone":
            raise FileNotFoundError(f"{rows_file(m.dir, m.inc)}: gone")
        return why

    def _touch(self, inc: str, what: str, buf: np.ndarray, upto: int, budget: int) -> int:
        key = (inc, what)
        start = self._done.get(key, 0)
        stop = min(upto, start + max(0, budget))
        if stop > start:
            buf[start:stop:PAGE].max()  # one read per page; numpy drops the GIL meanwhile
            self._done[key] = stop
        return stop - start


class TableReader:
    """Read-only access to a table shared by its writer process; see the module docstring.

    Use :meth:`open`.
    """

    def __init__(self, state_dir: Path, name: str, dir: Path, m: _Mapped) -> None:
        self.state_dir, self.name, self._dir, self._m = state_dir, name, dir, m
        self._writers = m.writers
        self._checked = time.monotonic()
        self._pointer = _stat_key(dir / "current")
        _Warmer(self).start()

    @classmethod
    def open(cls, state_dir: os.PathLike | str, table: str, *, timeout: float = 0.0,
             shm_dir: Optional[os.PathLike | str] = None) -> TableReader:
        """Open table ``table`` shared by the writer of ``state_dir``; wait up to
        ``timeout`` s for it to appear. ``shm_dir``: the one the writer was given (default:
        ``$DELTASTREAM_SHM_DIR``, else ``/dev/shm``). Raises
        :class:`~consumers.errors.ConsumerError` when no writer shares it there."""
        if not isinstance(table, str) or not table:
            raise ValueError(f"table: expected a non-empty str, got {table!r}")
        t0 = time.monotonic()
        deadline = t0 + max(0.0, float(timeout))
        while True:
            dir = table_dir(state_dir, table, shm_dir)  # where the writer would share it
            try:
                writers = writers_of(state_dir)
            except FileNotFoundError:  # no state dir (yet)
                writers = frozenset()
            inc = _trusted_current(dir, writers) if writers else None
            if inc is not None:
                try:
                    return cls(Path(state_dir), table, dir, _Mapped(dir, inc, table, writers))
                except FileNotFoundError:
                    pass  # replaced between reading the pointer and mapping: again
            stopped = stopped_at(state_dir, writers) if inc is None and writers else None
            # a daemon being started clears the mark within the grace: wait for it then
            if stopped is not None and time.monotonic() >= min(deadline, t0 + STOP_GRACE_S):
                when = datetime.fromtimestamp(stopped).isoformat(" ", "seconds")
                raise ConsumerError(
                    f"no shared table {table!r} for state dir {state_dir}: its daemon stopped "
                    f"cleanly at {when} (a clean stop removes the shared tables; readers "
                    "opened before keep its last rows); start it again to share them")
            if time.monotonic() >= deadline:
                planted = planted_root(state_dir, shm_dir)
                raise ConsumerError(f"no shared table {table!r} for state dir {state_dir} "
                                    f"(looked in {dir}); is its daemon running with "
                                    "share_tables / --share-tables, and given the same "
                                    f"shm dir (shm_dir / --shm-dir / {SHM_ENV})?" +
                                    (f" Refused {planted}" if planted else ""))
            time.sleep(0.05)

    @property
    def dim(self) -> int:
        """Row width."""
        return self._m.dim

    @property
    def dtype(self) -> str:
        """Storage dtype of the rows (lookups return float32 either way)."""
        return "f16" if self._m.dtype == np.float16 else "f32"

    @property
    def incarnation(self) -> str:
        """The writer incarnation this reader maps."""
        return self._m.inc

    def lookup(self, ids: Any, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Rows of ``ids`` (int64 ``[N]``) as float32 ``[N, dim]``; zeros for unknown ids.
        ``out``: a C-contiguous float32 ``[N, dim]`` array to fill."""
        return self._read(ids, out)[0]

    def read(self, ids: Any, out: Optional[np.ndarray] = None) -> tuple[np.ndarray, ReadInfo]:
        """Like :meth:`lookup`, plus :class:`ReadInfo` of the state read."""
        while True:
            rows, m, s = self._read(ids, out)
            info = _info(m, s, _STATES.get(int(m.hdr[H_STATE]), "unknown"))
            if info is not None:  # else the writer moved two states on meanwhile: again
                return rows, info

    def info(self) -> ReadInfo:
        """The state the next read would see (``writer`` also says ``"dead"`` when the
        writing process is gone)."""
        self._maybe_reopen()
        m = self._m
        state = _STATES.get(int(m.hdr[H_STATE]), "unknown")
        if state == "live" and not _alive(int(m.hdr[H_PID])):
            state = "dead"
        while True:
            info = _info(m, int(m.hdr[H_SEQ]), state)
            if info is not None:
                return info

    def __len__(self) -> int:
        return self.info().rows

    def refresh(self) -> bool:
        """Switch to the current incarnation now if there is a newer one; True if it did."""
        self._checked = time.monotonic()
        self._pointer = _stat_key(self._dir / "current")
        try:
            inc = _trusted_current(self._dir, self._writers)
        except ConsumerError as e:  # planted meanwhile: keep serving what we have
            log.error("table %s: %s", self.name, e)
            return False
        if inc is None or inc == self._m.inc:
            return False
        try:
            self._m = _Mapped(self._dir, inc, self.name, self._writers)
        except (OSError, ConsumerError) as e:  # mid-replacement: keep what we have
            log.debug("table %s: cannot map incarnation %s yet: %s", self.name, inc, e)
            return False
        log.info("table %s: reading incarnation %s", self.name, inc)
        return True

    def close(self) -> None:
        """Drop the mappings (they also go when the reader is garbage-collected)."""
        self._m = None  # type: ignore[assignment]

    def __enter__(self) -> TableReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TableReader({self.name!r}, state_dir={str(self.state_dir)!r}, " \
               f"incarnation={self._m.inc if self._m else None})"

    # ------------------------------------------------------------------ internals

    def _maybe_reopen(self) -> None:
        m = self._m
        if m is None:
            raise ConsumerError(f"table {self.name!r}: the reader is closed")
        now = time.monotonic()
        if int(m.hdr[H_STATE]) != STATE_LIVE or now - self._checked >= RECHECK_S:
            self._checked = now
            key = _stat_key(self._dir / "current")
            if key != self._pointer or int(m.hdr[H_STATE]) != STATE_LIVE:
                self.refresh()

    def _read(self, ids: Any, out: Optional[np.ndarray]) -> tuple[np.ndarray, _Mapped, int]:
        keys = as_ids(ids)
        self._maybe_reopen()
        m = self._m
        if out is None:
            out = np.empty((keys.shape[0], m.dim), np.float32)
        elif not isinstance(out, np.ndarray):
            raise TypeError(f"out: expected a writable C-contiguous float32 numpy array of "
                            f"shape [{keys.shape[0]}, {m.dim}], got {type(out).__name__}")
        elif out.dtype != np.float32 or out.shape != (keys.shape[0], m.dim) \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out: expected a writable C-contiguous float32 array of shape "
                             f"[{keys.shape[0]}, {m.dim}], got {out.dtype} {out.shape}")
        tries = 0
        while True:
            hdr = m.hdr
            s = int(hdr[H_SEQ])
            gen = int(hdr[H_IDX_GEN])  # read after H_SEQ: the index of state s or newer
            tab = m.tab_of(gen)
            if tab is None:  # its file is gone: the writer moved on or went away
                if int(hdr[H_STATE]) != STATE_LIVE or tries > 1000:
                    if self.refresh():
                        m = self._m
                        continue
                    raise ConsumerError(
                        f"table {self.name!r}: index generation {gen} of incarnation "
                        f"{m.inc} is gone and no writer shares the table now")
            elif read_rows(hdr, tab, m.rows, s, keys, out):
                return out, m, s
            tries += 1  # overtaken by the writer (or its index moved on): again
            if tries > 32:
                time.sleep(min(0.001, 1e-5 * tries))


def open_table(state_dir: os.PathLike | str, table: str, *, timeout: float = 0.0
               ) -> TableReader:
    """:meth:`TableReader.open`."""
    return TableReader.open(state_dir, table, timeout=timeout)


def _trusted_current(dir: Path, writers: frozenset[int]) -> Optional[str]:
    """The incarnation the ``current`` pointer of table dir ``dir`` names (None when
    there is none yet), after checking that the shm dirs on the way and the pointer were
    written by one of ``writers`` (``ConsumerError`` naming the path otherwise)."""
    try:
        check_dir(dir.parent, writers)
        check_dir(dir, writers)
    except FileNotFoundError:
        return None
    return read_current(dir, writers)


def _info(m: _Mapped, s: int, writer: str) -> Optional[ReadInfo]:
    """The metadata of published state ``s`` (None when the writer already reuses the
    value copy of ``s``: read again)."""
    hdr, c = m.hdr, s & 1
    applied = int(hdr[meta_word(c, M_APPLIED_NS)])
    src = int(hdr[meta_word(c, M_SOURCE_NS)])
    live = int(hdr[meta_word(c, M_LIVE)])
    if int(hdr[H_PREP]) > s + 1:
        return None
    return ReadInfo(version=int(hdr[H_VERSION_BASE]) + s, incarnation=m.inc, rows=live,
                    applied_at=applied / 1e9 if applied else None,
                    source_ts=src / 1e9 if src else None, writer=writer)


def _lower_priority(nice: int) -> None:
    """Lower the CPU priority of the calling thread only (Linux: a thread is a task): the
    ordinary policy — a thread inherits its starter's, and a real-time warmer would keep
    ordinary threads off its CPU for :data:`FOLLOW_S` at a time — and ``nice`` more."""
    try:
        if thread_policy().name in ("fifo", "rr"):
            set_thread_policy("other")
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError, ValueError):  # not Linux, or not allowed: as it is
        pass


def _stat_key(path: Path) -> Optional[tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
