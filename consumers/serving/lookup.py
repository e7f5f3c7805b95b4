"""The read path of a serving table: probe the id index and gather rows, native or numpy.

The C extension :mod:`consumers.serving.native` (built at install when a C compiler is
there, see ``setup.py``) does both in one call with software prefetching: a 256-id lookup
of random ids is a chain of cache and TLB misses, which numpy's one-pass-per-operation
code takes one after another. Without the extension (or with ``DELTASTREAM_NATIVE=0`` in
the environment, or after :func:`use_native(False) <use_native>`), the numpy code of
:mod:`consumers.id_index` runs; both give the same results.

Both follow the seqlock protocol of :mod:`consumers.serving.core`: :func:`read_rows` says
whether the read is valid, and the caller retries when it is not.

Big requests (≥ :data:`NOGIL_IDS` ids) release the GIL while the C loop runs, so reader
threads and the daemon's thread overlap. Small ones keep it: a 256-id lookup takes
microseconds, while taking the GIL back after releasing it can wait for another thread's
whole switch interval (5 ms by default).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from consumers.errors import ConsumerError
from consumers.id_index import lookup_slots as numpy_lookup_slots
from consumers.serving.memory import H_PREP

try:
    from consumers.serving import native
except ImportError as e:  # not built (no compiler at install): numpy it is
    native = None  # type: ignore[assignment]
    _WHY = str(e)
else:
    _WHY = ""

__all__ = ["NATIVE_AVAILABLE", "NOGIL_IDS", "lookup_slots", "native_enabled", "read_rows",
           "use_native"]

log = logging.getLogger(__name__)

#: whether the C extension was built and imports
NATIVE_AVAILABLE = native is not None
#: requests of at least this many ids release the GIL in the native path
NOGIL_IDS = 4096

_use = NATIVE_AVAILABLE and os.environ.get("DELTASTREAM_NATIVE", "1") != "0"
if not NATIVE_AVAILABLE:
    log.info("native lookup probe unavailable (%s): lookups use numpy", _WHY)
elif not _use:
    log.info("native lookup probe disabled by DELTASTREAM_NATIVE=0: lookups use numpy")


def native_enabled() -> bool:
    """Whether lookups run the native code now."""
    return _use


def use_native(on: bool) -> None:
    """Switch lookups to the native code (``on``; ``RuntimeError`` when it is not built)
    or to numpy. Process-wide; meant for tests and benchmarks."""
    global _use
    if on and not NATIVE_AVAILABLE:
        raise RuntimeError(f"the native lookup probe is not built ({_WHY})")
    _use = bool(on)


def lookup_slots(tab: np.ndarray, keys: np.ndarray, col: int) -> np.ndarray:
    """Row slot (int32 ``[n]``, 0 when absent) of each key (contiguous int64 ``[n]``) in
    value copy ``col`` of index buckets ``tab`` (``int64 [B, 2]``); reads only."""
    if not _use:
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
    if not _use:
        slots = numpy_lookup_slots(tab, keys, s & 1)
        if rows.dtype == np.float32:
            np.take(rows, slots, axis=0, out=out)
        else:
            out[...] = np.take(rows, slots, axis=0)
        return int(hdr[H_PREP]) <= s + 1
    r = native.read_rows(hdr, tab, rows, s, keys, out, keys.shape[0] >= NOGIL_IDS)
    if r == 2:
        raise ConsumerError(f"index of state {s} names a row slot beyond the {rows.shape[0]} "
                            "slots of the table (corrupt memory)")
    return r == 1
