"""Column slices on the predictor: which columns of a table's rows a wire batch carries.

A wire-v2 batch from a column-wise trainer shard carries columns ``[col, col + dim)`` of rows
``width`` wide (:mod:`deltastream.wire`: fields ``col``, ``width``). The serving table is
``width`` wide; applying such a batch writes only those columns of each row.

A row first seen through one column shard has its **other columns read as zeros** until
their shards' batches arrive. The predictor does not know the trainer's initializer, so it
uses the same value an unknown id reads as (``lookup`` of a missing id returns a zero row):
a fresh row starts all zero, then each column shard fills its own columns. Once every
column shard of a row has published, the row equals the trainer's full row.

Kept apart from the table's internals (:class:`~consumers.serving.core.TableCore`) so its
storage can change without touching this logic: the table calls :func:`batch_columns` to
validate the batch against its width and :func:`scatter_columns` to write the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from consumers.errors import ApplyError

__all__ = ["Columns", "batch_columns", "scatter_columns"]


@dataclass(frozen=True)
class Columns:
    """The columns ``[col, col + n)`` of rows ``width`` wide that a batch carries."""

    col: int
    n: int
    width: int

    @property
    def whole(self) -> bool:
        """True when the batch carries whole rows."""
        return self.col == 0 and self.n == self.width


def batch_columns(batch: Any) -> Columns:
    """The column range of ``batch`` (a :class:`~deltastream.wire.DeltaBatch`), checked:
    ``0 ≤ col``, ``col + dim ≤ width``. Raises :class:`ApplyError` naming the table."""
    rows = np.asarray(batch.rows)
    if rows.ndim != 2:
        raise ApplyError(f"rows: batch of table {batch.table!r} has rows of shape "
                         f"{rows.shape}, expected [n, dim]")
    n = int(rows.shape[1])
    col = getattr(batch, "col", 0)
    width = getattr(batch, "width", None)
    width = n if width is None else width
    for what, v in (("col", col), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ApplyError(f"{what}: batch of table {batch.table!r} has {what} {v!r}, "
                             "expected an int")
    if not (0 <= col and col + n <= width):
        raise ApplyError(f"columns: batch of table {batch.table!r} carries columns "
                         f"[{col}, {col + n}) of rows {width} wide; expected 0 ≤ col and "
                         "col + dim ≤ width")
    return Columns(int(col), n, int(width))


def scatter_columns(dst: np.ndarray, slots: np.ndarray, rows: np.ndarray, cols: Columns,
                    fresh: np.ndarray) -> None:
    """``dst[slots, col:col + n] = rows`` after zeroing the ``fresh`` slots (rows first seen
    now: their other columns read as zeros, and a reused slot must not show an old row).

    ``dst`` is ``[R, width]``, ``slots`` int ``[k]``, ``rows`` ``[k, n]`` in ``dst``'s dtype.
    """
    if fresh.size:
        dst[fresh] = 0
    dst[slots, cols.col:cols.col + cols.n] = rows
