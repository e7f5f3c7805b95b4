"""The demo's small CTR model: user and item embedding tables + an MLP.

``logit = MLP(concat[u, v, u*v, dense])`` with ``u = user(user_id)``, ``v = item(item_id)``.
The tables are :class:`~deltastream.HashTable` (one process) or
:class:`~deltastream.ShardedEmbedding` (``sharded=True``: each rank owns the rows of its
slice range; lookups and gradients are routed by ``torch.distributed``), or with
``sharding="table"`` / ``"column"`` a :class:`~deltastream.ShardedEmbeddingCollection`
executing :func:`demo_plan`. Table names are ``"user"`` and ``"item"`` either way; those are
the names rows are published under.

The dense part is exported to plain numpy arrays with :func:`export_dense` so that a
torch-free predictor can run the same forward pass (:mod:`deltastream_demo.scoring`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from deltastream.embedding.hashtable import HashTable, normal_initializer

__all__ = ["CTRModel", "click_mlp", "export_dense", "local_tables", "demo_plan", "TABLE_NAMES"]

TABLE_NAMES = ("user", "item")


def click_mlp(dim: int, n_dense: int, hidden: Sequence[int],
              device: torch.device) -> torch.nn.Sequential:
    """The click MLP over ``[u, v, u*v, dense]`` (``3 * dim + n_dense`` wide): ``hidden``
    ReLU layers, then one logit."""
    layers: list[torch.nn.Module] = []
    width = 3 * dim + n_dense
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers).to(device)


class CTRModel(torch.nn.Module):
    """User/item embeddings + MLP click model.

    Args:
        dim: embedding width (> 0).
        n_dense: dense features per example (>= 0).
        hidden: widths of the hidden MLP layers.
        sharded: use :class:`~deltastream.ShardedEmbedding` over the default process group.
        device: where rows and weights live.
        init_std: std of the normal initializer of new rows (mean 0, so unseen ids read as
            zeros in eval mode — the same as a serving table's missing rows).
        seed: seeds the row initializers (dense weights follow ``torch.manual_seed``).
        process_group: for ``sharded=True``; ``None`` = the default group.
        sharding: with ``sharded=True``: ``"row"`` (:class:`~deltastream.ShardedEmbedding`
            per table), ``"table"`` or ``"column"`` (:func:`demo_plan`).
    """

    def __init__(self, dim: int, n_dense: int, hidden: Sequence[int] = (64, 32), *,
                 sharded: bool = False, device: torch.device | str = "cpu",
                 init_std: float = 0.05, seed: Optional[int] = None,
                 process_group=None, sharding: str = "row") -> None:
        super().__init__()
        if not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(n_dense, int) or n_dense < 0:
            raise ValueError(f"n_dense must be an int >= 0, got {n_dense!r}")
        if not hidden or any(not isinstance(h, int) or h <= 0 for h in hidden):
            raise ValueError(f"hidden must be a non-empty list of positive ints, got {hidden!r}")
        self.dim = dim
        self.n_dense = n_dense
        self.sharded = sharded
        self.plan = None
        tables = []
        inits = {name: normal_initializer(init_std, seed=None if seed is None else seed * 7919 + i)
                 for i, name in enumerate(TABLE_NAMES)}
        if sharded and sharding != "row":
            import torch.distributed as dist

            from deltastream.embedding.collection import ShardedEmbeddingCollection

            self.plan = demo_plan(sharding, dim, dist.get_world_size(process_group))
            self.emb = ShardedEmbeddingCollection(self.plan, process_group=process_group,
                                                  device=device, initializer=inits,
                                                  capacity=16384)
        for name in TABLE_NAMES if self.plan is None else ():
            init = inits[name]
            if sharded:
                from deltastream.embedding.sharded import ShardedEmbedding

                tables.append(ShardedEmbedding(dim, name=name, process_group=process_group,
                                               device=device, initializer=init,
                                               capacity=16384))
            else:
                tables.append(HashTable(dim, name=name, device=device, initializer=init,
                                        capacity=16384))
        if self.plan is None:
            self.user, self.item = tables
        self.mlp = click_mlp(dim, n_dense, hidden, device)

    def forward(self, user_ids: torch.Tensor, item_ids: torch.Tensor,
                dense: torch.Tensor) -> torch.Tensor:
        """Click logits ``[B]`` for int64 ``user_ids [B]``, ``item_ids [B]``, ``dense [B, n_dense]``."""
        if self.plan is not None:
            out = self.emb({"user": user_ids, "item": item_ids})
            u, v = out["user"], out["item"]
        else:
            u = self.user(user_ids)
            v = self.item(item_ids)
        x = torch.cat([u, v, u * v, dense.to(u.dtype)], dim=1)
        return self.mlp(x).squeeze(1)

    def dense_parameters(self) -> list[torch.nn.Parameter]:
        """The MLP's parameters (the only ``Parameter`` s: table rows are not parameters)."""
        return list(self.mlp.parameters())


def demo_plan(sharding: str, dim: int, world: int):
    """The demo's :class:`~deltastream.ShardingPlan` for ``sharding`` ``"table"`` (user on
    rank 0, item on rank 1 mod ``world``) or ``"column"`` (each table's columns split evenly
    over every rank, shard ``i`` on rank ``i``)."""
    from deltastream.embedding.plan import ShardingPlan, column_wise, table_wise

    if sharding == "table":
        return ShardingPlan.of(world, [table_wise(n, dim, i % world)
                                       for i, n in enumerate(TABLE_NAMES)])
    if sharding == "column":
        return ShardingPlan.of(world, [column_wise(n, dim, list(range(world)))
                                       for n in TABLE_NAMES])
    raise ValueError(f"sharding: expected 'table' or 'column', got {sharding!r}")


def local_tables(model: torch.nn.Module) -> dict[str, HashTable]:
    """``{table name: local HashTable}`` of ``model`` (a sharded table's local shard)."""
    out: dict[str, HashTable] = {}
    for mod in model.modules():
        if isinstance(mod, HashTable):
            if mod.name in out:
                raise ValueError(f"two HashTables are named {mod.name!r}")
            out[mod.name] = mod
    return out


@torch.no_grad()
def export_dense(model: CTRModel) -> dict[str, np.ndarray]:
    """The MLP as ``{"w0", "b0", "w1", …}`` float32 numpy arrays (``w{i}`` is ``[out, in]``).

    :func:`deltastream_demo.scoring.mlp_logits` runs the same forward pass.
    """
    linears = [m for m in model.mlp if isinstance(m, torch.nn.Linear)]
    out: dict[str, np.ndarray] = {}
    for i, lin in enumerate(linears):
        out[f"w{i}"] = lin.weight.detach().float().cpu().numpy().copy()
        out[f"b{i}"] = lin.bias.detach().float().cpu().numpy().copy()
    return out
