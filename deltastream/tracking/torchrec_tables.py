"""TorchRec embedding collections as tables a :class:`~deltastream.DeltaTracker` tracks.

TorchRec is optional: nothing here imports it unless the model already did (a TorchRec
module cannot exist otherwise), so this module is cheap to import without TorchRec.

:func:`torchrec_tables` turns one TorchRec module into :class:`TorchRecTable` views, one per
table (or per shard of a table this rank holds):

* unsharded ``EmbeddingBagCollection`` / ``EmbeddingCollection``: the whole ``nn.EmbeddingBag``
  / ``nn.Embedding`` weight of each table;
* ``ShardedEmbeddingBagCollection`` / ``ShardedEmbeddingCollection`` (what
  ``DistributedModelParallel`` puts in their place): this rank's **local shards**, read from
  the module's ``state_dict`` once. Their tensors are views of the live weights (the fused
  kernel's own storage), so reading a row never copies a table. Table-wise, row-wise,
  column-wise, table-wise-column-wise and data-parallel plans all have this form: a shard
  holds rows ``[row_offset, row_offset + rows)`` and columns ``[column_offset,
  column_offset + embedding_dim)`` of a table ``full_width`` wide.

A shard a fused kernel updates is tracked from its lookups (``fused``: the kernel's
optimizer moves only the rows it was fed; :mod:`.torchrec_lookups`); every other table
(unsharded, data-parallel, a non-fused kernel) by the exact scan.

A view speaks global ids: :meth:`TorchRecTable.lookup` takes global row ids (a row-wise
shard's local row plus its offset) and the tracker adds ``row_offset`` to the rows its scan
finds. Names are TorchRec's: ``name`` and ``plan_table`` are the table name (what
:func:`~deltastream.publish_delta` publishes under), and a table split in several shards
carries ``shard_id`` (the shard's position in the table's shard list, ordered by row then
column offset: the same on every rank), ``column_offset`` and ``full_width``, so each
shard publishes its own sequence stream with wire v2 ``col``/``width``.

Any other TorchRec embedding module (managed collision, quantized, ITEP, KV/SSD-backed
tables, ...) is refused with a ``ValueError`` naming it: its rows cannot be read exactly.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from deltastream.tracking.torchrec_lookups import fused_slots

__all__ = ["TorchRecTable", "TORCHREC_KIND", "is_torchrec_module", "torchrec_tables",
           "unwrap_dmp"]

log = logging.getLogger(__name__)

#: ``TrackedTable.kind`` of a TorchRec table
TORCHREC_KIND = "torchrec"

# (module class path, attribute holding the per-table modules / state_dict prefix)
_UNSHARDED = {
    "torchrec.modules.embedding_modules.EmbeddingBagCollection": "embedding_bags",
    "torchrec.modules.embedding_modules.EmbeddingCollection": "embeddings",
}
_SHARDED = {
    "torchrec.distributed.embeddingbag.ShardedEmbeddingBagCollection": "embedding_bags",
    "torchrec.distributed.embedding.ShardedEmbeddingCollection": "embeddings",
    "torchrec.distributed.fused_embeddingbag.ShardedFusedEmbeddingBagCollection":
        "embedding_bags",
    "torchrec.distributed.fused_embedding.ShardedFusedEmbeddingCollection": "embeddings",
}


def _class_path(mod: Any) -> str:
    cls = type(mod)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_torchrec_module(mod: torch.nn.Module) -> bool:
    """True for a module defined by TorchRec (without importing TorchRec)."""
    return "torchrec" in sys.modules and type(mod).__module__.startswith("torchrec.")


def unwrap_dmp(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module a ``DistributedModelParallel`` wraps (possibly a DDP of it), else None."""
    if not is_torchrec_module(model) or type(model).__name__ != "DistributedModelParallel":
        return None
    inner = getattr(model, "_dmp_wrapped_module", None)
    return inner if isinstance(inner, torch.nn.Module) else None


