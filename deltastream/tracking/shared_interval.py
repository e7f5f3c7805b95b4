"""An interval one reader drains unordered (a publisher's hand-off) that other consumers
have yet to read: it also becomes their record in the touched store, at the current index,
with no sort and no second gather of what the reader already has.

* :func:`drain_sharing_rows` — some other consumer reads FIRST states: the record is the
  marks' ids and the FIRST rows where they lie, in the arena handed to the reader, which is
  given back only once the reader and the store are both done with it.
* :func:`drain_sharing_ids` — every other consumer reads ids only
  (``DeltaTracker(id_only_consumers=...)``): the record is a copy of the reader's own ids,
  made on the thread that completes the owed walk writing them (the lane's, or a tick's
  capture), before the reader may give their buffer back.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from deltastream.tracking.positions import UniqueLookups
from deltastream.tracking.spare_rows import after_both
from deltastream.tracking.store import DeltaStore

__all__ = ["drain_sharing_rows", "drain_sharing_ids"]


def drain_sharing_rows(touched: DeltaStore, idx: int, fqn: str, p: UniqueLookups,
                       table: Any, storage: Optional[torch.Tensor]
                       ) -> Optional[tuple[Any, ...]]:
    """``p.drain_unordered(table, storage)``, its ids and FIRST rows also appended to
    ``touched`` for table ``fqn`` at ``idx`` (the arena borrowed: ``give_back`` returned
    runs once both are done); None (nothing done) when not every position's id is at
    hand."""
    shared = p.marked_rows(table)
    if shared is None:
        return None
    got = p.drain_unordered(table, storage)
    if got is None:
        return None
    ids, rows, borrowed = shared
    give_back = released = got[5]
    if borrowed and give_back is not None:  # the store holds the arena too
        give_back = released = after_both(give_back)
    else:  # the rows are a copy of their own
        released = None
    touched.append(idx, fqn, ids, rows, copy_states=False, unique=True, released=released)
    return (*got[:5], give_back)


def drain_sharing_ids(touched: DeltaStore, idx: int, fqn: str, p: UniqueLookups,
                      table: Any, storage: Optional[torch.Tensor]
                      ) -> Optional[tuple[Any, ...]]:
    """``p.drain_unordered(table, storage)``, its ids (int64 ``[k]``) also appended to
    ``touched`` for table ``fqn`` at ``idx`` as an ids-only record: copied once the owed
    walk wrote them; a read of the record completes the walk first."""
    got = p.drain_unordered(table, storage)
    if got is None:
        return None
    ids, fresh = got[0], p.fresh
    owed = fresh.owed
    if owed is None or not owed.walking:  # written already: the store copies them
        touched.append(idx, fqn, ids, ids_only=True, unique=True)
        return got
    buf, copied = torch.empty_like(ids), []

    def copy() -> None:
        buf.copy_(ids)
        copied.append(True)

    def ready() -> None:
        if not copied:
            fresh.capture(None)

    owed.when_walked(copy)
    touched.append(idx, fqn, buf, ids_only=True, unique=True, ready=ready)
    return got
