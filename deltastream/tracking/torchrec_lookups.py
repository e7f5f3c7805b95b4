"""The ids each fused TorchRec kernel looks up: the lookups path of sharded TorchRec tables.

A ``ShardedEmbeddingBagCollection`` / ``ShardedEmbeddingCollection`` runs its local shards
through embedding kernels (``module._lookups[i]._emb_modules[j]``, fbgemm's table-batched
embedding). A **fused** kernel (``BatchedFusedEmbeddingBag`` / ``BatchedFusedEmbedding``)
applies its optimizer (SGD, Adagrad, row-wise Adagrad, Adam, ... — fbgemm's sparse
optimizers, weight decay included) inside the backward, to exactly the rows in the ids it
was fed in the forward. So the ids a fused kernel receives — this rank's **local** rows of
each shard, after TorchRec's input distribution: a row-wise shard's rows count from 0 — are
every row that can change, and the tracker needs no shadow copy: its "lookups" path.
Data-parallel tables (rows also move with the other ranks' gradients, all-reduced) and
non-fused kernels (a ``torch.optim`` optimizer over the weights) stay on the scan.

:func:`fused_slots` says which local shards sit in a fused kernel; :class:`LookupTap` hooks
the kernels of one collection and hands each shard's local ids to a callback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch

__all__ = ["Slot", "fused_slots", "LookupTap", "tap_tables"]

log = logging.getLogger(__name__)

#: a local shard: (table name, first row, first column)
Slot = tuple[str, int, int]

_FUSED = ("BatchedFusedEmbeddingBag", "BatchedFusedEmbedding")


def _kernels(owner: torch.nn.Module) -> list[torch.nn.Module]:
    out = []
    for lookup in getattr(owner, "_lookups", None) or ():
        out.extend(getattr(lookup, "_emb_modules", None) or ())
    return out


def _is_fused(kernel: torch.nn.Module) -> bool:
    return any(k.__name__ in _FUSED for k in type(kernel).__mro__)


def _slots_of(kernel: torch.nn.Module) -> list[tuple[Optional[Slot], int]]:
    """Per table of ``kernel``'s config, in its feature order: ``(slot, features)``."""
    config = getattr(kernel, "_config", None)
    out: list[tuple[Optional[Slot], int]] = []
    for table in getattr(config, "embedding_tables", None) or ():
        meta = getattr(table, "local_metadata", None)
        slot = None if meta is None else (str(table.name), int(meta.shard_offsets[0]),
                                          int(meta.shard_offsets[1]))
        out.append((slot, int(table.num_features())))
    return out


def fused_slots(owner: torch.nn.Module) -> set[Slot]:
    """The local shards of collection ``owner`` that a fused kernel updates."""
    found: set[Slot] = set()
    for kernel in _kernels(owner):
        if _is_fused(kernel):
            found.update(s for s, _ in _slots_of(kernel) if s is not None)
    return found


