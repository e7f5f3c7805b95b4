"""Read the current rows of any table :func:`~deltastream.publishing.selection.select_changed`
takes: a :class:`~deltastream.HashTable` (or anything with ``lookup(ids)`` and an int
``embedding_dim``), a :class:`~deltastream.ShardedEmbedding` (its local shard, ``.table``)
or a ``torch.nn.Embedding`` / ``torch.nn.EmbeddingBag`` (ids are row indices of its weight).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from deltastream.embedding.hashtable import HashTable
from deltastream.embedding.row_storage import row_storage  # re-exported: its old home

__all__ = ["Reader", "row_reader", "read_rows", "row_storage"]


Reader = Callable[[torch.Tensor], torch.Tensor]


def row_reader(table: Any) -> tuple[Reader, int, Optional[torch.dtype], bool]:
    """How to read ``table``'s current rows: ``(read, dim, dtype, fresh)``.

    ``read(ids)`` returns the rows ``[len(ids), dim]`` (detached); ``dtype`` is the table's
    row dtype (None: learnt from the first read); ``fresh`` says whether every read returns
    a new copy that the caller may overwrite. Raises ``TypeError`` for an unsupported table.
    """
    if isinstance(table, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        kind = type(table).__name__

        def read_embedding(ids: torch.Tensor) -> torch.Tensor:
            weight = table.weight  # looked up per read: a module moved or reloaded is seen
            num = weight.shape[0]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num):
                raise ValueError(f"ids must be row indices in [0, {num}) for {kind}, "
                                 f"got range [{int(ids.min())}, {int(ids.max())}]")
            return weight.detach().index_select(0, ids.to(weight.device))

        return read_embedding, int(table.embedding_dim), table.weight.dtype, True
    inner = table
    if not callable(getattr(inner, "lookup", None)) and hasattr(inner, "table"):
        inner = inner.table  # ShardedEmbedding: its local shard
    if not callable(getattr(inner, "lookup", None)):
        raise TypeError(
            "table must be a HashTable (with lookup(ids)), a ShardedEmbedding, a "
            f"torch.nn.Embedding or a torch.nn.EmbeddingBag, got {type(table).__name__}")
    dim = getattr(inner, "embedding_dim", None)
    if not isinstance(dim, int):
        raise TypeError(f"table {type(inner).__name__} has no int attribute embedding_dim")
    dtype = getattr(inner, "dtype", None)

    def read_table(ids: torch.Tensor) -> torch.Tensor:
        rows = inner.lookup(ids)
        return rows.detach()

    if not isinstance(dtype, torch.dtype):
        dtype = None  # learnt from the first read
    # HashTable.lookup documents that it returns a copy; other duck-typed tables may not
    return read_table, dim, dtype, isinstance(inner, HashTable)


def read_rows(read: Reader, ids: torch.Tensor, dim: int, dtype: torch.dtype,
              dev: torch.device) -> torch.Tensor:
    """Current values of ``ids`` as one ``[len(ids), dim]`` tensor on ``dev``."""
    if ids.numel() == 0:
        return torch.empty(0, dim, dtype=dtype, device=dev)
    rows = read(ids)
    return rows.to(dev) if rows.device != dev else rows
