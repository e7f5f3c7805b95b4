"""DeltaTracker.get_delta_unordered: the same rows as get_delta, sorted later, or get_delta's
own rows where the unsorted form does not apply."""

from __future__ import annotations

import pytest
import torch

from deltastream.embedding.optim import SparseAdam
from deltastream.tracking import fresh_rows, recorder
from deltastream.tracking.rows import RawRows, UnorderedRows
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import DeltaRows, TrackingMode

from .test_tracker import Trainer

EMB = TrackingMode.EMBEDDING

pytestmark = pytest.mark.skipif(not fresh_rows.NATIVE_AVAILABLE,
                                reason="deltastream.tracking.native is not built")


def _same(a: DeltaRows, b: DeltaRows) -> None:
    assert torch.equal(a.ids, b.ids)
    assert torch.equal(a.states, b.states)  # bit for bit
    for x, y in ((a.new, b.new), (a.tombstones, b.tombstones), (a.age, b.age)):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y))


def _twins(device: str = "cpu", consumers=("p",)):
    """Two identical trainers (same seed, same steps), one tracker each."""
    out = []
    for _ in range(2):
        t = Trainer(device=device, seed=3, sparse_opt=SparseAdam)
        out.append((t, DeltaTracker(t.net, consumers=list(consumers), mode=EMB)))
    return out


def _intervals(twins, n: int, evict_at: tuple[int, ...]):
    """Train both twins alike, yielding after each of ``n`` intervals of 3 steps (Zipf-ish
    user ids over a growing range: repeats and inserts); after the intervals in
    ``evict_at`` a few ids held now are evicted in both."""
    g = torch.Generator().manual_seed(9)
    for interval in range(n):
        for _ in range(3):
            u = (torch.rand(60, generator=g) ** 2 * (40 + 30 * interval)).long() * 7919 + 11
            i = torch.randint(0, 64, (20,), generator=g)
            for t, tracker in twins:
                t.step(u, i, [tracker])
        if interval in evict_at:
            gone = u[:4].unique()
            for t, _ in twins:
                t.net.user.evict(gone.to(t.device))
        yield interval


def test_the_unordered_read_finishes_into_get_deltas_rows():
    """Intervals with repeats, inserts (new), evictions (tombstones, and rows freed after
    they were looked up: their marks are forgotten, the unsorted form holds) — each read
    equals get_delta's on a twin, bit for bit; positions are where the rows live. The twin
    turns its marks into a sorted record at every freed row (as before marks could be
    forgotten): an oracle apart from the forgetting."""
    twins = _twins()
    (ta, a), (tb, b) = twins
    a._rec.rows_freed = lambda fqn, positions: a._rec.flush(fqn)
    kinds = set()
    for _ in _intervals(twins, 8, evict_at=(2, 5)):
        want = a.get_delta("p")
        got = b.get_delta_unordered("p")
        assert got.keys() == want.keys()
        for fqn, d in got.items():
            kinds.add((fqn, type(d).__name__))
            if isinstance(d, UnorderedRows):
                table = tb.net.user
                assert torch.equal(table.ids_at(d.positions), d.ids)
                rows, order = d.finish()
                assert torch.equal(rows.ids, d.ids[order])
                d = rows
            _same(d, want[fqn])
    assert ("user", "UnorderedRows") in kinds  # the HashTable: unsorted on every read,
    assert ("user", "DeltaRows") not in kinds  # after an eviction too
    assert ("item", "DeltaRows") in kinds  # nn.Embedding with SGD: the scan, as before


def test_the_unordered_read_follows_a_hash_table_that_grew_between_reads():
    """Each read maps positions to ids through the table's ``position_ids``, whose numpy
    view the tracker keeps between reads: after the table grew (a new array) the read
    still equals get_delta's on a twin."""
    twins = _twins()
    (ta, a), (tb, b) = twins
    user = tb.net.user
    seen = []
    for interval in range(5):
        ids = (torch.arange(600) + 600 * interval) * 7919 + 11  # all new: the table grows
        for t, tracker in twins:
            t.step(ids, torch.arange(8), [tracker])
            t.step(ids[::3], torch.arange(8), [tracker])  # repeats
        seen.append(user.position_ids())
        want, got = a.get_delta("p"), b.get_delta_unordered("p")
        d = got["user"]
        assert isinstance(d, UnorderedRows)
        assert torch.equal(user.ids_at(d.positions), d.ids)
        _same(d.finish()[0], want["user"])
    assert len({id(x) for x in seen}) > 1  # it grew: position_ids was replaced


