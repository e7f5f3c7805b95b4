"""Dynamic embedding table: a vectorized id -> row hash index over growable row storage.

:class:`HashTable` is a ``torch.nn.Module`` that maps arbitrary int64 ids (negative ones
included) of its :class:`~deltastream.sharding.Slice` range to rows of width
``embedding_dim``. It is used like ``torch.nn.Embedding`` without a vocabulary size::

    >>> import torch
    >>> from deltastream import HashTable, SparseAdam
    >>> from deltastream.embedding.hashtable import normal_initializer
    >>> table = HashTable(16, name="user", initializer=normal_initializer(0.01))
    >>> opt = SparseAdam(table, lr=1e-2)       # dense layers: a normal torch optimizer
    >>> out = table(torch.tensor([[3, 10**12], [-7, 3]]))   # [2, 2, 16]; inserts 3 ids
    >>> out.sum().backward()
    >>> opt.step(); opt.zero_grad()            # updates only the 3 touched rows
    >>> len(table)
    3

Design (why this shape):

* **Index: open addressing with linear probing over two flat tensors** (``keys`` int64,
  ``vals`` int64 row position or ``EMPTY``/``DELETED``), a power-of-two slot count and a
  multiplicative (Fibonacci) hash. A batch of ``N`` ids is resolved in *probing rounds*:
  every round gathers ``keys[slot]``/``vals[slot]`` for all still-unresolved ids at once,
  settles hits and misses, and advances the rest by one slot. Live + deleted slots are kept
  <= 0.5 of the slots (a rebuild brings the load down to <= 0.3), so the expected number of
  rounds is < 2 for hits and the work is O(N) with a handful of kernels per round -- no
  per-id Python, and the same code runs on CUDA. Separate ``keys``/``vals`` arrays rather
  than one ``[slots, 2]`` tensor: a 1-D ``index_select`` is ~10x faster on CPU than
  gathering 16-byte rows. A sorted-key index with ``searchsorted`` was the alternative; it costs
  log2(n) dependent random reads per id (20 for 1M rows) and needs merges of an insertion
  buffer, which is slower for the lookup-dominated workload here.
* **Batched insert** uses the same rounds: ids that target a free slot race for it by
  scattering their batch index into a scratch ``claim`` array and reading it back; the
  winner writes, losers advance. Free slots include ``DELETED`` ones (evicted ids), which
  are therefore reused; the index is rebuilt (O(live)) when live + deleted slots exceed the
  load bound, so insert is amortized O(1).
* **Rows** live in one contiguous ``[capacity, dim]`` tensor that grows geometrically
  (x1.5, rounded up to whole blocks of 1024 rows) so that a lookup is a single
  ``index_select`` kernel. A list of separate blocks would avoid the copy at growth but turn
  every gather into a per-block loop; the copy is amortized O(1) per row. Positions freed by
  :meth:`HashTable.evict` go on a free list and are handed out again before the storage grows.
* **Gradients**: :meth:`HashTable.forward` returns rows through a custom autograd function
  whose backward only *stashes* ``(positions, ids, grad)``; :meth:`HashTable.sparse_grad`
  coalesces the stash (unique positions, summed grads) on demand. Growth, eviction and
  reuse between forward and the optimizer step are safe: positions are stable while a row
  lives, and stale entries (a position that no longer holds the same id) are dropped.
  Sparse optimizers are in :mod:`deltastream.embedding.optim`; the storage is deliberately not a
  ``Parameter``, so ``model.parameters()`` lists only dense weights for a dense optimizer.

Values of unseen ids read in eval mode or by :meth:`HashTable.lookup`: the initializer's
``eval_value`` attribute when it has one (:func:`constant_initializer` -> its constant),
otherwise zeros (:func:`uniform_initializer` and plain callables); :func:`normal_initializer`
reads as its mean (0 by default). The value does not depend on the id.
"""

from __future__ import annotations

import inspect
import logging
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
from torch.utils.hooks import RemovableHandle

from deltastream.sharding import DEFAULT_SLICE_SIZE, Slice

__all__ = [
    "HashTable",
    "SparseGrad",
    "Initializer",
    "normal_initializer",
    "uniform_initializer",
    "constant_initializer",
]

logger = logging.getLogger(__name__)

