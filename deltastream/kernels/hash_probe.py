"""Triton kernels for :class:`~deltastream.embedding.hash_index.HashIndex`: find,
find-or-claim, insert and remove, each one launch with the probe loop inside the kernel.

They work on the index's own layout (:mod:`deltastream.kernels.hash_layout`): two flat
int64 tensors ``keys``/``vals`` over a power-of-two slot count, Fibonacci hashing, linear
probing, ``vals`` = row position (>= 0), ``EMPTY`` or ``DELETED``. The torch path and the
kernels read and write the same tensors, so growth and rehash stay in ``HashIndex``.

Why the atomics sit on ``vals`` and not on ``keys``: every int64 is a valid id (the table
takes negative ids and the int64 extremes), so no key value can mean "empty"; the slot state
lives in ``vals``. Two more states exist only while a find-or-claim kernel runs:

* ``LOCKED`` (-3): a lane has won the slot and is writing its key;
* ``PENDING - r`` (<= -4): the slot holds the key of the r-th new id of the batch; the row
  position is filled in after the kernel (:func:`settle`), once the host knows how many new
  ids there are and has allocated their positions (in ascending id order, as the torch
  path does, so both paths hand out the same positions).

So inside a find-or-claim kernel a value >= 0 is never written: a plain load that sees one
reads a slot that was live before the launch, whose key no lane changes. Lanes therefore
probe with plain loads (the hit path costs no atomics) and switch to *careful* mode at the
first slot that is or may be changing (``EMPTY``, ``LOCKED``, ``PENDING``, or a ``DELETED``
slot holding their own key): there ``vals`` is read with an acquire atomic before the key,
and a claim is a compare-and-swap ``EMPTY``/``DELETED`` -> ``LOCKED``, then the key store,
then a release exchange to ``PENDING - rank``. Lanes with the same id meet at the same
first claimable slot: one wins the swap, the others read ``LOCKED`` (and wait on that slot)
or ``PENDING`` with their key (and share the rank). Single-stream use only: no other
kernel may touch the index while one runs.

Cost on CUDA (what one call launches; syncs are device->host reads):

* :func:`find` -- 1 kernel (+ the output allocations), 0 syncs.
* :func:`find_or_claim` -- 1 memset + 1 kernel, then 1 sync: the 2-int64 count of new ids
  and reused tombstones. :func:`settle` (only when there are new ids) is a few torch ops.
* :func:`insert` -- 1 memset + 1 kernel + 1 sync (reused-tombstone count).
* :func:`remove` -- 1 kernel, 0 syncs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from deltastream.kernels.hash_layout import DELETED, EMPTY, GOLDEN
from deltastream.kernels.runtime import interpreted

__all__ = ["find", "find_or_claim", "settle", "insert", "remove", "LOCKED", "PENDING"]

log = logging.getLogger(__name__)

LOCKED = -3  # vals[]: a lane is writing this slot's key (find-or-claim only)
PENDING = -4  # vals[] = PENDING - rank: claimed for the rank-th new id, position to come
_NEVER = -(1 << 63)  # a compare value no slot ever holds: makes a swap a no-op
_BLOCK = 512  # ids per program on a GPU: a probe loop runs as long as its slowest lane

# the same values as constexprs, for use inside kernels
_K_EMPTY = tl.constexpr(EMPTY)
_K_DELETED = tl.constexpr(DELETED)
_K_LOCKED = tl.constexpr(LOCKED)
_K_PENDING = tl.constexpr(PENDING)
_K_NEVER = tl.constexpr(_NEVER)


@triton.jit
def _find_kernel(keys_ptr, vals_ptr, ids_ptr, pos_ptr, slot_out_ptr, n, golden, shift, mask,
                 NEED_SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    active = offs < n
    x = tl.load(ids_ptr + offs, mask=active, other=0)
    slot = ((x * golden) >> shift) & mask  # as HashIndex._hash
    pos = tl.full([BLOCK], -1, tl.int64)
    found = tl.full([BLOCK], -1, tl.int64)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        v = tl.load(vals_ptr + slot, mask=active, other=_K_EMPTY)
        k = tl.load(keys_ptr + slot, mask=active, other=0)
        # a slot with the id's key ends the probe (live: the position; DELETED: absent);
        # an EMPTY slot ends it too
        match = active & (k == x)
        hit = match & (v >= 0)
        pos = tl.where(hit, v, pos)
        if NEED_SLOTS:
            found = tl.where(hit, slot, found)
        active = active & ~match & (v != _K_EMPTY)
        slot = tl.where(active, (slot + 1) & mask, slot)
    inb = offs < n
    tl.store(pos_ptr + offs, pos, mask=inb)
    if NEED_SLOTS:
        tl.store(slot_out_ptr + offs, found, mask=inb)


@triton.jit
def _find_or_claim_kernel(keys_ptr, vals_ptr, ids_ptr, pos_ptr, new_ids_ptr, new_slots_ptr,
                          counts_ptr, n, golden, shift, mask, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    active = offs < n
    x = tl.load(ids_ptr + offs, mask=active, other=0)
    slot = ((x * golden) >> shift) & mask  # as HashIndex._hash
    pos = tl.full([BLOCK], -1, tl.int64)
    careful = tl.zeros([BLOCK], dtype=tl.int1)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        plain = active & ~careful
        vp = tl.load(vals_ptr + slot, mask=plain, other=_K_EMPTY)
        # careful lanes read vals with acquire semantics: the key load below then sees
        # the key stored before the release that published this value
        va = tl.atomic_add(vals_ptr + slot, tl.zeros([BLOCK], tl.int64), mask=active & careful,
                           sem="acquire")
        v = tl.where(careful, va, vp)
        keyed = active & (v != _K_EMPTY) & (v != _K_LOCKED)
        k = tl.load(keys_ptr + slot, mask=keyed, other=0, volatile=True)
        match = keyed & (k == x)
        # plain lanes: hit a live slot, advance past other keys, else turn careful here
        unsure = plain & ((v == _K_EMPTY) | (v == _K_LOCKED) | (v <= _K_PENDING)
                          | (match & (v == _K_DELETED)))
        hit = active & match & ((v >= 0) | (careful & (v <= _K_PENDING)))
        claim = active & careful & ((v == _K_EMPTY) | (match & (v == _K_DELETED)))
        won = tl.zeros([BLOCK], dtype=tl.int1)
        if tl.max(claim.to(tl.int32), axis=0) > 0:
            # the swap has no mask: non-claiming lanes compare against a value never held
            old = tl.atomic_cas(vals_ptr + slot, tl.where(claim, v, _K_NEVER),
                                tl.full([BLOCK], _K_LOCKED, tl.int64), sem="acq_rel")
            won = claim & (old == v)
            nwon = tl.sum(won.to(tl.int64), axis=0)
            ntomb = tl.sum((won & (v == _K_DELETED)).to(tl.int64), axis=0)
            base = tl.atomic_add(counts_ptr, nwon, sem="relaxed")
            tl.atomic_add(counts_ptr + 1, ntomb, sem="relaxed")
            rank = base + tl.cumsum(won.to(tl.int64), axis=0) - 1
            tl.store(keys_ptr + slot, x, mask=won)
            tl.store(new_ids_ptr + rank, x, mask=won)
            tl.store(new_slots_ptr + rank, slot, mask=won)
            code = -rank + _K_PENDING
            tl.atomic_xchg(vals_ptr + slot, code, mask=won, sem="release")
            pos = tl.where(won, code, pos)
        pos = tl.where(hit, v, pos)
        # stay on this slot: turning careful, waiting on LOCKED, or a lost swap
        stay = unsure | (careful & (v == _K_LOCKED)) | (claim & ~won)
        active = active & ~hit & ~won
        careful = careful | unsure
        slot = tl.where(active & ~stay, (slot + 1) & mask, slot)
    tl.store(pos_ptr + offs, pos, mask=offs < n)


@triton.jit
def _insert_kernel(keys_ptr, vals_ptr, ids_ptr, src_pos_ptr, counts_ptr, n, golden, shift, mask,
                   BLOCK: tl.constexpr):
    # absent, unique keys: no lane reads another's key, so the swap alone claims a slot
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    active = offs < n
    x = tl.load(ids_ptr + offs, mask=active, other=0)
    p = tl.load(src_pos_ptr + offs, mask=active, other=0)
    slot = ((x * golden) >> shift) & mask  # as HashIndex._hash
    reused = tl.zeros([BLOCK], dtype=tl.int64)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        v = tl.load(vals_ptr + slot, mask=active, other=0, volatile=True)
        free = active & (v < 0)  # EMPTY or DELETED (a stale read only fails the swap)
        old = tl.atomic_cas(vals_ptr + slot, tl.where(free, v, _K_NEVER), p, sem="relaxed")
        won = free & (old == v)
        tl.store(keys_ptr + slot, x, mask=won)
        reused += (won & (v == _K_DELETED)).to(tl.int64)
        active = active & ~won
        slot = tl.where(active, (slot + 1) & mask, slot)
    tl.atomic_add(counts_ptr, tl.sum(reused, axis=0), sem="relaxed")


@triton.jit
def _remove_kernel(keys_ptr, vals_ptr, ids_ptr, pos_ptr, n, golden, shift, mask,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    active = offs < n
    x = tl.load(ids_ptr + offs, mask=active, other=0)
    slot = ((x * golden) >> shift) & mask  # as HashIndex._hash
    pos = tl.full([BLOCK], -1, tl.int64)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        v = tl.load(vals_ptr + slot, mask=active, other=_K_EMPTY)
        k = tl.load(keys_ptr + slot, mask=active, other=0)
        match = active & (k == x)
        live = match & (v >= 0)
        # exchange, not store: of two lanes with the same id only one sees the position
        old = tl.atomic_xchg(vals_ptr + slot, tl.full([BLOCK], _K_DELETED, tl.int64), mask=live,
                             sem="relaxed")
        pos = tl.where(live & (old >= 0), old, pos)
        active = active & ~match & (v != _K_EMPTY)
        slot = tl.where(active, (slot + 1) & mask, slot)
    tl.store(pos_ptr + offs, pos, mask=offs < n)


def _block(n: int) -> int:
    # Triton's interpreter (tests on CPU) pays per program and per loop iteration, and
    # per lane in every op: it gets one block the size of the batch (up to 4096 ids)
    if interpreted():
        return max(16, min(4096, triton.next_power_of_2(n)))
    return _BLOCK


def _launch(kernel, n: int, *args, **constexprs) -> None:
    if n == 0:
        return
    block = _block(n)
    kernel[(triton.cdiv(n, block),)](*args, BLOCK=block, **constexprs)


def _geometry(keys: torch.Tensor, shift: int) -> tuple[int, int, int]:
    return GOLDEN, shift, keys.numel() - 1


def find(keys: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor, shift: int,
         need_slots: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row position of each id of int64 ``ids`` ``[N]`` (-1 if absent) and, with
    ``need_slots``, its slot (-1 if absent). One kernel launch, no sync."""
    n, ids = ids.numel(), ids.contiguous()
    pos = torch.empty(n, dtype=torch.int64, device=ids.device)
    slots = torch.empty(n, dtype=torch.int64, device=ids.device) if need_slots else pos
    _launch(_find_kernel, n, keys, vals, ids, pos, slots, n, *_geometry(keys, shift),
            NEED_SLOTS=need_slots)
    return pos, (slots if need_slots else None)