def test_raw_rows_finish_into_unique_rows_with_their_first_states():
    """An accelerator's read as recorded: each id once with its first occurrence's state,
    ``new`` from the inserted ids, tombstones once and only for ids not live again."""
    raw = RawRows(ids=torch.tensor([5, 2, 5, 2]), states=torch.tensor([[1.0], [2], [3], [4]]),
                  positions=None, tombstones=torch.tensor([2, 9, 9]), news=torch.tensor([2, 2]),
                  dynamic=True)
    rows, where = raw.finish()
    assert rows.ids.tolist() == [2, 5] and where.tolist() == [1, 0]
    assert rows.states.flatten().tolist() == [2.0, 1.0]
    assert rows.new.tolist() == [True, False] and rows.tombstones.tolist() == [9]


def _same_rows(d: DeltaRows, w: DeltaRows) -> None:
    assert torch.equal(d.ids, w.ids) and torch.equal(d.tombstones, w.tombstones)
    assert (d.new is None) == (w.new is None)
    assert d.new is None or torch.equal(d.new, w.new)
    torch.testing.assert_close(d.states, w.states)  # twins on CUDA: atomics may differ


ACCELERATORS = [
    pytest.param("cpu", id="cpu-as-recorded"),  # the accelerators' path on CPU tensors
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
]


@pytest.mark.parametrize("device", ACCELERATORS)
@pytest.mark.parametrize("consumers,merge_min", [(["p"], None), (["p", "q"], None),
                                                 (["p", "q"], 50)])
def test_an_accelerators_read_as_recorded_finishes_into_get_deltas_rows(
        device, consumers, merge_min, monkeypatch):
    """On an accelerator every lookup is recorded as is; the unordered read hands them
    over with no sort (:class:`RawRows`) and finishes into get_delta's rows on a twin,
    across repeats, inserts and evictions; a second consumer, read now and then, still
    reads every row (its records merged now and then: every few reads with ``merge_min``
    50). On the CPU the same path runs with ``records_as_is`` true for CPU tables."""
    monkeypatch.setattr(recorder, "records_as_is", lambda d: True)
    merges = []
    if merge_min is not None:
        monkeypatch.setattr(recorder, "RAW_MERGE_MIN", merge_min)
        real = recorder.Recorder.compact_all

        def counted(self, cursors):
            merges.append(len(cursors))
            return real(self, cursors)
        monkeypatch.setattr(recorder.Recorder, "compact_all", counted)
    twins = _twins(device, consumers)
    (_, a), (_, b) = twins
    kinds = set()
    for interval in _intervals(twins, 6, evict_at=(2, 4)):
        want = a.get_delta("p")
        for fqn, d in b.get_delta_unordered("p").items():
            kinds.add((fqn, type(d).__name__))
            if isinstance(d, RawRows):
                d = d.finish()[0]
            _same_rows(d, want[fqn])
        if "q" in consumers and interval % 3 == 2:
            want, got = a.get_delta("q"), b.get_delta("q")
            for fqn, d in got.items():
                _same_rows(d, want[fqn])
    assert ("user", "RawRows") in kinds
    assert bool(merges) == (merge_min is not None)  # merged while held for "q"


def _retained_round_trip(kind: type):
    """A first read of ``kind`` (lookups of 5, 6, 7, 5), handed back (``retain``): the
    next read is the sorted one, the retained rows merged with the new ones (the older
    FIRST state wins, ``age`` counts the retains). Returns the trainer and its tracker."""
    t = Trainer(seed=1, sparse_opt=SparseAdam)
    tr = DeltaTracker(t.net, consumers=["p"], mode=EMB)
    t.step([5, 6, 7, 5], [1], [tr])
    first = tr.get_delta_unordered("p")["user"]
    assert isinstance(first, kind)
    rows, _ = first.finish()
    tr.retain("p", "user", rows)
    t.step([9, 5], [1], [tr])
    again = tr.get_delta_unordered("p")["user"]
    assert isinstance(again, DeltaRows)  # the retained rows come merged, in order
    assert again.ids.tolist() == [5, 6, 7, 9] and again.age.tolist() == [1, 1, 1, 0]
    assert torch.equal(again.states[:3], rows.states)
    return t, tr


