"""Sparse gradients of a row table: stashed by backward, coalesced on demand.

:func:`gather_rows` is the autograd op behind ``HashTable.forward``: ``storage[positions]``
whose backward only *stashes* ``(positions, ids, grad)`` in a :class:`GradStash`. The stash
coalesces on demand (:meth:`GradStash.coalesce`: unique positions, summed gradients), which
is what sparse optimizers read. Growth, eviction and reuse between forward and the optimizer
step are safe: positions are stable while a row lives, and stale entries (a position that no
longer holds the same id) are dropped.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

__all__ = ["SparseGrad", "GradStash", "gather_rows"]


class SparseGrad(NamedTuple):
    """Coalesced gradient of a :class:`~deltastream.HashTable`: one entry per touched row.

    ``positions`` int64 ``[u]`` (unique row positions in the storage), ``ids`` int64 ``[u]``
    (the ids at those positions), ``values`` ``[u, dim]`` (summed gradients, table dtype).
    """

    positions: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor


class GradStash:
    """Row gradients accumulated since the last :meth:`clear`.

    Args:
        dim: row width. dtype: the table's row dtype (gradients are stored in it).
    """

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        self.dim = dim
        self.dtype = dtype
        self._entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._cache: Optional[SparseGrad] = None

    def add(self, positions: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Stash the gradient ``grad`` ``[n, dim]`` (any leading shape) of the rows at
        ``positions`` ``[n]``, which held ``ids`` ``[n]`` when they were read."""
        self._entries.append((positions, ids, grad.to(self.dtype)))
        self._cache = None

    @torch.no_grad()
    def coalesce(self, pos_ids: torch.Tensor, occupied: torch.Tensor) -> Optional[SparseGrad]:
        """The stash as one :class:`SparseGrad`, or ``None`` when empty.

        ``pos_ids`` int64 ``[capacity]`` and ``occupied`` bool ``[capacity]`` are the table's
        id and liveness per position now: entries whose row was evicted (or reused by
        another id) since the backward are dropped. The result is cached (and kept as the
        stash) until the next :meth:`add` or :meth:`clear`.
        """
        if self._cache is not None:
            return self._cache
        if not self._entries:
            return None
        device, capacity = pos_ids.device, pos_ids.shape[0]
        pos = torch.cat([p for p, _, _ in self._entries]).to(device)
        ids = torch.cat([i for _, i, _ in self._entries]).to(device)
        grad = torch.cat([g.reshape(-1, self.dim) for _, _, g in self._entries]).to(device)
        valid = (pos < capacity)
        valid &= occupied[pos.clamp(max=capacity - 1)]
        valid &= pos_ids[pos.clamp(max=capacity - 1)] == ids
        if not bool(valid.all()):
            keep = valid.nonzero().squeeze(1)
            pos, grad = pos.index_select(0, keep), grad.index_select(0, keep)
        uniq, inv = torch.unique(pos, return_inverse=True)
        summed = torch.zeros(uniq.numel(), self.dim, dtype=grad.dtype, device=device)
        summed.index_add_(0, inv, grad)
        self._cache = SparseGrad(uniq, pos_ids.index_select(0, uniq), summed)
        self._entries = [(uniq, self._cache.ids, summed)]
        return self._cache

    def clear(self) -> None:
        """Drop every stashed gradient."""
        self._entries = []
        self._cache = None

    def to(self, device: torch.device, dtype: torch.dtype) -> GradStash:
        """Move the stash to ``device`` and the row ``dtype`` (in place); returns ``self``."""
        self.dtype = dtype
        self._entries = [(p.to(device=device), i.to(device=device),
                          g.to(device=device, dtype=dtype)) for p, i, g in self._entries]
        self._cache = None
        return self


class _GatherRows(torch.autograd.Function):
    """``rows = storage[positions]``; backward stashes the grads (sparse)."""

    @staticmethod
    def forward(ctx: Any, holder: torch.Tensor, storage: torch.Tensor, stash: GradStash,
                positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ctx.stash = stash
        ctx.save_for_backward(positions, ids)
        return storage.index_select(0, positions)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        positions, ids = ctx.saved_tensors
        ctx.stash.add(positions, ids, grad)
        return None, None, None, None, None


def gather_rows(holder: torch.Tensor, storage: torch.Tensor, stash: GradStash,
                positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``storage[positions]`` ``[n, dim]`` with autograd: the gradient of the rows goes to
    ``stash`` (with ``ids``, the ids at ``positions`` now), not to ``storage``.

    ``holder`` is a scalar leaf with ``requires_grad`` that connects the result to the
    autograd graph (the storage itself is not a ``Parameter``).
    """
    return _GatherRows.apply(holder, storage, stash, positions, ids)
