"""Exact drift scan: every row of a dense table that changed since the last read.

A dense optimizer with state (SGD momentum, Adam's moments, AdamW's or Adagrad's weight
decay), ``load_state_dict`` or a manual write moves rows of an ``nn.Embedding`` /
``nn.EmbeddingBag`` that were not looked up, so lookups cannot tell which rows changed.
:class:`DriftScan` keeps a **shadow**: the table's weight as of the tracker's last read
boundary (any consumer's read). At the next boundary :meth:`DriftScan.scan` compares the
weight with the shadow **bit for bit** (rows viewed as integers: a NaN that stays NaN is
unchanged, ``-0.0`` vs ``0.0`` is a change) chunk by chunk, returns every changed row — and
every row looked up since (:meth:`DriftScan.note`), changed or not — with its shadow value,
which is the exact FIRST state (its value at the previous boundary), then copies the changed
rows into the shadow. The tracker records that as one run in its store, so the per-consumer
cursors and FIRST merging work as for lookups.

Cost: one copy of the table (the shadow) and, per read, a pass over weight and shadow
(~30 ms for 1M x 32 float32 rows on one CPU core pair) plus a gather of the rows reported.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["DriftScan", "ScanResult", "bits_view"]

log = logging.getLogger(__name__)

#: rows compared per chunk: 8K x 32 float32 = 1 MiB of weight (and of shadow) in cache
_CHUNK_ROWS = 8192

_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bits_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[n, dim]`` (contiguous rows) viewed as integers, as wide as the row allows
    (``[n, dim * itemsize / k]`` of ``k``-byte ints): comparing them compares the bits."""
    row_bytes = x.shape[1] * x.element_size()
    for k in (8, 4, 2, 1):
        if row_bytes % k == 0 and k >= x.element_size():
            return x.view(_INT[k])
    return x.view(_INT[x.element_size()])


@dataclass
class ScanResult:
    """One scan: ``ids`` int64 ``[k]`` ascending rows changed or looked up since the last
    scan; ``states`` their shadow values ``[k, dim]`` (FIRST) or None; ``changed`` how many
    rows changed; ``unlooked`` how many of those were not looked up (moved by something
    else); ``reset`` True when the weight's shape or dtype changed (every row reported,
    no states)."""

    ids: torch.Tensor
    states: Optional[torch.Tensor]
    changed: int
    unlooked: int
    reset: bool = False


class DriftScan:
    """Shadow of one dense table's weight and the rows looked up since the last scan.

    Args:
        weight: the table's ``[rows, dim]`` weight (copied: the shadow starts equal to it).
        chunk_rows: rows compared per chunk.
    """

    def __init__(self, weight: torch.Tensor, chunk_rows: int = _CHUNK_ROWS) -> None:
        w = weight.detach()
        self.shadow = w.clone(memory_format=torch.contiguous_format)
        self.marks = torch.zeros(w.shape[0], dtype=torch.bool, device=w.device)
        self.chunk_rows = int(chunk_rows)
        self.noted = 0  #: lookup ids marked since the last scan (repeats counted)
        self.scans = 0  #: scans run
        self.seconds = 0.0  #: time spent in scans
        self.unlooked = 0  #: rows found changed without a lookup, over all scans

    @property
    def nbytes(self) -> int:
        """Memory held: the shadow and the lookup marks."""
        return self.shadow.numel() * self.shadow.element_size() + self.marks.numel()

    def note(self, ids: torch.Tensor) -> None:
        """Mark rows looked up (int ``ids`` of any shape, valid row indices)."""
        flat = ids.reshape(-1)
        if flat.numel():
            self.marks.index_fill_(0, flat.to(self.marks.device, torch.int64), True)
            self.noted += int(flat.numel())

    def resync(self, weight: torch.Tensor) -> None:
        """Make the shadow equal to ``weight`` and forget the marks (everything is read)."""
        w = weight.detach()
        if w.shape != self.shadow.shape or w.dtype != self.shadow.dtype \
                or w.device != self.shadow.device:
            self.shadow = w.clone(memory_format=torch.contiguous_format)
            self.marks = torch.zeros(w.shape[0], dtype=torch.bool, device=w.device)
        else:
            self.shadow.copy_(w)
            self.marks.zero_()
        self.noted = 0

    @torch.no_grad()
    def scan(self, weight: torch.Tensor, with_states: bool) -> ScanResult:
        """Rows of ``weight`` changed (bitwise) or looked up since the last scan.

        Returns their ids ascending and, with ``with_states``, their shadow values (the
        value at the last scan); the shadow then takes the changed rows' current values.
        """
        t0 = time.perf_counter()
        w = weight.detach()
        if w.shape != self.shadow.shape or w.dtype != self.shadow.dtype:
            log.warning("DriftScan: weight changed from %s %s to %s %s; every row is reported "
                        "(ids only)", tuple(self.shadow.shape), self.shadow.dtype,
                        tuple(w.shape), w.dtype)
            self.resync(w)
            ids = torch.arange(w.shape[0], device=w.device)
            return self._done(t0, ScanResult(ids, None, w.shape[0], w.shape[0], True))
        if w.device != self.shadow.device:  # the module was moved: follow it
            self.shadow = self.shadow.to(w.device)
            self.marks = self.marks.to(w.device)
        if not w.is_contiguous():
            w = w.contiguous()
        moved = self._compare(w)
        n, shadow = w.shape[0], self.shadow
        pos = moved.nonzero().squeeze(1)  # changed rows, ascending
        changed = int(pos.numel())
        if self.noted:
            hit = (moved | self.marks).nonzero().squeeze(1)  # changed or looked up
            unlooked = int((moved & ~self.marks).sum())
            self.marks.zero_()
            self.noted = 0
        else:
            hit, unlooked = pos, changed
        states = None
        if with_states:  # FIRST: the shadow before it takes the new values (one gather)
            states = shadow.clone() if hit.numel() == n else shadow.index_select(0, hit)
        if changed * 4 >= n:  # most rows moved (Adam's steady state): one pass, no gather
            torch.where(moved.unsqueeze(1), w, shadow, out=shadow)
        elif changed:
            shadow.index_copy_(0, pos, w.index_select(0, pos))
        self.unlooked += unlooked
        return self._done(t0, ScanResult(hit, states, changed, unlooked))

    def _compare(self, w: torch.Tensor) -> torch.Tensor:
        """Bool ``[rows]``: which rows of ``w`` differ from the shadow, bit for bit."""
        wb, sb = bits_view(w), bits_view(self.shadow)
        n = w.shape[0]
        moved = torch.empty(n, dtype=torch.bool, device=w.device)
        # element-wise differences go to one reused buffer, whose bytes per row are then
        # read as a few wide ints (a pass fewer than ne().any() over every element)
        diff = torch.empty((min(self.chunk_rows, n), wb.shape[1]), dtype=torch.bool,
                           device=w.device)
        for a in range(0, n, self.chunk_rows):
            b = min(n, a + self.chunk_rows)
            d = torch.ne(wb[a:b], sb[a:b], out=diff[: b - a])
            torch.any(bits_view(d).ne(0), 1, out=moved[a:b])
        return moved

    def _done(self, t0: float, res: ScanResult) -> ScanResult:
        self.scans += 1
        self.seconds += time.perf_counter() - t0
        return res
