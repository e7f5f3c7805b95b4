"""The read path of a serving table: probe the id index and gather rows, native or numpy.

The C extension :mod:`consumers.serving.native` (:mod:`consumers.serving.accel` says whether
it runs) does both in one call with software prefetching: a 256-id lookup of random ids is
a chain of cache and TLB misses, which numpy's one-pass-per-operation code takes one after
another. Without the extension (or with ``DELTASTREAM_NATIVE=0`` in the environment, or
after :func:`use_native(False) <use_native>`), the numpy code of :mod:`consumers.serving.id_index`
runs; both give the same results.

Both follow the seqlock protocol of :mod:`consumers.serving.core`: :func:`read_rows` says
whether the read is valid, and the caller retries when it is not.

Big requests (≥ :data:`NOGIL_IDS` ids) release the GIL while the C loop runs, so reader
threads and the daemon's thread overlap. Small ones keep it: a 256-id lookup takes
microseconds, while taking the GIL back after releasing it can wait for another thread's
whole switch interval (5 ms by default). Bulk requests (≥ :data:`SPLIT_IDS` ids) are split
into :func:`bulk_threads` parts gathered at once by a small pool of threads: one core's
gather is bound by memory latency, not bandwidth. Each part checks the seqlock after its own
copy, so the read is valid only when every part is.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from consumers.errors import ConsumerError
from consumers.serving.accel import NATIVE_AVAILABLE, native, native_enabled, use_native
from consumers.serving.id_index import lookup_slots as numpy_lookup_slots
from consumers.serving.memory import H_PREP

__all__ = ["NATIVE_AVAILABLE", "NOGIL_IDS", "SPLIT_IDS", "bulk_threads", "lookup_slots",
           "native_enabled", "read_rows", "use_native"]

#: requests of at least this many ids release the GIL in the native path
NOGIL_IDS = 4096
#: native requests of at least this many ids are gathered by several threads at once
SPLIT_IDS = 1 << 18
_MAX_THREADS = 4

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()
_threads = min(_MAX_THREADS, len(os.sched_getaffinity(0)))


def bulk_threads(n: int | None = None) -> int:
    """Threads a bulk request (≥ :data:`SPLIT_IDS` ids) is gathered by: the CPUs this
    process may run on, at most 4, unless set with ``n`` (1 turns splitting off; meant for
    hosts where the model server wants its other cores). Returns the value in force."""
    global _threads
    if n is not None:
        if not 1 <= int(n) <= 64:
            raise ValueError(f"n: expected 1..64 threads, got {n}")
        _threads = int(n)
    return _threads


def _split_read(hdr: np.ndarray, tab: np.ndarray, rows: np.ndarray, s: int,
                keys: np.ndarray, out: np.ndarray, parts: int) -> int:
    """:func:`native.read_rows` over ``parts`` contiguous slices, the first in this thread;
    the worst code of the parts (0 overtaken, 2 corrupt, else 1)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool_size < parts - 1:  # (a pool it replaces ends once its threads are idle)
            old, _pool = _pool, ThreadPoolExecutor(parts - 1,
                                                   thread_name_prefix="deltastream-lookup")
            _pool_size = parts - 1
            if old is not None:
                old.shutdown(wait=False)
        pool = _pool
    cut = np.linspace(0, keys.shape[0], parts + 1).astype(np.int64)
    futs = [pool.submit(native.read_rows, hdr, tab, rows, s, keys[a:b], out[a:b], True)
            for a, b in zip(cut[1:-1], cut[2:], strict=True)]
    codes = [native.read_rows(hdr, tab, rows, s, keys[: cut[1]], out[: cut[1]], True)]
    codes += [f.result() for f in futs]
    return 2 if 2 in codes else min(codes)


def lookup_slots(tab: np.ndarray, keys: np.ndarray, col: int) -> np.ndarray:
    """Row slot (int32 ``[n]``, 0 when absent) of each key (contiguous int64 ``[n]``) in
    value copy ``col`` of index buckets ``tab`` (``int64 [B, 2]``); reads only."""
    if not native_enabled():
        return numpy_lookup_slots(tab, keys, col)
    out = np.empty(keys.shape[0], np.int32)
    native.lookup_slots(tab, keys, col, out, keys.shape[0] >= NOGIL_IDS)
    return out


def read_rows(hdr: np.ndarray, tab: np.ndarray, rows: np.ndarray, s: int, keys: np.ndarray,
              out: np.ndarray) -> bool:
    """Gather the rows of ``keys`` (contiguous int64 ``[n]``) in published state ``s`` into
    float32 ``out`` (C-contiguous ``[n, dim]``; zeros for absent ids).

    ``s`` was read from ``hdr[H_SEQ]`` *before* ``tab`` (the index buckets) and ``rows``
    (``[slots, dim]``, float32 or float16) were chosen. True when the read is valid; False
    when the writer overtook it (retry).
    """
    if not native_enabled():
        slots = numpy_lookup_slots(tab, keys, s & 1)
        if rows.dtype == np.float32:
            np.take(rows, slots, axis=0, out=out)
        else:
            out[...] = np.take(rows, slots, axis=0)
        return int(hdr[H_PREP]) <= s + 1
    n = keys.shape[0]
    if n >= SPLIT_IDS and _threads > 1:
        r = _split_read(hdr, tab, rows, s, keys, out, _threads)
    else:
        r = native.read_rows(hdr, tab, rows, s, keys, out, n >= NOGIL_IDS)
    if r == 2:
        raise ConsumerError(f"index of state {s} names a row slot beyond the {rows.shape[0]} "
                            "slots of the table (corrupt memory)")
    return r == 1
