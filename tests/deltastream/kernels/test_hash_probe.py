"""HashIndex on the Triton kernel path (deltastream.kernels.hash_probe) and on the C path
(deltastream.embedding.native, CPU) against the torch reference path: the same operations
on each, the same answers.

The kernel path runs on CUDA when there is one, else on CPU under Triton's interpreter
(the ``kernel_device`` fixture); sizes stay small because the interpreter is slow.
"""

from __future__ import annotations

import random

import pytest
import torch

from deltastream.embedding import hash_index
from deltastream.embedding.hash_index import HashIndex
from deltastream.kernels.hash_layout import GOLDEN
from deltastream.kernels.runtime import kernels_mode

_INV_GOLDEN = pow(GOLDEN % (1 << 64), -1, 1 << 64)  # GOLDEN is odd: invertible mod 2^64


def _with_home(home: int, slots: int, n: int, seed: int) -> list[int]:
    """``n`` distinct int64 keys whose home slot in a ``slots``-slot index is ``home``."""
    bits = slots.bit_length() - 1
    rng = random.Random(seed)
    low = rng.sample(range(1 << 40), n)  # the bits under the top ``bits`` of key * GOLDEN
    out = []
    for r in low:
        k = (((home << (64 - bits)) | r) * _INV_GOLDEN) % (1 << 64)
        out.append(k - (1 << 64) if k >= 1 << 63 else k)
    return out


