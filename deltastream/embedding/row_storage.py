"""Where a table's rows live: the one tensor kernels and the tracker's owed copies read
them from in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from deltastream.embedding.hashtable import HashTable

__all__ = ["row_storage", "cpu_row_storage"]


def row_storage(table: Any) -> Optional[tuple[torch.Tensor, Callable[[torch.Tensor],
                                                                    torch.Tensor]]]:
    """Where ``table``'s rows live, for kernels that gather them in place:
    ``(storage, positions)`` or None when the table has no such storage (duck-typed tables).

    ``storage`` is ``[R, dim]`` (detached); ``positions(ids)`` gives each id's row in it,
    ``-1`` or an index outside ``[0, R)`` for an id the table does not hold (the caller then
    falls back to ``row_reader``'s ``read``, which raises or reads the eval value exactly
    as the reference path does). nn.Embedding / EmbeddingBag: the ids are the positions;
    HashTable (and ShardedEmbedding's local HashTable): its ``storage`` and ``positions``.
    """
    if isinstance(table, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return table.weight.detach(), lambda ids: ids
    inner = table
    if not callable(getattr(inner, "lookup", None)) and hasattr(inner, "table"):
        inner = inner.table  # ShardedEmbedding: its local shard (as row_reader reads it)
    if isinstance(inner, HashTable):
        return inner.storage.detach(), inner.positions
    return None


def cpu_row_storage(table: Any) -> Optional[torch.Tensor]:
    """The CPU tensor ``table``'s rows live in now (:func:`row_storage`'s ``storage``), or
    None (no such storage, or on a device): the rows the tracker may owe a reader, copied
    where they lie. Ask per read: a hash table's storage is replaced as it grows."""
    where = row_storage(table)
    return where[0] if where is not None and where[0].device.type == "cpu" else None
