"""ServingTable: lookup/upsert/delete/apply semantics, refusals, concurrency, save/load."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading

import numpy as np
import pytest

from consumers.serving.table import ApplyError, ApplyResult, ServingTable, SnapshotError
from deltastream.wire import DecodedBatch, DeltaBatch, decode, encode

pytestmark = pytest.mark.usefixtures("lookup_path")  # native and numpy lookups


def wire_batch(ids, rows, *, table="emb", dtype="f32", tombstones=None, seq=0, dim=None,
               **columns):
    """Encode + decode one batch, as the daemon sees it."""
    ids = np.asarray(ids, np.int64)
    rows = np.asarray(rows, np.float32).reshape(len(ids), -1 if dim is None else dim)
    msgs = encode(DeltaBatch("m", table, 0, 0, seq, 0, 0, ids=ids, rows=rows, dtype=dtype,
                             tombstones=tombstones, **columns), max_message_bytes=64 << 20)
    assert len(msgs) == 1
    return decode(msgs[0])


def raw_decoded(ids, rows, dtype, table="emb", scale=None):
    """A batch as decode() would return it, with arbitrary (possibly non-finite) rows."""
    return DecodedBatch("m", table, 0, 0, 0, 0, 0, ids=np.asarray(ids, np.int64), rows=rows,
                        dtype=dtype, scale=scale)


# ----------------------------------------------------------------------------- basics


def test_lookup_unknown_ids_are_zeros():
    t = ServingTable("emb", 4)
    out = t.lookup([1, 2, -5])
    assert out.shape == (3, 4) and out.dtype == np.float32 and not out.any()
    t.upsert([2], [[1, 2, 3, 4]])
    out = t.lookup(np.array([1, 2, 3]))
    assert np.array_equal(out, [[0, 0, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0]])
    assert t.lookup(np.zeros(0, np.int64)).shape == (0, 4)


def test_upsert_delete_ids_rows_and_slot_reuse():
    rng = np.random.default_rng(0)
    t = ServingTable("emb", 3, capacity=8)
    ids = rng.choice(1 << 40, 500, replace=False).astype(np.int64) - (1 << 39)  # negatives too
    rows = rng.standard_normal((500, 3)).astype(np.float32)
    t.upsert(ids, rows)
    assert len(t) == 500
    order = np.argsort(ids)
    assert np.array_equal(t.ids(), ids[order])
    assert np.array_equal(t.rows(), rows[order])
    assert np.array_equal(t.rows(ids[:5]), rows[:5])
    got_ids, got_rows = t.items()
    assert np.array_equal(got_ids, ids[order]) and np.array_equal(got_rows, rows[order])
    assert t.delete(np.concatenate([ids[:100], ids[:10], [123456789]])) == 100
    assert len(t) == 400
    assert not t.lookup(ids[:100]).any()
    assert np.array_equal(t.lookup(ids[100:]), rows[100:])
    assert t.contains(ids[98:102]).tolist() == [False, False, True, True]
    cap = t.stats()["row_capacity"]
    # deleted slots are reused: inserting 100 new ids does not grow the row storage
    t.upsert(ids[:100] + 7, rows[:100])
    assert t.stats()["row_capacity"] == cap
    assert np.array_equal(t.lookup(ids[:100] + 7), rows[:100])


def test_upsert_repeated_id_takes_last_row():
    t = ServingTable("emb", 2)
    t.upsert([5, 1, 5], [[1, 1], [2, 2], [3, 3]])
    assert len(t) == 2
    assert np.array_equal(t.lookup([5, 1]), [[3, 3], [2, 2]])


def test_matches_dict_reference_under_random_operations():
    """Many inserts/deletes into a small id space (heavy collisions, delete markers,
    index rebuilds) must behave exactly like a dict."""
    rng = np.random.default_rng(1)
    for trial in range(6):
        t = ServingTable("emb", 2, capacity=int(rng.integers(1, 40)))
        ref: dict[int, np.ndarray] = {}
        space = int(rng.integers(50, 3000))
        for _ in range(40):
            k = int(rng.integers(0, 300))
            ids = rng.integers(-space, space, k)
            if rng.random() < 0.65:
                rows = rng.standard_normal((k, 2)).astype(np.float32)
                t.upsert(ids, rows)
                ref.update({int(i): r for i, r in zip(ids, rows, strict=True)})
            else:
                uniq = set(ids.tolist())
                assert t.delete(ids) == sum(i in ref for i in uniq)
                for i in uniq:
                    ref.pop(i, None)
            assert len(t) == len(ref)
        q = rng.integers(-space, space, 1000)
        exp = np.array([ref.get(int(i), np.zeros(2, np.float32)) for i in q])
        assert np.array_equal(t.lookup(q), exp), trial
        assert np.array_equal(t.ids(), np.array(sorted(ref), np.int64))


def test_grows_past_initial_capacity():
    t = ServingTable("emb", 8, capacity=1)
    ids = np.arange(50_000, dtype=np.int64) * 7919
    rows = np.repeat(np.arange(50_000, dtype=np.float32)[:, None], 8, axis=1)
    for i in range(0, 50_000, 4096):
        t.upsert(ids[i:i + 4096], rows[i:i + 4096])
    assert len(t) == 50_000
    assert np.array_equal(t.lookup(ids[::-1]), rows[::-1])


@pytest.mark.parametrize("bad", [
    dict(name=""), dict(dim=0), dict(dim=1 << 20), dict(dim=2.0), dict(dtype="bf16"),
    dict(capacity=0)])
def test_constructor_validates(bad):
    kw = dict(name="emb", dim=4) | bad
    with pytest.raises(ValueError):
        ServingTable(kw.pop("name"), kw.pop("dim"), **kw)


def test_lookup_rejects_bad_ids():
    t = ServingTable("emb", 2)
    with pytest.raises(TypeError, match="integer"):
        t.lookup(np.array([1.5]))
    with pytest.raises(ValueError, match="1-D"):
        t.lookup(np.zeros((2, 2), np.int64))


# ----------------------------------------------------------------------------- apply


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i8"])
def test_apply_every_wire_dtype(dtype):
    rng = np.random.default_rng(2)
    ids = np.sort(rng.choice(10_000, 300, replace=False)).astype(np.int64)
    rows = rng.standard_normal((300, 16)).astype(np.float32)
    b = wire_batch(ids, rows, dtype=dtype)
    t = ServingTable("emb", 16)
    assert t.apply(b) == ApplyResult(upserted=300, deleted=0)
    got = t.lookup(ids)
    # the table holds exactly the dequantized wire values
    assert np.array_equal(got, b.rows_f32())
    tol = {"f32": 0, "f16": 1e-3, "bf16": 8e-3, "i8": None}[dtype]
    if tol is None:  # i8: |err| ≤ max|row| / 254
        bound = np.abs(rows).max(axis=1, keepdims=True) / 254 + 1e-7
        assert (np.abs(got - rows) <= bound).all()
    else:
        assert np.allclose(got, rows, rtol=tol, atol=1e-6)


def test_apply_tombstones_then_upserts():
    t = ServingTable("emb", 2)
    t.upsert([1, 2, 3, 4], np.ones((4, 2)))
    res = t.apply(wire_batch([3, 9], [[5, 5], [9, 9]], dim=2, tombstones=np.array([1, 2, 3, 77])))
    # 1, 2 and 3 deleted (77 unknown), then 3 and 9 upserted
    assert res == ApplyResult(upserted=2, deleted=3)
    assert t.ids().tolist() == [3, 4, 9]
    assert np.array_equal(t.lookup([1, 3, 4, 9]), [[0, 0], [5, 5], [1, 1], [9, 9]])
    # a message with tombstones only
    res = t.apply(wire_batch([], np.zeros((0, 2)), dim=2, tombstones=np.array([4, 4])))
    assert res == ApplyResult(upserted=0, deleted=1)
    assert t.ids().tolist() == [3, 9]


def test_apply_into_f16_storage():
    rng = np.random.default_rng(3)
    ids = np.arange(100, dtype=np.int64)
    rows = rng.standard_normal((100, 8)).astype(np.float32)
    for wire in ("f32", "f16", "bf16", "i8"):
        b = wire_batch(ids, rows, dtype=wire)
        t = ServingTable("emb", 8, dtype="f16")
        t.apply(b)
        assert np.array_equal(t.lookup(ids), b.rows_f32().astype(np.float16).astype(np.float32))
    with pytest.raises(ApplyError, match="f16 storage range"):
        ServingTable("emb", 1, dtype="f16").apply(wire_batch([1], [[1e6]], dim=1))


def _refusals():
    ids = np.array([1, 2], np.int64)
    nan_f16 = np.array([[1, np.nan], [0, 1]], np.float16)
    inf_bf16 = np.array([[0x3F80, 0x7F80], [0, 0]], np.uint16)  # 1.0, +inf
    return {
        "wrong table": (wire_batch(ids, np.ones((2, 2)), table="other"), "other"),
        "dim mismatch": (wire_batch(ids, np.ones((2, 3))), "dim 3"),
        "nan f32": (wire_batch(ids, [[1, np.nan], [0, 1]]), "NaN or inf"),
        "inf f32": (wire_batch(ids, [[1, 2], [np.inf, 1]]), "NaN or inf"),
        "nan f16": (raw_decoded(ids, nan_f16, "f16"), "NaN or inf"),
        "inf bf16": (raw_decoded(ids, inf_bf16, "bf16"), "NaN or inf"),
        "i8 overflow": (raw_decoded(ids, np.ones((2, 2), np.int8), "i8",
                                    scale=np.array([1, 3e37], np.float32)), "overflow"),
        "i8 no scale": (raw_decoded(ids, np.ones((2, 2), np.int8), "i8"), "scale"),
        "duplicate ids": (DeltaBatch("m", "emb", 0, 0, 0, 0, 0, ids=np.array([3, 3]),
                                     rows=np.ones((2, 2))), "duplicate"),
        "row count": (DeltaBatch("m", "emb", 0, 0, 0, 0, 0, ids=np.array([3, 4]),
                                 rows=np.ones((3, 2))), "shape"),
        "unknown dtype": (DeltaBatch("m", "emb", 0, 0, 0, 0, 0, ids=np.array([3]),
                                     rows=np.ones((1, 2)), dtype="f64"), "dtype"),
        # wire v2 column slices of rows wider than the table
        "column slice": (wire_batch(ids, np.ones((2, 2)), col=2, width=4),
                         r"width \(columns \[2, 4\)\) 4, the table has dim 2"),
        "left columns": (wire_batch(ids, np.ones((2, 2)), width=4), r"columns \[0, 2\)"),
        "slice past width": (DeltaBatch("m", "emb", 0, 0, 0, 0, 0, ids=ids, rows=np.ones((2, 1)),
                                        col=2, width=2), r"columns \[2, 3\) of rows 2 wide"),
    }


@pytest.mark.parametrize("case", sorted(_refusals()))
def test_refused_batch_leaves_table_untouched(case):
    batch, match = _refusals()[case]
    t = ServingTable("emb", 2)
    t.upsert([1, 5], [[7, 7], [8, 8]])
    # tombstones on the refused batch must not be applied either
    batch.tombstones = np.array([5], np.int64)
    before = t.digest()
    with pytest.raises(ApplyError, match=match):
        t.apply(batch)
    assert t.digest() == before and len(t) == 2
    assert np.array_equal(t.lookup([1, 5]), [[7, 7], [8, 8]])


def test_upsert_refuses_non_finite_and_bad_shapes():
    t = ServingTable("emb", 2)
    with pytest.raises(ApplyError, match="NaN or inf"):
        t.upsert([1], [[np.nan, 0]])
    with pytest.raises(ApplyError, match="shape"):
        t.upsert([1, 2], [[1, 1]])
    with pytest.raises(ApplyError):
        t.apply("not a batch")  # type: ignore[arg-type]
    assert len(t) == 0


# ----------------------------------------------------------------------------- threads


def test_concurrent_lookups_never_see_torn_rows_or_half_batches():
    """A writer applies batches that set every row of every id to the batch's version (and
    deletes/re-adds a second id group); readers check each row is constant (no torn row)
    and all rows of one lookup share one version (no half-applied batch)."""
    dim, n = 256, 2048
    ids = np.arange(n, dtype=np.int64) * 3
    extra = ids + 1
    t = ServingTable("emb", dim)
    t.apply(wire_batch(ids, np.zeros((n, dim)), dim=dim))
    batches = []
    for v in range(1, 41):
        rows = np.full((2 * n, dim), float(v), np.float32)
        all_ids = np.sort(np.concatenate([ids, extra]))
        batches.append(wire_batch(all_ids, rows, dim=dim, tombstones=extra, seq=v))
    stop = threading.Event()
    errors: list[str] = []
    seen: list[int] = []

    def reader():
        last = 0
        q = np.concatenate([ids, extra])
        while not stop.is_set():
            out = t.lookup(q)
            if not (out.min(axis=1) == out.max(axis=1)).all():
                errors.append("torn row")
                return
            vals = out[:, 0]
            known = vals[:n]
            if known.min() != known.max():
                errors.append(f"half-applied batch: versions {np.unique(known)}")
                return
            # extra ids are deleted then re-upserted in the same batch: never missing
            # once present, and always the same version as the rest
            if last and not (vals[n:] == known[0]).all():
                errors.append("extra ids out of step with their batch")
                return
            if known[0] < last:
                errors.append("version went backwards")
                return
            last = int(known[0])
            seen.append(last)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: make interleavings likely
    try:
        readers = [threading.Thread(target=reader) for _ in range(3)]
        for r in readers:
            r.start()
        for b in batches:
            t.apply(b)
        stop.set()
        for r in readers:
            r.join(10)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    assert len(seen) > 10 and len(set(seen)) > 2  # readers really ran during the applies
    assert (t.lookup(ids) == 40).all()


def test_lookups_stay_correct_while_the_table_grows():
    """Readers of a fixed id set keep seeing its rows while a writer inserts enough new ids
    to force row-storage growth and index rebuilds (and deletes some again)."""
    t = ServingTable("emb", 8, capacity=16)
    stable = np.arange(500, dtype=np.int64) * 1_000_003
    rows = np.repeat(np.arange(1, 501, dtype=np.float32)[:, None], 8, axis=1)
    t.upsert(stable, rows)
    stop = threading.Event()
    errors: list[str] = []
    checks = [0]

    def reader():
        while not stop.is_set():
            if not np.array_equal(t.lookup(stable), rows):
                errors.append("stable rows changed")
                return
            checks[0] += 1

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        rng = np.random.default_rng(8)
        for i in range(60):
            new = np.unique(rng.integers(1, 1 << 60, 2000)) * 2 + 1  # odd: never in stable
            t.upsert(new, np.full((new.size, 8), -1.0))
            if i % 3 == 0:
                t.delete(new[::2])
    finally:
        stop.set()
        for r in readers:
            r.join(10)
    assert not errors and checks[0] > 5
    assert t.stats()["row_capacity"] > 16


# ----------------------------------------------------------------------------- digest


def test_digest_depends_on_contents_only():
    rng = np.random.default_rng(4)
    ids = rng.choice(1 << 30, 1000, replace=False).astype(np.int64)
    rows = rng.standard_normal((1000, 4)).astype(np.float32)
    a = ServingTable("a", 4, capacity=1)
    a.upsert(ids, rows)
    b = ServingTable("b", 4, capacity=5000)
    perm = rng.permutation(1000)
    b.upsert(ids[perm][:600], rows[perm][:600])
    b.upsert(np.array([1 << 40]), np.ones((1, 4)))
    b.upsert(ids[perm][600:], rows[perm][600:])
    assert a.digest() != b.digest()
    b.delete([1 << 40])
    assert a.digest() == b.digest()
    rows2 = rows.copy()
    rows2[17, 2] = np.nextafter(rows2[17, 2], np.float32(9))
    c = ServingTable("a", 4)
    c.upsert(ids, rows2)
    assert c.digest() != a.digest()


# ----------------------------------------------------------------------------- save/load


@pytest.fixture
def saved(tmp_path):
    rng = np.random.default_rng(5)
    t = ServingTable("user/emb", 6)  # a name with a slash is fine on disk
    t.upsert(rng.choice(1 << 50, 400, replace=False), rng.standard_normal((400, 6)))
    t.delete(t.ids()[:50])
    path = tmp_path / "snap"
    t.save(path)
    return t, path


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_save_load_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(6)
    t = ServingTable("emb", 5, dtype=dtype)
    ids = rng.choice(1 << 50, 300, replace=False)
    t.upsert(ids, rng.standard_normal((300, 5)))
    t.save(tmp_path / "s")
    u = ServingTable.load(tmp_path / "s")
    assert (u.name, u.dim, u.dtype, len(u)) == ("emb", 5, dtype, 300)
    assert u.digest() == t.digest()
    assert np.array_equal(u.lookup(ids), t.lookup(ids))
    u.upsert([1], [[1] * 5])  # the loaded table is writable
    assert len(u) == 301
    files = sorted(os.listdir(tmp_path / "s"))
    assert files == ["ids.npy", "manifest.json", "rows.npy"]
    for f in ("ids.npy", "rows.npy"):
        np.load(tmp_path / "s" / f, allow_pickle=False)  # plain npy files


def test_save_empty_table_and_overwrite(tmp_path):
    t = ServingTable("emb", 3)
    t.save(tmp_path / "s")
    assert len(ServingTable.load(tmp_path / "s")) == 0
    t.upsert([1, 2], np.ones((2, 3)))
    t.save(tmp_path / "s")  # replaces the old one
    assert ServingTable.load(tmp_path / "s").digest() == t.digest()
    assert sorted(os.listdir(tmp_path)) == ["s"]  # no temp or .old left behind


def test_load_missing_dir(tmp_path):
    with pytest.raises(SnapshotError, match="no snapshot"):
        ServingTable.load(tmp_path / "nope")


def test_interrupted_save_falls_back_to_previous(saved, tmp_path):
    t, path = saved
    # state after a crash between "rename path -> path.old" and "rename tmp -> path"
    os.rename(path, str(path) + ".old")
    (tmp_path / "snap.tmp-1-deadbeef").mkdir()
    assert ServingTable.load(path).digest() == t.digest()
    t.upsert([3], [[3] * 6])
    t.save(path)  # recovers: new snapshot in place, leftovers removed
    assert ServingTable.load(path).digest() == t.digest()
    assert sorted(os.listdir(tmp_path)) == ["snap"]


@pytest.mark.parametrize("name", ["rows.npy", "ids.npy", "manifest.json"])
def test_flipped_byte_detected(saved, name):
    _, path = saved
    f = path / name
    data = bytearray(f.read_bytes())
    pos = len(data) // 2 if name != "manifest.json" else data.index(b'"dim"') + 2
    data[pos] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="checksum|JSON"):
        ServingTable.load(path)


@pytest.mark.parametrize("name", ["rows.npy", "ids.npy", "manifest.json"])
def test_truncated_file_detected(saved, name):
    _, path = saved
    f = path / name
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 9])
    with pytest.raises(SnapshotError, match=r"truncated|JSON|checksum"):
        ServingTable.load(path)


@pytest.mark.parametrize("name", ["rows.npy", "ids.npy", "manifest.json"])
def test_missing_file_detected(saved, name):
    _, path = saved
    (path / name).unlink()
    with pytest.raises(SnapshotError, match="missing"):
        ServingTable.load(path)


def test_edited_manifest_detected(saved):
    _, path = saved
    doc = json.loads((path / "manifest.json").read_text())
    doc["dim"] = 7  # valid JSON, stale checksum
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(SnapshotError, match="manifest checksum mismatch"):
        ServingTable.load(path)
    (path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(SnapshotError, match="no checksum"):
        ServingTable.load(path)


def test_resealed_manifest_with_wrong_shape_detected(saved):
    """Even a manifest with a valid checksum cannot make a file be read with another shape
    or dtype (and object arrays are never unpickled)."""
    from consumers.files import seal

    _, path = saved
    doc = json.loads((path / "manifest.json").read_text())
    body = {k: v for k, v in doc.items() if k != "checksum"}
    body["dim"] = 3
    (path / "manifest.json").write_text(json.dumps(seal(body)))
    with pytest.raises(SnapshotError, match="expected"):
        ServingTable.load(path)


def test_object_npy_refused(saved):
    from consumers.files import seal

    _, path = saved
    doc = json.loads((path / "manifest.json").read_text())
    with open(path / "ids.npy", "wb") as f:
        np.save(f, np.array([object()] * 350, dtype=object), allow_pickle=True)
    os.remove(path / "rows.npy")
    shutil.copy(path / "ids.npy", path / "rows.npy")
    body = {k: v for k, v in doc.items() if k != "checksum"}
    for name in ("ids.npy", "rows.npy"):
        data = (path / name).read_bytes()
        body["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (path / "manifest.json").write_text(json.dumps(seal(body)))
    with pytest.raises(SnapshotError, match="expected"):
        ServingTable.load(path)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("wire_dtype", ["f32", "f16", "i8"])
def test_column_slices_write_only_their_columns(dtype, wire_dtype):
    """A column shard's batch writes its columns; a row first seen through one shard reads
    zeros in the other columns until they arrive; a reused slot shows no old row."""
    t = ServingTable("emb", 5, dtype=dtype, capacity=2)
    t.upsert([9], [[9, 9, 9, 9, 9]])
    t.delete([9])  # its slot goes on the free stack and is reused by a fresh row below
    right = np.array([[1, 2], [3, 4]], np.float32)
    res = t.apply(wire_batch([1, 2], right, col=3, width=5, dtype=wire_dtype))
    assert (res.upserted, len(t)) == (2, 2)
    tol = 0.05 if wire_dtype == "i8" else 0
    got = t.lookup([1, 2])
    assert np.allclose(got[:, :3], 0) and np.allclose(got[:, 3:], right, atol=tol)
    left = np.array([[5, 6, 7], [8, 9, 10]], np.float32)
    t.apply(wire_batch([2, 3], left, col=0, width=5, dtype=wire_dtype))
    got = t.lookup([1, 2, 3])
    assert np.allclose(got[1], [5, 6, 7, 3, 4], atol=tol * 10)
    assert np.allclose(got[2], [8, 9, 10, 0, 0], atol=tol * 10)
    assert np.allclose(got[0, :3], 0)
    # whole rows still overwrite every column; tombstones on a slice delete whole rows
    t.apply(wire_batch([1], [[1, 1, 1, 1, 1]], dim=5))
    assert np.array_equal(t.lookup([1]), [[1, 1, 1, 1, 1]])
    t.apply(wire_batch([1], [[4]], col=4, width=5, tombstones=np.array([3], np.int64)))
    assert np.array_equal(t.lookup([1, 3]), [[1, 1, 1, 1, 4], [0, 0, 0, 0, 0]])
    assert len(t) == 2
