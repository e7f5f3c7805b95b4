"""Dynamic embedding table: a vectorized id -> row hash index over growable row storage.

:class:`HashTable` is a ``torch.nn.Module`` that maps arbitrary int64 ids (negative ones
included) of its :class:`~deltastream.sharding.Slice` range to rows of width
``embedding_dim``. It is used like ``torch.nn.Embedding`` without a vocabulary size::

    >>> import torch
    >>> from deltastream import HashTable, SparseAdam
    >>> from deltastream.embedding.initializers import normal_initializer
    >>> table = HashTable(16, name="user", initializer=normal_initializer(0.01))
    >>> opt = SparseAdam(table, lr=1e-2)       # dense layers: a normal torch optimizer
    >>> out = table(torch.tensor([[3, 10**12], [-7, 3]]))   # [2, 2, 16]; inserts 3 ids
    >>> out.sum().backward()
    >>> opt.step(); opt.zero_grad()            # updates only the 3 touched rows
    >>> len(table)
    3

Design (why this shape):

* **Index**: an open-addressing hash index over flat tensors that resolves a whole batch
  of ids per probing round (:mod:`deltastream.embedding.hash_index`); on CUDA its
  operations are Triton kernels with the probe loop inside (:mod:`deltastream.kernels.hash_probe`).
  What a call costs there: :meth:`HashTable.positions` 2 launches, ``lookup`` (and eval
  forward) 5, no host sync; a training forward 1 find-or-insert kernel and one
  device->host read (the count of new ids), plus the row gather.
* **Rows** live in one contiguous ``[capacity, dim]`` tensor that grows geometrically
  (x1.5, rounded up to whole blocks of 1024 rows) so that a lookup is a single
  ``index_select`` kernel. A list of separate blocks would avoid the copy at growth but turn
  every gather into a per-block loop; the copy is amortized O(1) per row. Positions freed by
  :meth:`HashTable.evict` go on a free list and are handed out again before the storage grows.
* **Gradients** are sparse: backward stashes ``(positions, ids, grad)`` and
  :meth:`HashTable.sparse_grad` coalesces them on demand
  (:mod:`deltastream.embedding.sparse_grad`). Sparse optimizers are in :mod:`deltastream.embedding.optim`; the storage is deliberately not a
  ``Parameter``, so ``model.parameters()`` lists only dense weights for a dense optimizer.

Values of unseen ids read in eval mode or by :meth:`HashTable.lookup`: the initializer's
``eval_value`` attribute when it has one (:func:`constant_initializer` -> its constant),
otherwise zeros (:func:`uniform_initializer` and plain callables); :func:`normal_initializer`
reads as its mean (0 by default). The value does not depend on the id.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Optional

import torch

from deltastream.embedding.hash_index import HashIndex
from deltastream.embedding.initializers import (
    Initializer,
    accepted_kwargs,
    constant_initializer,
    init_rows,
    normal_initializer,
    uniform_initializer,
)
from deltastream.embedding.sparse_grad import GradStash, SparseGrad, gather_rows
from deltastream.embedding.table_hooks import TableHooks
from deltastream.sharding import DEFAULT_SLICE_SIZE, Slice

# The initializers live in .initializers; they are re-exported here, where users have
# always imported them from.
__all__ = [
    "HashTable",
    "SparseGrad",
    "Initializer",
    "normal_initializer",
    "uniform_initializer",
    "constant_initializer",
]

log = logging.getLogger(__name__)

_BLOCK_ROWS = 1024  # row storage grows in whole blocks of this many rows
_GROWTH = 1.5
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------- the table


class HashTable(TableHooks, torch.nn.Module):
    """Dynamic id -> row embedding table for the ids of one slice range.

    Args:
        embedding_dim: row width (> 0).
        name: table name, used in logs, optimizer state and by the tracker/publisher.
        dtype: floating point row dtype.
        device: where rows and index live (``"cpu"``, ``"cuda"``, ...).
        initializer: ``init(n, dim, **kw) -> Tensor[n, dim]`` for new rows; keyword
            arguments ``device``, ``dtype`` and ``ids`` (the new ids, ascending) are passed
            when the callable accepts them. ``None`` = zeros. See the module docstring for
            what unseen ids read as in eval mode.
        slice: the :class:`Slice` range whose ids this table may hold (default: all ids).
        capacity: rows allocated up front (the storage grows beyond it on demand).

    ``forward(ids)`` takes int ids of any shape and returns ``[*ids.shape, dim]``. In
    training mode unseen ids are inserted first and the result has autograd to the touched
    rows (see :meth:`sparse_grad`); in eval mode nothing is inserted, unseen ids read as the
    eval value and the result carries no autograd. ``insert``, ``forward`` and ``lookup``
    raise ``ValueError`` for an id outside the slice range; ``contains`` answers False and
    ``evict`` ignores such ids (the table can never hold them).

    Example (``torch.nn.Embedding``-style, no vocabulary size)::

        >>> emb = HashTable(8, name="item")
        >>> emb(torch.tensor([[1, 2], [2, -3]])).shape
        torch.Size([2, 2, 8])
        >>> len(emb), emb.contains(torch.tensor([2, 5])).tolist()
        (3, [True, False])
    """

    def __init__(self, embedding_dim: int, *, name: str, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 initializer: Optional[Callable[..., torch.Tensor]] = None,
                 slice: Optional[Slice] = None, capacity: int = 1024) -> None:  # noqa: A002
        super().__init__()
        if not isinstance(embedding_dim, int) or isinstance(embedding_dim, bool) \
                or embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be a positive int, got {embedding_dim!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
        if slice is None:
            slice = Slice(0, DEFAULT_SLICE_SIZE, DEFAULT_SLICE_SIZE)  # noqa: A001
        if not isinstance(slice, Slice):
            raise TypeError(f"slice must be a deltastream.Slice, got {type(slice).__name__}")
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if initializer is not None and not callable(initializer):
            raise TypeError(f"initializer must be callable or None, got {initializer!r}")

        self.embedding_dim = embedding_dim
        self.name = name
        self.slice = slice
        self.device = torch.device(device)
        self.dtype = dtype
        self.initializer = initializer
        self._init_kwargs = accepted_kwargs(initializer, ("device", "dtype", "ids"))
        self._eval_value = float(getattr(initializer, "eval_value", 0.0))

        dev = self.device
        # row storage: rows [capacity, dim]; id and liveness of every position
        self._weight = torch.zeros(capacity, embedding_dim, dtype=dtype, device=dev)
        self.device = dev = self._weight.device  # "cuda" -> "cuda:0": compare equal later
        self._pos_ids = torch.zeros(capacity, dtype=torch.int64, device=dev)
        self._occupied = torch.zeros(capacity, dtype=torch.bool, device=dev)
        self._hw = 0  # high-water mark: positions >= _hw were never used
        self._free = torch.empty(0, dtype=torch.int64, device=dev)  # evicted positions
        self._live = 0
        self._index = HashIndex(capacity, dev, name)
        # autograd
        self._holder = torch.zeros((), device=dev, requires_grad=True)
        self._grads = GradStash(embedding_dim, dtype)
        # hooks and row-state listeners (sparse optimizers)
        self._insert_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._evict_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._lookup_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._write_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._row_listeners: list[weakref.ref] = []

    # ------------------------------------------------------------------ small helpers

    def __len__(self) -> int:
        return self._live

    def __bool__(self) -> bool:  # an empty table is still a module, not "falsy"
        return True

    @property
    def capacity(self) -> int:
        """Rows currently allocated in the storage (>= ``len(self)``)."""
        return int(self._weight.shape[0])

    @property
    def storage(self) -> torch.Tensor:
        """The row storage ``[capacity, dim]``: the row of an id is at its position
        (:meth:`positions`). Sparse optimizers update rows in place here; it is replaced
        (not resized) when the table grows, so do not keep it across inserts."""
        return self._weight

    @property
    def num_slots(self) -> int:
        """Slots of the hash index (a power of two)."""
        return self._index.slots

    def extra_repr(self) -> str:
        return (f"{self.embedding_dim}, name={self.name!r}, len={self._live}, "
                f"dtype={self.dtype}, device={self.device}, "
                f"slice=[{self.slice.begin}, {self.slice.end})/{self.slice.size}")

    def _as_ids(self, ids, what: str = "ids") -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            ids = torch.as_tensor(ids, dtype=torch.int64)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{what} must be an integer tensor, got dtype {ids.dtype}")
        return ids.to(device=self.device, dtype=torch.int64)

    def _check_range(self, flat: torch.Tensor) -> None:
        if self.slice.full or flat.numel() == 0:
            return
        bad = ~self.slice.contains(flat)
        if bool(bad.any()):
            first = int(flat[bad][0])
            raise ValueError(
                f"HashTable {self.name!r}: id {first} (slice {first % self.slice.size}) is "
                f"outside this table's slice range [{self.slice.begin}, {self.slice.end}) "
                f"of {self.slice.size} ({int(bad.sum())} such ids in the batch)")

    # ------------------------------------------------------------------ row storage

    def _grow(self, rows: int) -> None:
        cap = self.capacity
        new = max(rows, int(cap * _GROWTH))
        new = -(-new // _BLOCK_ROWS) * _BLOCK_ROWS
        log.debug("HashTable %r: storage %d -> %d rows", self.name, cap, new)
        weight = torch.zeros(new, self.embedding_dim, dtype=self.dtype, device=self.device)
        weight[: self._hw] = self._weight[: self._hw]
        pos_ids = torch.zeros(new, dtype=torch.int64, device=self.device)
        pos_ids[: self._hw] = self._pos_ids[: self._hw]
        occ = torch.zeros(new, dtype=torch.bool, device=self.device)
        occ[: self._hw] = self._occupied[: self._hw]
        self._weight, self._pos_ids, self._occupied = weight, pos_ids, occ

    def _alloc(self, n: int) -> torch.Tensor:
        """``n`` free row positions: evicted ones first, then fresh ones (growing)."""
        nfree = self._free.numel()
        k = min(n, nfree)
        reuse = self._free[nfree - k:]
        self._free = self._free[: nfree - k]
        fresh = n - k
        if fresh == 0:
            return reuse
        if self._hw + fresh > self.capacity:
            self._grow(self._hw + fresh)
        new = torch.arange(self._hw, self._hw + fresh, device=self.device)
        self._hw += fresh
        return torch.cat([reuse, new]) if k else new

    def _insert_new(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Insert absent, unique ``ids`` with ``rows``; returns their positions."""
        n = ids.numel()
        self._index.reserve(n, self._live_entries)  # before the new positions are marked live
        pos = self._alloc(n)
        self._index.insert(ids, pos)
        self._store_new(ids, pos, rows)
        return pos

    def _store_new(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> None:
        """Fill the rows of ids just added to the index at positions ``pos``."""
        self._weight.index_copy_(0, pos, rows)
        self._pos_ids.index_copy_(0, pos, ids)
        self._occupied[pos] = True
        self._live += ids.numel()

    def _init_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return init_rows(self.initializer, self._init_kwargs, ids, self.embedding_dim,
                         device=self.device, dtype=self.dtype, table=self.name)

    def _find_or_insert(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of ``flat`` (inserting unseen ids) and the newly inserted ids."""
        pos, new_ids, new_pos = self._index.find_or_insert(flat, self._alloc,
                                                           self._live_entries)
        if new_ids.numel():
            self._store_new(new_ids, new_pos, self._init_rows(new_ids))
        return pos, new_ids

    # ------------------------------------------------------------------ public API

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``ids`` (int, any shape) -> ``[*ids.shape, dim]``.

        Training mode: unseen ids are inserted (initializer rows, insert hooks fire once
        with them) and the result has autograd to the touched rows. Eval mode: nothing is
        inserted, unseen ids read as the eval value, no autograd.
        """
        ids = self._as_ids(ids)
        flat = ids.reshape(-1)
        self._check_range(flat)
        shape = (*ids.shape, self.embedding_dim)
        lookup_hooks = self.__dict__.get("_lookup_hooks")  # absent on tables pickled before
        if not self.training:
            out = self._read(flat)
            if lookup_hooks:
                for fn in list(lookup_hooks.values()):
                    fn(self, None, out)
            return out.reshape(shape)
        pos, new_ids = self._find_or_insert(flat)
        if new_ids.numel():
            self._fire(self._insert_hooks, new_ids)
        if torch.is_grad_enabled():
            # ids are kept to spot rows evicted/reused before the optimizer step; a copy so
            # that the caller may reuse its id buffer in place before backward
            out = gather_rows(self._holder, self._weight, self._grads, pos, flat.clone())
        else:
            out = self._weight.index_select(0, pos)
        if lookup_hooks:
            for fn in list(lookup_hooks.values()):
                fn(self, pos, out)
        return out.reshape(shape)

    def _read(self, flat: torch.Tensor) -> torch.Tensor:
        pos, _ = self._index.probe(flat)
        if flat.is_cuda:  # no host sync: gather a row for every id, then fill the misses
            out = self._weight.index_select(0, pos.clamp(min=0))
            return out.masked_fill_((pos < 0).unsqueeze(1), self._eval_value)
        if flat.numel() == 0 or int(pos.min()) >= 0:  # common case: every id present
            return self._weight.index_select(0, pos)
        miss = pos < 0
        out = self._weight.index_select(0, pos.clamp(min=0))
        out[miss] = self._eval_value
        return out

    @torch.no_grad()
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Current rows for ``ids`` (any shape) -> ``[*ids.shape, dim]`` (a copy).

        No insert, no autograd; unseen ids read as the eval value.
        """
        ids = self._as_ids(ids)
        flat = ids.reshape(-1)
        self._check_range(flat)
        return self._read(flat).reshape(*ids.shape, self.embedding_dim)

    @torch.no_grad()
    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Storage row position per id (same shape; -1 for ids not in the table).

        Positions are stable while a row lives; an evicted position may be reused.
        """
        ids = self._as_ids(ids)
        return self._index.probe(ids.reshape(-1))[0].reshape(ids.shape)

    @torch.no_grad()
    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool tensor (same shape as ``ids``): which ids the table holds."""
        return self.positions(ids) >= 0

    @torch.no_grad()
    def insert(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Upsert: set the rows of ``ids`` ``[N]`` to ``rows`` ``[N, dim]``.

        Ids already present are overwritten in place (their optimizer state is kept); for
        an id repeated in the batch the last row wins. Insert hooks fire once with the ids
        that were not present before (if any); write hooks fire before the overwrite and
        after the new rows are stored (:meth:`register_write_hook`).
        """
        ids = self._as_ids(ids)
        if ids.dim() != 1:
            raise ValueError(f"insert: ids must be 1-D [N], got shape {tuple(ids.shape)}")
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"insert: rows must be a tensor, got {type(rows).__name__}")
        if tuple(rows.shape) != (ids.numel(), self.embedding_dim):
            raise ValueError(f"insert: rows must have shape ({ids.numel()}, "
                             f"{self.embedding_dim}), got {tuple(rows.shape)}")
        self._check_range(ids)
        if ids.numel() == 0:
            return
        rows = rows.detach().to(device=self.device, dtype=self.dtype)
        uniq, inv = torch.unique(ids, return_inverse=True)
        # the row of each unique id: the last occurrence wins for an id repeated in the batch
        last = torch.full((uniq.numel(),), -1, dtype=torch.int64, device=self.device)
        last.scatter_reduce_(0, inv, torch.arange(ids.numel(), device=self.device), "amax")
        rows = rows.index_select(0, last)
        pos, _ = self._index.probe(uniq)
        present = pos >= 0
        have = present.nonzero().squeeze(1)
        if have.numel():
            at = pos.index_select(0, have)
            self._fire_writes(at)  # before the write: a listener reads the rows it replaces
            self._weight.index_copy_(0, at, rows.index_select(0, have))
        absent = (~present).nonzero().squeeze(1)
        if absent.numel():
            new_ids, new_rows = uniq.index_select(0, absent), rows.index_select(0, absent)
            at = self._insert_new(new_ids, new_rows)
            self._fire(self._insert_hooks, new_ids)
            self._fire_writes(at, new_rows)  # the rows just stored (a copy of the caller's)

    @torch.no_grad()
    def evict(self, ids: torch.Tensor) -> int:
        """Remove ``ids`` (absent ones are ignored); returns how many rows were removed.

        Their positions are reused by later inserts; sparse optimizers drop their state and
        pending gradients for them are discarded. Evict hooks fire once with the removed ids.
        """
        ids = self._as_ids(ids).reshape(-1)
        if ids.numel() == 0 or self._live == 0:
            return 0
        uniq = torch.unique(ids)
        found, pos = self._index.remove(uniq)
        k = found.numel()
        if k == 0:
            return 0
        gone = uniq.index_select(0, found)
        self._occupied[pos] = False
        self._notify_rows(pos)  # before the rows are zeroed: a listener may still read them
        self._weight[pos] = 0
        self._free = torch.cat([self._free, pos])
        self._live -= k
        if self._live == 0:  # nothing left: fresh positions from the start again
            self._free = torch.empty(0, dtype=torch.int64, device=self.device)
            self._hw = 0
        self._fire(self._evict_hooks, gone)
        return k

    @torch.no_grad()
    def clear(self) -> None:
        """Remove every row; optimizer state for the table is reset. Evict hooks fire once
        with every id held (ascending), as :meth:`evict` does: a tracker turns them into
        tombstones, so predictors drop them too."""
        gone = torch.sort(self.ids()).values
        self._clear_rows()
        if gone.numel():
            self._fire(self._evict_hooks, gone)

    def _clear_rows(self) -> None:
        """:meth:`clear` without the evict hooks (a reload: the tracker's reload hooks
        report the ids it removes)."""
        self._notify_rows(None)  # before the rows are zeroed: a listener may still read them
        self._occupied.zero_()
        self._weight.zero_()
        self._free = torch.empty(0, dtype=torch.int64, device=self.device)
        self._hw = 0
        self._live = 0
        self._index.clear()
        self._grads.clear()

    def live_positions(self) -> torch.Tensor:
        """Storage positions of every row held, int64 ``[len]`` ascending (see
        :attr:`storage`)."""
        return self._occupied[: self._hw].nonzero().squeeze(1)

    def _live_entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) of every row held: what the hash index is rebuilt from."""
        live = self.live_positions()
        return self._pos_ids.index_select(0, live), live

    @torch.no_grad()
    def ids(self) -> torch.Tensor:
        """All ids held, int64 ``[len]``, in storage order (aligned with :meth:`embeddings`)."""
        return self._pos_ids.index_select(0, self.live_positions())

    @torch.no_grad()
    def embeddings(self) -> torch.Tensor:
        """All rows ``[len, dim]`` (a copy); row i belongs to ``ids()[i]``."""
        return self._weight.index_select(0, self.live_positions())

    # ------------------------------------------------------------------ gradients

    @torch.no_grad()
    def sparse_grad(self) -> Optional[SparseGrad]:
        """Gradient accumulated since the last :meth:`zero_grad`, coalesced, or ``None``.

        Entries for rows evicted (or reused by another id) since the backward are dropped.
        Update hooks run first (:meth:`register_update_hook`).
        """
        self._fire_update()
        return self._grads.coalesce(self._pos_ids, self._occupied)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated sparse gradient (and dense ones, as ``Module.zero_grad``)."""
        super().zero_grad(set_to_none=set_to_none)
        self._grads.clear()

    # ------------------------------------------------------------------ positions

    def ids_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The id stored at each row position (int64 ``positions``, any shape -> same shape).

        For a position freed by :meth:`evict`/:meth:`clear` this is the id it held until
        an insert reuses it (row listeners run before any reuse).
        """
        return self._pos_ids.index_select(0, positions)

    def position_ids(self) -> torch.Tensor:
        """:meth:`ids_at` of every position: int64 ``[capacity]`` on the table's device.
        The table's own array, not a copy (read it, never write it); valid until the next
        insert or growth."""
        return self._pos_ids

    # ------------------------------------------------------------------ state dict / devices

    def __getstate__(self) -> dict:
        # pickling / deepcopy: pending gradients and optimizer links stay with the original
        state = super().__getstate__() if hasattr(super(), "__getstate__") else \
            self.__dict__.copy()
        state = dict(state)
        state["_row_listeners"] = []
        state["_grads"] = GradStash(self.embedding_dim, self.dtype)
        return state

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        live = self.live_positions()
        destination[prefix + "ids"] = self._pos_ids.index_select(0, live)
        destination[prefix + "rows"] = self._weight.index_select(0, live)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs) -> None:
        for key in state_dict:
            if key.startswith(prefix) and "." not in key[len(prefix):] \
                    and key[len(prefix):] not in ("ids", "rows", "_extra_state"):
                unexpected_keys.append(key)
        missing = [prefix + k for k in ("ids", "rows") if prefix + k not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        ids, rows = state_dict[prefix + "ids"], state_dict[prefix + "rows"]
        if ids.dim() != 1 or rows.dim() != 2 or rows.shape[0] != ids.shape[0] \
                or rows.shape[1] != self.embedding_dim:
            error_msgs.append(
                f"HashTable {self.name!r}: expected ids [n] and rows [n, {self.embedding_dim}], "
                f"got ids {tuple(ids.shape)} and rows {tuple(rows.shape)}")
            return
        ids = ids.to(device=self.device, dtype=torch.int64)
        if not self.slice.full and ids.numel() and not bool(self.slice.contains(ids).all()):
            error_msgs.append(f"HashTable {self.name!r}: state holds ids outside the slice "
                              f"range [{self.slice.begin}, {self.slice.end})")
            return
        if torch.unique(ids).numel() != ids.numel():
            error_msgs.append(f"HashTable {self.name!r}: state holds repeated ids")
            return
        with torch.no_grad():
            self._clear_rows()
            n = ids.numel()
            if n > self.capacity:
                self._grow(n)
            if n:
                self._insert_new(ids, rows.to(device=self.device, dtype=self.dtype))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        weight = fn(self._weight)
        if not weight.dtype.is_floating_point:
            raise TypeError(f"HashTable {self.name!r} rows must stay floating point, "
                            f"got {weight.dtype}")
        dev = weight.device

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=dev)

        self._weight = weight
        self._pos_ids, self._occupied, self._free = (move(self._pos_ids), move(self._occupied),
                                                     move(self._free))
        self._index.to(dev)
        self._holder = torch.zeros((), device=dev, requires_grad=True)
        self._grads.to(dev, weight.dtype)
        self.device, self.dtype = dev, weight.dtype
        return self
