"""Row buffers a hand-off's reader gives back to the tracker, for the next interval.

A CPU table's FIRST rows (its :class:`~deltastream.tracking.fresh_rows.FreshRows` arena)
and the current rows a hand-off owes (:class:`~deltastream.tracking.owed_rows.OwedRows`)
are written on the training thread, and both are handed over whole at each read: the next
interval needs new buffers. Fresh memory costs its first write a page fault per 4 KB
(~3 µs each on a VM, ~20 a step in ``bench trainer-cost``), paid inside the lookup hooks
and the ticks; and a reader freeing megabytes on another thread lets the allocator hand
them back to the system, so the training step's own tensors fault again. A reader done
with the rows (a budget publisher's worker once it merged a hand-off) gives the buffers
back instead (:meth:`SpareRows.give_back`, from any thread), and the tracker takes them
for its next interval (:meth:`SpareRows.take`, on the training thread).
"""

from __future__ import annotations

import threading
from collections import deque

import torch

__all__ = ["SpareRows"]

#: a given-back buffer more than this many times the rows asked for is not taken, unless
#: it is small (:data:`SMALL_BYTES`): one burst of lookups must not pin its memory for good
SLACK = 4
SMALL_BYTES = 16 << 20
#: buffers over this are not kept at all (a first read of millions of rows: its faults are
#: a small part of its own cost, and holding it would hold that memory)
MAX_BYTES = 64 << 20


class SpareRows:
    """Given-back ``[rows, dim]`` buffers (at most ``keep``; the oldest is dropped).

    Any thread may call either (a lock, held for a few list operations: uncontended but
    for the rare hand-off given back while the next interval takes its first buffer)."""

    def __init__(self, keep: int = 4) -> None:
        self._back: deque[torch.Tensor] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.reused = 0  #: buffers taken from the given-back ones
        self.allocated = 0  #: buffers allocated because none fit

    def __len__(self) -> int:
        return len(self._back)

    def give_back(self, *buffers: torch.Tensor) -> None:
        """Buffers nobody reads or writes any more (2-D CPU tensors; None is skipped, and
        so are buffers over :data:`MAX_BYTES`)."""
        with self._lock:
            for b in buffers:
                if b is not None and b.dim() == 2 and b.device.type == "cpu" \
                        and b.numel() * b.element_size() <= MAX_BYTES:
                    self._back.append(b)

    def take(self, rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """A CPU buffer ``[>= rows, dim]`` of ``dtype`` (contents undefined): the smallest
        given-back one that fits (one over :data:`SLACK` times ``rows`` only if it is
        small), else a new one of ``rows`` rounded up to a power of two (so that the next,
        slightly larger, interval fits it). The others stay for later takes (an arena and
        a hand-off's current rows differ in size)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._back)
                    if b.dtype == dtype and b.shape[1] == dim and b.shape[0] >= rows and (
                        b.shape[0] <= SLACK * max(rows, 1)
                        or b.numel() * b.element_size() <= SMALL_BYTES)]
            if fits:
                at = min(fits, key=lambda i: self._back[i].shape[0])
                best = self._back[at]
                del self._back[at]
                self.reused += 1
                return best
        self.allocated += 1
        return torch.empty((1 << max(0, rows - 1).bit_length(), dim), dtype=dtype)
