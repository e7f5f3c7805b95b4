"""IdIndex (consumers.serving.id_index): lookups in both probe paths (and natively), two value
copies, inserts."""

from __future__ import annotations

import numpy as np
import pytest

from consumers.serving.id_index import (
    DELETED_SLOT,
    EMPTY_SLOT,
    IdIndex,
    as_ids,
    bucket_of,
    buckets_for,
)
from consumers.serving.lookup import lookup_slots  # native or numpy (lookup_path)

pytestmark = pytest.mark.usefixtures("lookup_path")  # native and numpy lookups


def _index(buckets: int) -> IdIndex:
    return IdIndex(np.zeros((buckets, 2), np.int64), "t")


@pytest.mark.parametrize("n_query", [1, 300, 5000])  # window path and bulk path
def test_lookup_matches_a_dict_with_collisions_and_deletes(n_query):
    rng = np.random.default_rng(n_query)
    idx = _index(1 << 12)
    keys = rng.choice(1 << 40, 1500, replace=False).astype(np.int64) - (1 << 39)
    slots = np.arange(1, keys.size + 1, dtype=np.int32)
    pos = idx.insert(keys, slots, None)
    gone = rng.choice(keys.size, 400, replace=False)
    idx.set(pos[gone], DELETED_SLOT, None)  # markers: probes must walk past them
    ref = {int(k): int(s) for k, s in zip(keys, slots, strict=True)}
    for g in gone:
        del ref[int(keys[g])]
    q = np.concatenate([keys, rng.integers(-(1 << 39), 1 << 39, 500)])
    q = rng.choice(q, n_query)
    want = np.array([ref.get(int(k), 0) for k in q])
    for col in (0, 1):
        assert np.array_equal(lookup_slots(idx.tab, q, col), want)
        found_pos, found = idx.find(q, col)
        assert np.array_equal(found, want)
        assert np.array_equal(idx.tab[found_pos[found > 0], 0], q[found > 0])


def test_long_runs_resolve_past_the_first_window():
    """Keys sharing one home bucket form a run longer than any window."""
    idx = _index(64)
    cand = np.arange(1, 20000, dtype=np.int64)
    keys = cand[bucket_of(cand, 64) == 5][:20]  # 20 ids with the same home bucket
    assert keys.size == 20
    idx.insert(keys, np.arange(1, 21, dtype=np.int32), None)
    assert np.array_equal(lookup_slots(idx.tab, keys, 0), np.arange(1, 21))
    assert np.array_equal(lookup_slots(idx.tab, keys[::-1].copy(), 1), np.arange(20, 0, -1))
    absent = np.array([10_000_000_007], np.int64)
    assert lookup_slots(idx.tab, absent, 0).tolist() == [0]


def test_the_two_value_copies_are_independent():
    idx = _index(256)
    keys = np.arange(10, 60, dtype=np.int64)
    pos = idx.insert(keys, np.arange(1, 51, dtype=np.int32), None)
    idx.set(pos[:10], np.arange(100, 110, dtype=np.int32), 1)  # copy 1 only
    more = np.arange(1000, 1010, dtype=np.int64)
    idx.insert(more, np.arange(200, 210, dtype=np.int32), 1, other=0)
    assert np.array_equal(lookup_slots(idx.tab, keys[:10], 0), np.arange(1, 11))
    assert np.array_equal(lookup_slots(idx.tab, keys[:10], 1), np.arange(100, 110))
    assert not lookup_slots(idx.tab, more, 0).any()  # invisible in copy 0
    assert np.array_equal(lookup_slots(idx.tab, more, 1), np.arange(200, 210))
    idx.copy_values(pos[:10], 1, 0)
    assert np.array_equal(lookup_slots(idx.tab, keys[:10], 0), np.arange(100, 110))
    idx.sync_copies(1)
    assert np.array_equal(lookup_slots(idx.tab, more, 0), np.arange(200, 210))


def test_insert_does_not_reuse_a_bucket_live_in_the_other_copy():
    idx = _index(16)
    a = np.array([7], np.int64)
    (p,) = idx.insert(a, np.array([1], np.int32), None)
    idx.set(np.array([p]), DELETED_SLOT, 1)  # deleted in the copy being built, live in copy 0
    b = np.arange(100, 104, dtype=np.int64)
    pos_b = idx.insert(b, np.arange(2, 6, dtype=np.int32), 1, other=0)
    assert p not in pos_b.tolist()
    assert lookup_slots(idx.tab, a, 0).tolist() == [1]  # readers of copy 0 unaffected