def test_the_unsorted_form_steps_aside_where_it_cannot_hold():
    """Retained rows (merged with the fresh ones), numpy-kept lookups (repeats in the
    arena): get_delta's rows, sorted here."""
    t, tr = _retained_round_trip(UnorderedRows)
    was = fresh_rows.native_enabled()
    try:
        fresh_rows.use_native(False)
        t.step([3, 3, 4], [1], [tr])
    finally:
        fresh_rows.use_native(was)
    t.step([8], [1], [tr])
    d = tr.get_delta_unordered("p")["user"]
    assert isinstance(d, DeltaRows) and d.ids.tolist() == [3, 4, 8]


def test_owed_rows_are_the_rows_at_the_read_across_evictions_reloads_and_training():
    """``get_delta_unordered(owe=...)``: each read's ``current`` (complete once
    ``capture_rows`` says so) equals the table's rows at the read, bit for bit, although
    training went on — lookups that moved owed rows, an eviction that zeroes owed rows
    (they are copied before), a reload through the model (copied before it), slices of a
    few positions per step."""
    t = Trainer(seed=5, sparse_opt=SparseAdam)
    tr = DeltaTracker(t.net, consumers=["p"], mode=EMB)
    user = t.net.user
    g = torch.Generator().manual_seed(12)

    since_read: list[torch.Tensor] = []  # the user ids looked up since the last read

    def steps(n: int, interval: int) -> None:
        for _ in range(n):
            u = (torch.rand(80, generator=g) ** 2 * (60 + 40 * interval)).long() * 7919 + 3
            since_read.append(u)
            t.step(u, torch.randint(0, 64, (20,), generator=g), [tr])

    deferred = 0
    for interval in range(6):
        steps(3, interval)
        d = tr.get_delta_unordered("p", owe={"user": user.storage.detach()})["user"]
        looked_up = torch.unique(torch.cat(since_read))
        since_read.clear()
        if not isinstance(d, UnorderedRows):
            continue
        # the table at the read (d.positions, d.ids and d.current are written as the marks
        # are walked)
        ids_then = user.position_ids().clone()
        rows_then = user.storage.detach().clone()
        assert d.current is not None and not tr.capture_rows(0)
        deferred += 1
        if interval == 2:  # zeroes rows the read still owes: copied before
            user.evict(looked_up[:5])
        if interval == 4:  # a reload through the model rewrites every row: copied before
            t.net.load_state_dict({k: v.clone() * 2 if k.startswith("user") and
                                   v.is_floating_point() else v
                                   for k, v in t.net.state_dict().items()})
        while not tr.capture_rows(7):
            steps(1, interval)
        assert torch.equal(torch.sort(d.ids).values, looked_up)
        assert torch.equal(d.ids, ids_then[d.positions])
        assert torch.equal(d.current, rows_then[d.positions])
    assert deferred >= 4
    tr.close()


def test_an_accelerators_retained_rows_come_back_through_the_sorted_read(monkeypatch):
    """Rows handed back (``retain``) after a read as recorded: that table's next read is
    the sorted one, the retained rows merged with the new ones (the older FIRST state
    wins, ``age`` counts the retains); the read after that is as recorded again."""
    monkeypatch.setattr(recorder, "records_as_is", lambda d: True)
    t, tr = _retained_round_trip(RawRows)
    t.step([3], [1], [tr])
    assert isinstance(tr.get_delta_unordered("p")["user"], RawRows)


def test_an_accelerators_records_kept_for_another_consumer_respect_the_bound(monkeypatch):
    """Records kept as recorded for a consumer that seldom reads count against
    ``max_tracked_rows``: past it they are merged (and tables degraded), so the rows held
    stay bounded; that consumer still reads every id touched since its last read."""
    monkeypatch.setattr(recorder, "records_as_is", lambda d: True)
    t = Trainer(seed=1, sparse_opt=SparseAdam)
    tr = DeltaTracker(t.net, consumers=["p", "q"], mode=EMB, max_tracked_rows=400)
    g = torch.Generator().manual_seed(4)
    touched, held = set(), []
    for _ in range(30):
        u = (torch.rand(40, generator=g) ** 2 * 300).long() * 7919 + 11
        t.step(u, torch.randint(0, 64, (8,), generator=g), [tr])
        touched |= set(u.tolist())
        d = tr.get_delta_unordered("p")["user"]
        assert isinstance(d, (RawRows, DeltaRows))
        held.append(tr.stats()["rows_tracked"])
    assert max(held) <= 400 + 40 * 2  # the bound, plus at most the lookups of one step
    assert tr.stats()["bound_compactions"] > 0  # the bound was reached, and held
    got = tr.get_delta("q")["user"]
    assert set(got.ids.tolist()) == touched


