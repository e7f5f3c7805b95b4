"""ServingTable.apply of residual (wire ``r1``) batches: the decoded values are *added* to
the rows held, in float32 (zeros for ids not held, or deleted by the same message), so a
trainer that mirrors them with ``wire_values.residual_values`` knows the table bit for bit
and can send the error left again (error feedback)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from consumers.serving.table import ApplyError, ApplyResult, ServingTable
from deltastream.wire import DecodedBatch, DeltaBatch, decode
from deltastream.wire_values import residual_values
from tests.consumers.serving.test_table import wire_batch
from tests.deltastream.wire_messages import make, one

pytestmark = pytest.mark.usefixtures("lookup_path")  # native and numpy lookups


def r1_batch(ids, residual, *, tombstones=None, fresh=None, **columns) -> DecodedBatch:
    """Encode (wire v4) + decode one r1 batch of table "emb", as the daemon sees it."""
    ids = np.asarray(ids, np.int64)
    residual = np.asarray(residual, np.float32).reshape(len(ids), -1)
    b = make(ids, residual, "r1", tombstones=tombstones, table="emb", fresh=fresh, **columns)
    d = decode(one(b, version=4, max_message_bytes=64 << 20))
    assert d.dtype == "r1" and d.additive
    return d


def _bits(a: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns: equal means equal bit for bit."""
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


class Mirror:
    """What the trainer believes the table holds: full rows replace, residuals add (float32),
    both then rounded to the table's storage dtype; tombstones (and ``fresh``) delete first."""

    def __init__(self, dim: int, storage=np.float32):
        self.dim, self.storage = dim, np.dtype(storage)
        self.rows: dict[int, np.ndarray] = {}

    def held(self, ids) -> np.ndarray:
        zero = np.zeros(self.dim, np.float32)
        return np.array([self.rows.get(int(i), zero) for i in ids], np.float32).reshape(-1,
                                                                                       self.dim)

    def delete(self, tombstones) -> None:
        for i in tombstones:
            self.rows.pop(int(i), None)

    def replace(self, ids, rows_f32) -> None:
        for i, row in zip(ids, rows_f32, strict=True):
            self.rows[int(i)] = row.astype(self.storage).astype(np.float32)

    def add(self, ids, residual, tombstones=(), fresh=None) -> None:
        self.delete(tombstones)
        if fresh is not None:
            self.delete(np.asarray(ids)[fresh])
        self.replace(ids, self.held(ids) + residual_values(residual))

    def check(self, t: ServingTable) -> None:
        ids = np.array(sorted(self.rows), np.int64)
        assert np.array_equal(t.ids(), ids)
        assert np.array_equal(_bits(t.lookup(ids)), _bits(self.held(ids)))


# ----------------------------------------------------------------------------- error feedback


