"""A collection of embedding tables sharded by a :class:`~deltastream.ShardingPlan`.

:class:`ShardedEmbeddingCollection` executes a plan over ``torch.distributed`` (gloo on CPU,
nccl on CUDA). Row-wise tables are :class:`~deltastream.ShardedEmbedding` modules (today's
path, unchanged). Every other shard — a whole table (table-wise) or a column range of every
row (column-wise, table-wise-column-wise) — is a :class:`~deltastream.HashTable` on its rank
whose ``embedding_dim`` is the shard's column count, with attributes

* ``plan_table``: the table's name (what its rows are published under),
* ``column_offset`` / ``full_width``: it holds columns ``[column_offset, column_offset +
  embedding_dim)`` of rows ``full_width`` wide,
* ``shard_id``: its position in the table's shard list (the wire ``shard`` it publishes
  under, one predictor sequence stream per column shard).

Its ``name`` is ``"<table>#<shard_id>"`` (sparse optimizers key their state by name).

``forward({table: ids})`` for the non-row tables, in one exchange per direction:

1. each rank deduplicates its ids per table; the per-table unique counts are exchanged
   (``all_to_all_single``) so every rank knows every split;
2. the unique ids of table ``t`` go to every rank holding a shard of ``t``, once per shard
   (``all_to_all_single`` with uneven splits);
3. each shard looks its ids up (inserting unseen ids in training mode, like a single table);
4. the rows travel back as one flat buffer through an autograd function whose backward is the
   reverse exchange, so every shard's gradient lands in its own ``HashTable``;
5. the pieces arrive grouped **by rank** (shards of one rank in shard order) and are stitched
   in **shard order** with permute indices (:func:`output_permute`): for a table whose shards
   sit on ranks ``[0, 1, 0]`` the pieces arrive as ``[s0, s2, s1]`` and permute ``[0, 2, 1]``
   puts them back as ``[s0, s1, s2]`` (the case of the TorchRec column-wise commit).

Forward and backward are collective, as for :class:`~deltastream.ShardedEmbedding`: every
rank calls ``forward`` with the same tables the same number of times (an empty batch is
fine) and runs backward through the outputs.

Optimizers: element-wise ones (``SparseSGD``, ``SparseAdam``) update a column shard exactly
as the whole table; a row-wise one (``RowWiseAdagrad``) keeps its per-row statistic over the
shard's own columns (as TorchRec does), which differs from a whole table's.

Initializers: a column shard calls the table's initializer for full-width rows and keeps its
columns, so rows agree with an unsharded table when the initializer derives rows from the
ids (accepts ``ids=``); a random one draws different numbers per shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Optional, Union

import torch
import torch.distributed as dist

from deltastream.embedding.hashtable import HashTable
from deltastream.embedding.initializers import accepted_kwargs, init_rows
from deltastream.embedding.plan import ShardingPlan, TablePlan
from deltastream.embedding.sharded import ExchangeRows, ShardedEmbedding
from deltastream.errors import PlanError

__all__ = ["ShardedEmbeddingCollection", "output_permute", "ColumnInitializer"]

log = logging.getLogger(__name__)

InitLike = Union[None, Callable[..., torch.Tensor], Mapping[str, Callable[..., torch.Tensor]]]


def output_permute(plan: TablePlan) -> list[int]:
    """Permute indices from rank order to shard order for one table.

    Pieces arrive ordered by ``(rank, shard id)``; ``perm[j]`` is the arrival position of
    shard ``j``. E.g. shard ranks ``[0, 1, 0]`` -> arrival ``[s0, s2, s1]`` -> ``[0, 2, 1]``.
    """
    arrival = sorted(range(len(plan.shards)), key=lambda j: (plan.shards[j].rank, j))
    perm = [0] * len(arrival)
    for pos, j in enumerate(arrival):
        perm[j] = pos
    return perm


class ColumnInitializer:
    """Columns ``[begin, end)`` of ``base``'s full-width rows (``width`` wide)."""

    def __init__(self, base: Optional[Callable[..., torch.Tensor]], begin: int, end: int,
                 width: int) -> None:
        self.base, self.begin, self.end, self.width = base, begin, end, width
        self.eval_value = float(getattr(base, "eval_value", 0.0))
        self._accepted = accepted_kwargs(base, ("device", "dtype", "ids"))

    def __call__(self, n: int, dim: int, *, ids: torch.Tensor, device: torch.device,
                 dtype: torch.dtype) -> torch.Tensor:
        rows = init_rows(self.base, self._accepted, ids, self.width, device=device,
                         dtype=dtype, table=f"columns {self.begin}-{self.end}")
        return rows[:, self.begin:self.end].contiguous()


