"""Shared tables (consumers.serving.shm) and their reader (consumers.serving.reader), within
one process; tests/integration/test_shared_tables.py runs writers and readers as processes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from consumers.errors import ConsumerError
from consumers.serving import TableReader
from consumers.serving.memory import MAGIC
from consumers.serving.shm import shm_root, table_dir
from consumers.serving.table import ServingTable
from deltastream.wire import DeltaBatch

pytestmark = pytest.mark.usefixtures("lookup_path")  # native and numpy lookups


@pytest.fixture
def state(tmp_path):
    yield tmp_path / "state"
    root = shm_root(tmp_path / "state")
    assert not root.exists() or not any(root.rglob("*.rows")), "a test left table files"
    for d in sorted(root.rglob("*"), reverse=True) if root.exists() else ():
        d.rmdir()  # only empty directories are left here (rmdir refuses anything else)
    if root.exists():
        root.rmdir()


def _table(n: int = 100, dim: int = 4, name: str = "emb", dtype: str = "f32") -> ServingTable:
    t = ServingTable(name, dim, dtype=dtype)
    t.upsert(np.arange(n), np.arange(n * dim, dtype=np.float32).reshape(n, dim))
    return t


def test_share_open_lookup_and_read_info(state):
    t = _table()
    loc = t.share(state)
    assert t.shared == loc and t.share(state) == loc  # idempotent
    try:
        r = TableReader.open(state, "emb")
        assert (r.dim, r.dtype, len(r)) == (4, "f32", 100)
        out = np.full((3, 4), -1, np.float32)
        rows, info = r.read([1, 2, 10**12], out=out)
        assert rows is out and rows.tolist() == [[4, 5, 6, 7], [8, 9, 10, 11], [0, 0, 0, 0]]
        assert info.rows == 100 and info.writer == "live" and info.version == t.version
        assert info.source_ts is None and info.age_s is not None and info.age_s < 60
        batch = DeltaBatch("m", "emb", 0, 0, 0, 7, 1_700_000_000_000_000_000,
                           ids=np.array([2, 500]), rows=np.ones((2, 4)), dtype="f32")
        t.apply(batch)
        rows, info = r.read([2, 500])
        assert (rows == 1).all() and info.rows == 101 and info.version == t.version
        assert info.source_ts == pytest.approx(1.7e9) and info.freshness_s > 0
        with pytest.raises(ValueError, match="out"):
            r.lookup([1], out=np.zeros((1, 4), np.float64))
    finally:
        t.unshare()
    assert t.shared is None and (t.lookup([2]) == 1).all()  # still usable in-process


def test_reader_follows_growth_and_index_migrations(state):
    t = ServingTable("emb", 8, capacity=16)
    t.share(state)
    try:
        r = TableReader.open(state, "emb")
        for i in range(30):
            ids = np.arange(i * 2000, (i + 1) * 2000)
            t.upsert(ids, np.repeat(ids[:, None], 8, axis=1).astype(np.float32))
            q = np.random.default_rng(i).integers(0, (i + 1) * 2000, 300)
            assert np.array_equal(r.lookup(q)[:, 3], q.astype(np.float32))
        assert t.stats()["index_gen"] >= 3 and r.info().rows == 60000
    finally:
        t.unshare()


def test_f16_table_reads_as_float32(state):
    t = _table(dtype="f16")
    t.share(state)
    try:
        got = TableReader.open(state, "emb").lookup([3])
        assert got.dtype == np.float32 and got.tolist() == [[12, 13, 14, 15]]
    finally:
        t.unshare()


def test_a_stopped_then_restarted_writer_is_followed(state):
    t1 = _table()
    t1.share(state)
    r = TableReader.open(state, "emb")
    inc1 = r.incarnation
    t1.unshare()  # the daemon stops: the reader keeps the last state
    assert r.info().writer == "closed" and r.lookup([1]).tolist() == [[4, 5, 6, 7]]
    t2 = ServingTable("emb", 4)
    t2.upsert([1], [[9, 9, 9, 9]])
    t2.share(state)  # the daemon restarted
    try:
        assert r.lookup([1]).tolist() == [[9, 9, 9, 9]] and r.incarnation != inc1
        assert r.info().writer == "live" and len(r) == 1
    finally:
        t2.unshare()


def test_one_writer_per_table_and_state_dir(state):
    t1 = _table()
    t1.share(state)
    try:
        with pytest.raises(ConsumerError, match="already shared"):
            _table().share(state)
        other = _table(name="other")
        other.share(state)  # another table of the same state dir is fine
        other.unshare()
    finally:
        t1.unshare()


def test_files_of_dead_writers_are_removed_and_foreign_files_kept(state):
    d = table_dir(state, "emb")
    d.mkdir(parents=True)
    stale = d / "0123456789abcdef.rows"
    stale.write_bytes(MAGIC.to_bytes(8, "little") + bytes(4088))
    foreign = d / "fedcba9876543210.rows"
    foreign.write_bytes(b"not a table" * 100)
    notes = d / "notes.txt"
    notes.write_text("mine")
    t = _table()
    t.share(state)
    try:
        assert not stale.exists() and foreign.exists() and notes.exists()
    finally:
        t.unshare()
    assert foreign.exists() and notes.exists()  # and the directory stays, as it is not empty
    foreign.unlink()
    notes.unlink()


def test_open_errors_and_locations(state, tmp_path, monkeypatch):
    import consumers.serving.shm_place as shm_place

    with pytest.raises(ConsumerError, match="no shared table 'emb'"):
        TableReader.open(state, "emb", timeout=0.1)
    with pytest.raises(ValueError):
        TableReader.open(state, "")
    monkeypatch.setattr(shm_place, "SHM_BASE", str(tmp_path / "no-shm"))  # a host without /dev/shm
    assert shm_root(state) == state.resolve() / "shm"
    monkeypatch.undo()
    assert table_dir(state, "a/b c").name.startswith("a_b_c-")
    assert table_dir(state, "x") != table_dir(state, "X")


def test_unshare_removes_every_file(state):
    t = _table(name="tbl with spaces/é")
    loc = t.share(state)
    names = sorted(os.listdir(loc))
    assert any(n.endswith(".rows") for n in names) and "current" in names
    t.unshare()
    assert not loc.exists()


def test_a_shared_table_outgrowing_its_reservation_moves_and_readers_follow(state,
                                                                             monkeypatch):
    import consumers.serving.memory as memory

    monkeypatch.setattr(memory, "RESERVE_BYTES", 64 * 4 * 4)  # 64 rows of dim 4
    t = ServingTable("emb", 4, capacity=8)
    t.upsert([1, 2], [[1, 1, 1, 1], [2, 2, 2, 2]])
    loc = t.share(state)
    try:
        r = TableReader.open(state, "emb")
        inc = r.incarnation
        ids = np.arange(10, 400, dtype=np.int64)
        t.upsert(ids, np.repeat(ids[:, None], 4, axis=1).astype(np.float32))
        assert r.lookup([2, 399]).tolist() == [[2, 2, 2, 2], [399, 399, 399, 399]]
        assert r.incarnation != inc and r.info().rows == 392
        assert len([p for p in loc.iterdir() if p.suffix == ".rows"]) == 1  # old one gone
    finally:
        t.unshare()
