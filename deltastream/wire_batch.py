"""The batch types of the wire: :class:`DeltaBatch` (what a producer builds) and
:class:`DecodedBatch` (what :func:`deltastream.wire.decode` returns, validated).

Users import them from :mod:`deltastream.wire`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from deltastream.wire_values import RESIDUAL_DTYPES, has_scale

__all__ = ["DeltaBatch", "DecodedBatch"]


@dataclass
class DeltaBatch:
    """Rows of one table from one trainer shard, as carried by one or more messages.

    Attributes:
        model, table: names (non-empty, ≤ 255 chars, no ``/`` or control characters).
        shard: trainer shard that owns the rows (≥ 0).
        epoch: trainer incarnation (≥ 0), new on every trainer start.
        seq: per (model, table, shard, epoch) message number; for a batch that :func:`encode`
            splits, the seq of its first message.
        step: trainer global step. ts: trainer wall clock in ns when the rows were read.
        ids: int64 ``[n]`` global ids, strictly ascending.
        rows: ``[n, dim]``. For a batch you build: any float array (it is converted to
            ``dtype`` on encode). For a decoded batch: the wire representation —
            float32/float16 arrays, bf16 bit patterns as uint16, or int8 with ``scale``.
            Use :meth:`rows_f32` for float32 values either way.
        dtype: wire dtype, one of ``f32``, ``f16``, ``bf16``, ``i8`` (full rows, replacing
            what predictors hold) or ``r1`` / ``r1e`` (1-bit residuals *added* to it,
            wire v4 / v5 on; :mod:`deltastream.wire_values`). A residual batch you build
            holds the float residuals ``[n, dim]``; a decoded one their signs (int8 ±1)
            and ``scale``.
        scale: float32 ``[n]`` per-row scale, decoded ``i8``, ``r1``, ``r1e`` batches only.
        tombstones: int64 ``[m]`` ids the trainer evicted, or ``None``. A consumer deletes
            them before upserting ``ids`` (the two sets are disjoint when produced by
            deltastream's tracker).
        col, width: the rows are columns ``[col, col + dim)`` of rows ``width`` wide (a
            column-wise shard). Defaults: ``col`` 0, ``width`` ``None`` = ``dim`` (whole
            rows); a decoded batch always has ``width`` set.
        fresh: bool ``[n]`` or ``None``, residuals only: rows that start from zeros at the
            predictors (the trainer's mirror of them is zeros: an id inserted again after
            an eviction), whatever row they hold for the id.
    """

    model: str
    table: str
    shard: int
    epoch: int
    seq: int
    step: int
    ts: int
    ids: np.ndarray
    rows: np.ndarray
    dtype: str = "f32"
    scale: Optional[np.ndarray] = None
    tombstones: Optional[np.ndarray] = None
    col: int = 0
    width: Optional[int] = None
    fresh: Optional[np.ndarray] = None

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])

    @property
    def dim(self) -> int:
        return int(self.rows.shape[1])

    @property
    def additive(self) -> bool:
        """True when the rows are residuals to add to what predictors hold (``r1``,
        ``r1e``)."""
        return self.dtype in RESIDUAL_DTYPES

    @property
    def is_column_slice(self) -> bool:
        """True when the rows are a column range of wider rows (``col != 0`` or
        ``width != dim``), False for whole rows."""
        return self.col != 0 or (self.width is not None and self.width != self.dim)

    def rows_f32(self) -> np.ndarray:
        """Row values as float32 ``[n, dim]`` (dequantized for decoded f16/bf16/i8)."""
        return np.asarray(self.rows, dtype=np.float32)


@dataclass
class DecodedBatch(DeltaBatch):
    """A batch :func:`decode` built from a message and validated, field by field; consumers
    trust it without checking again.

    Guarantees (on top of :class:`DeltaBatch`): names, ints and ``dtype`` valid; ``ids``
    int64 ``[n]`` strictly ascending (so unique); ``rows`` ``[n, dim]`` in the wire
    representation of ``dtype`` (float32, float16, bf16 bit patterns as uint16, int8);
    ``scale`` float32 ``[n]`` finite and non-negative for ``i8``, ``r1`` and ``r1e`` (else
    None; residual rows are int8 ±1);
    ``tombstones`` int64 or None; ``width`` set and ``0 ≤ col``, ``col + dim ≤ width``.
    Not checked: whether the row values are finite (:meth:`nonfinite_rows`).
    """

    def __post_init__(self) -> None:
        if self.width is None:
            self.width = self.dim

    def rows_f32(self) -> np.ndarray:
        """Row values as float32 ``[n, dim]``, dequantized from the wire representation."""
        if self.dtype == "bf16":
            return (self.rows.astype(np.uint32) << 16).view(np.float32)
        if has_scale(self.dtype):
            return self.rows.astype(np.float32) * self.scale[:, None]
        return self.rows.astype(np.float32, copy=False)

    def nonfinite_rows(self) -> int:
        """Rows holding a NaN or ±inf value, read off the wire representation (f16/bf16:
        exponent bits all ones; cheaper than checking float32 values). An i8 or residual
        row is finite by construction (its scale is); 0 for those."""
        if has_scale(self.dtype):
            return 0
        if self.dtype == "f32":
            return int(np.count_nonzero(~np.isfinite(self.rows).all(axis=1)))
        exp_all_ones = 0x7C00 if self.dtype == "f16" else 0x7F80
        bits = np.bitwise_and(self.rows.view(np.uint16), 0x7FFF)
        if not bits.size or int(bits.max()) < exp_all_ones:
            return 0
        return int(np.count_nonzero((bits >= exp_all_ones).any(axis=1)))