class ShardedEmbeddingCollection(torch.nn.Module):
    """Embedding tables sharded row-, table- or column-wise by ``plan``.

    Args:
        plan: a :class:`~deltastream.ShardingPlan` whose ``world_size`` is the group's.
        process_group: the group (``None``: the default group), initialized.
        dtype, device, capacity: of every local table.
        initializer: one initializer for every table, or ``{table: initializer}``.

    Attributes:
        row_tables: ``{table: ShardedEmbedding}`` for row-wise tables.
        shards: ``{"<table>#<j>": HashTable}`` of the non-row shards on this rank.
    """

    def __init__(self, plan: ShardingPlan, *, process_group=None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 initializer: InitLike = None, capacity: int = 1024) -> None:
        super().__init__()
        if not isinstance(plan, ShardingPlan):
            raise TypeError(f"plan: expected a ShardingPlan, got {type(plan).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedEmbeddingCollection needs torch.distributed to be "
                               "initialized (call torch.distributed.init_process_group first)")
        self.plan = plan
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if self.world_size != plan.world_size:
            raise PlanError(f"plan is for {plan.world_size} ranks, the process group has "
                            f"{self.world_size}")
        self.device = torch.device(device)
        self.dtype = dtype

        def init_of(name: str):
            return initializer.get(name) if isinstance(initializer, Mapping) else initializer

        self.row_tables = torch.nn.ModuleDict()
        self.shards = torch.nn.ModuleDict()
        for name, tp in plan.tables.items():
            if tp.kind == "row":
                self.row_tables[name] = ShardedEmbedding(
                    tp.dim, name=name, process_group=process_group, dtype=dtype,
                    device=device, initializer=init_of(name),
                    slice_size=tp.shards[0].rows.size, capacity=capacity)
        for name, j, spec in plan.shards_on(self.rank):
            tp = plan.tables[name]
            if tp.kind == "row":
                continue
            b, e = spec.cols
            t = HashTable(e - b, name=f"{name}#{j}", dtype=dtype, device=device,
                          initializer=ColumnInitializer(init_of(name), b, e, tp.dim),
                          capacity=capacity)
            t.plan_table, t.column_offset, t.full_width, t.shard_id = name, b, tp.dim, j
            self.shards[f"{name}#{j}"] = t
        # non-row tables, in plan order; per rank, the (table, shard id, width) it holds
        self._col_tables = [n for n, tp in plan.tables.items() if tp.kind != "row"]
        self._on_rank = [[(n, j, s.width) for n, j, s in plan.shards_on(r)
                          if plan.tables[n].kind != "row"] for r in range(self.world_size)]
        self._perm = {n: output_permute(plan.tables[n]) for n in self._col_tables}
        self._holder = torch.zeros((), device=self.device, requires_grad=True)

    def extra_repr(self) -> str:
        return f"rank={self.rank}/{self.world_size}, tables={list(self.plan.tables)}"

    def forward(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{table: ids}`` (int, any shape) -> ``{table: [*ids.shape, dim]}``. Collective:
        every rank passes the same tables (a table missing here counts as no ids)."""
        unknown = sorted(set(features) - set(self.plan.tables))
        if unknown:
            raise KeyError(f"tables {unknown} are not in the plan {sorted(self.plan.tables)}")
        out: dict[str, torch.Tensor] = {}
        for name, emb in self.row_tables.items():
            ids = features.get(name)
            out[name] = emb(torch.zeros(0, dtype=torch.int64) if ids is None else ids)
        if self._col_tables:
            out.update(self._forward_columns(features))
        return {n: out[n] for n in self.plan.tables if n in features}

    def _forward_columns(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        W, T, dev, group = self.world_size, len(self._col_tables), self.device, self.process_group
        shapes, uniq, inverse = {}, {}, {}
        for name in self._col_tables:
            ids = features.get(name)
            ids = torch.zeros(0, dtype=torch.int64) if ids is None else ids
            if not isinstance(ids, torch.Tensor):
                ids = torch.as_tensor(ids, dtype=torch.int64)
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise TypeError(f"ids of table {name!r} must be integers, got {ids.dtype}")
            shapes[name] = (*ids.shape, self.plan.tables[name].dim)
            flat = ids.reshape(-1).to(device=dev, dtype=torch.int64)
            uniq[name], inverse[name] = torch.unique(flat, return_inverse=True)
        # 1. unique counts per table, from every rank: counts[s][t]
        mine = torch.tensor([uniq[n].numel() for n in self._col_tables], dtype=torch.int64,
                            device=dev)
        counts_t = torch.empty(W * T, dtype=torch.int64, device=dev)
        dist.all_to_all_single(counts_t, mine.repeat(W), group=group)
        col = {n: i for i, n in enumerate(self._col_tables)}
        counts = counts_t.view(W, T).tolist()
        # 2. ids to every shard's rank (per rank, its shards in shard order)
        send = [uniq[n] for r in range(W) for n, _, _ in self._on_rank[r]]
        send_splits = [sum(uniq[n].numel() for n, _, _ in self._on_rank[r]) for r in range(W)]
        local = self._on_rank[self.rank]
        recv_splits = [sum(counts[s][col[n]] for n, _, _ in local) for s in range(W)]
        send_ids = torch.cat(send) if send else torch.zeros(0, dtype=torch.int64, device=dev)
        recv_ids = send_ids.new_empty(sum(recv_splits))
        dist.all_to_all_single(recv_ids, send_ids, output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=group)
        # 3. each local shard looks up the ids every rank sent it
        sizes = [counts[s][col[n]] for s in range(W) for n, _, _ in local]
        segs = list(torch.split(recv_ids, sizes)) if sizes else []
        k = len(local)
        rows_of = []
        for i, (n, j, _) in enumerate(local):
            mine_ids = torch.cat([segs[s * k + i] for s in range(W)])
            rows = self.shards[f"{n}#{j}"](mine_ids)
            rows_of.append(torch.split(rows, [counts[s][col[n]] for s in range(W)]))
        # 4. rows back, flat (shards differ in width), sender-major then shard order
        back = [rows_of[i][s].reshape(-1).to(self.dtype) for s in range(W) for i in range(k)]
        back_splits = [sum(counts[s][col[n]] * w for n, _, w in local) for s in range(W)]
        got_splits = [sum(uniq[n].numel() * w for n, _, w in self._on_rank[r])
                      for r in range(W)]
        values = torch.cat(back) if back else torch.zeros(0, dtype=self.dtype, device=dev)
        got = ExchangeRows.apply(values, self._holder, back_splits, got_splits, group)
        # 5. pieces arrive by rank; stitch each table's in shard order (permute indices)
        arrived: dict[str, list[torch.Tensor]] = {n: [] for n in self._col_tables}
        pieces = torch.split(got, [uniq[n].numel() * w for r in range(W)
                                   for n, _, w in self._on_rank[r]])
        it = iter(pieces)
        for r in range(W):
            for n, _, w in self._on_rank[r]:
                arrived[n].append(next(it).view(uniq[n].numel(), w))
        out = {}
        for n in self._col_tables:
            parts = arrived[n]
            full = torch.cat([parts[p] for p in self._perm[n]], dim=1)
            out[n] = full.index_select(0, inverse[n]).reshape(shapes[n])
        return out