@dataclass
class TorchRecTable:
    """One TorchRec table, or the part of it this rank holds, as the tracker reads it.

    Attributes:
        name: the TorchRec table name (``plan_table`` too: the published name).
        sharding: ``"unsharded"`` or TorchRec's sharding type (``"table_wise"``, ...).
        num_embeddings: rows of the whole table; ``full_width``: its width, set only for a
            table split in several shards (else ``None``: whole rows).
        row_offset, rows: global rows ``[row_offset, row_offset + rows)`` held here.
        column_offset, embedding_dim: columns ``[column_offset, column_offset +
            embedding_dim)`` held here.
        shard_id: this shard's position in the table's shard list (``None`` for a table in
            one piece).
        fused: a fused kernel updates this shard, only at the rows it looks up (so the
            tracker's lookups path is exact: :mod:`.torchrec_lookups`).
        owner: the (sharded) collection module holding the table.
    """

    name: str
    sharding: str
    num_embeddings: int
    rows: int
    embedding_dim: int
    row_offset: int
    column_offset: int
    full_width: Optional[int]
    shard_id: Optional[int]
    _get_weight: Callable[[], torch.Tensor]
    fused: bool = False
    owner: Optional[torch.nn.Module] = None

    @property
    def plan_table(self) -> str:
        """The table name (what :func:`~deltastream.publish_delta` publishes under)."""
        return self.name

    @property
    def weight(self) -> torch.Tensor:
        """This shard's live ``[rows, embedding_dim]`` weight (a view, no copy)."""
        return self._get_weight()

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Current rows ``[n, embedding_dim]`` of global row ``ids`` ``[n]`` (detached).

        Raises ``ValueError`` for an id outside ``[row_offset, row_offset + rows)``.
        """
        w = self.weight
        pos = ids.to(device=w.device, dtype=torch.int64).reshape(-1) - self.row_offset
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= w.shape[0]):
            raise ValueError(
                f"ids of TorchRec table {self.name!r} held here must be in "
                f"[{self.row_offset}, {self.row_offset + w.shape[0]}), got "
                f"[{int(pos.min()) + self.row_offset}, {int(pos.max()) + self.row_offset}]")
        return w.detach().index_select(0, pos)


def _refuse(name: str, mod: torch.nn.Module, why: str) -> ValueError:
    return ValueError(f"DeltaTracker cannot track TorchRec module {name or '<root>'} "
                      f"({type(mod).__name__}) exactly: {why}; add {name or '<root>'!r} to "
                      f"fqns_to_skip to leave it out")


def _unsharded(name: str, mod: torch.nn.Module, attr: str) -> dict[str, TorchRecTable]:
    tables = getattr(mod, attr)
    prefix = f"{name}.{attr}" if name else attr
    out = {}
    for tname, emb in tables.items():
        w = emb.weight
        out[f"{prefix}.{tname}"] = TorchRecTable(
            tname, "unsharded", int(w.shape[0]), int(w.shape[0]), int(w.shape[1]), 0, 0,
            None, None, (lambda e=emb: e.weight), False, mod)
    return out


def _plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter) \
        and t.dim() == 2


def _sharded(name: str, mod: torch.nn.Module, attr: str) -> dict[str, TorchRecTable]:
    kinds = {}
    for tname, ps in (getattr(mod, "module_sharding_plan", None) or {}).items():
        kinds[tname] = str(getattr(ps, "sharding_type", "") or "")
    prefix = f"{name}.{attr}" if name else attr
    fused = fused_slots(mod)
    out: dict[str, TorchRecTable] = {}
    for key, value in mod.state_dict().items():
        if not key.startswith(attr + ".") or not key.endswith(".weight"):
            continue
        tname = key[len(attr) + 1:-len(".weight")]
        fqn = f"{prefix}.{tname}"
        kind = kinds.get(tname, "data_parallel")
        if _plain(value):  # data-parallel: every rank holds the whole table
            w = value
            out[fqn] = TorchRecTable(tname, kind, int(w.shape[0]), int(w.shape[0]),
                                     int(w.shape[1]), 0, 0, None, None, (lambda t=w: t),
                                     False, mod)
            continue
        if not callable(getattr(value, "local_shards", None)):
            raise _refuse(name, mod, f"table {tname!r} has a {type(value).__name__} weight "
                          "(neither a tensor nor a ShardedTensor)")
        meta = value.metadata()
        size = tuple(int(s) for s in meta.size)
        order = sorted(range(len(meta.shards_metadata)),
                       key=lambda i: tuple(meta.shards_metadata[i].shard_offsets))
        index = {tuple(meta.shards_metadata[i].shard_offsets): k for k, i in enumerate(order)}
        split = len(order) > 1
        local = value.local_shards()
        for shard in local:
            t = shard.tensor
            if not _plain(t):
                raise _refuse(name, mod, f"shard of table {tname!r} is a {type(t).__name__}, "
                              "not an in-memory tensor (KV/SSD-backed tables are not "
                              "supported)")
            r0, c0 = (int(o) for o in shard.metadata.shard_offsets)
            sid = index[(r0, c0)]
            key_out = fqn if len(local) == 1 else f"{fqn}#{sid}"
            out[key_out] = TorchRecTable(
                tname, kind, size[0], int(t.shape[0]), int(t.shape[1]), r0, c0,
                size[1] if split else None, sid if split else None, (lambda x=t: x),
                (tname, r0, c0) in fused, mod)
    return out


def torchrec_tables(name: str, mod: torch.nn.Module) -> Optional[dict[str, TorchRecTable]]:
    """The tables of TorchRec module ``mod`` (at FQN ``name``) by tracker key, or ``None``
    when ``mod`` is not a TorchRec embedding module.

    Keys are ``<name>.embedding_bags.<table>`` (``.embeddings.`` for an
    ``EmbeddingCollection``), the FQN TorchRec's ``state_dict`` uses; a rank holding several
    shards of one table (column-wise) gets ``<fqn>#<shard_id>`` per shard. Raises
    ``ValueError`` naming a TorchRec embedding module it cannot track exactly.
    """
    if not is_torchrec_module(mod):
        return None
    path = _class_path(mod)
    if path in _UNSHARDED:
        return _unsharded(name, mod, _UNSHARDED[path])
    if path in _SHARDED:
        return _sharded(name, mod, _SHARDED[path])
    cls = type(mod).__name__
    if "Embedding" not in cls:
        return None
    if ".quant." in path or "Quant" in cls:
        raise _refuse(name, mod, "a quantized (inference) table is not trained")
    if "ManagedCollision" in cls or "MCH" in cls:
        raise _refuse(name, mod, "managed collision remaps the ids to slots, so its rows "
                      "are not keyed by the ids the model is fed")
    if cls.startswith("Sharded") or "ITEP" in cls or "PEC" in cls:
        raise _refuse(name, mod, "only EmbeddingBagCollection and EmbeddingCollection, "
                      "unsharded or sharded by DistributedModelParallel, are supported")
    return None  # a container (e.g. feature-processed): the collections inside are found