_EMPTY = -1  # vals[] marker: slot never used (ends a probe chain)
_DELETED = -2  # vals[] marker: slot held an evicted id (probe chains pass over it)
_MAX_LOAD = 0.5  # (live + deleted) / slots above which the index is rebuilt
_REBUILD_LOAD = 0.3  # live / slots right after a rebuild
_MIN_SLOTS = 64
_BLOCK_ROWS = 1024  # row storage grows in whole blocks of this many rows
_GROWTH = 1.5
# Golden-ratio multiplier 0x9E3779B97F4A7C15 as a signed int64 (torch multiplies with wrap).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------- initializers


class Initializer:
    """Base class of the row initializers: ``init(n, dim, *, device, dtype) -> [n, dim]``.

    ``eval_value`` is the value unseen ids read as in eval mode / :meth:`HashTable.lookup`.
    A seeded initializer owns one generator per device, so a table's rows are reproducible.
    """

    eval_value: float = 0.0

    def __init__(self, seed: Optional[int] = None) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> Optional[torch.Generator]:
        if self.seed is None:
            return None
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[key] = gen
        return gen

    def __call__(self, n: int, dim: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError


class _Normal(Initializer):
    def __init__(self, std: float, mean: float, seed: Optional[int]) -> None:
        super().__init__(seed)
        self.std, self.mean = float(std), float(mean)
        self.eval_value = self.mean

    def __call__(self, n, dim, *, device="cpu", dtype=torch.float32):
        device = torch.device(device)
        out = torch.empty(n, dim, device=device, dtype=torch.float32)
        out.normal_(self.mean, self.std, generator=self._generator(device))
        return out.to(dtype)

    def __repr__(self) -> str:
        return f"normal_initializer(std={self.std}, mean={self.mean}, seed={self.seed})"


class _Uniform(Initializer):
    def __init__(self, a: float, seed: Optional[int]) -> None:
        super().__init__(seed)
        self.a = float(a)

    def __call__(self, n, dim, *, device="cpu", dtype=torch.float32):
        device = torch.device(device)
        out = torch.empty(n, dim, device=device, dtype=torch.float32)
        out.uniform_(-self.a, self.a, generator=self._generator(device))
        return out.to(dtype)

    def __repr__(self) -> str:
        return f"uniform_initializer(a={self.a}, seed={self.seed})"


class _Constant(Initializer):
    def __init__(self, value: float) -> None:
        super().__init__(None)
        self.value = float(value)
        self.eval_value = self.value

    def __call__(self, n, dim, *, device="cpu", dtype=torch.float32):
        return torch.full((n, dim), self.value, device=device, dtype=dtype)

    def __repr__(self) -> str:
        return f"constant_initializer({self.value})"


def normal_initializer(std: float = 0.01, mean: float = 0.0, *,
                       seed: Optional[int] = None) -> Initializer:
    """Rows drawn from N(mean, std²); unseen ids read as ``mean`` in eval mode."""
    if not std >= 0:
        raise ValueError(f"std must be >= 0, got {std}")
    return _Normal(std, mean, seed)


def uniform_initializer(a: float = 0.01, *, seed: Optional[int] = None) -> Initializer:
    """Rows drawn from U(-a, a); unseen ids read as 0 in eval mode."""
    if not a >= 0:
        raise ValueError(f"a must be >= 0, got {a}")
    return _Uniform(a, seed)


def constant_initializer(value: float = 0.0) -> Initializer:
    """Every new row is ``value``; unseen ids read as ``value`` in eval mode too."""
    return _Constant(value)


# --------------------------------------------------------------------------- autograd


class SparseGrad(NamedTuple):
    """Coalesced gradient of a :class:`HashTable`: one entry per touched row.

    ``positions`` int64 ``[u]`` (unique row positions in the storage), ``ids`` int64 ``[u]``
    (the ids at those positions), ``values`` ``[u, dim]`` (summed gradients, table dtype).
    """

    positions: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor


class _GatherRows(torch.autograd.Function):
    """``rows = storage[positions]``; backward stashes the grads in the table (sparse)."""

    @staticmethod
    def forward(ctx, holder, table, positions, ids):  # holder: a leaf that carries the grad
        ctx.table = table
        ctx.save_for_backward(positions, ids)
        return table._weight.index_select(0, positions)

    @staticmethod
    def backward(ctx, grad):
        positions, ids = ctx.saved_tensors
        ctx.table._stash_grad(positions, ids, grad)
        return None, None, None, None


# --------------------------------------------------------------------------- the table


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


class HashTable(torch.nn.Module):
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
        self._init_kwargs = _accepted_kwargs(initializer, ("device", "dtype", "ids"))
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
        # hash index
        self._new_index(_next_pow2(max(_MIN_SLOTS, math.ceil(capacity / _REBUILD_LOAD))))
        # autograd
        self._holder = torch.zeros((), device=dev, requires_grad=True)
        self._grad_stash: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._grad_cache: Optional[SparseGrad] = None
        # hooks and row-state listeners (sparse optimizers)
        self._insert_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._evict_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._lookup_hooks: OrderedDict[int, Callable] = OrderedDict()
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
    def num_slots(self) -> int:
        """Slots of the hash index (a power of two)."""
        return self._slots

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

    # ------------------------------------------------------------------ hash index

    def _new_index(self, slots: int) -> None:
        dev = self.device
        self._slots = slots
        self._shift = 64 - (slots.bit_length() - 1)
        self._keys = torch.zeros(slots, dtype=torch.int64, device=dev)
        self._vals = torch.full((slots,), _EMPTY, dtype=torch.int64, device=dev)
        self._claim = torch.empty(slots, dtype=torch.int64, device=dev)
        self._used = 0  # live + deleted slots

    def _hash(self, keys: torch.Tensor) -> torch.Tensor:
        # Fibonacci hashing: the top log2(slots) bits of key * golden ratio (mod 2^64). Bit i
        # of the key reaches every product bit >= i, so all key bits reach the top bits;
        # the mask undoes the sign extension of the arithmetic shift.
        return ((keys * _GOLDEN) >> self._shift) & (self._slots - 1)

    def _probe(self, keys: torch.Tensor, need_slots: bool = False):
        """Row position per key (-1 if absent) and, optionally, the slot holding it."""
        n = keys.numel()
        if n == 0 or self._live == 0:
            pos = torch.full((n,), -1, dtype=torch.int64, device=self.device)
            return pos, (pos.clone() if need_slots else None)
        slots = None
        mask = self._slots - 1
        slot = self._hash(keys)
        # A slot whose key equals the id ends its probe: the position if the slot is live,
        # else the id is absent (a DELETED slot keeps its old key; an id re-inserted after
        # its eviction lands in that slot or an earlier one, never further along). A slot
        # with another key continues the probe unless it is EMPTY.
        # Round 0 runs over the whole batch without compaction.
        v = self._vals.index_select(0, slot)
        other = self._keys.index_select(0, slot) != keys
        pos = v.masked_fill(other, -1)
        if need_slots:
            slots = slot.masked_fill(other, -1)
        rest = (other & (v != _EMPTY)).nonzero().squeeze(1)
        if rest.numel() == 0:
            return pos, slots
        cur, ckeys, cslot = rest, keys.index_select(0, rest), (slot.index_select(0, rest) + 1) & mask
        while cur.numel():
            v = self._vals.index_select(0, cslot)
            other = self._keys.index_select(0, cslot) != ckeys
            hi = (~other).nonzero().squeeze(1)
            if hi.numel():
                where = cur.index_select(0, hi)
                pos.index_copy_(0, where, v.index_select(0, hi))
                if need_slots:
                    slots.index_copy_(0, where, cslot.index_select(0, hi))
            keep = (other & (v != _EMPTY)).nonzero().squeeze(1)
            cur = cur.index_select(0, keep)
            ckeys = ckeys.index_select(0, keep)
            cslot = (cslot.index_select(0, keep) + 1) & mask
        return pos, slots

    def _index_insert(self, keys: torch.Tensor, positions: torch.Tensor) -> None:
        """Add absent, unique ``keys`` -> ``positions`` to the index (room ensured)."""
        n = keys.numel()
        if n == 0:
            return
        mask = self._slots - 1
        slot = self._hash(keys)
        cur = torch.arange(n, device=self.device)
        reused = 0
        while cur.numel():
            v = self._vals.index_select(0, slot)
            free = (v < 0).nonzero().squeeze(1)
            if free.numel():
                cand = cur.index_select(0, free)
                cslot = slot.index_select(0, free)
                # ids racing for one slot: whichever write lands wins, read back to see who
                self._claim.index_copy_(0, cslot, cand)
                won_mask = self._claim.index_select(0, cslot) == cand
                won = won_mask.nonzero().squeeze(1)
                wslot = cslot.index_select(0, won)
                widx = cand.index_select(0, won)
                reused += int((v.index_select(0, free.index_select(0, won)) == _DELETED).sum())
                self._keys.index_copy_(0, wslot, keys.index_select(0, widx))
                self._vals.index_copy_(0, wslot, positions.index_select(0, widx))
                settled = torch.zeros(cur.numel(), dtype=torch.bool, device=self.device)
                settled[free.index_select(0, won)] = True
                keep = (~settled).nonzero().squeeze(1)
            else:
                keep = torch.arange(cur.numel(), device=self.device)
            cur = cur.index_select(0, keep)
            slot = (slot.index_select(0, keep) + 1) & mask
        self._used += n - reused

    def _reserve_index(self, n: int) -> None:
        """Make room for ``n`` more keys: rebuild the index if it would pass the bound."""
        if self._used + n <= self._slots * _MAX_LOAD:
            return
        target = self._live + n
        slots = _next_pow2(max(_MIN_SLOTS, math.ceil(target / _REBUILD_LOAD)))
        live_pos = self._occupied[: self._hw].nonzero().squeeze(1)
        logger.debug("HashTable %r: index rebuild %d -> %d slots (%d live, %d deleted)",
                     self.name, self._slots, slots, self._live, self._used - self._live)
        self._new_index(slots)
        self._index_insert(self._pos_ids.index_select(0, live_pos), live_pos)

    # ------------------------------------------------------------------ row storage

    def _grow(self, rows: int) -> None:
        cap = self.capacity
        new = max(rows, int(cap * _GROWTH))
        new = -(-new // _BLOCK_ROWS) * _BLOCK_ROWS
        logger.debug("HashTable %r: storage %d -> %d rows", self.name, cap, new)
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
        self._reserve_index(n)  # before the new positions are marked live
        pos = self._alloc(n)
        self._weight.index_copy_(0, pos, rows)
        self._pos_ids.index_copy_(0, pos, ids)
        self._occupied[pos] = True
        self._index_insert(ids, pos)
        self._live += n
        return pos

    def _init_rows(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.numel()
        if self.initializer is None:
            return torch.zeros(n, self.embedding_dim, dtype=self.dtype, device=self.device)
        kw = {}
        if "device" in self._init_kwargs:
            kw["device"] = self.device
        if "dtype" in self._init_kwargs:
            kw["dtype"] = self.dtype
        if "ids" in self._init_kwargs:
            kw["ids"] = ids
        rows = self.initializer(n, self.embedding_dim, **kw)
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (n, self.embedding_dim):
            got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"HashTable {self.name!r}: initializer returned {got}, expected "
                             f"a tensor of shape ({n}, {self.embedding_dim})")
        return rows.to(device=self.device, dtype=self.dtype)

    def _eval_rows(self, n: int) -> torch.Tensor:
        return torch.full((n, self.embedding_dim), self._eval_value, dtype=self.dtype,
                          device=self.device)

    def _find_or_insert(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of ``flat`` (inserting unseen ids) and the newly inserted ids."""
        pos, _ = self._probe(flat)
        miss = (pos < 0).nonzero().squeeze(1)
        if miss.numel() == 0:
            return pos, flat[:0]
        new_ids, inv = torch.unique(flat.index_select(0, miss), return_inverse=True)
        new_pos = self._insert_new(new_ids, self._init_rows(new_ids))
        pos.index_copy_(0, miss, new_pos.index_select(0, inv))
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
            out = _GatherRows.apply(self._holder, self, pos, flat.clone())
        else:
            out = self._weight.index_select(0, pos)
        if lookup_hooks:
            for fn in list(lookup_hooks.values()):
                fn(self, pos, out)
        return out.reshape(shape)

    def _read(self, flat: torch.Tensor) -> torch.Tensor:
        pos, _ = self._probe(flat)
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
        return self._probe(ids.reshape(-1))[0].clamp_(min=-1).reshape(ids.shape)

    @torch.no_grad()
    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool tensor (same shape as ``ids``): which ids the table holds."""
        return self.positions(ids) >= 0

    @torch.no_grad()
    def insert(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Upsert: set the rows of ``ids`` ``[N]`` to ``rows`` ``[N, dim]``.

        Ids already present are overwritten in place (their optimizer state is kept); for
        an id repeated in the batch the last row wins. Insert hooks fire once with the ids
        that were not present before (if any).
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
        pos, _ = self._probe(uniq)
        present = pos >= 0
        have = present.nonzero().squeeze(1)
        if have.numel():
            self._weight.index_copy_(0, pos.index_select(0, have), rows.index_select(0, have))
        absent = (~present).nonzero().squeeze(1)
        if absent.numel():
            new_ids = uniq.index_select(0, absent)
            self._insert_new(new_ids, rows.index_select(0, absent))
            self._fire(self._insert_hooks, new_ids)

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
        pos, slots = self._probe(uniq, need_slots=True)
        found = (pos >= 0).nonzero().squeeze(1)
        k = found.numel()
        if k == 0:
            return 0
        pos = pos.index_select(0, found)
        gone = uniq.index_select(0, found)
        self._vals[slots.index_select(0, found)] = _DELETED
        self._occupied[pos] = False
        self._weight[pos] = 0
        self._free = torch.cat([self._free, pos])
        self._live -= k
        if self._live == 0:  # nothing left: start from a clean index, no tombstones
            self._vals.fill_(_EMPTY)
            self._used = 0
            self._free = torch.empty(0, dtype=torch.int64, device=self.device)
            self._hw = 0
        self._notify_rows(pos)
        self._fire(self._evict_hooks, gone)
        return k

    @torch.no_grad()
    def clear(self) -> None:
        """Remove every row (no evict hooks fire); optimizer state for the table is reset."""
        self._occupied.zero_()
        self._weight.zero_()
        self._free = torch.empty(0, dtype=torch.int64, device=self.device)
        self._hw = 0
        self._live = 0
        self._vals.fill_(_EMPTY)
        self._used = 0
        self._grad_stash.clear()
        self._grad_cache = None
        self._notify_rows(None)

    def _live_positions(self) -> torch.Tensor:
        return self._occupied[: self._hw].nonzero().squeeze(1)

    @torch.no_grad()
    def ids(self) -> torch.Tensor:
        """All ids held, int64 ``[len]``, in storage order (aligned with :meth:`embeddings`)."""
        return self._pos_ids.index_select(0, self._live_positions())

    @torch.no_grad()
    def embeddings(self) -> torch.Tensor:
        """All rows ``[len, dim]`` (a copy); row i belongs to ``ids()[i]``."""
        return self._weight.index_select(0, self._live_positions())

    # ------------------------------------------------------------------ gradients

    def _stash_grad(self, positions: torch.Tensor, ids: torch.Tensor,
                    grad: torch.Tensor) -> None:
        self._grad_stash.append((positions, ids, grad.to(self.dtype)))
        self._grad_cache = None

    @torch.no_grad()
    def sparse_grad(self) -> Optional[SparseGrad]:
        """Gradient accumulated since the last :meth:`zero_grad`, coalesced, or ``None``.

        Entries for rows evicted (or reused by another id) since the backward are dropped.
        """
        if self._grad_cache is not None:
            return self._grad_cache
        if not self._grad_stash:
            return None
        pos = torch.cat([p for p, _, _ in self._grad_stash])
        ids = torch.cat([i for _, i, _ in self._grad_stash])
        grad = torch.cat([g.reshape(-1, self.embedding_dim) for _, _, g in self._grad_stash])
        pos = pos.to(self.device)
        ids = ids.to(self.device)
        grad = grad.to(self.device)
        valid = (pos < self.capacity)
        valid &= self._occupied[pos.clamp(max=self.capacity - 1)]
        valid &= self._pos_ids[pos.clamp(max=self.capacity - 1)] == ids
        if not bool(valid.all()):
            keep = valid.nonzero().squeeze(1)
            pos, grad = pos.index_select(0, keep), grad.index_select(0, keep)
        uniq, inv = torch.unique(pos, return_inverse=True)
        summed = torch.zeros(uniq.numel(), self.embedding_dim, dtype=grad.dtype,
                             device=self.device)
        summed.index_add_(0, inv, grad)
        self._grad_stash = []
        self._grad_cache = SparseGrad(uniq, self._pos_ids.index_select(0, uniq), summed)
        self._grad_stash.append((uniq, self._grad_cache.ids, summed))
        return self._grad_cache

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated sparse gradient (and dense ones, as ``Module.zero_grad``)."""
        super().zero_grad(set_to_none=set_to_none)
        self._grad_stash = []
        self._grad_cache = None

    # ------------------------------------------------------------------ hooks

    def register_insert_hook(self, fn: Callable[[HashTable, torch.Tensor], None]
                             ) -> RemovableHandle:
        """Call ``fn(table, new_ids)`` once per forward/insert that inserted ids.

        ``new_ids`` is int64 ``[k]``, ascending, k > 0. Returns a handle with ``.remove()``.
        """
        if not callable(fn):
            raise TypeError(f"hook must be callable, got {fn!r}")
        handle = RemovableHandle(self._insert_hooks)
        self._insert_hooks[handle.id] = fn
        return handle

    def register_evict_hook(self, fn: Callable[[HashTable, torch.Tensor], None]
                            ) -> RemovableHandle:
        """Call ``fn(table, evicted_ids)`` once per :meth:`evict` that removed ids.

        ``evicted_ids`` is int64 ``[k]``, ascending, k > 0. Returns a handle with ``.remove()``.
        """
        if not callable(fn):
            raise TypeError(f"hook must be callable, got {fn!r}")
        handle = RemovableHandle(self._evict_hooks)
        self._evict_hooks[handle.id] = fn
        return handle

    def register_lookup_hook(
            self, fn: Callable[[HashTable, Optional[torch.Tensor], torch.Tensor], None]
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
        if not callable(fn):
            raise TypeError(f"hook must be callable, got {fn!r}")
        hooks = self.__dict__.setdefault("_lookup_hooks", OrderedDict())
        handle = RemovableHandle(hooks)
        hooks[handle.id] = fn
        return handle

    def _ids_at(self, positions: torch.Tensor) -> torch.Tensor:
        """Internal: the id stored at each row position (int64, same shape).

        For a position freed by :meth:`evict`/:meth:`clear` this is the id it held until
        an insert reuses it (row listeners run before any reuse).
        """
        return self._pos_ids.index_select(0, positions)

    def _fire(self, hooks: OrderedDict, ids: torch.Tensor) -> None:
        for fn in list(hooks.values()):
            fn(self, ids)

    def _register_row_listener(
            self, callback: Callable[[HashTable, Optional[torch.Tensor]], None]) -> None:
        """Internal: ``callback(table, positions)`` when rows are freed (``None`` = all rows).

        Sparse optimizers use it to reset the state of freed rows; held weakly.
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

    # ------------------------------------------------------------------ state dict / devices

    def __getstate__(self) -> dict:
        # pickling / deepcopy: pending gradients and optimizer links stay with the original
        state = super().__getstate__() if hasattr(super(), "__getstate__") else \
            self.__dict__.copy()
        state = dict(state)
        state["_row_listeners"] = []
        state["_grad_stash"] = []
        state["_grad_cache"] = None
        return state

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        live = self._live_positions()
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
            self.clear()
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
        self._keys, self._vals, self._claim = move(self._keys), move(self._vals), move(self._claim)
        self._holder = torch.zeros((), device=dev, requires_grad=True)
        self._grad_stash = [(move(p), move(i), g.to(device=dev, dtype=weight.dtype))
                            for p, i, g in self._grad_stash]
        self._grad_cache = None
        self.device, self.dtype = dev, weight.dtype
        return self


def _accepted_kwargs(fn: Optional[Callable], names: tuple[str, ...]) -> frozenset:
    """Which of ``names`` ``fn`` accepts as keyword arguments."""
    if fn is None:
        return frozenset()
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return frozenset(names)
    ok = {p.name for p in params
          if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return frozenset(n for n in names if n in ok)
