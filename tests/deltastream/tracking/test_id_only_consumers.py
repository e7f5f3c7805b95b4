"""DeltaTracker(id_only_consumers=...): a consumer that reads ids only (a snapshot writer
reads the rows' current values itself) gets every id, tombstone and ``new`` flag a
consumer of states gets at the same reads, and costs no FIRST rows: none are merged for it,
and none are kept for it alone."""

from __future__ import annotations

import pytest
import torch

from deltastream.embedding.optim import SparseAdam
from deltastream.tracking.rows import UnorderedRows
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import DeltaRows, TrackingMode

from .test_tracker import DIM, Trainer
from .test_unordered import _read_p, _same, _steps_evicting

EMB = TrackingMode.EMBEDDING


def _ids_same(d: DeltaRows, w: DeltaRows) -> None:
    """Everything of ``w`` but its states; ``d`` has none."""
    assert d.states is None
    _same(DeltaRows(ids=d.ids, states=w.states, new=d.new, tombstones=d.tombstones,
                    age=d.age), w)


def _pair(consumers: list[str], id_only: list[str]):
    """Twin trainers: ``a``'s consumers all read states, ``b``'s ``id_only`` read ids."""
    out = []
    for ids in ([], id_only):
        t = Trainer(seed=3, sparse_opt=SparseAdam)
        out.append((t, DeltaTracker(t.net, consumers=consumers, mode=EMB,
                                    id_only_consumers=ids)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("consumers", [["p", "q"], ["p", "q", "r"]])
def test_an_id_only_consumer_reads_what_a_consumer_of_states_reads_but_states(seed,
                                                                            consumers):
    """``p`` reads unordered every interval (current rows owed), ``q`` (ids only) reads
    every third interval with ``get_delta`` or ``get_delta_ids`` and retains some ids, a
    third consumer ``r`` (states) every second; now and then ``q`` reads before ``p``'s
    owed rows (and ids) were captured. Random steps with evictions: ``p``'s and
    ``r``'s reads equal a twin's whose consumers all read states, FIRST rows bit for bit;
    ``q``'s equal the twin's but for states. Without ``r``, the hash table's records kept
    for ``q`` alone hold no state row and ``p``'s arenas come back at once."""
    twins = _pair(consumers, ["q"])
    (ta, a), (tb, b) = twins
    a._rec.rows_freed = lambda fqn, positions: a._rec.flush(fqn)
    g = torch.Generator().manual_seed(seed)
    for interval in range(10):
        _steps_evicting(twins, g, 0.5)
        want, got = _read_p(twins)
        assert isinstance(got, UnorderedRows)
        if interval % 4 == 1:  # q reads while the ids of p's hand-off are still owed
            w, d = a.get_delta("q"), b.get_delta("q")
            for fqn in w:
                _ids_same(d[fqn], w[fqn])
        assert b.capture_rows(None)
        _same(got.finish()[0], want)
        got.give_back()
        if "r" not in consumers:
            assert b._rec.touched.num_state_rows("user") == 0
        if interval % 3 == 2:
            if interval % 2:
                w = a.get_delta("q")
                d = b.get_delta("q")
                for fqn in w:
                    _ids_same(d[fqn], w[fqn])
                keep = d["user"].ids[::3].clone()
                a.retain("q", "user", DeltaRows(ids=keep, states=w["user"].states[::3]))
                b.retain("q", "user", DeltaRows(ids=keep, states=w["user"].states[::3]))
            else:
                w, d = a.get_delta_ids("q"), b.get_delta_ids("q")
                assert w.keys() == d.keys()
                for fqn, ids in d.items():
                    assert torch.equal(ids, w[fqn]), fqn
        if "r" in consumers and interval % 2:
            w, d = a.get_delta("r"), b.get_delta("r")
            for fqn in w:
                _same(d[fqn], w[fqn])
    w, d = a.get_delta("q"), b.get_delta("q")
    for fqn in w:
        _ids_same(d[fqn], w[fqn])
    if "r" not in consumers:  # p's arenas were never held for q
        assert b.stats()["row_buffers"]["reused"] >= 8


def test_a_read_of_ids_merges_no_state():
    """``get_delta_ids`` (any consumer) and every read of an id-only consumer take the ids
    of the store's records without gathering a state: the records keep theirs for the
    consumers of states."""
    t = Trainer(seed=3, sparse_opt=SparseAdam)
    tracker = DeltaTracker(t.net, consumers=["p", "q", "s"], mode=EMB,
                           id_only_consumers=["q"])
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        t.step((torch.rand(40, generator=g) * 90).long(), torch.randint(0, 64, (20,),
                                                                         generator=g),
               [tracker])
    store = tracker._rec.touched
    gathered = []
    real = store.get_unique

    def spy(*a, **k):
        gathered.append(k.get("states", True))
        return real(*a, **k)

    store.get_unique = spy
    ids = tracker.get_delta_ids("p")
    q = tracker.get_delta("q")
    assert gathered == [False, False]
    s = tracker.get_delta("s")  # a consumer of states still gets every FIRST row
    assert gathered[-1] is True
    for fqn in ids:
        assert torch.equal(ids[fqn], q[fqn].ids) and torch.equal(q[fqn].ids, s[fqn].ids)
        assert q[fqn].states is None and s[fqn].states.shape == (len(s[fqn]), DIM)


def test_id_only_consumers_must_be_consumers():
    t = Trainer(seed=3, sparse_opt=SparseAdam)
    with pytest.raises(ValueError, match="id_only_consumers"):
        DeltaTracker(t.net, consumers=["p"], mode=EMB, id_only_consumers=["snapshot"])
