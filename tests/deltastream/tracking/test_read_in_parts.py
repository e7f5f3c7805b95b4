"""DeltaTracker.get_delta_unordered(tables=...): a reader of many tables reads them some at
a time; a table left unread keeps everything that changed in it until its own next read,
whatever consumers of ids only read meanwhile."""

from __future__ import annotations

import pytest
import torch

from deltastream.embedding.optim import SparseAdam
from deltastream.tracking.rows import UnorderedRows
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import DeltaRows, TrackingMode

from .test_tracker import Trainer
from .test_unordered import _same, _steps_evicting

EMB = TrackingMode.EMBEDDING
TABLES = ("user", "item")


def _trainers(n: int, **kw) -> list:
    """``n`` identical trainers (same seed, same steps), one tracker each."""
    out = []
    for _ in range(n):
        t = Trainer(seed=3, sparse_opt=SparseAdam)
        out.append((t, DeltaTracker(t.net, consumers=["p"], mode=EMB, **kw)))
    return out


def _finished(d, rows_then: torch.Tensor):
    """``d`` as ``DeltaRows``; an ``UnorderedRows``'s current rows first checked against
    the table's rows at its read, ``rows_then``."""
    if not isinstance(d, UnorderedRows):
        return d
    assert torch.equal(d.current, rows_then[d.positions])
    return d.finish()[0]


