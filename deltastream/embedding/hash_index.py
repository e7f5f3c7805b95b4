"""Vectorized hash index: int64 id -> int64 row position, resolved a whole batch at a time.

The index of :class:`~deltastream.embedding.hashtable.HashTable` (which owns the rows).

Design (why this shape):

* **Open addressing with linear probing over two flat tensors** (``keys`` int64, ``vals``
  int64 row position or ``EMPTY``/``DELETED``), a power-of-two slot count and a
  multiplicative (Fibonacci) hash. A batch of ``N`` ids is resolved in *probing rounds*:
  every round gathers ``keys[slot]``/``vals[slot]`` for all still-unresolved ids at once,
  settles hits and misses, and advances the rest by one slot. Live + deleted slots are kept
  <= 0.5 of the slots (a rebuild brings the load down to <= 0.3), so the expected number of
  rounds is < 2 for hits and the work is O(N) with a handful of kernels per round -- no
  per-id Python, and the same code runs on CUDA. Separate ``keys``/``vals`` arrays rather
  than one ``[slots, 2]`` tensor: a 1-D ``index_select`` is ~10x faster on CPU than
  gathering 16-byte rows. A sorted-key index with ``searchsorted`` was the alternative; it
  costs log2(n) dependent random reads per id (20 for 1M rows) and needs merges of an
  insertion buffer, which is slower for the lookup-dominated workload here.
* **Batched insert** uses the same rounds: ids that target a free slot race for it by
  scattering their batch index into a scratch ``claim`` array and reading it back; the
  winner writes, losers advance. Free slots include ``DELETED`` ones (evicted ids), which
  are therefore reused; the index is rebuilt (O(live)) when live + deleted slots exceed the
  load bound, so insert is amortized O(1).
* **CPU**: the C extension :mod:`deltastream.embedding.native` (when built) runs
  :meth:`probe` and :meth:`insert` one id at a time, each walking its chain directly with
  the GIL released: a training step's few thousand ids cost less that way than the rounds'
  whole-batch torch calls. The rounds below stay the reference and the fallback.
* **CUDA**: where :func:`~deltastream.kernels.runtime.use_kernels` says so, :meth:`probe`,
  :meth:`insert`, :meth:`find_or_insert` and :meth:`remove` run as Triton kernels with the
  probe loop inside the kernel (:mod:`deltastream.kernels.hash_probe`), on the same
  tensors: a find is one launch and no host sync, a find-or-insert one launch and one
  small device->host read (the count of new ids). Growth and rehash stay here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Optional

import torch

from deltastream.kernels.hash_layout import DELETED, EMPTY, GOLDEN
from deltastream.kernels.runtime import use_kernels
from deltastream.native_ext import NativeExtension

__all__ = ["HashIndex", "use_native"]

log = logging.getLogger(__name__)

_NATIVE = NativeExtension("deltastream.embedding.native", "native hash index",
                          "CPU probes run in torch")
#: switch the CPU probes and inserts to the C code (``RuntimeError`` when it is not built)
#: or to torch
use_native = _NATIVE.use

_MAX_LOAD = 0.5  # (live + deleted) / slots above which the index is rebuilt
_REBUILD_LOAD = 0.3  # live / slots right after a rebuild
_MIN_SLOTS = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _slots_for(n: int) -> int:
    """Slots that hold ``n`` keys at the load right after a rebuild."""
    return _next_pow2(max(_MIN_SLOTS, math.ceil(n / _REBUILD_LOAD)))


class HashIndex:
    """Map unique int64 ids to int64 row positions (see the module docstring).

    Args:
        capacity: keys to hold without a rebuild.
        device: where the index tensors live.
        name: the owning table's name, for log lines.
    """

    def __init__(self, capacity: int, device: torch.device, name: str = "") -> None:
        self.device = device
        self.name = name
        self._new(_slots_for(capacity))

    def _new(self, slots: int) -> None:
        dev = self.device
        self.slots = slots  #: slot count (a power of two)
        self._shift = 64 - (slots.bit_length() - 1)
        self._keys = torch.zeros(slots, dtype=torch.int64, device=dev)
        self._vals = torch.full((slots,), EMPTY, dtype=torch.int64, device=dev)
        self._claim = torch.empty(slots, dtype=torch.int64, device=dev)
        self._used = 0  # live + deleted slots
        self.live = 0  #: keys held

    def _hash(self, keys: torch.Tensor) -> torch.Tensor:
        # Fibonacci hashing: the top log2(slots) bits of key * golden ratio (mod 2^64). Bit i
        # of the key reaches every product bit >= i, so all key bits reach the top bits;
        # the mask undoes the sign extension of the arithmetic shift.
        return ((keys * GOLDEN) >> self._shift) & (self.slots - 1)

    def probe(self, keys: torch.Tensor, need_slots: bool = False
              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Row position per key of int64 ``keys`` ``[N]`` (-1 if absent) and, with
        ``need_slots``, the slot holding it (for :meth:`delete`; valid where the position
        is >= 0)."""
        n = keys.numel()
        if n == 0 or self.live == 0:
            pos = torch.full((n,), -1, dtype=torch.int64, device=self.device)
            return pos, (pos.clone() if need_slots else None)
        if use_kernels(keys):
            return self._kernels().find(self._keys, self._vals, keys, self._shift, need_slots)
        if self._native(keys):
            pos = torch.empty(n, dtype=torch.int64)
            slots = torch.empty(n, dtype=torch.int64) if need_slots else None
            _NATIVE.module.probe(self._keys.numpy(), self._vals.numpy(),
                                 keys.contiguous().numpy(), self._shift, pos.numpy(),
                                 None if slots is None else slots.numpy())
            return pos, slots
        slots = None
        mask = self.slots - 1
        slot = self._hash(keys)
        # A slot whose key equals the id ends its probe: the position if the slot is live,
        # else the id is absent (a DELETED slot keeps its old key; an id re-inserted after
        # its eviction lands in that slot or an earlier one, never further along). A slot
        # with another key continues the probe unless it is EMPTY.
        # Round 0 runs over the whole batch without compaction.
        v = self._vals.index_select(0, slot)
        other = self._keys.index_select(0, slot) != keys
        pos = v.masked_fill(other, -1).clamp_(min=-1)  # a DELETED slot's key: absent
        if need_slots:
            slots = slot.masked_fill(other, -1)
        rest = (other & (v != EMPTY)).nonzero().squeeze(1)
        if rest.numel() == 0:
            return pos, slots
        cur, ckeys, cslot = rest, keys.index_select(0, rest), (slot.index_select(0, rest) + 1) & mask
        while cur.numel():
            v = self._vals.index_select(0, cslot)
            other = self._keys.index_select(0, cslot) != ckeys
            hi = (~other).nonzero().squeeze(1)
            if hi.numel():
                where = cur.index_select(0, hi)
                pos.index_copy_(0, where, v.index_select(0, hi).clamp_(min=-1))
                if need_slots:
                    slots.index_copy_(0, where, cslot.index_select(0, hi))
            keep = (other & (v != EMPTY)).nonzero().squeeze(1)
            cur = cur.index_select(0, keep)
            ckeys = ckeys.index_select(0, keep)
            cslot = (cslot.index_select(0, keep) + 1) & mask
        return pos, slots

    def insert(self, keys: torch.Tensor, positions: torch.Tensor) -> None:
        """Add absent, unique ``keys`` -> ``positions`` (room ensured by :meth:`reserve`)."""
        n = keys.numel()
        if n == 0:
            return
        if use_kernels(keys):
            reused = self._kernels().insert(self._keys, self._vals, keys, positions, self._shift)
            self._used += n - reused
            self.live += n
            return
        if self._native(keys):
            reused = _NATIVE.module.insert(self._keys.numpy(), self._vals.numpy(),
                                           keys.contiguous().numpy(),
                                           positions.to(torch.int64).contiguous().numpy(),
                                           self._shift)
            self._used += n - reused
            self.live += n
            return
        mask = self.slots - 1
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
                reused += int((v.index_select(0, free.index_select(0, won)) == DELETED).sum())
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
        self.live += n

    def find_or_insert(self, keys: torch.Tensor, alloc: Callable[[int], torch.Tensor],
                       entries: Callable[[], tuple[torch.Tensor, torch.Tensor]]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row position of every id of int64 ``keys`` ``[N]``, inserting the absent ones.

        ``alloc(k)`` hands out ``k`` row positions for the new ids in ascending order;
        ``entries`` is as for :meth:`reserve`. Returns ``(pos [N], new_keys [k] ascending,
        new_positions [k])``. The kernel path makes room for all ``N`` ids being new
        before its one launch (it learns how many are new only after it), then reads the
        count of new ids: one device->host read per call.
        """
        if keys.numel() and use_kernels(keys):
            kernels = self._kernels()
            self.reserve(keys.numel(), entries)
            pos, new_keys, new_slots, reused = kernels.find_or_claim(self._keys, self._vals,
                                                                     keys, self._shift)
            k = new_keys.numel()
            if k == 0:
                return pos, new_keys, new_keys
            self._used += k - reused
            self.live += k
            new_keys, new_pos = kernels.settle(self._vals, pos, new_keys, new_slots, alloc)
            return pos, new_keys, new_pos
        pos, _ = self.probe(keys)
        miss = (pos < 0).nonzero().squeeze(1)
        if miss.numel() == 0:
            return pos, keys[:0], keys[:0]
        new_keys, inv = torch.unique(keys.index_select(0, miss), return_inverse=True)
        self.reserve(new_keys.numel(), entries)
        new_pos = alloc(new_keys.numel())
        self.insert(new_keys, new_pos)
        pos.index_copy_(0, miss, new_pos.index_select(0, inv))
        return pos, new_keys, new_pos

    def remove(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove the held ones of unique int64 ``keys`` ``[N]``; returns ``(which [k],
        positions [k])``: their indices in ``keys`` and the row positions they had."""
        if keys.numel() == 0 or self.live == 0:
            none = keys.new_empty(0)
            return none, none
        if use_kernels(keys):
            pos = self._kernels().remove(self._keys, self._vals, keys, self._shift)
            found = (pos >= 0).nonzero().squeeze(1)
            self._forget(found.numel())
            return found, pos.index_select(0, found)
        pos, slots = self.probe(keys, need_slots=True)
        found = (pos >= 0).nonzero().squeeze(1)
        self.delete(slots.index_select(0, found))
        return found, pos.index_select(0, found)

    def _native(self, keys: torch.Tensor) -> bool:
        # the C probes: CPU int64 ids on a CPU index (the index's arrays are contiguous)
        return (_NATIVE.enabled() and keys.device.type == "cpu" and self._keys.device.type == "cpu"
                and keys.dtype == torch.int64)

    @staticmethod
    def _kernels():
        # imported on first use: it imports triton, which use_kernels() has found to import
        from deltastream.kernels import hash_probe

        return hash_probe

    def reserve(self, n: int,
                entries: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make room for ``n`` more keys: rebuild when the load would pass the bound, from
        ``entries()`` -> ``(keys, positions)`` of every key held (called only then)."""
        if self._used + n <= self.slots * _MAX_LOAD:
            return
        slots = _slots_for(self.live + n)
        log.debug("HashTable %r: index rebuild %d -> %d slots (%d live, %d deleted)",
                  self.name, self.slots, slots, self.live, self._used - self.live)
        keys, positions = entries()
        self._new(slots)
        self.insert(keys, positions)

    def delete(self, slots: torch.Tensor) -> None:
        """Remove the keys in ``slots`` (from :meth:`probe` with ``need_slots``; all held)."""
        self._vals[slots] = DELETED
        self._forget(slots.numel())

    def _forget(self, k: int) -> None:
        # k keys were marked DELETED (their slots stay used until a rebuild)
        self.live -= k
        if self.live == 0:  # nothing left: start from a clean index, no tombstones
            self.clear()

    def clear(self) -> None:
        """Remove every key (the slot count stays)."""
        self._vals.fill_(EMPTY)
        self._used = 0
        self.live = 0

    def to(self, device: torch.device) -> HashIndex:
        """Move the index to ``device`` (in place); returns ``self``."""
        self.device = device
        self._keys, self._vals, self._claim = (self._keys.to(device), self._vals.to(device),
                                               self._claim.to(device))
        return self