class _Table:
    """A HashIndex with the bookkeeping its owner does: row positions and held entries."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.index = HashIndex(capacity, device, "t")
        self.device = device
        self.next = 0
        self.held: dict[int, int] = {}

    def _alloc(self, k: int) -> torch.Tensor:
        self.next += k
        return torch.arange(self.next - k, self.next, device=self.device)

    def _entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.tensor(list(self.held), dtype=torch.int64, device=self.device)
        pos = torch.tensor(list(self.held.values()), dtype=torch.int64, device=self.device)
        return keys, pos

    def find_or_insert(self, keys: list[int]) -> tuple[list[int], list[int]]:
        t = torch.tensor(keys, dtype=torch.int64, device=self.device)
        pos, new_keys, new_pos = self.index.find_or_insert(t, self._alloc, self._entries)
        self.held.update(zip(new_keys.tolist(), new_pos.tolist(), strict=True))
        return pos.tolist(), new_keys.tolist()

    def find(self, keys: list[int]) -> list[int]:
        t = torch.tensor(keys, dtype=torch.int64, device=self.device)
        pos, slots = self.index.probe(t, need_slots=True)
        assert (slots[pos >= 0] >= 0).all()
        return pos.tolist()  # -1 for every absent key, evicted ones too, on both paths

    def remove(self, keys: list[int]) -> list[int]:
        t = torch.tensor(keys, dtype=torch.int64, device=self.device)
        which, pos = self.index.remove(t)
        for k in t.index_select(0, which).tolist():
            del self.held[k]
        return sorted(zip(which.tolist(), pos.tolist(), strict=True))

    def insert(self, keys: list[int]) -> None:
        t = torch.tensor(keys, dtype=torch.int64, device=self.device)
        self.index.reserve(len(keys), self._entries)
        pos = self._alloc(len(keys))
        self.index.insert(t, pos)
        self.held.update(zip(keys, pos.tolist(), strict=True))


@pytest.fixture(params=["triton", "native"])
def other_path(request):
    """The device of the path compared with torch's: the Triton kernels (on
    ``kernel_device``) or the C probes (CPU, kernel mode off)."""
    if request.param == "triton":
        yield request.getfixturevalue("kernel_device")
        return
    if not hash_index._NATIVE.available:
        pytest.skip(f"deltastream.embedding.native is not built ({hash_index._NATIVE.why})")
    before = hash_index._NATIVE.enabled()
    with kernels_mode("off"):
        hash_index.use_native(True)
        try:
            yield torch.device("cpu")
        finally:
            hash_index.use_native(before)


def _both(device, scenario) -> list:
    """Run ``scenario(make_table)`` on the torch path and on the path under test; the
    observations must agree. Returns them."""
    native = hash_index._NATIVE.enabled()
    with kernels_mode("off"):
        hash_index.use_native(False)
        try:
            ref = scenario(lambda cap: _Table(cap, torch.device("cpu")))
        finally:
            hash_index.use_native(native)
    got = scenario(lambda cap: _Table(cap, device))
    assert got == ref
    return got


def _check_held(t: _Table) -> None:
    keys = list(t.held)
    assert t.find(keys) == [t.held[k] for k in keys]
    assert t.index.live == len(keys)


def test_collisions_and_wrap_around(other_path):
    def scenario(make):
        t = make(60)
        slots = t.index.slots
        assert slots == 256
        # 40 keys with the last slot as home: the chain wraps to slot 0 and on
        wrap = _with_home(slots - 1, slots, 40, seed=1)
        same = _with_home(7, slots, 30, seed=2)  # another crowded chain
        obs = [t.find_or_insert(wrap[:25] + same[:10])]
        assert t.index.slots == slots  # no rebuild: the chains really collide
        obs.append(t.find_or_insert(wrap + same))  # 25 + 10 hits, 35 new
        _check_held(t)
        obs.append(t.find(wrap[::-1] + _with_home(slots - 1, slots, 5, seed=9)))
        return obs

    obs = _both(other_path, scenario)
    assert obs[-1][-5:] == [-1] * 5  # absent keys at the end of the crowded chain


def test_duplicates_in_a_batch_get_one_slot_and_one_position(other_path):
    def scenario(make):
        t = make(64)
        home = _with_home(3, t.index.slots, 6, seed=3)
        batch = [5, 5, -1, home[0], 5, home[1], home[0], -1, 0, 0, home[2]] * 3
        pos, new = t.find_or_insert(batch)
        assert new == sorted(set(batch))  # each new key once, ascending
        for k, p in zip(batch, pos, strict=True):
            assert p == t.held[k]
        _check_held(t)
        return [pos, new, t.find_or_insert(batch + [7, 7])]

    _both(other_path, scenario)


def test_insert_after_delete_reuses_tombstones(other_path):
    def scenario(make):
        t = make(60)
        slots = t.index.slots
        chain = _with_home(slots - 2, slots, 30, seed=4)
        obs = [t.find_or_insert(chain)]
        obs.append(t.remove(chain[::3] + [12345]))  # one absent id
        assert t.index.live == 20
        obs.append(t.find(chain))  # deleted ones absent, later ones still found
        obs.append(t.find_or_insert(chain[::6] + [777]))  # half the deleted come back
        obs.append(t.find(chain))
        t.insert(_with_home(slots - 2, slots, 3, seed=5))  # plain insert reuses tombstones
        _check_held(t)
        obs.append(t.remove(list(t.held)))
        assert t.index.live == 0
        obs.append(t.find_or_insert(chain[:4]))  # after everything left: a clean index
        return obs

    _both(other_path, scenario)


def test_growth_rebuilds_keep_every_key(other_path):
    def scenario(make):
        t = make(1)
        rng = random.Random(6)
        obs, sizes = [], set()
        for step in range(8):
            fresh = [rng.randrange(-(1 << 62), 1 << 62) for _ in range(90 * (step + 1))]
            old = rng.sample(list(t.held), min(len(t.held), 200))
            pos, new = t.find_or_insert(fresh + old)
            obs.append((pos, new))
            assert t.index.live <= t.index.slots * 0.5  # the load bound holds
            sizes.add(t.index.slots)
            if step % 3 == 2:
                obs.append(t.remove(rng.sample(list(t.held), 100)))
        # one batch over several kernel programs
        big = [rng.randrange(-(1 << 62), 1 << 62) for _ in range(4500)] + list(t.held)[:600]
        obs.append(t.find_or_insert(big))
        assert len(sizes) >= 3
        _check_held(t)
        return obs

    _both(other_path, scenario)


@pytest.mark.gpu
def test_cuda_many_blocks_racing_for_the_same_ids_match_the_reference():
    # ids repeated across thousands of programs: lanes of different blocks race for one
    # slot (LOCKED / PENDING states); positions must still equal the torch path's
    rng = random.Random(8)
    cpu, gpu = _Table(1000, torch.device("cpu")), _Table(1000, torch.device("cuda"))
    for _ in range(6):
        batch = [rng.randrange(-40_000, 40_000) for _i in range(300_000)]
        with kernels_mode("off"):
            ref = cpu.find_or_insert(batch)
        with kernels_mode("on"):
            assert gpu.find_or_insert(batch) == ref
        gone = rng.sample(list(cpu.held), len(cpu.held) // 3)
        with kernels_mode("off"):
            ref = cpu.remove(gone)
        with kernels_mode("on"):
            assert gpu.remove(gone) == ref
    assert gpu.held == cpu.held


def test_native_refuses_mismatched_arrays_and_a_full_index():
    """The C functions name what they cannot use instead of reading or writing out of
    bounds, and an insert with no free slot left stops with an error."""
    if not hash_index._NATIVE.available:
        pytest.skip(f"deltastream.embedding.native is not built ({hash_index._NATIVE.why})")
    import numpy as np

    native = hash_index._NATIVE.module
    tk, tv = np.zeros(8, np.int64), np.full(8, -1, np.int64)
    keys, pos = np.arange(3, dtype=np.int64), np.empty(3, np.int64)
    native.probe(tk, tv, keys, 61, pos, None)
    assert pos.tolist() == [-1, -1, -1]
    with pytest.raises(ValueError, match="shift"):
        native.probe(tk, tv, keys, 60, pos, None)  # 16 slots' shift on 8
    with pytest.raises(ValueError, match="slot count"):
        native.probe(tk, np.full(16, -1, np.int64), keys, 61, pos, None)
    with pytest.raises(ValueError, match="keys: wrong element type"):
        native.probe(tk, tv, keys.astype(np.int32), 61, pos, None)
    with pytest.raises(ValueError, match="out_pos"):
        native.probe(tk, tv, keys, 61, np.empty(2, np.int64), None)
    with pytest.raises(ValueError, match="positions"):
        native.insert(tk, tv, keys, np.arange(2, dtype=np.int64), 61)
    assert native.insert(tk, tv, np.arange(8, dtype=np.int64), np.arange(8, dtype=np.int64),
                         61) == 0
    with pytest.raises(ValueError, match="no free slot left for key 99"):
        native.insert(tk, tv, np.array([99], np.int64), np.array([8], np.int64), 61)
    native.probe(tk, tv, np.arange(9, dtype=np.int64), 61, pos := np.empty(9, np.int64), None)
    assert pos.tolist() == list(range(8)) + [-1]