class LookupTap:
    """Forward hooks on the fused kernels of one sharded collection.

    Its fused optimizer changes the rows only in the backward, so during the forward they
    still hold their FIRST state. Without ``before_update`` the ids are recorded after the
    kernel's forward, which has just read the rows (the tracker's copy of each new row then
    mostly hits the cache: 0.15 instead of 0.21 ms per step in ``deltastream bench
    torchrec-tracker --collection ebc``). With it, before the forward, ``later``: the marking
    and the copy run on the C code's lane thread beside the kernel (the rows it copies are
    in the shared cache when the kernel reads them), and a forward hook calls
    ``before_update``, which waits for them, once the kernel's forward returned — before
    any backward (the fused update) can start. (A gradient hook on the kernel's output,
    waiting only at the backward, cost more than it let overlap: registering it and calling
    it from the backward took ~30 us a step, and the copy of a step's new rows is done by
    the time the kernel's forward is: ``BENCHMARKS.md``.)

    Args:
        owner: the sharded collection (its ``training`` flag says whether a lookup trains:
            the kernels are not registered submodules, so ``model.eval()`` reaches only it).
        keys: ``{slot: tracker key}`` of the shards to report.
        on_ids: ``on_ids(key, local_ids, later)`` per training lookup of a reported shard
            (``local_ids``: int64 ``[n]``, rows of the local shard, repeats allowed;
            ``later``: the FIRST rows may be copied off the training thread until
            ``before_update`` runs).
        wrap: applied to the hooks (the tracker keeps its hooks out of ``torch.compile``).
        before_update: called after the kernel's forward of a training lookup (before
            its backward); None: every lookup is recorded with ``later`` False.
    """

    def __init__(self, owner: torch.nn.Module, keys: dict[Slot, str],
                 on_ids: Callable[[str, torch.Tensor, bool], None],
                 wrap: Callable[[Any], Any] = lambda f: f,
                 before_update: Optional[Callable[[], None]] = None) -> None:
        self._owner = owner
        self._on_ids = on_ids
        self._before_update = before_update
        self.handles: list[Any] = []
        for kernel in _kernels(owner):
            if not _is_fused(kernel):
                continue
            routes = [(keys.get(slot) if slot is not None else None, nf)
                      for slot, nf in _slots_of(kernel)]
            if not any(k is not None for k, _ in routes):
                continue
            if before_update is None:
                self.handles.append(kernel.register_forward_hook(
                    wrap(self._hook(routes, False))))
            else:
                self.handles.append(kernel.register_forward_pre_hook(
                    wrap(self._hook(routes, True))))
                self.handles.append(kernel.register_forward_hook(wrap(self._after)))

    def _hook(self, routes: list[tuple[Optional[str], int]], later: bool):
        def hook(kernel: torch.nn.Module, args: tuple, output: Any = None) -> None:
            if not args or not (self._owner.training and torch.is_grad_enabled()):
                return
            features = args[0]
            values = features.values()
            lengths = features.length_per_key()  # features in the kernel's table order
            start = f = 0
            for key, nf in routes:
                n = int(sum(lengths[f:f + nf]))
                if key is not None and n:
                    v = values[start:start + n]
                    # .to() costs ~3 us even when it returns its input: only when needed
                    self._on_ids(key, v if v.dtype == torch.int64 else v.to(torch.int64),
                                 later)
                start += n
                f += nf
        return hook

    def _after(self, kernel: torch.nn.Module, args: tuple, output: Any) -> None:
        # the FIRST rows were copied beside the kernel's forward; its backward (a fused
        # optimizer's update) must find them copied
        if args and self._owner.training and torch.is_grad_enabled():
            self._before_update()

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self.handles:
            h.remove()
        self.handles = []


def tap_tables(tables: dict[str, Any], on_ids: Callable[[str, torch.Tensor, bool], None],
               on_reload: Callable[[list[str]], Any],
               wrap: Callable[[Any], Any] = lambda f: f,
               before_update: Optional[Callable[[], None]] = None) -> list[Any]:
    """Hook every collection holding one of ``tables`` (``{tracker key: TorchRecTable}`` on
    the lookups path): a :class:`LookupTap` calling ``on_ids(key, local_ids, later)`` and
    ``before_update``, and a ``load_state_dict`` pre-hook calling ``on_reload(keys of that
    collection)``. Returns the hook handles (``remove()`` each to detach)."""
    owners: dict[int, tuple[torch.nn.Module, dict[Slot, str]]] = {}
    for key, t in tables.items():
        owners.setdefault(id(t.owner), (t.owner, {}))[1][
            (t.name, t.row_offset, t.column_offset)] = key
    handles: list[Any] = []
    for owner, keys in owners.values():
        handles.extend(LookupTap(owner, keys, on_ids, wrap, before_update).handles)
        fqns = list(keys.values())
        handles.append(owner.register_load_state_dict_pre_hook(
            wrap(lambda m, *a, fqns=fqns: on_reload(fqns))))
    return handles