def find_or_claim(keys: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor, shift: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Find every id of ``ids`` ``[N]``, claiming a slot for each absent one (once per
    distinct id). The caller guarantees room: used slots + N stay below the slot count.

    Returns ``(pos, new_ids, new_slots, reused)``: ``pos`` ``[N]`` the row position of each
    id, or ``PENDING - r`` for the r-th new id; ``new_ids``/``new_slots`` ``[k]`` by rank;
    ``reused`` how many claimed slots were tombstones. One memset, one kernel, one sync (the
    counts). Pass the result to :func:`settle` once the positions are allocated.
    """
    n, ids, dev = ids.numel(), ids.contiguous(), ids.device
    pos = torch.empty(n, dtype=torch.int64, device=dev)
    new_ids = torch.empty(n, dtype=torch.int64, device=dev)
    new_slots = torch.empty(n, dtype=torch.int64, device=dev)
    counts = torch.zeros(2, dtype=torch.int64, device=dev)
    _launch(_find_or_claim_kernel, n, keys, vals, ids, pos, new_ids, new_slots, counts, n,
            *_geometry(keys, shift))
    k, reused = counts.tolist()  # the one device->host read of the batch
    return pos, new_ids[:k], new_slots[:k], reused


def settle(vals: torch.Tensor, pos: torch.Tensor, new_ids: torch.Tensor,
           new_slots: torch.Tensor, alloc: Callable[[int], torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Give the claimed ids of :func:`find_or_claim` their row positions.

    ``alloc(k)`` returns ``k`` positions for the new ids in ascending id order. Writes them
    into ``vals`` and ``pos`` (in place) and returns ``(new_ids, positions)``, ascending.
    A handful of torch ops (sort, scatter, gather); no sync.
    """
    k = new_ids.numel()
    sorted_ids, order = torch.sort(new_ids)
    new_pos = alloc(k)
    by_rank = torch.empty_like(new_pos)
    by_rank[order] = new_pos
    vals.index_copy_(0, new_slots, by_rank)
    pending = pos <= PENDING
    pos.copy_(torch.where(pending, by_rank[(PENDING - pos).clamp_(0, k - 1)], pos))
    return sorted_ids, new_pos


def insert(keys: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
           shift: int) -> int:
    """Add absent, unique ``ids`` -> ``positions``; returns how many tombstones were reused.
    One memset, one kernel, one sync (that count)."""
    n, ids, positions = ids.numel(), ids.contiguous(), positions.contiguous()
    counts = torch.zeros(1, dtype=torch.int64, device=ids.device)
    _launch(_insert_kernel, n, keys, vals, ids, positions, counts, n, *_geometry(keys, shift))
    return int(counts.item())


def remove(keys: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor, shift: int
           ) -> torch.Tensor:
    """Mark the slots of ``ids`` deleted; returns the row position each id had (-1 if
    absent, or for a repeat of an id in the batch). One kernel launch, no sync."""
    n, ids = ids.numel(), ids.contiguous()
    pos = torch.empty(n, dtype=torch.int64, device=ids.device)
    _launch(_remove_kernel, n, keys, vals, ids, pos, n, *_geometry(keys, shift))
    return pos
