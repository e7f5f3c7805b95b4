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

from deltastream.kernels.runtime import use_kernels

__all__ = ["SparseGrad", "GradStash", "gather_rows", "coalesce_rows"]


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

        Host syncs: on the kernel path (CUDA, :func:`~deltastream.kernels.runtime.use_kernels`)
        exactly one, the number of touched rows (:func:`coalesce_rows`); on the reference
        path one more when stale entries must be dropped.
        """
        if self._cache is not None:
            return self._cache
        if not self._entries:
            return None
        device, capacity = pos_ids.device, pos_ids.shape[0]
        pos = _cat([p for p, _, _ in self._entries]).to(device)
        ids = _cat([i for _, i, _ in self._entries]).to(device)
        grad = _cat([g.reshape(-1, self.dim) for _, _, g in self._entries]).to(device)
        valid = (pos < capacity)
        valid &= occupied[pos.clamp(max=capacity - 1)]
        valid &= pos_ids[pos.clamp(max=capacity - 1)] == ids
        if use_kernels(pos_ids):
            uniq, summed = coalesce_rows(pos, grad, valid, capacity)
        else:
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


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def coalesce_rows(pos: torch.Tensor, grad: torch.Tensor, valid: torch.Tensor,
                  capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique valid positions (ascending, int64 ``[u]``) and their summed gradient rows
    ``[u, dim]``, from ``pos`` int64 ``[n]`` (``< capacity`` where ``valid``), ``grad``
    ``[n, dim]`` and the bool mask ``valid`` ``[n]``.

    One sort and **one** device->host read (``u``, which sizes the result); invalid
    entries are sorted past every valid position and summed into a scratch row that is
    cut off, so dropping them costs no sync of its own (``torch.unique`` plus a validity
    check costs two).
    """
    n, device = pos.numel(), pos.device
    key = torch.where(valid, pos, torch.full_like(pos, capacity))  # invalid: sorted last
    skey, order = torch.sort(key)
    start = torch.ones(n, dtype=torch.bool, device=device)
    if n > 1:
        torch.ne(skey[1:], skey[:-1], out=start[1:])
    live = skey < capacity
    start &= live
    seg = torch.cumsum(start, 0).sub_(1)  # row of each sorted entry in the result
    u = int(seg[-1]) + 1 if n else 0  # the one sync
    dump = torch.full_like(seg, u)
    dst_sorted = torch.where(live, seg, dump)
    dst = torch.empty_like(dst_sorted).scatter_(0, order, dst_sorted)  # back to input order
    summed = torch.zeros(u + 1, grad.shape[1], dtype=grad.dtype, device=device)
    summed.index_add_(0, dst, grad)
    uniq = torch.empty(u + 1, dtype=torch.int64, device=device)
    # every entry of a segment carries the same key: repeated writes agree
    uniq.index_copy_(0, dst_sorted, skey)
    return uniq[:u], summed[:u]


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