def test_used_counts_buckets_leaving_empty_and_live_lists_a_range():
    idx = _index(64)
    keys = np.arange(1, 11, dtype=np.int64)
    pos = idx.insert(keys, np.arange(1, 11, dtype=np.int32), None)
    assert idx.used == 10
    idx.set(pos[:3], DELETED_SLOT, None)
    idx.insert(np.arange(20, 23, dtype=np.int64), np.arange(11, 14, dtype=np.int32), None)
    assert idx.used <= 13 and (idx.tab.view(np.int32)[:, 2] != EMPTY_SLOT).sum() == idx.used
    got_keys, got_slots = idx.live(0)
    assert sorted(got_keys.tolist()) == sorted(keys[3:].tolist() + [20, 21, 22])
    lo, _ = idx.live(0, 0, 32)
    hi, _ = idx.live(0, 32, 64)
    assert sorted(np.concatenate([lo, hi]).tolist()) == sorted(got_keys.tolist())


def test_validation_and_sizes():
    with pytest.raises(ValueError, match="power of 2"):
        IdIndex(np.zeros((24, 2), np.int64))
    assert buckets_for(1) == 16 and buckets_for(1000) == 4096
    assert as_ids(np.array([3], np.uint8)).dtype == np.int64
    with pytest.raises(TypeError):
        as_ids([1.5])
    with pytest.raises(ValueError):
        as_ids(np.array([2 ** 63], np.uint64))


def test_an_insert_into_a_full_index_raises_instead_of_looping():
    idx = _index(16)
    idx.insert(np.arange(1, 17, dtype=np.int64), np.arange(1, 17, dtype=np.int32), None)
    with pytest.raises(ValueError, match="no free bucket"):
        idx.insert(np.array([99], np.int64), np.array([17], np.int32), 0)


def test_find_and_insert_agree_across_paths_with_markers_and_the_other_copy(lookup_path):
    """Both paths build indexes that answer alike: a key is found wherever it was put,
    DELETED_SLOT markers are walked past, buckets live in the other copy are left alone, and
    ``used`` counts the buckets that left EMPTY_SLOT."""
    rng = np.random.default_rng(7)
    idx = _index(1 << 13)
    keys = rng.choice(1 << 40, 3000, replace=False).astype(np.int64)
    pos = idx.insert(keys, np.arange(1, 3001, dtype=np.int32), None)
    assert np.array_equal(idx.tab[pos, 0], keys) and np.unique(pos).size == pos.size
    idx.set(pos[:500], DELETED_SLOT, 1)  # deleted in copy 1 only: still live in copy 0
    new = rng.choice(1 << 40, 2000, replace=False).astype(np.int64) + (1 << 41)
    pos_n = idx.insert(new, np.arange(5001, 7001, dtype=np.int32), 1, other=0)
    assert not np.isin(pos_n, pos[:500]).any()
    assert idx.used == int((idx.tab.view(np.int32)[:, 2:] != EMPTY_SLOT).any(axis=1).sum())
    f1, s1 = idx.find(np.concatenate([keys, new]), 1)
    assert np.array_equal(s1[:500], np.zeros(500)) and np.array_equal(f1[:500], [-1] * 500)
    assert np.array_equal(s1[500:3000], np.arange(501, 3001))
    assert np.array_equal(s1[3000:], np.arange(5001, 7001))
    assert np.array_equal(f1[3000:], pos_n)
    f0, s0 = idx.find(np.concatenate([keys, new]), 0)
    assert np.array_equal(s0[:3000], np.arange(1, 3001)) and not s0[3000:].any()


def test_big_native_index_batches_let_other_threads_run(lookup_path, gil_gap):
    """Index work of a big batch runs without the GIL: another Python thread keeps
    running while one insert and one find are in C (the daemon's reader threads)."""
    if lookup_path != "native":
        pytest.skip("numpy holds the GIL")
    keys = np.random.default_rng(3).choice(1 << 50, 2_000_000, replace=False).astype(np.int64)
    # Up to three tries, each on a fresh index: a call that holds the GIL leaves one gap
    # spanning it every time, while this VM's vCPU stalls (tens of ms, against a find of
    # ~50 ms) can stretch one gap of one try.
    tries = []
    for _ in range(3):
        idx = _index(1 << 23)
        spans = [gil_gap(lambda i=idx: i.insert(keys, np.ones(keys.size, np.int32), None)),
                 gil_gap(lambda i=idx: i.find(keys, 0))]
        tries.append(spans)
        if all(gap < span / 2 for span, gap in spans):
            break
    # with the GIL held, one gap spans the call
    assert all(gap < span / 2 for span, gap in tries[-1]), tries
