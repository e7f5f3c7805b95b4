"""Incremental index migration (consumers/serving/growth.py): the new index's memory is
backed in step with the copy, never behind a write, and keys whose probe runs wrapped
round the old index are copied too."""

import numpy as np
import pytest

import consumers.serving.growth as growth_mod
from consumers.serving.growth import Growth
from consumers.serving.id_index import DELETED_SLOT, EMPTY_SLOT, IdIndex, bucket_of

OLD, NEW = 1 << 12, 1 << 14  # buckets: a 4× growth (16 B each: the new index is 256 KiB)


def _old_index(rng: np.random.Generator) -> tuple[IdIndex, np.ndarray]:
    """An old index 35 % used, whose last buckets' run wraps round to bucket 0."""
    keys = rng.integers(1, 1 << 62, 40 * OLD)
    home = bucket_of(keys, OLD)
    last = keys[home == OLD - 1][:6]  # six keys that all want the last bucket: five wrap
    rest = keys[(home < OLD - 40) & (home > 40)][: int(0.35 * OLD) - last.size]
    old = IdIndex(np.zeros((OLD, 2), np.int64))
    old.insert(last, np.arange(1, last.size + 1, dtype=np.int32), None)
    old.insert(rest, np.arange(100, 100 + rest.size, dtype=np.int32), None)
    return old, np.concatenate([last, rest])


def test_the_new_index_is_backed_in_step_with_the_copy(monkeypatch):
    monkeypatch.setattr(growth_mod, "MIN_STEP", 64)
    old, keys = _old_index(np.random.default_rng(5))
    assert (old.find(keys[:6], 0)[0] < 5).sum() == 5  # the wrapped run is there
    new = IdIndex(np.zeros((NEW, 2), np.int64))
    backs: list[tuple[int, int]] = []
    g = Growth(old, new, 1, lambda a, b: backs.append((a, b)))
    assert 0 < g.start < 10  # copying begins after the wrapped run
    fractions = []
    while not g.step(16, 0):
        # nothing written beyond what was backed: buckets past the frontier are untouched
        written = np.flatnonzero(new.tab.view(np.int32)[:, 2] != EMPTY_SLOT)
        assert written.size == 0 or (written.max() + 1) * 16 <= g.backed
        fractions.append(g.backed / new.nbytes)
    assert len(fractions) > 10
    assert fractions[len(fractions) // 2] < 0.75  # half the applies in, a quarter left
    # the backed ranges follow one another from byte 0 to the end, none twice
    assert backs[0][0] == 0 and backs[-1][1] == new.nbytes
    assert all(a[1] == b[0] for a, b in zip(backs[:-1], backs[1:], strict=True))
    pos, slots = new.find(keys, 0)
    assert (pos >= 0).all()
    assert np.array_equal(slots, old.find(keys, 0)[1])
    assert new.used == keys.size


def test_a_key_whose_run_wrapped_onto_copied_buckets_waits_for_the_backing(monkeypatch):
    monkeypatch.setattr(growth_mod, "MIN_STEP", 64)
    monkeypatch.setattr(growth_mod, "_FAR", 1 << 14)  # "far", at this index's scale
    old, keys = _old_index(np.random.default_rng(6))
    new = IdIndex(np.zeros((NEW, 2), np.int64))
    g = Growth(old, new, 1, lambda a, b: None)
    g.step(16, 0)
    backed = g.backed
    assert 0 < backed < new.nbytes // 2 and g.cursor > 0
    # two more keys for the last old bucket: their runs wrap past bucket 0 onto buckets
    # copied already, and their homes in the new index are its last buckets
    cand = np.random.default_rng(7).integers(1, 1 << 62, 1 << 16)
    k = np.setdiff1d(cand[bucket_of(cand, OLD) == OLD - 1], keys)[:2]
    pos = old.insert(k, np.array([7, 8], np.int32), None)
    none = np.zeros(0, np.int64)
    g.mirror((none, none, none.astype(np.int32)), (none, none),
             (k, pos, np.array([7, 8], np.int32)))
    assert g.backed == backed  # nothing backed out of step, and nothing written there
    assert not new.tab[NEW // 2:].any()
    # one of them changes its slot, the other is deleted, while they wait
    g.mirror((k[:1], pos[:1], np.array([9], np.int32)), (k[1:], pos[1:]),
             (none, none, none.astype(np.int32)))
    while not g.step(16, 0):
        pass
    assert new.find(k, 0)[1].tolist() == [9, 0] and new.find(k, 0)[0][1] == -1
    assert np.array_equal(new.find(keys, 0)[1], old.find(keys, 0)[1])


def test_first_empty_finds_the_end_of_the_wrapped_run():
    old, _ = _old_index(np.random.default_rng(5))
    e = old.first_empty()
    v = old.tab.view(np.int32)
    assert (v[e, 2:] == EMPTY_SLOT).all() and (v[:e, 2] != EMPTY_SLOT).all()
    full = IdIndex(np.zeros((16, 2), np.int64))
    full.insert(np.arange(1, 17, dtype=np.int64), np.ones(16, np.int32), None)
    assert full.first_empty() == 0  # no empty bucket: start anywhere


@pytest.mark.parametrize("seed", range(4))
def test_the_new_index_ends_equal_to_the_old_under_random_applies(monkeypatch, seed):
    """Like the table's applies during a migration: updates, deletes and inserts (half of
    them wrapping round the old index's end) mirrored each time, many keys set aside."""
    monkeypatch.setattr(growth_mod, "MIN_STEP", 16)
    monkeypatch.setattr(growth_mod, "_FAR", 1 << 12)
    rng = np.random.default_rng(seed)
    old, keys = _old_index(rng)
    live = dict(zip(keys.tolist(), old.find(keys, 0)[1].tolist(), strict=True))
    cand = rng.integers(1, 1 << 62, 1 << 20)
    fresh = np.setdiff1d(cand[:4096], keys)
    wraps = cand[4096:][bucket_of(cand[4096:], OLD) >= OLD - 3]
    wraps, fresh = iter(np.setdiff1d(wraps, keys).tolist()), iter(fresh.tolist())
    new = IdIndex(np.zeros((NEW, 2), np.int64))
    g = Growth(old, new, 1, lambda a, b: None)
    slot = 10_000
    for _ in range(200):
        have = np.fromiter(live, np.int64)
        upd = rng.choice(have, 12, replace=False)
        gone = np.setdiff1d(rng.choice(have, 8, replace=False), upd)
        ins = np.array([next(wraps) if i % 2 else next(fresh) for i in range(16)], np.int64)
        slots_u = np.arange(slot, slot + upd.size, dtype=np.int32)
        slots_n = np.arange(slot + 100, slot + 100 + ins.size, dtype=np.int32)
        slot += 200
        pos_u, pos_d = old.find(upd, 0)[0], old.find(gone, 0)[0]
        old.set(pos_u, slots_u, None)
        old.set(pos_d, DELETED_SLOT, None)
        pos_n = old.insert(ins, slots_n, None)
        g.mirror((upd, pos_u, slots_u), (gone, pos_d), (ins, pos_n, slots_n))
        live.update(zip(upd.tolist(), slots_u.tolist(), strict=True))
        live.update(zip(ins.tolist(), slots_n.tolist(), strict=True))
        for k in gone.tolist():
            del live[k]
        if g.step(16, 0):
            break
    assert g.done
    got_keys, got_slots = new.live(0)
    assert dict(zip(got_keys.tolist(), got_slots.tolist(), strict=True)) == live
