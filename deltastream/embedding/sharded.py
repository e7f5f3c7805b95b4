"""Row-wise sharded embedding over ``torch.distributed``: every id lives on one owner rank.

:class:`ShardedEmbedding` is the multi-process form of :class:`~deltastream.HashTable`.
Rank ``r`` of ``W`` holds the local shard ``self.table`` (a ``HashTable`` restricted to
``gen_slice(r, W, slice_size)``); ``forward(ids)`` works for ids of any rank:

1. deduplicate the batch locally and bucket the unique ids by owner (:func:`owner_of`);
2. ``all_to_all_single`` the per-owner counts, then the ids (uneven splits: gloo supports
   ``all_to_all_single`` with split sizes on CPU, nccl on CUDA; the list form
   ``dist.all_to_all`` is not supported by gloo for uneven splits, so it is not used);
3. every owner looks its received ids up in its shard (``table(ids)``: inserting unseen
   ids in training mode, exactly like a single table);
4. the rows travel back through :class:`ExchangeRows`, an autograd function whose backward
   is the reverse ``all_to_all_single``: the gradient of each row lands on its owner, in the
   owner's ``table`` sparse gradient, so the owner's sparse optimizer (``SparseSGD(emb)``
   etc.) updates exactly its rows;
5. rows are put back in input order (``[*ids.shape, dim]``).

Forward and backward are **collective**: every rank of the group must call ``forward``
the same number of times (an empty batch is fine) and, when training, run ``backward``
through every output (standard for model-parallel embeddings). The output always requires
grad while grad mode is on (an internal holder tensor), so a rank whose batch was empty or
whose shard received nothing still takes part in the backward exchange.

The tracker and the publisher see the local shard: ``DeltaTracker(model)`` finds
``<fqn>.table`` (a HashTable holding global ids of this rank's slice range), and
``select_changed(delta, emb)`` reads the local shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist

from deltastream.embedding.hashtable import HashTable
from deltastream.sharding import DEFAULT_SLICE_SIZE, gen_slice, owner_of

__all__ = ["ShardedEmbedding", "ExchangeRows"]

log = logging.getLogger(__name__)


class ExchangeRows(torch.autograd.Function):
    """Send ``rows`` (``[n, ...]``, split along dim 0 by ``send_splits``) to the ranks of
    ``group``; receive ``recv_splits`` of them. Backward sends the gradients back along the
    reverse route. ``holder`` is a parameter that requires grad, so autograd calls backward
    on ranks that sent nothing.

    Use: ``ExchangeRows.apply(rows, holder, send_splits, recv_splits, group)``.
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, holder: torch.Tensor,  # noqa: ARG004 - holder: grad
                send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        ctx.rows_dtype = rows.dtype
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().to(ctx.rows_dtype)
        back = grad.new_empty((sum(ctx.send_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad, output_split_sizes=ctx.send_splits,
                               input_split_sizes=ctx.recv_splits, group=ctx.group)
        return back, None, None, None, None


class ShardedEmbedding(torch.nn.Module):
    """Embedding table sharded row-wise (by slice) across the ranks of a process group.

    Args:
        embedding_dim: row width.
        name: table name (also the local shard's name).
        process_group: the group to shard over (``None``: the default group). Must be
            initialized (``dist.init_process_group``); gloo for CPU tensors, nccl for CUDA.
        dtype, device, initializer, capacity: passed to the local :class:`HashTable`.
            For identical rows regardless of sharding, use an initializer that derives rows
            from the ids (it may accept an ``ids`` keyword), or insert rows explicitly.
        slice_size: size of the slice space (the partition is ``gen_slice(rank, W, ...)``).

    Attributes:
        table: the local shard (``HashTable``, slice ``gen_slice(rank, world_size)``).
        rank, world_size: this process's place in the group.
    """

    def __init__(self, embedding_dim: int, *, name: str, process_group=None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 initializer: Optional[Callable[..., torch.Tensor]] = None,
                 slice_size: int = DEFAULT_SLICE_SIZE, capacity: int = 1024) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedEmbedding needs torch.distributed to be initialized "
                               "(call torch.distributed.init_process_group first)")
        if not isinstance(slice_size, int) or isinstance(slice_size, bool) or slice_size <= 0:
            raise ValueError(f"slice_size must be a positive int, got {slice_size!r}")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if self.rank < 0:
            raise ValueError("this process is not a member of process_group")
        if self.world_size > slice_size:
            raise ValueError(f"world size {self.world_size} exceeds slice_size {slice_size}: "
                             "some ranks would own no slice")
        self.slice_size = slice_size
        self.embedding_dim = embedding_dim
        self.name = name
        self.device = torch.device(device)
        backend = dist.get_backend(process_group)
        if self.device.type == "cpu" and backend == "nccl":
            raise ValueError("ShardedEmbedding on device 'cpu' needs a CPU backend (gloo), "
                             "the process group uses nccl")
        self.table = HashTable(embedding_dim, name=name, dtype=dtype, device=device,
                               initializer=initializer,
                               slice=gen_slice(self.rank, self.world_size, slice_size),
                               capacity=capacity)
        # Makes every output require grad while grad mode is on, so that each rank joins
        # the backward exchange even when its own shard returned no rows.
        self._holder = torch.zeros((), device=self.device, requires_grad=True)

    @property
    def slice(self):
        """The slice range of the local shard."""
        return self.table.slice

    def extra_repr(self) -> str:
        return (f"{self.embedding_dim}, name={self.name!r}, rank={self.rank}/"
                f"{self.world_size}, local_rows={len(self.table)}")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for global ``ids`` (int, any shape) -> ``[*ids.shape, dim]``. Collective."""
        if not isinstance(ids, torch.Tensor):
            ids = torch.as_tensor(ids, dtype=torch.int64)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"ids must be an integer tensor, got dtype {ids.dtype}")
        shape = (*ids.shape, self.embedding_dim)
        flat = ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        if self.world_size == 1:
            return self.table(flat).reshape(shape)

        # 1. unique ids bucketed by owner (fewer bytes on the wire, one row per id)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        owner = owner_of(uniq, self.world_size, self.slice_size)
        order = torch.argsort(owner, stable=True)
        send_ids = uniq.index_select(0, order)
        send_counts = torch.bincount(owner, minlength=self.world_size)
        # 2. counts, then ids
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.process_group)
        send_splits = send_counts.tolist()
        recv_splits = recv_counts.tolist()
        recv_ids = send_ids.new_empty(sum(recv_splits))
        dist.all_to_all_single(recv_ids, send_ids, output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=self.process_group)
        # 3. the owner's lookup (inserts unseen ids in training mode; autograd to its rows)
        rows = self.table(recv_ids)
        if rows.dtype != self.table.dtype:
            rows = rows.to(self.table.dtype)
        # 4. rows back to the requesters; gradients come back the reverse way
        got = ExchangeRows.apply(rows, self._holder, recv_splits, send_splits,
                                  self.process_group)
        # 5. input order: got[j] is the row of uniq[order[j]], so uniq[u] is got[rank_of[u]]
        rank_of = torch.empty_like(order)
        rank_of[order] = torch.arange(order.numel(), device=order.device)
        return got.index_select(0, rank_of.index_select(0, inverse)).reshape(shape)
