"""Hand the rows of undelivered messages back to a tracker, so a later round sends them.

A message :func:`~deltastream.publish_delta` handed to the publisher may fail after the
round returned (the broker went down before acknowledging it). Its
:class:`~deltastream.Undelivered` names the table, shard and ids; :func:`hand_back_undelivered`
retains those ids for the consumer as changed rows, so the next round publishes their
*current* value (the trainer's table holds the newest one; no row values were kept).

What the predictor holds for such a row is unknown (some older value), so its FIRST state
is taken as zeros (the drift is the row's norm) and its ``age`` as ``max_age``: under a
count budget it is overdue and goes out in the next round; under a threshold a row whose
norm is within the threshold may wait for the final round, which publishes everything.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Optional

import torch

from deltastream.publishing.results import Undelivered
from deltastream.publishing.table_rows import row_reader
from deltastream.types import DeltaRows

if TYPE_CHECKING:
    from deltastream.tracking.tracker import DeltaTracker

__all__ = ["hand_back_undelivered"]

log = logging.getLogger(__name__)


def hand_back_undelivered(tracker: DeltaTracker, consumer: str,
                          undelivered: Iterable[Undelivered],
                          streams: Mapping[tuple[str, Optional[int]], str],
                          modules: Mapping[str, torch.nn.Module], age: int = 0) -> int:
    """Retain the ids of ``undelivered`` messages for ``consumer``; returns the rows retained.

    Args:
        streams: ``{(published table name, shard or None): fqn}``; ``None`` stands for the
            publisher's own shard (tables published without a ``shard``).
        modules: ``{fqn: table module}`` (the rows' width, dtype and device).
        age: the ``age`` the rows come back with (``max_age`` of the policy: overdue).

    Messages of tables the tracker does not track (another caller's) are logged and left.
    """
    by_fqn: dict[str, list[torch.Tensor]] = {}
    for u in undelivered:
        fqn = streams.get((u.table, u.shard), streams.get((u.table, None)))
        if fqn is None or fqn not in modules:
            log.warning("undelivered %s: not a table of this tracker; not handed back", u)
            continue
        if u.rows:
            by_fqn.setdefault(fqn, []).append(torch.from_numpy(u.ids))
    total = 0
    for fqn, parts in by_fqn.items():
        module = modules[fqn]
        read, dim, dtype, _ = row_reader(module)
        device = _device(module)
        if dtype is None:  # learnt from a read (of no ids)
            dtype = read(torch.zeros(0, dtype=torch.int64, device=device)).dtype
        ids = torch.cat(parts).unique().to(device)
        n = ids.numel()
        rows = DeltaRows(ids=ids, states=torch.zeros((n, dim), dtype=dtype, device=device),
                         age=torch.full((n,), age, dtype=torch.int64, device=device))
        tracker.retain(consumer, fqn, rows)
        total += n
    return total


def _device(module: torch.nn.Module) -> torch.device:
    """Where ``module``'s rows live: its ``device`` attribute (a HashTable, a TorchRec
    table), else its first parameter's or buffer's, else the CPU."""
    dev = getattr(module, "device", None)
    if isinstance(dev, (torch.device, str)):
        return torch.device(dev)
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")