@pytest.mark.skipif(not fresh_rows.NATIVE_AVAILABLE,
                    reason="deltastream.tracking.native is not built")
def test_a_spent_budget_queues_lane_walks_unless_told_not_to(monkeypatch):
    """``capture_rows(0)`` queues each owing table's walk on the lane (the walk is not the
    training thread's); ``capture_rows(0, lane=False)`` queues none (a hand-off whose drain
    took its tick's time leaves them to the next tick), and walks nothing."""
    from deltastream import HashTable

    monkeypatch.setattr(fresh_rows, "spare_core", lambda: True)
    net = torch.nn.ModuleList(HashTable(16, name=f"f{j}", capacity=4000) for j in range(3))
    tr = DeltaTracker(net, consumers=["p"], mode=EMB)
    for t in net:
        t(torch.arange(1000))
    tr.step()
    tr.get_delta_unordered("p", owe={f: m.storage.detach()
                                     for f, m in tr.get_tracked_modules().items()})
    queued = tr._rec.pending  # the tracker's recorder: which tables' walks are queued
    assert not tr.capture_rows(0, lane=False)
    assert not any(p.fresh.walk_queued for p in queued.values())
    tr.capture_rows(0)
    assert all(p.fresh.walk_queued or not p.fresh.owes for p in queued.values())
    assert tr.capture_rows(None)  # waits for them
    tr.close()


@pytest.mark.skipif(not fresh_rows.NATIVE_AVAILABLE,
                    reason="deltastream.tracking.native is not built")
@pytest.mark.parametrize("budget", [1500, 0])
def test_walks_the_lane_ran_finish_in_one_capture_whatever_the_tables(monkeypatch,
                                                                      budget: int):
    """Where torch leaves a core spare, each owing table's walk is queued on the C code's
    lane thread. Once they ran, one ``capture_rows`` call with a small budget finishes
    every table: the budget bounds the training thread's own walking, and the lane's is
    not its own. (It counted the lane's positions, so a hand-off of N tables each over the
    budget took N ticks: a budget publisher on a 26-table model sent a third less than its
    budget, its hand-offs waiting a tick per table for walks long done.) A budget of 0 (a
    hand-off that drained its tick's share) queues them too: else they waited for the
    next tick, and the step between copied the rows it read itself."""
    import time

    from deltastream import HashTable

    monkeypatch.setattr(fresh_rows, "spare_core", lambda: True)
    n, dim, rows = 6, 64, 3000
    net = torch.nn.ModuleList(HashTable(dim, name=f"f{j}", capacity=4 * rows)
                              for j in range(n))
    tr = DeltaTracker(net, consumers=["p"], mode=EMB)
    g = torch.Generator().manual_seed(3)
    for t in net:  # every table looks up `rows` distinct ids, then its rows move
        t(torch.randperm(4 * rows, generator=g)[:rows])
    tr.step()
    with torch.no_grad():
        for t in net:
            t.storage.add_(1.0)
    owe = {fqn: m.storage.detach() for fqn, m in tr.get_tracked_modules().items()}
    at_read = {fqn: s.clone() for fqn, s in owe.items()}
    d = tr.get_delta_unordered("p", owe=owe)
    assert all(isinstance(r, UnorderedRows) for r in d.values()) and len(d) == n
    assert budget < rows  # positions per call: each table's walk is over it
    before = sum(fresh_rows.native.lane_jobs())
    assert not tr.capture_rows(budget)  # queues the walks on the lane
    # they take microseconds, but the lane runs at SCHED_IDLE: on a loaded host it may wait
    deadline = time.monotonic() + 60
    while sum(fresh_rows.native.lane_jobs()) - before < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tr.capture_rows(budget)  # every table finished in this one call
    for fqn, r in d.items():
        assert r.ids.numel() == rows
        assert torch.equal(r.current, at_read[fqn][r.positions])
    tr.close()