def test_the_table_equals_the_trainers_mirror_and_the_error_shrinks():
    rng = np.random.default_rng(21)
    dim = 13
    t = ServingTable("emb", dim, capacity=4)  # grows along the way
    mirror = Mirror(dim)
    start = np.arange(0, 60, 3, dtype=np.int64)
    first = rng.standard_normal((start.size, dim)).astype(np.float32)
    t.upsert(start, first)
    mirror.replace(start, first)
    target = {int(i): r.copy() for i, r in zip(start, first, strict=True)}
    fixed = 7  # a new id whose target never moves: its error must shrink every round
    target[fixed] = (rng.standard_normal(dim) * 3).astype(np.float32)
    errors = [float(np.linalg.norm(target[fixed]))]
    next_new = 1000
    for _ in range(20):
        held_ids = [i for i in mirror.rows if i != fixed]
        moved = rng.choice(held_ids, size=min(8, len(held_ids)), replace=False).tolist()
        new = list(range(next_new, next_new + 3))
        next_new += 3
        for i in moved:
            target[i] = target[i] + rng.normal(0, 0.3, dim).astype(np.float32)
        for i in new:
            target[i] = rng.standard_normal(dim).astype(np.float32)
        ids = np.array(sorted(set(moved + new + [fixed])), np.int64)
        present = t.contains(ids)
        assert present.any() and not present.all()
        cur = np.array([target[int(i)] for i in ids], np.float32)
        residual = cur - mirror.held(ids)
        version = t.version
        assert t.apply(r1_batch(ids, residual)) == ApplyResult(upserted=ids.size, deleted=0)
        assert t.version > version  # (growing the index publishes states too)
        mirror.add(ids, residual)
        mirror.check(t)
        assert len(t) == len(mirror.rows)
        errors.append(float(np.linalg.norm(target[fixed] - t.lookup([fixed])[0])))
    assert all(b < a for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < errors[0] / 50, errors
    # the rows whose target moved are tracked too: the mean error is far below a step's
    ids = np.array(sorted(target), np.int64)
    err = np.abs(np.array([target[int(i)] for i in ids]) - t.lookup(ids))
    assert err.mean() < 0.3


def test_a_new_id_starts_from_zeros_and_a_held_one_from_its_row():
    t = ServingTable("emb", 8)
    held = np.arange(8, dtype=np.float32) - 3.5
    t.upsert([1], [held])
    r = np.array([[1, -2, 0, 3, -4, 5, 0.5, -0.5], [2, 2, -2, -2, 0, 1, -1, 0]], np.float32)
    t.apply(r1_batch([1, 2], r))
    v = residual_values(r)
    assert np.array_equal(_bits(t.lookup([1, 2])), _bits(np.stack([held + v[0], v[1]])))
    assert v[0, 0] == np.float32(np.float16(np.abs(r[0]).mean())) == -v[0, 1]


# ----------------------------------------------------------------------------- tombstones


def test_an_id_also_in_the_messages_tombstones_starts_from_zeros():
    t = ServingTable("emb", 4)
    old = np.array([[10, 20, 30, 40], [5, 5, 5, 5], [1, 1, 1, 1]], np.float32)
    t.upsert([1, 2, 3], old)
    r = np.array([[1, -1, 2, -2], [0.5, 0.5, 0.5, 0.5]], np.float32)
    res = t.apply(r1_batch([1, 4], r, tombstones=np.array([1, 2, 99], np.int64)))
    assert res == ApplyResult(upserted=2, deleted=2)
    v = residual_values(r)
    assert t.ids().tolist() == [1, 3, 4]
    got = t.lookup([1, 2, 3, 4])
    assert np.array_equal(got[0], v[0]) and not np.array_equal(got[0], old[0] + v[0])
    assert np.array_equal(got[1:], [[0] * 4, [1] * 4, v[1]])
    mirror = Mirror(4)
    mirror.replace([1, 2, 3], old)
    mirror.add([1, 4], r, tombstones=[1, 2, 99])
    mirror.check(t)


def test_a_fresh_row_starts_from_zeros_whatever_the_table_holds():
    """``fresh`` (an id the trainer re-inserted after an eviction whose tombstone it folded
    away): its residual adds to zeros, like a tombstoned id's; the others add to their rows."""
    t = ServingTable("emb", 4)
    old = np.array([[10, 20, 30, 40], [5, 5, 5, 5]], np.float32)
    t.upsert([1, 2], old)
    r = np.array([[1, -1, 2, -2], [0.5, -0.5, 0.5, 0.5], [3, 3, 3, 3]], np.float32)
    fresh = np.array([True, False, True])
    b = r1_batch([1, 2, 3], r, fresh=fresh)
    assert b.fresh.tolist() == fresh.tolist()
    assert t.apply(b) == ApplyResult(upserted=3, deleted=0)
    v = residual_values(r)
    assert np.array_equal(_bits(t.lookup([1, 2, 3])), _bits(np.stack([v[0], old[1] + v[1], v[2]])))
    mirror = Mirror(4)
    mirror.replace([1, 2], old)
    mirror.add([1, 2, 3], r, fresh=fresh)
    mirror.check(t)


@pytest.mark.parametrize("how", ["r1 tombstone", "r1 fresh", "f16 tombstone"])
@pytest.mark.parametrize("col", [0, 8])
def test_a_column_slice_row_deleted_first_reads_zeros_in_its_other_columns(how, col):
    """Deleted first (a tombstone, or ``fresh``): the columns the slice does not carry read
    zeros too, as for an id new to the table, not the deleted row's values. Full values
    (f16) follow the same rule."""
    t = ServingTable("emb", 16)
    t.upsert([1, 2], np.full((2, 16), 9, np.float32))
    r = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    cols = dict(col=col, width=16)
    if how == "f16 tombstone":
        b = wire_batch([1, 2], r, dtype="f16", tombstones=np.array([1], np.int64), **cols)
        v = b.rows_f32()
    else:
        first = dict(tombstones=np.array([1], np.int64)) if how == "r1 tombstone" else \
            dict(fresh=np.array([True, False]))
        b = r1_batch([1, 2], r, **first, **cols)
        v = residual_values(r)
    res = t.apply(b)
    assert res == ApplyResult(upserted=2, deleted=int(how.endswith("tombstone")))
    want = np.zeros((2, 16), np.float32)
    want[0, col:col + 8] = v[0]
    want[1] = 9
    want[1, col:col + 8] = v[1] + 9 if b.additive else v[1]
    assert np.array_equal(_bits(t.lookup([1, 2])), _bits(want))
    assert len(t) == 2


# ----------------------------------------------------------------------------- column slices


@pytest.mark.parametrize("storage", ["f32", "f16"])
def test_a_column_slice_adds_only_to_its_columns(storage):
    rng = np.random.default_rng(22)
    t = ServingTable("emb", 16, dtype=storage)
    a = rng.standard_normal((1, 16)).astype(np.float32)
    t.upsert([1], a)
    held = t.lookup([1])[0]
    r = rng.standard_normal((2, 8)).astype(np.float32)
    res = t.apply(r1_batch([1, 2], r, col=8, width=16))
    assert res == ApplyResult(upserted=2, deleted=0)
    v = residual_values(r)
    sdt = np.float16 if storage == "f16" else np.float32
    got = t.lookup([1, 2])
    assert np.array_equal(_bits(got[0, :8]), _bits(held[:8]))  # kept as they were
    assert np.array_equal(_bits(got[0, 8:]), _bits((held[8:] + v[0]).astype(sdt)))
    assert not np.array_equal(got[0, 8:], held[8:])
    assert np.array_equal(_bits(got[1]), _bits(np.concatenate([np.zeros(8), v[1].astype(sdt)])))
    # the other shard's columns of the new id add onto its zeros
    r2 = rng.standard_normal((1, 8)).astype(np.float32)
    t.apply(r1_batch([2], r2, col=0, width=16))
    got2 = t.lookup([1, 2])
    assert np.array_equal(_bits(got2[0]), _bits(got[0]))
    assert np.array_equal(_bits(got2[1]), _bits(np.concatenate(
        [residual_values(r2)[0].astype(sdt), v[1].astype(sdt)])))


# ----------------------------------------------------------------------------- f16 storage


@pytest.mark.filterwarnings("error")  # the overflow is an ApplyError, not a warning
def test_f16_storage_rounds_each_sum_and_refuses_an_overflow_untouched():
    t = ServingTable("emb", 4, dtype="f16")
    rows = np.array([[60000, -60000, 1, 2], [1, 1, 1, 1], [3, 3, 3, 3]], np.float32)
    t.upsert([1, 2, 7], rows)
    # a sum that fits is added in float32, then rounded to f16 (row 1 adds ±500: the mean)
    ok = np.array([[1000, -1000, 0.001, 0.001], [0.3, 0.3, 0.3, 0.3]], np.float32)
    t.apply(r1_batch([1, 2], ok))
    v = residual_values(ok)
    want = (rows[:2] + v).astype(np.float16).astype(np.float32)
    assert np.array_equal(_bits(t.lookup([1, 2])), _bits(want))
    assert want[0].tolist() == [60512, -60512, 501, 502]  # 60500: f16's ulp is 32 there
    before = (t.version, t.digest(), len(t), t.lookup([1, 2, 7]))
    for r in ([[10000, 10000, 10000, 10000], [1, 1, 1, 1]],      # 60512 + 10000 > 65504
              [[-9000, -9000, -9000, -9000], [1, 1, 1, 1]]):    # -60512 - 9000 as well
        with pytest.raises(ApplyError, match="beyond the float16 storage range"):
            t.apply(r1_batch([1, 2], r, tombstones=np.array([7], np.int64)))
        assert (t.version, t.digest(), len(t)) == before[:3]
        assert np.array_equal(t.lookup([1, 2, 7]), before[3])  # tombstone 7 not applied
    # the same residual into an f32 table is fine
    t32 = ServingTable("emb", 4)
    t32.upsert([1], want[:1])
    t32.apply(r1_batch([1], [[10000] * 4]))
    assert np.array_equal(t32.lookup([1])[0], want[0] + 10000)


# ----------------------------------------------------------------------------- refusals


def test_a_hand_built_r1_batch_is_refused():
    t = ServingTable("emb", 4)
    t.upsert([1, 2], np.ones((2, 4), np.float32))
    before = (t.version, t.digest())
    built = DeltaBatch("m", "emb", 0, 0, 0, 0, 0, ids=np.array([1, 3]),
                       rows=np.full((2, 4), 0.5, np.float32), dtype="r1",
                       tombstones=np.array([2]))
    assert built.additive
    with pytest.raises(ApplyError, match="dtype: a residual batch .*decode"):
        t.apply(built)
    assert (t.version, t.digest()) == before and t.ids().tolist() == [1, 2]
    # the same batch through the wire is applied
    t.apply(decode(one(built, version=4)))
    assert t.ids().tolist() == [1, 3]
    assert np.array_equal(t.lookup([1, 3]), [[1.5] * 4, [0.5] * 4])


def test_a_decoded_r1_batch_without_its_scale_or_with_bad_fresh_flags_is_refused():
    """A DecodedBatch built by hand is trusted, but as for i8 its scale is checked for
    shape (an ApplyError, not a TypeError from deep inside), and so are its fresh flags."""
    t = ServingTable("emb", 2)
    t.upsert([1], [[1, 1]])
    before = (t.version, t.digest())
    good = r1_batch([1, 2], [[1, -1], [2, 2]])
    for change, match in [(dict(scale=None), "scale: an r1 batch needs one scale per row"),
                          (dict(scale=good.scale[:1]), "scale"),
                          (dict(fresh=np.array([True])), "fresh: .*bool \\[2\\]"),
                          (dict(fresh=np.array([1, 0])), "fresh")]:
        bad = DecodedBatch(**{**vars(good), **change})
        with pytest.raises(ApplyError, match=match):
            t.apply(bad)
        assert (t.version, t.digest()) == before
    t.apply(good)
    assert np.array_equal(t.lookup([1, 2]), [[2, 0], [2, 2]])


def test_a_residual_for_another_dim_or_table_is_refused():
    t = ServingTable("emb", 4)
    t.upsert([1], np.ones((1, 4), np.float32))
    before = t.digest()
    with pytest.raises(ApplyError, match="dim 5"):
        t.apply(r1_batch([1], np.ones((1, 5), np.float32)))
    with pytest.raises(ApplyError, match="width"):
        t.apply(r1_batch([1], np.ones((1, 2), np.float32), col=2, width=6))
    other = decode(one(make([1], np.ones((1, 4), np.float32), "r1", table="other"), version=4))
    with pytest.raises(ApplyError, match="other"):
        t.apply(other)
    assert t.digest() == before


# ----------------------------------------------------------------------------- mixed


@pytest.mark.parametrize("storage", ["f32", "f16"])
def test_full_rows_and_residuals_interleaved_equal_the_mirror(storage):
    rng = np.random.default_rng(23)
    dim = 10
    t = ServingTable("emb", dim, dtype=storage, capacity=2)
    mirror = Mirror(dim, np.float16 if storage == "f16" else np.float32)
    target: dict[int, np.ndarray] = {}
    kinds = ["f16", "r1", "i8", "r1", "r1", "f16", "r1", "i8", "r1", "r1", "f32", "r1"] * 2
    for step, kind in enumerate(kinds):
        known = sorted(mirror.rows)
        ids = set(rng.choice(known, size=min(6, len(known)), replace=False).tolist()) \
            if known else set()
        ids |= set(rng.integers(0, 200, 4).tolist())
        ids = np.array(sorted(ids), np.int64)
        gone = sorted(set(known) - set(ids.tolist()))
        tomb = np.array(gone[:2], np.int64) if step % 3 == 2 and gone else None
        for i in ids:
            base = target.get(int(i), np.zeros(dim, np.float32))
            target[int(i)] = base + rng.normal(0, 1, dim).astype(np.float32)
        cur = np.array([target[int(i)] for i in ids], np.float32)
        if kind == "r1":
            residual = cur - mirror.held(ids)
            b = r1_batch(ids, residual, tombstones=tomb)
            mirror.add(ids, residual, () if tomb is None else tomb)
        else:
            b = wire_batch(ids, cur, dtype=kind, tombstones=tomb)
            if kind == "f16":  # what the predictor gets: the float16 of each value
                assert np.array_equal(b.rows_f32(), cur.astype(np.float16).astype(np.float32))
            mirror.delete(() if tomb is None else tomb)
            mirror.replace(ids, b.rows_f32())
        assert b.additive == (kind == "r1")
        res = t.apply(b)
        assert res.upserted == ids.size
        mirror.check(t)
        assert len(t) == len(mirror.rows)


def test_an_f16_table_says_once_that_it_rounds_residual_sums(caplog):
    t = ServingTable("emb", 4, dtype="f16")
    with caplog.at_level(logging.WARNING, logger="consumers.serving.table"):
        for _ in range(3):
            t.apply(r1_batch([1], np.ones((1, 4), np.float32)))
    assert sum("stores f16" in r.getMessage() for r in caplog.records) == 1
    f32 = ServingTable("emb", 4)
    with caplog.at_level(logging.WARNING, logger="consumers.serving.table"):
        f32.apply(r1_batch([1], np.ones((1, 4), np.float32)))
    assert sum("stores f16" in r.getMessage() for r in caplog.records) == 1
