"""Row buffers a hand-off's reader gives back to the tracker, for the next interval.

A CPU table's FIRST rows (its :class:`~deltastream.tracking.fresh_rows.FreshRows` arena)
and the current rows a hand-off owes (:class:`~deltastream.tracking.owed_rows.OwedRows`)
are written on the training thread, and both are handed over whole at each read: the next
interval needs new buffers. Fresh memory costs its first write a page fault per 4 KB
(~3 µs each on a VM, ~20 a step in ``bench trainer-cost``), paid inside the lookup hooks
and the ticks; and a reader freeing megabytes on another thread lets the allocator hand
them back to the system, so the training step's own tensors fault again. A reader done
with the rows (a budget publisher's worker once it merged a hand-off, or the worker
process's parent once it copied one) gives the buffers back instead
(:meth:`SpareRows.give_back`, from any thread), and the tracker takes them for its next
interval (:meth:`SpareRows.take`, on the training thread).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Optional

import numpy as np
import torch

from deltastream.tensor_views import as_buffer

__all__ = ["SpareRows", "after_both"]

#: a given-back buffer more than this many times the rows asked for is not taken, unless
#: it is small (:data:`SMALL_BYTES`): one burst of lookups must not pin its memory for good
SLACK = 4
SMALL_BYTES = 16 << 20
#: buffers over this are not kept at all (a first read of millions of rows: its faults are
#: a small part of its own cost, and holding it would hold that memory)
MAX_BYTES = 64 << 20
#: the most all kept buffers of one pool hold (the oldest go first)
TOTAL_BYTES = 128 << 20


class SpareRows:
    """Given-back ``[rows, dim]`` buffers (at most ``keep`` and :data:`TOTAL_BYTES`; the
    oldest are dropped).

    Any thread may call either (a lock, held for a few list operations: uncontended but
    for the rare hand-off given back while the next interval takes its first buffer).
    Each buffer is kept with its shape, dtype and size as plain values: a take compares
    those, not tensor attributes (microseconds each on a cold cache, in a tick); and with
    its :func:`~deltastream.tensor_views.as_buffer` view, made where it is given back
    (the reader's thread), which :meth:`take_viewed` hands out with it."""

    def __init__(self, keep: int = 8) -> None:
        #: ``(rows, dim, dtype, bytes, buffer, view)``, oldest first
        self._back: deque[tuple[int, int, torch.dtype, int, torch.Tensor, np.ndarray]] = \
            deque(maxlen=keep)
        self._lock = threading.RLock()  # give_back may run from a finalizer on any thread
        self.reused = 0  #: buffers taken from the given-back ones
        self.allocated = 0  #: buffers allocated because none fit

    def __len__(self) -> int:
        return len(self._back)

    def give_back(self, *buffers: Optional[torch.Tensor]) -> None:
        """Buffers nobody reads or writes any more (2-D CPU tensors; None is skipped, and
        so are buffers over :data:`MAX_BYTES`)."""
        kept = [(b.shape[0], b.shape[1], b.dtype, b.numel() * b.element_size(), b,
                 as_buffer(b))
                for b in buffers if b is not None and b.dim() == 2 and b.device.type == "cpu"]
        with self._lock:
            self._back.extend(k for k in kept if k[3] <= MAX_BYTES)
            while sum(k[3] for k in self._back) > TOTAL_BYTES:
                self._back.popleft()

    def take(self, rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """A CPU buffer ``[>= rows, dim]`` of ``dtype`` (contents undefined): the smallest
        given-back one that fits (one over :data:`SLACK` times ``rows`` only if it is
        small), else a new one of ``rows`` rounded up to a power of two (so that the next,
        slightly larger, interval fits it). The others stay for later takes (an arena and
        a hand-off's current rows differ in size)."""
        return self.take_viewed(rows, dim, dtype)[0]

    def take_viewed(self, rows: int, dim: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, np.ndarray]:
        """:meth:`take`'s buffer and its :func:`~deltastream.tensor_views.as_buffer` view."""
        with self._lock:
            best = None
            for i, (r, d, dt, nbytes, _, _) in enumerate(self._back):
                if d == dim and dt == dtype and rows <= r and (
                        r <= SLACK * max(rows, 1) or nbytes <= SMALL_BYTES) and (
                        best is None or r < self._back[best][0]):
                    best = i
            if best is not None:
                got = self._back[best]
                del self._back[best]
                self.reused += 1
                return got[4], got[5]
        self.allocated += 1
        buf = torch.empty((1 << max(0, rows - 1).bit_length(), dim), dtype=dtype)
        return buf, as_buffer(buf)


def after_both(give_back: Callable[[], None]) -> Callable[[], None]:
    """A function whose second call runs ``give_back`` (on the thread of that call): two
    readers' releases of the same buffers (a hand-off's reader and the tracker's store), in
    either order."""
    left, lock = [2], threading.Lock()

    def release() -> None:
        with lock:
            left[0] -= 1
            done = left[0] == 0
        if done:
            give_back()

    return release