def _disturb(tracker: DeltaTracker, g: torch.Generator) -> None:
    """What may befall a table left unread between its reads: its marks flushed into the
    store (an eviction on an accelerator, a full read's boundary), or the store compacted
    and trimmed below every cursor as ``max_tracked_rows`` does under pressure."""
    rec = tracker._rec
    draw = float(torch.rand(1, generator=g))
    if draw < 0.2:
        rec.flush("user")
    elif draw < 0.4:
        cursors = list(rec._cursors())
        for store in rec.stores():
            store.delete(min(cursors))
        rec.compact_all(cursors)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_table_read_in_parts_equals_a_whole_read_at_its_own_reads(seed):
    """Random steps with evictions; the tested tracker reads ``user``, ``item`` or both at
    each boundary (its current rows owed), and between reads its unread tables are
    disturbed. A table's rows at each of its reads equal those of a twin that reads every
    table whole, but only when that table is read — FIRST rows, ``new``, tombstones, bit
    for bit — and its current rows are the table's at the read."""
    trainers = _trainers(1 + len(TABLES))
    (tb, b), twins = trainers[0], dict(zip(TABLES, trainers[1:], strict=True))
    g = torch.Generator().manual_seed(seed)
    user = tb.net.user
    parts = [("user",), ("item",), TABLES, ("user",), ("user",), ("item",)]
    unordered = 0
    for k in range(14):
        _steps_evicting(trainers, g, 0.5)
        if k:
            _disturb(b, g)
        part = parts[int(torch.randint(len(parts), (1,), generator=g))]
        got = b.get_delta_unordered("p", owe={"user": user.storage.detach()},
                                    tables=None if part == TABLES else part)
        assert got.keys() == set(part)
        rows_then = user.storage.detach().clone()
        assert b.capture_rows(None)
        for fqn in part:
            unordered += isinstance(got[fqn], UnorderedRows)
            _same(_finished(got[fqn], rows_then), twins[fqn][1].get_delta("p")[fqn])
    assert unordered >= 3  # the hash table's reads after a flush are sorted, the others not
    whole = b.get_delta("p")  # whatever was left unread, in one read
    for fqn in TABLES:
        _same(whole[fqn], twins[fqn][1].get_delta("p")[fqn])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parts_beside_a_consumer_of_ids_read_as_twins_that_read_whole(seed):
    """A tracker with ``p`` (states, read in parts with its current rows owed) and ``s``
    (ids only, read whole now and then, between parts too): each table's rows at each of
    ``p``'s reads equal those of a twin that reads every table whole but only when that
    table is read — or, for the hash table read early for ``p`` at a read of ``s``, at
    that read (its current rows too); each of ``s``'s reads equals that of a twin with
    ``s`` alone, but for states — ids, ``new``, tombstones. Between reads the unread
    tables are disturbed."""
    trainers = _trainers(1 + len(TABLES))
    t = Trainer(seed=3, sparse_opt=SparseAdam)
    b = DeltaTracker(t.net, consumers=["p", "s"], mode=EMB, id_only_consumers=["s"])
    ts = Trainer(seed=3, sparse_opt=SparseAdam)
    alone = DeltaTracker(ts.net, consumers=["s"], mode=EMB)
    trainers = [(t, b), *trainers[1:], (ts, alone)]
    twins = dict(zip(TABLES, trainers[1:3], strict=True))
    g = torch.Generator().manual_seed(seed)
    user = t.net.user
    parts = [("user",), ("item",), TABLES, ("user",), ("item",)]
    unordered = snaps = handed = 0
    early: dict = {}  # {fqn: (the twin's rows, the table's rows) at the read of s}
    for k in range(24):
        _steps_evicting(trainers, g, 0.5)
        if k:
            _disturb(b, g)
        if bool(torch.rand(1, generator=g) < 0.3):
            snaps += 1
            held = set(b._early.rows)
            got, want = b.get_delta("s"), alone.get_delta("s")
            for fqn in set(b._early.rows) - held:  # read for p now, handed over later
                early[fqn] = (twins[fqn][1].get_delta("p")[fqn], user.storage.detach().clone())
            for fqn in TABLES:
                assert got[fqn].states is None
                _same(DeltaRows(ids=got[fqn].ids, states=want[fqn].states, new=got[fqn].new,
                                tombstones=got[fqn].tombstones, age=got[fqn].age),
                      want[fqn])
        part = parts[int(torch.randint(len(parts), (1,), generator=g))]
        got = b.get_delta_unordered("p", owe={"user": user.storage.detach()}, tables=part)
        assert got.keys() == set(part)
        rows_then = user.storage.detach().clone()
        assert b.capture_rows(None)
        for fqn in part:
            handed += fqn in early
            want, then = early.pop(fqn) if fqn in early else \
                (twins[fqn][1].get_delta("p")[fqn], rows_then)
            unordered += isinstance(got[fqn], UnorderedRows)
            _same(_finished(got[fqn], then), want)
    assert unordered >= 3 and snaps >= 3 and handed >= 1
    got = b.get_delta_unordered("p", owe={"user": user.storage.detach()}, tables=TABLES)
    assert b.capture_rows(None)  # a read in parts hands over what was read early as it was
    for fqn in TABLES:
        want = early[fqn][0] if fqn in early else twins[fqn][1].get_delta("p")[fqn]
        d = got[fqn]
        _same(d.finish()[0] if isinstance(d, UnorderedRows) else d, want)
    whole = b.get_delta("p")
    for fqn in TABLES:
        _same(whole[fqn], twins[fqn][1].get_delta("p")[fqn])
    got, want = b.get_delta("s"), alone.get_delta("s")
    for fqn in TABLES:
        assert torch.equal(got[fqn].ids, want[fqn].ids)
        assert torch.equal(got[fqn].tombstones, want[fqn].tombstones)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("then", ["get_delta", "get_delta_ids", "whole", "clear"])