@pytest.mark.skipif(not fresh_rows.NATIVE_AVAILABLE,
                    reason="deltastream.tracking.native is not built")
def test_a_capture_of_some_tables_takes_in_the_lane_walks_of_others_that_ran(monkeypatch):
    """A hand-off read in parts queues each part's walks with ``capture_rows(0, tables=
    part)``. The next call, whatever its tables, takes in the walks earlier calls queued
    that have run (their rows complete, the tables no longer owe): else the call for every
    table at the last part took in every table's walk at once (~25 µs each, 26 tables: over
    the 1 ms a tick may take)."""
    import time

    from deltastream import HashTable

    monkeypatch.setattr(fresh_rows, "spare_core", lambda: True)
    n, rows = 4, 2000
    net = torch.nn.ModuleList(HashTable(16, name=f"f{j}", capacity=4 * rows) for j in range(n))
    tr = DeltaTracker(net, consumers=["p"], mode=EMB)
    for t in net:
        t(torch.arange(rows))
    tr.step()
    owe = {f: m.storage.detach() for f, m in tr.get_tracked_modules().items()}
    d = tr.get_delta_unordered("p", owe=owe)
    fresh = {f: p.fresh for f, p in tr._rec.pending.items()}  # each table's walk
    before = sum(fresh_rows.native.lane_jobs())
    assert not tr.capture_rows(0, tables=["0", "1"])  # the first part's walks queued
    assert fresh["0"].walk_queued and fresh["1"].walk_queued
    assert fresh["2"].owes and not fresh["2"].walk_queued
    deadline = time.monotonic() + 60  # the lane runs at SCHED_IDLE: it may wait
    while sum(fresh_rows.native.lane_jobs()) - before < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tr.capture_rows(0, tables=["2"])  # the next part's, and the first part's in
    assert not fresh["0"].owes and not fresh["1"].owes and fresh["2"].walk_queued
    for f in ("0", "1"):
        assert d[f].ids.numel() == rows and torch.equal(d[f].current, owe[f][d[f].positions])
    assert tr.capture_rows(None)
    tr.close()


@pytest.mark.parametrize("ttl,asks", [(60.0, 1), (0.0, 3)])
def test_whether_a_core_is_spare_is_asked_once_per_ttl_not_per_hand_off(monkeypatch, ttl,
                                                                         asks):
    """Its answer costs ~25 µs on a tick's cold cache (a syscall, the environment, torch):
    three hand-offs within ``SPARE_CORE_TTL_S`` ask once; with no TTL, each asks."""
    from deltastream import HashTable

    calls = []
    monkeypatch.setattr(fresh_rows, "spare_core", lambda: calls.append(1) or True)
    monkeypatch.setattr(recorder, "SPARE_CORE_TTL_S", ttl)
    table = HashTable(16, name="f", capacity=4000)
    tr = DeltaTracker(torch.nn.ModuleList([table]), consumers=["p"], mode=EMB)
    for k in range(3):
        table(torch.arange(100 * k, 100 * k + 500))
        tr.step()
        tr.get_delta_unordered("p", owe={"0": table.storage.detach()})
        tr.capture_rows(0)  # queues the walk on the lane: asks (or reuses) the answer
        assert tr.capture_rows(None)
    assert len(calls) == asks
    tr.close()


def test_an_unordered_read_leaves_the_sort_of_inserts_and_evictions_to_its_reader():
    """Several steps of inserts and an eviction in each interval: the unordered read
    hands the inserted and evicted ids over as recorded — nothing is merged (sorted) on the
    reading thread, ``compactions`` stays 0 — and they finish into get_delta's rows. (The
    steps' inserts are one growing record: test_store's grown records.)"""
    twins = _twins()
    (ta, a), (tb, b) = twins
    g = torch.Generator().manual_seed(5)
    fresh = 10_000
    unordered = 0
    for _ in range(4):
        # an id evicted (with no lookup pending) before this interval's lookups insert
        held = tb.net.user.position_ids()
        gone = held[held >= 0][:2]
        for t, _ in twins:
            t.net.user.evict(gone.clone())
        for _ in range(3):  # three steps, each inserting ids never seen
            u = torch.cat([torch.randint(0, 64, (30,), generator=g) * 7919 + 11,
                           torch.arange(fresh, fresh + 10) * 7919 + 13])
            fresh += 10
            i = torch.randint(0, 64, (20,), generator=g)
            for t, tracker in twins:
                t.step(u, i, [tracker])
        want = a.get_delta("p")["user"]
        got = b.get_delta_unordered("p")["user"]
        if isinstance(got, UnorderedRows):
            unordered += 1
            assert got.news.numel() >= 30  # three steps' records, as recorded
            got = got.finish()[0]
        _same(got, want)
    assert unordered == 4
    assert b.stats()["compactions"] == 0


