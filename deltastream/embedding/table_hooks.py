"""The hooks of a :class:`~deltastream.embedding.hashtable.HashTable`: insert, evict, lookup,
write and update hooks (with removable handles) and weakly held row listeners.

A mixin of the table: the table owns the hook dicts and the listener list (made in its
``__init__``) and fires them (:meth:`TableHooks._fire`, :meth:`TableHooks._notify_rows`);
the tracker and the sparse optimizers register here.
"""

from __future__ import annotations

import inspect
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["TableHooks"]


def _add_hook(hooks: OrderedDict, fn: Callable) -> RemovableHandle:
    if not callable(fn):
        raise TypeError(f"hook must be callable, got {fn!r}")
    handle = RemovableHandle(hooks)
    hooks[handle.id] = fn
    return handle


class TableHooks:
    """Hook registration and firing of a table (``_insert_hooks``, ``_evict_hooks``,
    ``_lookup_hooks``, ``_write_hooks``: ordered dicts; ``_row_listeners``: weak
    references)."""

    _insert_hooks: OrderedDict
    _evict_hooks: OrderedDict
    _row_listeners: list
    storage: torch.Tensor  # the table's [capacity, dim] rows (a property of the table)

    def register_insert_hook(self, fn: Callable[[Any, torch.Tensor], None]
                             ) -> RemovableHandle:
        """Call ``fn(table, new_ids)`` once per forward/insert that inserted ids.

        ``new_ids`` is int64 ``[k]``, ascending, k > 0. Returns a handle with ``.remove()``.
        """
        return _add_hook(self._insert_hooks, fn)

    def register_evict_hook(self, fn: Callable[[Any, torch.Tensor], None]
                            ) -> RemovableHandle:
        """Call ``fn(table, evicted_ids)`` once per :meth:`evict` that removed ids.

        ``evicted_ids`` is int64 ``[k]``, ascending, k > 0. Returns a handle with ``.remove()``.
        """
        return _add_hook(self._evict_hooks, fn)

    def register_lookup_hook(
            self, fn: Callable[[Any, Optional[torch.Tensor], torch.Tensor], None]
    ) -> RemovableHandle:
        """Call ``fn(table, positions, rows)`` at the end of every :meth:`forward`.

        Training mode: ``positions`` is int64 ``[N]``, the storage row position of each
        looked-up id (flattened order, after inserts; see :meth:`positions`), and ``rows``
        the ``[N, dim]`` result (before the reshape to ``[*ids.shape, dim]``, sharing its
        memory). Eval mode: ``positions`` is ``None`` (nothing was resolved for training).
        Both are the forward's own tensors: read them, never modify them. Unlike a module
        forward hook it also fires when ``forward`` is called directly. Returns a handle
        with ``.remove()``.
        """
        return _add_hook(self.__dict__.setdefault("_lookup_hooks", OrderedDict()), fn)

    def register_write_hook(
            self, fn: Callable[[Any, torch.Tensor, torch.Tensor], None]) -> RemovableHandle:
        """Call ``fn(table, positions, rows)`` when :meth:`insert` writes rows (a write
        without a lookup): before it overwrites rows the table holds, with their values
        before the write, and after it stores new ids, with the values stored. ``positions``
        int64 ``[k]``, ``rows`` ``[k, dim]`` (a gather: the hook may keep it), k > 0, in
        training and eval mode alike. Returns a handle with ``.remove()``."""
        return _add_hook(self.__dict__.setdefault("_write_hooks", OrderedDict()), fn)

    def register_update_hook(self, fn: Callable[[Any], None]) -> RemovableHandle:
        """Call ``fn(table)`` whenever :meth:`sparse_grad` hands out the gradient: before an
        optimizer moves rows with it (the tracker finishes copying the rows its lookups
        read here). Returns a handle with ``.remove()``."""
        return _add_hook(self.__dict__.setdefault("_update_hooks", OrderedDict()), fn)

    def _fire_update(self) -> None:
        hooks = self.__dict__.get("_update_hooks")  # absent on tables pickled before
        if hooks:
            for fn in list(hooks.values()):
                fn(self)

    def _fire_writes(self, positions: torch.Tensor, rows: Optional[torch.Tensor] = None
                     ) -> None:
        """Write hooks for ``positions``: ``rows`` their values (a tensor the hooks may
        keep), or None to gather them from the storage now."""
        hooks = self.__dict__.get("_write_hooks")  # absent on tables pickled before
        if hooks:
            if rows is None:
                rows = self.storage.index_select(0, positions)
            for fn in list(hooks.values()):
                fn(self, positions, rows)

    def _fire(self, hooks: OrderedDict, ids: torch.Tensor) -> None:
        for fn in list(hooks.values()):
            fn(self, ids)

    def register_row_listener(
            self, callback: Callable[[Any, Optional[torch.Tensor]], None]) -> None:
        """Call ``callback(table, positions)`` when rows are freed, before any freed position
        is reused: ``positions`` int64 ``[k]`` (:meth:`evict`) or ``None`` (all rows,
        :meth:`clear`).

        Sparse optimizers reset the state of freed rows; the tracker turns recorded
        positions into ids (:meth:`ids_at`) while they still hold them. Held weakly (a
        bound method through :class:`weakref.WeakMethod`): keep a reference to
        ``callback`` as long as it should be called; there is no handle to remove it.
        """
        ref = weakref.WeakMethod(callback) if inspect.ismethod(callback) else weakref.ref(callback)
        self._row_listeners.append(ref)

    def _notify_rows(self, positions: Optional[torch.Tensor]) -> None:
        alive = []
        for ref in self._row_listeners:
            cb = ref()
            if cb is not None:
                cb(self, positions)
                alive.append(ref)
        self._row_listeners = alive
