"""The lock-free table core (consumers.serving.core) through ServingTable: copy-on-write
rows and frozen views, slot reuse, incremental index growth, failed applies."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

import consumers.serving.core as core_mod
from consumers.files import HashingWriter
from consumers.serving import lookup
from consumers.serving.table import ServingTable

pytestmark = pytest.mark.usefixtures("lookup_path")  # native and numpy lookups


def _rows(n: int, dim: int, v: float) -> np.ndarray:
    return np.full((n, dim), v, np.float32)


def test_frozen_view_keeps_its_state_while_the_table_changes():
    t = ServingTable("e", 4)
    ids = np.arange(1000, dtype=np.int64)
    t.upsert(ids, _rows(1000, 4, 1.0))
    before = t.digest()
    with t.frozen() as view:
        t.upsert(ids[:600], _rows(600, 4, 2.0))  # copy-on-write: new slots
        t.delete(ids[600:700])
        t.upsert(np.arange(5000, 5300), _rows(300, 4, 3.0))
        assert view.n == 1000 and np.array_equal(view.ids, ids)
        assert (view.rows() == 1.0).all()
        chunks = list(view.row_chunks(333))
        assert sum(c.shape[0] for c in chunks) == 1000 and all((c == 1.0).all() for c in chunks)
    assert t.digest() != before and len(t) == 1200
    assert (t.lookup(ids[:600]) == 2.0).all() and not t.lookup(ids[600:700]).any()
    with pytest.raises(RuntimeError, match="after release"):
        view.rows()


def test_replaced_slots_are_reused_but_not_while_a_view_pins_them():
    t = ServingTable("e", 8)
    ids = np.arange(500, dtype=np.int64)
    t.upsert(ids, _rows(500, 8, 0.0))
    for v in range(1, 6):  # updates reuse the slots the previous update replaced
        t.upsert(ids, _rows(500, 8, float(v)))
    hwm = t.stats()["slots_used"]
    assert hwm <= 1 + 3 * 500
    view = t.frozen()
    for v in range(6, 10):
        t.upsert(ids, _rows(500, 8, float(v)))
    assert t.stats()["slots_used"] > hwm  # pinned: nothing the view reads was reused
    assert (view.rows() == 5.0).all()
    view.release()
    grown = t.stats()["slots_used"]
    for v in range(10, 20):
        t.upsert(ids, _rows(500, 8, float(v)))
    assert t.stats()["slots_used"] == grown and (t.lookup(ids) == 19.0).all()


def test_changes_view_holds_only_rows_changed_since_the_last_take():
    t = ServingTable("e", 2)
    t.upsert(np.arange(100), _rows(100, 2, 1.0))
    t.start_tracking()
    t.upsert([5, 6, 500], _rows(3, 2, 2.0))
    t.upsert([6], _rows(1, 2, 4.0))  # written twice: once, with the last value
    t.delete([7, 500, 12345])  # 500 inserted then deleted: no upsert; 12345 never there
    ch = t.frozen_changes()
    t.upsert([5], _rows(1, 2, 9.0))  # after the take: next time
    with ch:
        assert ch.ids.tolist() == [5, 6] and ch.rows().tolist() == [[2, 2], [4, 4]]
        assert ch.deleted.tolist() == [7, 500]
    ids, rows, gone = t.take_changes()
    assert ids.tolist() == [5] and rows.tolist() == [[9, 9]] and gone.size == 0


def test_index_grows_a_slice_per_apply_and_stays_correct(monkeypatch):
    import consumers.serving.growth as growth_mod

    monkeypatch.setattr(growth_mod, "MIN_STEP", 64)  # long migrations: many applies inside
    t = ServingTable("e", 3, capacity=16)
    ref: dict[int, float] = {}
    rng = np.random.default_rng(3)
    seen_migrating = 0
    gens = set()
    forced_small = None
    for step in range(300):
        new = rng.integers(0, 1 << 50, 200)
        t.upsert(new, np.repeat(new[:, None] % 997, 3, axis=1).astype(np.float32))
        ref.update((int(k), float(k % 997)) for k in new)
        if step % 4 == 0:
            gone = rng.choice(np.fromiter(ref, np.int64), 50)
            t.delete(gone)
            for g in gone.tolist():
                ref.pop(g, None)
        st = t.stats()
        if forced_small is None and len(t) > 10_000:  # batches ≤ 2% of the table
            forced_small = t.stats()["index_forced"]
        seen_migrating += st["index_migrating"]
        gens.add(st["index_gen"])
        q = rng.choice(np.fromiter(ref, np.int64), 64)
        assert (t.lookup(q)[:, 0] == q % 997).all(), step
    assert len(t) == len(ref) and set(t.ids().tolist()) == set(ref)
    assert len(gens) >= 5 and seen_migrating > 20  # migrations ran across many applies
    assert t.stats()["index_forced"] == forced_small  # once batches are small next to the table, no
    # apply had to finish a migration by itself


def test_a_batch_bigger_than_the_index_room_is_applied_in_one_go():
    t = ServingTable("e", 2, capacity=4)
    ids = np.arange(100_000, dtype=np.int64)
    t.upsert(ids, np.repeat(ids[:, None], 2, axis=1).astype(np.float32))
    assert len(t) == 100_000 and np.array_equal(t.lookup(ids[::997])[:, 1], ids[::997])


def test_a_failed_apply_publishes_nothing(monkeypatch):
    t = ServingTable("e", 4)
    t.upsert(np.arange(50), _rows(50, 4, 1.0))
    t.delete([3])
    digest, version = t.digest(), t.version

    def boom(*a, **k):
        raise MemoryError("injected")

    with monkeypatch.context() as m:
        m.setattr(core_mod, "_scatter_rows", boom)
        with pytest.raises(MemoryError):
            t.upsert(np.arange(40, 80), _rows(40, 4, 2.0))
    assert t.digest() == digest and t.version == version and len(t) == 49
    t.upsert(np.arange(40, 80), _rows(40, 4, 2.0))
    assert len(t) == 79 and (t.lookup(np.arange(40, 80)) == 2.0).all()
    assert (t.lookup(np.arange(0, 40)[np.arange(40) != 3]) == 1.0).all()


def test_lookups_and_applies_go_on_while_a_view_is_written_out(monkeypatch):
    """A checkpoint reads a frozen view off every lock: while it is stuck (a slow disk),
    other threads still look up and apply."""
    t = ServingTable("e", 8)
    t.upsert(np.arange(20000), _rows(20000, 8, 1.0))
    inside, release = threading.Event(), threading.Event()
    real = HashingWriter.write

    def slow_write(self, b):
        inside.set()
        release.wait(10)
        return real(self, b)

    monkeypatch.setattr(HashingWriter, "write", slow_write)
    out = Path(tempfile.mkdtemp()) / "saved"
    saver = threading.Thread(target=t.save, args=(out,))
    saver.start()
    try:
        assert inside.wait(10)
        t.upsert(np.arange(20000, 20100), _rows(100, 8, 5.0))  # apply: no lock held by save
        assert (t.lookup(np.arange(19990, 20010)).sum(axis=1) > 0).all()
    finally:
        release.set()
        saver.join(10)
    loaded = ServingTable.load(out)
    assert len(loaded) == 20000 and (loaded.lookup(np.arange(20000)) == 1.0).all()


def test_a_read_is_valid_until_the_writer_starts_to_rebuild_its_copy():
    """The seqlock protocol, step by step: a reader that took state s stays valid through
    the next publish (its copy and slots are untouched) and is told to retry as soon as
    the apply after that begins."""
    core = core_mod.TableCore("e", 4, np.dtype(np.float32), 64)
    ids = np.arange(100, dtype=np.int64)

    def apply(v: float) -> None:
        with core.lock:
            core.apply(ids, np.full((100, 4), v, np.float32), None)

    apply(1.0)
    v = core.view
    s = int(v.hdr[core_mod.H_SEQ])
    out = np.empty((100, 4), np.float32)
    apply(2.0)  # publishes s + 1
    assert lookup.read_rows(v.hdr, v.tab, v.rows, s, ids, out) and (out == 1.0).all()
    apply(3.0)  # rebuilt copy s & 1 and reused the slots of state s
    assert not lookup.read_rows(v.hdr, v.tab, v.rows, s, ids, out)
    s = int(core.view.hdr[core_mod.H_SEQ])
    assert lookup.read_rows(v.hdr, v.tab, v.rows, s, ids, out) and (out == 3.0).all()


def test_rows_regrow_when_the_reserved_region_is_full(monkeypatch, caplog):
    """A host that limits address space: the rows outgrow their reservation and move to a
    bigger region once (logged); nothing is lost and lookups keep working."""
    import consumers.serving.memory as memory

    monkeypatch.setattr(memory, "RESERVE_BYTES", 64 * 4 * 4)  # 64 rows of dim 4
    t = ServingTable("e", 4, capacity=8)
    with t.frozen() as view_before:
        ids = np.arange(500, dtype=np.int64)
        t.upsert(ids, np.repeat(ids[:, None], 4, axis=1).astype(np.float32))
        assert view_before.n == 0  # a view of the old region stays valid
    assert "not enough" in caplog.text
    assert len(t) == 500 and np.array_equal(t.lookup(ids)[:, 2], ids.astype(np.float32))
    t.delete(ids[:100])
    assert set(t.ids().tolist()) == set(range(100, 500))


def _slice(ids: np.ndarray, v: float, col: int, width: int, n: int):
    from deltastream.wire import DeltaBatch, decode, encode
    rows = np.full((ids.size, n), v, np.float32)
    msg = encode(DeltaBatch("m", "e", 0, 0, 0, 0, 0, ids=ids, rows=rows, col=col, width=width),
                 max_message_bytes=64 << 20)
    return decode(msg[0])


def test_column_slices_are_copy_on_write_and_never_read_torn():
    """A column slice writes whole new rows into fresh slots (the other columns copied): a
    frozen view keeps the old rows, and a concurrent reader sees every row of one batch
    with the same value and the other columns untouched."""
    t = ServingTable("e", 4)
    ids = np.arange(2000, dtype=np.int64)
    t.upsert(ids, _rows(2000, 4, 7.0))
    with t.frozen() as view:
        t.apply(_slice(ids, 1.0, 0, 4, 2))
        assert (view.rows() == 7.0).all()  # the slots the view reads were not written
    got = t.lookup(ids)
    assert (got[:, :2] == 1.0).all() and (got[:, 2:] == 7.0).all()
    stop, bad = threading.Event(), []

    def reader() -> None:
        while not stop.is_set():
            r = t.lookup(ids)
            if not ((r[:, :2] == r[0, 0]).all() and (r[:, 2:] == 7.0).all()):
                bad.append(r)
                return

    th = threading.Thread(target=reader)
    th.start()
    try:
        for v in range(2, 200):
            t.apply(_slice(ids, float(v), 0, 4, 2))
    finally:
        stop.set()
        th.join()
    assert not bad
    assert (t.lookup(ids)[:, :2] == 199.0).all()
