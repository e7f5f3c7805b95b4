"""A table's rows as the hand-offs copied them: what a worker's round reads instead of the
live table.

A :class:`~.round_engine.RoundEngine` runs :func:`~deltastream.publish_delta`'s selection
off the training thread. It must not read the live table — the optimizer writes it while
the worker scores — so it reads :class:`HeldRows`: every row the hand-offs brought
(``current``, the values at a step boundary), newest value per id, kept while some round
may still read it (a candidate, a carried or a handed-back row). It has what the selection
and :func:`~.rounds.shard_publish_kwargs` read of a table module: ``lookup(ids)``,
``embedding_dim``, ``dtype``, ``device``, ``name`` and the column-shard attributes.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from deltastream.publishing.row_moves import move_rows
from deltastream.publishing.slot_pool import SlotPool
from deltastream.tracking.row_copy import gather_rows

__all__ = ["HeldRows"]


class HeldRows:
    """Rows keyed by id (see the module docstring).

    Args:
        name: the published table name. dim: row width. dtype: row dtype.
        publish_kwargs: the table's column-shard keywords (``col``, ``width``, ``shard``;
            empty for whole rows), as :func:`~.rounds.shard_publish_kwargs` gave them.
    """

    def __init__(self, name: str, dim: int, dtype: torch.dtype,
                 publish_kwargs: Optional[dict[str, int]] = None) -> None:
        self.name, self.embedding_dim, self.dtype = name, int(dim), dtype
        self.device = torch.device("cpu")  # host copies, whatever the table's device
        kw = publish_kwargs or {}
        if "width" in kw:  # read back by shard_publish_kwargs
            self.full_width, self.column_offset = int(kw["width"]), int(kw.get("col", 0))
            self.shard_id = kw.get("shard")
        self._pool = SlotPool({"row": torch.zeros(1024, self.embedding_dim, dtype=dtype)},
                              f"held rows of {name}")

    def __len__(self) -> int:
        return len(self._pool)

    def put(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Hold ``rows`` ``[n, dim]`` as the values of ``ids`` (int64 ``[n]``, unique),
        replacing what was held for them."""
        if not ids.numel():
            return
        slots = self._pool.find(ids)
        miss = slots < 0
        if bool(miss.any()):
            slots[miss] = self._pool.add(ids[miss])
        # one pass of the C code (index_copy_ takes ~2x longer per row)
        move_rows(self._pool.cols["row"], slots, rows.to(self.dtype), None)

    def drop(self, ids: torch.Tensor) -> None:
        """Forget ``ids`` (int64 ``[n]``, unique; ids not held are ignored)."""
        if ids.numel() and len(self._pool):
            self._pool.remove(ids)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The held rows of ``ids`` (int64 ``[n]``) as a new ``[n, dim]`` tensor.

        Raises:
            KeyError: naming ids not held (a round read a row no hand-off brought).
        """
        slots = self._pool.find(ids.to(torch.int64))
        miss = slots < 0
        if bool(miss.any()):
            bad = ids[miss][:8].tolist()
            raise KeyError(f"held rows of {self.name}: {int(miss.sum())} ids not held, "
                           f"e.g. {bad}")
        return gather_rows(self._pool.cols["row"], slots)

    def memory_bytes(self) -> int:
        """Bytes of the held rows' storage."""
        row = self._pool.cols["row"]
        return int(row.numel() * row.element_size() + self._pool.ids.numel() * 8
                   + np.asarray(self._pool.live).nbytes)