def _read_p(twins) -> tuple[DeltaRows, object]:
    """``p``'s read on both twins: ``a``'s sorted (``want``), ``b``'s unordered with the
    user table's current rows owed (``got``)."""
    (_, a), (tb, b) = twins
    want = a.get_delta("p")["user"]
    got = b.get_delta_unordered("p", owe={"user": tb.net.user.storage.detach()})["user"]
    return want, got


def _steps_evicting(twins, g: torch.Generator, p_evict: float) -> None:
    """One to three steps of both twins alike (Zipf-ish user ids); after each, with
    probability ``p_evict``, six ids the tables hold (any of them) are evicted in both."""
    user = twins[1][0].net.user
    for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
        u = (torch.rand(50, generator=g) ** 2 * 120).long() * 7919 + 11
        i = torch.randint(0, 64, (20,), generator=g)
        for t, tracker in twins:
            t.step(u, i, [tracker])
        if bool(torch.rand(1, generator=g) < p_evict):
            held = user.ids()
            gone = held[torch.randperm(held.numel(), generator=g)[:6]]
            for t, _ in twins:
                t.net.user.evict(gone.clone())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_evictions_mid_interval_against_a_twin_that_flushes(seed):
    """Random steps with ids evicted between them — ids this interval looked up, ids it did
    not, ids then looked up again (re-inserted, often at a freed position) — read with
    their current rows owed: every read finishes into the rows of a twin whose tracker
    turns its marks into a sorted record at every freed row (as before marks could be
    forgotten), and its current rows are the table's at the read, bit for bit."""
    twins = _twins()
    (ta, a), (tb, b) = twins
    a._rec.rows_freed = lambda fqn, positions: a._rec.flush(fqn)
    g = torch.Generator().manual_seed(seed)
    user = tb.net.user
    unordered = 0
    for _ in range(8):
        _steps_evicting(twins, g, 0.7)
        want, got = _read_p(twins)
        if isinstance(got, UnorderedRows):
            unordered += 1
            rows_then, ids_then = user.storage.detach().clone(), user.position_ids().clone()
            assert b.capture_rows(None)
            assert torch.equal(got.ids, ids_then[got.positions])
            assert torch.equal(got.current, rows_then[got.positions])
            rows, order = got.finish()
            got = rows
        _same(got, want)
    assert unordered == 8


@pytest.mark.parametrize("seed", [0, 1])
def test_a_second_consumer_gets_its_rows_from_where_the_unordered_read_left_them(seed):
    """Consumers ``p`` (read unordered, its current rows owed, every interval) and ``q``
    (``get_delta``, every third): ``p``'s reads stay unordered, the interval becoming
    ``q``'s record where it lies — the FIRST rows in the arena handed to ``p``, given back
    only once both are done. Random steps with evictions between them: every read of both
    equals a twin's, whose consumers both read sorted and whose marks become a record at
    every freed row; the arenas are reused once ``q`` has read them."""
    twins = _twins(consumers=("p", "q"))
    (ta, a), (tb, b) = twins
    a._rec.rows_freed = lambda fqn, positions: a._rec.flush(fqn)
    g = torch.Generator().manual_seed(seed)
    user = tb.net.user
    for interval in range(9):
        _steps_evicting(twins, g, 0.5)
        want, got = _read_p(twins)
        assert isinstance(got, UnorderedRows)
        rows_then = user.storage.detach().clone()
        assert b.capture_rows(None)
        assert torch.equal(got.current, rows_then[got.positions])
        _same(got.finish()[0], want)
        got.give_back()  # p's reader is done: the store may still hold the arena
        if interval % 3 == 2:
            _same(b.get_delta("q")["user"], a.get_delta("q")["user"])
    assert b.stats()["row_buffers"]["reused"] > 0  # arenas came back once q had read