def test_rows_read_early_join_their_readers_whole_read_or_its_clear(seed, then):
    """``p`` reads in parts with its current rows owed, a read of ``s`` (ids only) reads
    the hash table early for ``p``; then steps evict and re-insert ids, and ``p`` reads
    whole — sorted, ids, or unordered as a flush does — (or clears): it gets what a twin
    gets whose ``p`` never had that early read — the early rows' FIRST states win, ids
    evicted since are tombstones, not rows, and what changed since is there too."""
    pair = _trainers(1)
    t = Trainer(seed=3, sparse_opt=SparseAdam)
    b = DeltaTracker(t.net, consumers=["p", "s"], mode=EMB, id_only_consumers=["s"])
    (ta, a), = pair
    both = [(t, b), (ta, a)]
    g = torch.Generator().manual_seed(seed)
    early = 0
    for _ in range(4):
        _steps_evicting(both, g, 0.5)
        got = b.get_delta_unordered("p", owe={"user": t.net.user.storage.detach()},
                                    tables=TABLES)
        assert b.capture_rows(None)
        want = a.get_delta("p")
        for fqn, d in got.items():
            _same(d.finish()[0] if isinstance(d, UnorderedRows) else d, want[fqn])
        _steps_evicting(both, g, 0.5)
        b.get_delta("s")
        early += "user" in b._early.rows
        _steps_evicting(both, g, 1.0)
        if then == "clear":
            b.clear("p")
            a.clear("p")
            assert not b._early.rows
        elif then == "whole":
            got = b.get_delta_unordered("p", owe={"user": t.net.user.storage.detach()})
            assert b.capture_rows(None)
            want = a.get_delta("p")
            for fqn, d in got.items():
                _same(d.finish()[0] if isinstance(d, UnorderedRows) else d, want[fqn])
        elif then == "get_delta_ids":
            got, want = b.get_delta_ids("p"), a.get_delta_ids("p")
            for fqn in want:
                assert torch.equal(got[fqn], want[fqn]), fqn
        else:
            got, want = b.get_delta("p"), a.get_delta("p")
            for fqn in want:
                _same(got[fqn], want[fqn])
    assert early >= 3


def test_a_table_left_unread_keeps_its_records_through_the_bound():
    """``max_tracked_rows`` compacts and trims the store below every cursor: the records
    of a table a read in parts left unread are kept (its first unread index counts as a
    cursor), and its next read has all of them: its ids, ``new`` and tombstones equal a
    twin's that reads whole (its FIRST rows may be dropped under the bound)."""
    trainers = _trainers(2, max_tracked_rows=60)
    (tb, b), (ta, a) = trainers
    g = torch.Generator().manual_seed(5)
    for _ in range(6):
        _steps_evicting(trainers, g, 0.5)
        b.get_delta("p")
        a.get_delta("p")
    _steps_evicting(trainers, g, 1.0)  # changes user and item, evicts from user
    b.get_delta_unordered("p", tables=["item"])
    for _ in range(4):
        _steps_evicting(trainers, g, 1.0)
        b.get_delta_unordered("p", tables=["item"])
    assert b.stats()["bound_compactions"] > 0
    want = a.get_delta("p")["user"]
    got = b.get_delta_unordered("p", tables=["user"])["user"]
    got = got.finish()[0] if isinstance(got, UnorderedRows) else got
    for field in ("ids", "new", "tombstones"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert want.tombstones.numel() and want.new.any()


def test_reading_in_parts_needs_the_only_consumer_and_deletes_on_read():
    t = Trainer(seed=3, sparse_opt=SparseAdam)
    two = DeltaTracker(t.net, consumers=["p", "q"], mode=EMB)
    kept = DeltaTracker(Trainer(seed=3).net, consumers=["p"], mode=EMB, delete_on_read=False)
    one = DeltaTracker(Trainer(seed=3).net, consumers=["p"], mode=EMB)
    ids = DeltaTracker(Trainer(seed=3).net, consumers=["p", "q"], mode=EMB,
                       id_only_consumers=["q"])
    assert not two.reads_in_parts("p") and not kept.reads_in_parts("p")
    assert one.reads_in_parts("p") and ids.reads_in_parts("p")
    assert not ids.reads_in_parts("q")  # a reader of ids reads whole
    for tracker in (two, kept):
        with pytest.raises(ValueError, match="cannot read some tables only"):
            tracker.get_delta_unordered("p", tables=["user"])
    with pytest.raises(ValueError, match="unknown tables"):
        one.get_delta_unordered("p", tables=["nope"])


def test_clear_forgets_what_tables_left_unread_had():
    (t, b), = _trainers(1)
    t.step([11, 12], [1, 2], [b])
    b.get_delta_unordered("p", tables=["item"])
    b.clear("p")
    t.step([13], [3], [b])
    got = b.get_delta("p")
    assert got["user"].ids.tolist() == [13] and got["item"].ids.tolist() == [3]
