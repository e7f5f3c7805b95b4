"""DeltaTracker: TorchRec ModelDeltaTracker behaviours on real tables and optimizers."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import deltastream.tracking.model_hooks as hooks_mod
import deltastream.tracking.store as store_mod
from deltastream.embedding.hashtable import HashTable
from deltastream.embedding.initializers import normal_initializer
from deltastream.embedding.optim import RowWiseAdagrad, SparseAdam, SparseSGD
from deltastream.sharding import gen_slice
from deltastream.tracking import fresh_rows
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import DeltaRows, TrackingMode

DIM = 4
EMB = TrackingMode.EMBEDDING
IDS = TrackingMode.ID_ONLY


class Net(torch.nn.Module):
    """A HashTable ("user") and an nn.Embedding ("item") feeding a linear head."""

    def __init__(self, device="cpu"):
        super().__init__()
        self.user = HashTable(DIM, name="user", device=device,
                              initializer=normal_initializer(0.1, seed=0))
        self.item = torch.nn.Embedding(64, DIM, device=device)
        self.head = torch.nn.Linear(2 * DIM, 1, device=device)

    def forward(self, u, i):
        # pooled per table, so user and item batches may differ in length
        return self.head(torch.cat([self.user(u).mean(0), self.item(i).mean(0)]))


class Trainer:
    """Net + row-wise Adagrad (HashTable) + SGD (nn.Embedding, dense head): a real step."""

    def __init__(self, device="cpu", seed=0, sparse_opt=RowWiseAdagrad):
        torch.manual_seed(seed)
        self.net = Net(device)
        self.sparse = sparse_opt(self.net, lr=0.5)
        self.dense = torch.optim.SGD(self.net.parameters(), lr=0.5)
        self.device = device

    def step(self, u, i, trackers=()):
        u = torch.as_tensor(u, dtype=torch.int64, device=self.device)
        i = torch.as_tensor(i, dtype=torch.int64, device=self.device)
        loss = (self.net(u, i) - 1.0).pow(2).mean()
        loss.backward()
        self.sparse.step()
        self.dense.step()
        self.sparse.zero_grad()
        self.dense.zero_grad()
        for t in trackers:
            t.step()

    def rows(self, fqn, ids):
        ids = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        if fqn == "user":
            return self.net.user.lookup(ids)
        return self.net.item.weight.detach()[ids].clone()


def equal_rows(a: DeltaRows, b: DeltaRows) -> bool:
    def same(x, y):
        if x is None or y is None:
            return x is None and y is None
        return torch.equal(x, y)
    return all(same(getattr(a, f), getattr(b, f))
               for f in ("ids", "states", "new", "tombstones", "age"))


# ---------------------------------------------------------------------- discovery


def test_discovery_and_fqns_to_skip_whole_segments():
    E = torch.nn.Embedding
    model = torch.nn.ModuleDict({
        "user": torch.nn.ModuleDict({"x": E(4, 2), "y": HashTable(2, name="y")}),
        "username": E(4, 2),
        "tower": torch.nn.ModuleDict({"user": E(4, 2), "item": E(4, 2)}),
        "mlp": torch.nn.Linear(2, 2),
    })
    all_fqns = {"user.x", "user.y", "username", "tower.user", "tower.item"}
    assert set(DeltaTracker(model).tracked_fqns) == all_fqns
    t = DeltaTracker(model, fqns_to_skip=["user"])
    assert set(t.tracked_fqns) == {"username", "tower.item"}
    t = DeltaTracker(model, fqns_to_skip=("tower.user", "y"))
    assert set(t.tracked_fqns) == {"user.x", "username", "tower.item"}
    assert set(DeltaTracker(model, fqns_to_skip="username").tracked_fqns) == all_fqns - {
        "username"}
    assert isinstance(t.get_tracked_modules()["user.x"], E)
    with pytest.raises(ValueError, match="no HashTable"):
        DeltaTracker(model, fqns_to_skip=["user", "username", "tower"])
    with pytest.raises(ValueError, match="dotted"):
        DeltaTracker(model, fqns_to_skip=["user..x"])


def test_argument_validation():
    net = Net()
    with pytest.raises(ValueError, match="unique"):
        DeltaTracker(net, consumers=["a", "a"])
    with pytest.raises(ValueError, match="non-empty"):
        DeltaTracker(net, consumers=[])
    with pytest.raises(ValueError, match="max_tracked_rows"):
        DeltaTracker(net, max_tracked_rows=0)
    with pytest.raises(TypeError):
        DeltaTracker("not a module")
    assert DeltaTracker(net, mode="embedding").mode is EMB
    t = DeltaTracker(net, consumers=["a", "b"])
    with pytest.raises(ValueError, match="unknown consumer"):
        t.get_delta("c")
    with pytest.raises(ValueError, match="consumer is required"):
        t.get_delta()
    with pytest.raises(ValueError, match="unknown table"):
        t.retain("a", "nope", DeltaRows(ids=torch.tensor([1])))
    with pytest.raises(TypeError):
        t.retain("a", "user", torch.tensor([1]))


# ---------------------------------------------------------------------- reads


@pytest.mark.parametrize("mode", [IDS, EMB])
def test_one_get_delta_per_batch_returns_only_that_batch(mode):
    tr = Trainer()
    t = DeltaTracker(tr.net, mode=mode)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        u = torch.randint(0, 30, (16,), generator=g)
        i = torch.randint(0, 64, (16,), generator=g)
        with t.pause():
            tr.net.user(u)  # insert unseen ids (not recorded) so their value can be read
        before = {"user": tr.rows("user", u.unique()), "item": tr.rows("item", i.unique())}
        tr.step(u, i, [t])
        d = t.get_delta()
        assert set(d) == {"user", "item"}
        assert torch.equal(d["user"].ids, u.unique())
        assert torch.equal(d["item"].ids, i.unique())
        for fqn in d:
            if mode is EMB:
                assert torch.equal(d[fqn].states, before[fqn])  # value before the update
            else:
                assert d[fqn].states is None
    assert t.stats()["rows_tracked"] == 0  # deleted on read


@pytest.mark.parametrize("mode", [IDS, EMB])
def test_empty_interval_gives_every_table_empty_rows(mode):
    tr = Trainer()
    t = DeltaTracker(tr.net, consumers=["a", "b"], mode=mode)
    for _ in range(2):
        for c in ("a", "b"):
            d = t.get_delta(c)
            assert set(d) == {"user", "item"}
            for fqn, rows in d.items():
                assert len(rows) == 0 and rows.ids.dtype == torch.int64
                assert rows.tombstones.numel() == 0 and rows.age.numel() == 0
                if mode is EMB:
                    assert tuple(rows.states.shape) == (0, DIM)
                else:
                    assert rows.states is None
                assert (rows.new is None) == (fqn == "item")
        tr.step([1], [2], [t])
        assert len(t.get_delta("a")["user"]) == 1
        t.step()  # a step without lookups, then the other consumer and an empty re-read
        assert len(t.get_delta("b")["user"]) == 1
        assert len(t.get_delta("a")["user"]) == 0
    ids = t.get_delta_ids("b")
    assert set(ids) == {"user", "item"} and all(v.numel() == 0 for v in ids.values())


def test_read_is_a_boundary_even_without_step():
    tr = Trainer()
    t = DeltaTracker(tr.net)
    tr.net.user(torch.tensor([1, 2]))
    assert t.get_delta_ids()["user"].tolist() == [1, 2]
    tr.net.user(torch.tensor([3]))  # same step, after the read
    assert t.get_unique()["user"].ids.tolist() == [3]


@pytest.mark.parametrize("auto_compact", [False, True])
def test_consumers_a_b_a_same_with_and_without_delete_on_read(auto_compact):
    """Two trackers on the same model see the same lookups; reads in order A, B, A."""
    tr = Trainer()
    keep = DeltaTracker(tr.net, consumers=["A", "B"], mode=EMB, delete_on_read=False,
                        auto_compact=auto_compact)
    drop = DeltaTracker(tr.net, consumers=["A", "B"], mode=EMB, delete_on_read=True,
                        auto_compact=auto_compact)
    g = torch.Generator().manual_seed(1)
    first_seen = {}
    reads = ["A", "B", "A", "A", "B", "B", "A"]
    for n, consumer in enumerate(reads):
        for _ in range(n % 3 + 1):
            u = torch.randint(0, 15, (12,), generator=g)
            with keep.pause(), drop.pause():
                tr.net.user(u)  # insert unseen ids (not recorded) so their value can be read
            for x in u.unique().tolist():
                first_seen.setdefault(x, tr.rows("user", [x])[0])
            tr.step(u, torch.randint(0, 64, (12,), generator=g), [keep, drop])
        a, b = keep.get_delta(consumer), drop.get_delta(consumer)
        for fqn in a:
            assert equal_rows(a[fqn], b[fqn]), (n, consumer, fqn)
        if n == 1:  # B's first read covers everything since the start: FIRST = first value
            want = torch.stack([first_seen[x] for x in b["user"].ids.tolist()])
            assert torch.equal(b["user"].states, want)
            assert bool(b["user"].new.all())
    assert drop.stats()["rows_tracked"] <= keep.stats()["rows_tracked"]


def test_lagging_consumer_gets_first_state_since_its_own_read():
    tr = Trainer()
    t = DeltaTracker(tr.net, consumers=["fast", "slow"], mode=EMB)
    tr.step([5], [1], [t])
    t.get_delta("fast")
    t.get_delta("slow")
    v1 = tr.rows("user", [5])
    tr.step([5], [1], [t])
    fast = t.get_delta("fast")
    v2 = tr.rows("user", [5])
    tr.step([5], [1], [t])
    slow = t.get_delta("slow")
    assert torch.equal(fast["user"].states, v1)
    assert torch.equal(slow["user"].states, v1)  # before slow's first update since its read
    fast2 = t.get_delta("fast")
    assert torch.equal(fast2["user"].states, v2)
    assert not torch.equal(v1, v2)


def test_clear_one_consumer_and_all():
    tr = Trainer()
    t = DeltaTracker(tr.net, consumers=["a", "b"])
    tr.step([1, 2], [3], [t])
    t.clear("a")
    assert len(t.get_delta("a")["user"]) == 0
    tr.step([7], [3], [t])
    assert t.get_delta_ids("a")["user"].tolist() == [7]
    assert t.get_delta_ids("b")["user"].tolist() == [1, 2, 7]
    tr.step([9], [3], [t])
    t.clear()
    assert all(len(r) == 0 for c in ("a", "b") for r in t.get_delta(c).values())
    assert t.stats()["rows_tracked"] == 0


def test_pause_is_per_thread_and_eval_is_skipped():
    tr = Trainer()
    t = DeltaTracker(tr.net)
    with t.pause():
        tr.net.user(torch.tensor([1]))
        with t.pause():  # re-entrant
            tr.net.item(torch.tensor([2]))
        tr.net.item(torch.tensor([3]))
    assert all(len(r) == 0 for r in t.get_delta().values())
    assert t.stats()["lookups_paused"] == 3

    inside, release = threading.Event(), threading.Event()

    def other():
        with t.pause():
            inside.set()
            release.wait(10)

    th = threading.Thread(target=other)
    th.start()
    inside.wait(10)
    tr.net.user(torch.tensor([4]))  # this thread is not paused
    release.set()
    th.join()
    assert t.get_delta_ids()["user"].tolist() == [4]

    tr.net.eval()
    tr.net.item(torch.tensor([5]))
    tr.net.train()
    assert len(t.get_delta()["item"]) == 0
    assert t.stats()["lookups_eval_skipped"] == 1


# ---------------------------------------------------------------------- retain


def test_retain_keeps_older_first_state_and_ages():
    tr = Trainer()
    t = DeltaTracker(tr.net, consumers=["pub", "snap"], mode=EMB)
    v0 = None
    tr.net.user(torch.tensor([1, 2, 3]))  # insert the rows first (so v0 is their value)
    t.get_delta("pub")
    v0 = tr.rows("user", [1, 2, 3])
    tr.step([1, 2, 3], [0], [t])
    d1 = t.get_delta("pub")["user"]
    assert torch.equal(d1.states, v0)
    keep = torch.tensor([0, 1])
    left = DeltaRows(ids=d1.ids[keep], states=d1.states[keep], new=d1.new[keep],
                     age=d1.age[keep])
    t.retain("pub", "user", left)
    assert t.stats()["retained"] == 2
    with t.pause():
        tr.net.user(torch.tensor([4]))  # insert (flagged new, lookup not recorded)
    v2_before = tr.rows("user", [2, 4])
    tr.step([2, 4], [0], [t])
    d2 = t.get_delta("pub")["user"]
    assert d2.ids.tolist() == [1, 2, 4]
    assert d2.age.tolist() == [1, 1, 0]
    assert torch.equal(d2.states[0], v0[0])
    assert torch.equal(d2.states[1], v0[1])  # the older FIRST, not the value before step 2
    assert not torch.equal(d2.states[1], v2_before[0])
    assert torch.equal(d2.states[2], v2_before[1])
    assert d2.new.tolist() == [False, False, True]
    t.retain("pub", "user", DeltaRows(ids=d2.ids[:1], states=d2.states[:1], new=d2.new[:1],
                                       age=d2.age[:1]))
    d3 = t.get_delta("pub")["user"]  # no lookups since: only the retained row
    assert d3.ids.tolist() == [1] and d3.age.tolist() == [2]
    assert torch.equal(d3.states[0], v0[0])
    assert len(t.get_delta("pub")["user"]) == 0  # published (not retained again): gone
    # the other consumer never saw the retained rows as such
    snap = t.get_delta("snap")["user"]
    assert snap.ids.tolist() == [1, 2, 3, 4] and bool((snap.age == 0).all())


def test_retain_unsorted_rows_and_validation():
    tr = Trainer()
    t = DeltaTracker(tr.net, mode=EMB)
    tr.step([5, 6], [0], [t])
    d = t.get_delta()["user"]
    rev = DeltaRows(ids=d.ids.flip(0), states=d.states.flip(0))
    t.retain("default", "user", rev)
    again = t.get_delta()["user"]
    assert again.ids.tolist() == [5, 6] and torch.equal(again.states, d.states)
    assert again.age.tolist() == [1, 1] and again.new.tolist() == [False, False]
    with pytest.raises(ValueError, match="states"):
        t.retain("default", "user", DeltaRows(ids=d.ids, states=d.states[:, :2]))
    with pytest.raises(ValueError, match="age"):
        t.retain("default", "user", DeltaRows(ids=d.ids, states=d.states,
                                               age=torch.tensor([-1, 0])))


# ---------------------------------------------------------------------- tombstones, new


def test_tombstones_and_new_flags():
    tr = Trainer()
    t = DeltaTracker(tr.net, consumers=["a", "b"])
    user = tr.net.user
    user(torch.tensor([1, 2, 3]))
    d = t.get_delta("a")["user"]
    assert d.ids.tolist() == [1, 2, 3] and d.new.tolist() == [True] * 3
    user(torch.tensor([2, 5]))
    d = t.get_delta("a")["user"]
    assert d.ids.tolist() == [2, 5] and d.new.tolist() == [False, True]
    assert user.evict(torch.tensor([2, 3])) == 2
    d = t.get_delta("a")["user"]
    assert d.ids.numel() == 0 and d.tombstones.tolist() == [2, 3]
    user(torch.tensor([1, 2]))  # 2 comes back (re-inserted), then 1 is evicted
    user.evict(torch.tensor([1]))
    d = t.get_delta("a")["user"]
    assert d.ids.tolist() == [2] and d.new.tolist() == [True]
    assert d.tombstones.tolist() == [1]
    # b reads once: the final state of every id since its (never) read
    d = t.get_delta("b")["user"]
    assert d.ids.tolist() == [2, 5] and d.new.tolist() == [True, True]
    assert d.tombstones.tolist() == [1, 3]
    assert t.stats()["tombstones"] == 3 and t.stats()["inserted"] == 5
    # nn.Embedding has neither hooks: empty tombstones, new None
    assert t.get_delta("a")["item"].new is None


def test_retained_rows_that_get_evicted_become_tombstones():
    tr = Trainer()
    t = DeltaTracker(tr.net, mode=EMB)
    tr.step([1, 2, 3], [0], [t])
    d = t.get_delta()["user"]
    t.retain("default", "user", d)
    tr.net.user.evict(torch.tensor([2]))
    d = t.get_delta()["user"]
    assert d.ids.tolist() == [1, 3] and d.tombstones.tolist() == [2]
    tr.net.user.evict(torch.tensor([3]))  # evicted after the read, before the retain
    t.retain("default", "user", d)
    d = t.get_delta()["user"]
    assert d.ids.tolist() == [1] and d.tombstones.tolist() == [3]


def test_ids_are_global_ids_of_a_shard():
    sl = gen_slice(1, 2)
    table = HashTable(DIM, name="shard1", slice=sl)
    t = DeltaTracker(torch.nn.ModuleDict({"t": table}))
    ids = torch.tensor([sl.begin, sl.end - 1]) + 65536 * torch.tensor([3, 1000])
    table(ids)
    got = t.get_delta_ids()["t"]
    assert torch.equal(got, ids.sort().values)
    assert bool(sl.contains(got).all())


# ---------------------------------------------------------------------- end to end


@pytest.fixture(params=["now", "lane"])
def first_copied(request, monkeypatch):
    """A HashTable lookup's FIRST rows copied at the lookup, from its output, or (``lane``,
    as where torch leaves a core spare: the C code only) from the storage on the C code's
    lane thread, waited for by the table's update hook."""
    lane = request.param == "lane"
    if lane and not fresh_rows.native_enabled():
        pytest.skip("deltastream.tracking.native is not built")
    monkeypatch.setattr(hooks_mod, "spare_core", lambda: lane)
    monkeypatch.setattr(hooks_mod, "first_rows_on_lane", lambda: lane)
    return request.param


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("sparse_opt", [SparseSGD, RowWiseAdagrad, SparseAdam])
def test_end_to_end_embedding_first_with_real_optimizers(sparse_opt, eager, first_copied,
                                                         monkeypatch):
    """FIRST = value before the first update since the consumer's last read, both tables."""
    if eager:  # every lookup deduplicated in the hook (the path of lookups >= 16K ids)
        monkeypatch.setattr(store_mod, "EAGER_DEDUPE_MIN", 1)
    tr = Trainer(seed=3, sparse_opt=sparse_opt)
    t = DeltaTracker(tr.net, consumers=["pub"], mode=EMB, auto_compact=True)
    g = torch.Generator().manual_seed(3)
    expect: dict[str, dict[int, torch.Tensor]] = {"user": {}, "item": {}}
    for step in range(1, 25):
        u = torch.randint(0, 50, (20,), generator=g)
        i = torch.randint(0, 64, (20,), generator=g)
        tr.net.user(u)  # insert unseen ids so their pre-update value can be read (tracked)
        for fqn, ids in (("user", u), ("item", i)):
            for x in ids.unique().tolist():
                if x not in expect[fqn]:
                    expect[fqn][x] = tr.rows(fqn, [x])[0]
        tr.step(u, i, [t])
        if step % 5 == 0:
            d = t.get_delta("pub")
            for fqn in ("user", "item"):
                ids = sorted(expect[fqn])
                assert d[fqn].ids.tolist() == ids
                want = torch.stack([expect[fqn][x] for x in ids])
                assert torch.equal(d[fqn].states, want)
                moved = (tr.rows(fqn, ids) - want).norm(dim=1)
                assert bool((moved > 0).all())  # every touched row was really updated
            expect = {"user": {}, "item": {}}


# ---------------------------------------------------------------------- bounded memory


def test_max_tracked_rows_10x_overload_degrades_and_keeps_every_id(caplog):
    table = HashTable(DIM, name="big", initializer=normal_initializer(0.1, seed=1))
    small = torch.nn.Embedding(16, DIM)
    model = torch.nn.ModuleDict({"big": table, "small": small})
    limit = 200
    t = DeltaTracker(model, mode=EMB, max_tracked_rows=limit)
    caplog.set_level(logging.INFO, logger="deltastream.tracking.tracker")
    for s in range(20):  # 100 new ids per step: 2000 distinct ids = 10x the bound
        table(torch.arange(s * 100, (s + 1) * 100))
        small(torch.tensor([1, 2]))
        t.step()
        assert t.stats()["state_rows"] <= limit  # the bound holds after every lookup
    st = t.stats()
    assert st["degradations"] >= 1 and st["bound_compactions"] >= 1
    assert "big" in st["degraded_tables"]
    d = t.get_delta()
    assert d["big"].ids.tolist() == list(range(2000))  # no id dropped
    assert d["big"].states is None  # degraded: ids only
    assert d["small"].ids.tolist() == [1, 2] and d["small"].states is not None
    warnings = [r for r in caplog.records
                if r.levelno == logging.WARNING and "degraded" in r.getMessage()]
    assert len(warnings) == 1  # warned once for the table
    # everything read: the table tracks states again
    table(torch.tensor([5]))
    d = t.get_delta()
    assert d["big"].ids.tolist() == [5] and d["big"].states.shape == (1, DIM)
    assert t.stats()["degraded_tables"] == []


def test_max_tracked_rows_compaction_suffices_without_degrading():
    table = HashTable(DIM, name="t", initializer=normal_initializer(0.1, seed=2))
    # 300: compaction leaves 200 rows (the 100 ids on either side of a's cursor), within
    # the quarter of headroom it must leave free
    t = DeltaTracker(torch.nn.ModuleDict({"t": table}), mode=EMB, max_tracked_rows=300,
                     consumers=["a", "b"])
    first = table(torch.arange(100)).detach().clone()
    for s in range(20):  # the same 100 ids every step: 2000 rows recorded, 100 unique
        table(torch.arange(100))
        table(torch.tensor([1000 + s]))
        table.evict(torch.tensor([1000 + s]))  # a row freed: its touches are void
        t.get_delta("a")  # each step's lookups become a record "b" has not read
        t.step()
    st = t.stats()
    assert st["degradations"] == 0 and st["bound_compactions"] >= 1
    d = t.get_delta("b")["t"]
    assert d.ids.tolist() == list(range(100)) and torch.equal(d.states, first)


def test_max_tracked_rows_id_only_never_drops_ids():
    table = HashTable(DIM, name="t")
    t = DeltaTracker(torch.nn.ModuleDict({"t": table}), max_tracked_rows=50)
    for s in range(10):
        table(torch.arange(s * 50, (s + 1) * 50))
        t.step()
    st = t.stats()
    assert st["over_bound_events"] >= 1 and st["degradations"] == 0
    assert t.get_delta_ids()["t"].tolist() == list(range(500))


# ---------------------------------------------------------------------- misc


def test_threaded_reader_sees_every_lookup_once_per_consumer():
    tr = Trainer()
    t = DeltaTracker(tr.net)
    seen, stop = [], threading.Event()

    def reader():
        while not stop.wait(0.002):
            ids = t.get_delta_ids()["user"]
            if ids.numel():
                seen.append(ids)

    th = threading.Thread(target=reader)
    th.start()
    g = torch.Generator().manual_seed(5)
    looked = []
    for _ in range(30):
        u = torch.randint(0, 1000, (8,), generator=g)
        looked.append(u)
        tr.step(u, [0], [t])
    stop.set()
    th.join()
    seen.append(t.get_delta_ids()["user"])
    assert torch.equal(torch.cat(seen).unique(), torch.cat(looked).unique())


def test_close_removes_hooks():
    tr = Trainer()
    with DeltaTracker(tr.net) as t:
        tr.net.user(torch.tensor([1]))
    tr.net.user(torch.tensor([2]))
    tr.net.user.evict(torch.tensor([1]))
    d = t.get_delta()["user"]
    assert d.ids.tolist() == [1] and d.tombstones.numel() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_embedding_mode():
    tr = Trainer(device="cuda")
    t = DeltaTracker(tr.net, mode=EMB, max_tracked_rows=10_000)
    tr.net.user(torch.tensor([1, 2], device="cuda"))
    before = tr.rows("user", [1, 2])
    tr.step([1, 2, 2], [3], [t])
    d = t.get_delta()
    assert d["user"].ids.is_cuda and d["user"].ids.tolist() == [1, 2]
    assert torch.equal(d["user"].states, before)
    tr.net.user.evict(torch.tensor([1], device="cuda"))
    assert t.get_delta()["user"].tombstones.tolist() == [1]


def test_lookup_output_modified_in_place_on_cpu_keeps_exact_first_states(first_copied):
    """On the CPU a lookup's rows are copied at the lookup (or from the storage, on the
    lane): changing its output in place afterwards changes nothing the tracker reports."""
    table = HashTable(DIM, name="t", initializer=normal_initializer(0.1, seed=4))
    t = DeltaTracker(torch.nn.ModuleDict({"t": table}), mode=EMB)
    with torch.no_grad():
        out = table(torch.tensor([1, 2]))
        before = out.clone()
        out.mul_(0)  # the user scales the lookup result in place
    d = t.get_delta()["t"]
    assert d.ids.tolist() == [1, 2] and torch.equal(d.states, before)
    assert t.stats()["states_modified"] == 0 and t.stats()["degradations"] == 0


def test_an_optimizer_step_waits_for_first_rows_still_on_the_lane(first_copied):
    """The lane thread has not yet copied a lookup's FIRST rows when the optimizer asks for
    the gradient: the table's update hook waits for the copy, so FIRST is the rows before
    the step (without the wait the lane would copy the rows the step wrote)."""
    tr = Trainer(seed=5, sparse_opt=SparseAdam)
    t = DeltaTracker(tr.net, consumers=["pub"], mode=EMB)
    u, i = torch.arange(8), torch.arange(4)
    tr.net.user(u)  # inserted: their rows before the step are known
    t.get_delta("pub")
    before = tr.rows("user", u)
    fresh_rows.native.hold_lane(True)  # a marking queued now waits
    try:
        threading.Timer(0.3, fresh_rows.native.hold_lane, (False,)).start()
        tr.step(u, i, [t])  # the update hook waits for the lane, released by the timer
    finally:
        fresh_rows.native.hold_lane(False)
    d = t.get_delta("pub")["user"]
    assert d.ids.tolist() == u.tolist() and torch.equal(d.states, before)
    assert not torch.equal(tr.rows("user", u), before)  # the step moved them


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the borrowing path)")
def test_lookup_output_modified_in_place_degrades_instead_of_lying(caplog):
    """On CUDA states are borrowed from the lookup output; an in-place change is detected."""
    table = HashTable(DIM, name="t", initializer=normal_initializer(0.1, seed=4),
                      device="cuda")
    t = DeltaTracker(torch.nn.ModuleDict({"t": table}), mode=EMB)
    with torch.no_grad():
        out = table(torch.tensor([1, 2], device="cuda"))
        before = out.clone()
        ok = table(torch.tensor([3], device="cuda"))  # untouched output: its states stay valid
    d = t.get_delta()["t"]
    assert torch.equal(d.states[:2], before) and torch.equal(d.states[2], ok[0])
    with torch.no_grad():
        out = table(torch.tensor([1, 2], device="cuda"))
        out.mul_(0)  # the user scales the lookup result in place
    with caplog.at_level(logging.WARNING, logger="deltastream.tracking.store"):
        d = t.get_delta()["t"]
    assert d.ids.tolist() == [1, 2] and d.states is None  # ids kept, states not trusted
    assert t.stats()["states_modified"] == 1
    assert any("modified in place" in r.getMessage() for r in caplog.records)
    table(torch.tensor([4], device="cuda"))  # everything was read: states are tracked again
    assert t.get_delta()["t"].states.shape == (1, DIM)


@pytest.mark.parametrize("delete_on_read", [True, False])
def test_bound_compaction_never_changes_what_consumers_read(delete_on_read):
    """Compaction at the bound merges only between read cursors: results are unchanged."""
    tr = Trainer()
    # item (plain SGD) on the lookups path, as every lookup is then a record on its own
    kw = dict(consumers=["A", "B"], mode=EMB, delete_on_read=delete_on_read,
              sparse_updates_only=True)
    # 80: the rows the two cursors keep apart cross it (a CPU table counts each row once per
    # read interval, repeats inside one lookup included, so 90 is never reached here), yet
    # compaction suffices
    bounded = DeltaTracker(tr.net, max_tracked_rows=80, **kw)
    free = DeltaTracker(tr.net, **kw)
    g = torch.Generator().manual_seed(9)
    for n, consumer in enumerate(["A", "A", "B", "A", "B", "B", "A"]):
        for _ in range(6):
            u = torch.randint(0, 15, (12,), generator=g)
            tr.step(u, torch.randint(0, 15, (12,), generator=g), [bounded, free])
        a, b = bounded.get_delta(consumer), free.get_delta(consumer)
        for fqn in a:
            assert equal_rows(a[fqn], b[fqn]), (n, consumer, fqn)
    st = bounded.stats()
    assert st["bound_compactions"] >= 1 and st["degradations"] == 0


# ---------------------------------------------------------------------- positional tables


@pytest.mark.parametrize("mode", [IDS, EMB])
def test_evicted_position_reused_by_new_id_is_not_a_stale_touch(mode):
    """Touches are marked per row position; a freed position reused by another id must not
    report that id (nor lose the evicted id's touch for the consumers' tombstone logic)."""
    table = HashTable(DIM, name="t", initializer=normal_initializer(0.1, seed=6), capacity=8)
    t = DeltaTracker(torch.nn.ModuleDict({"t": table}), mode=mode, consumers=["A", "B"])
    table(torch.tensor([10, 11, 12]))
    pos10 = int(table.positions(torch.tensor([10]))[0])
    table.evict(torch.tensor([10]))
    table.insert(torch.tensor([99]), torch.ones(1, DIM))  # reuses the freed position
    assert int(table.positions(torch.tensor([99]))[0]) == pos10
    a = t.get_delta("A")["t"]
    # 99 is reported for its own write (the insert), not for 10's touch of the position
    assert a.ids.tolist() == [11, 12, 99] and a.tombstones.tolist() == [10]
    assert a.new.tolist() == [True, True, True]  # inserted since the tracker started
    if mode is EMB:
        assert torch.equal(a.states[2], torch.ones(DIM))
    # re-inserted and looked up again: a live row with its fresh state
    table(torch.tensor([10, 99]))
    b = t.get_delta("B")["t"]
    assert b.ids.tolist() == [10, 11, 12, 99] and b.tombstones.numel() == 0
    if mode is EMB:
        assert torch.equal(b.states[3], torch.ones(DIM))
        assert torch.equal(b.states[0], table.lookup(torch.tensor([10]))[0])
    a = t.get_delta("A")["t"]
    assert a.ids.tolist() == [10, 99] and a.new.tolist() == [True, False]


@pytest.mark.parametrize("mode", [IDS, EMB])
@pytest.mark.parametrize("training", [True, False])
def test_rows_insert_writes_without_a_lookup_are_reported(mode, training):
    """``HashTable.insert`` changes rows without a lookup: a new id, an overwritten one and
    one evicted and inserted again in the same interval are all reported rows, with their
    state before the write as FIRST (a new row's is its inserted value). Before, the
    re-inserted id was read as a tombstone: predictors dropped a row the trainer held."""
    table = HashTable(DIM, name="t", initializer=normal_initializer(0.1, seed=2), capacity=16)
    t = DeltaTracker(torch.nn.ModuleDict({"t": table}), mode=mode, consumers=["A"])
    table(torch.tensor([1, 2, 3]))
    t.get_delta("A")
    before = table.lookup(torch.tensor([2])).clone()
    table.train(training)
    table.evict(torch.tensor([3]))
    table.insert(torch.tensor([2, 3, 9]), torch.stack([torch.full((DIM,), float(v))
                                                        for v in (2, 3, 9)]))
    d = t.get_delta("A")["t"]
    assert d.ids.tolist() == [2, 3, 9] and d.tombstones.numel() == 0
    assert d.new.tolist() == [False, True, True]
    if mode is EMB:
        assert torch.equal(d.states[0], before[0])  # FIRST: the row before the write
        assert torch.equal(d.states[1], torch.full((DIM,), 3.0))
        assert torch.equal(d.states[2], torch.full((DIM,), 9.0))
    table.insert(torch.tensor([9]), torch.zeros(1, DIM))  # an overwrite alone
    d = t.get_delta("A")["t"]
    assert d.ids.tolist() == [9] and d.new.tolist() == [False]
    if mode is EMB:
        assert torch.equal(d.states[0], torch.full((DIM,), 9.0))


def test_table_clear_and_growth_keep_positional_marks_right():
    """HashTable.clear and storage growth between reads: every id the table held before a
    clear is a tombstone (before, the ids looked up since the read came back as live rows
    of a table that no longer held them, and the others as nothing, so predictors kept
    serving them all); the positions reused after it report their new ids once."""
    table = HashTable(DIM, name="t", capacity=4)
    table.insert(torch.tensor([3]), torch.ones(1, DIM))  # held, never looked up
    t = DeltaTracker(torch.nn.ModuleDict({"t": table}), mode=EMB)
    table(torch.tensor([1, 2]))
    table.clear()  # positions 0-2 are free again
    fresh = table(torch.tensor([7, 8])).detach().clone()
    d = t.get_delta()["t"]
    assert d.ids.tolist() == [7, 8] and d.tombstones.tolist() == [1, 2, 3]
    assert torch.equal(d.states, fresh) and d.new.tolist() == [True, True]
    big = torch.arange(100, 1100)  # grows the storage far past the marks' first size
    table(big)
    table(torch.tensor([100, 5]))
    d = t.get_delta()["t"]
    assert d.ids.tolist() == [5, *big.tolist()]
    assert table.capacity >= 1000 and t.stats()["rows_tracked"] == 0


def test_first_state_is_earliest_lookup_with_duplicates_across_steps():
    table = HashTable(DIM, name="t", initializer=normal_initializer(0.1, seed=8))
    opt = RowWiseAdagrad(torch.nn.ModuleDict({"t": table}), lr=0.5)
    t = DeltaTracker(torch.nn.ModuleDict({"t": table}), mode=EMB)
    ids = torch.tensor([3, 1, 3, 2, 1])
    table(ids)  # inserts
    t.get_delta()
    before = table.lookup(torch.tensor([1, 2, 3, 4]))
    for s in range(4):
        batch = torch.cat([ids, torch.tensor([4])]) if s == 2 else ids
        table(batch).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        t.step()
    d = t.get_delta()["t"]
    assert d.ids.tolist() == [1, 2, 3, 4]
    assert torch.equal(d.states[:3], before[:3])  # before the first update since the read
    assert not torch.equal(d.states[:3], table.lookup(torch.tensor([1, 2, 3])))
    st = t.stats()
    assert st["ids_recorded"] == 4 * 5 + 1 + 5 and st["lookups_recorded"] == 5


def test_hashtable_lookup_hook_reports_positions_and_rows():
    table = HashTable(DIM, name="t", initializer=normal_initializer(0.1, seed=9))
    seen = []
    h = table.register_lookup_hook(lambda tb, pos, rows: seen.append((pos, rows)))
    out = table(torch.tensor([[5, 6], [6, 7]]))
    pos, rows = seen[-1]
    assert torch.equal(pos, table.positions(torch.tensor([5, 6, 6, 7])))
    assert torch.equal(rows.detach(), out.detach().reshape(4, DIM))
    table.eval()
    table(torch.tensor([5]))
    assert seen[-1][0] is None  # eval mode: nothing resolved for training
    h.remove()
    table.train()
    table(torch.tensor([8]))
    assert len(seen) == 2


@pytest.mark.parametrize("n", [0, 1, 100, 2047, 2048, 5000, 30000])
def test_read_sort_matches_numpy_sort_over_the_whole_int64_range(n):
    """The reads' radix sort (16-bit digits over max - min) on extreme and narrow ids."""
    import numpy as np

    from deltastream.tracking.sorted_ids import radix_sort as _np_sort

    rng = np.random.default_rng(n)
    for a in (rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64, endpoint=True),
              rng.integers(0, 1 << 40, n, dtype=np.int64),
              rng.integers(-5, 50, n, dtype=np.int64),
              np.array([-2**63, 2**63 - 1, 0, -1, 1] * (n // 5), dtype=np.int64)):
        vals, _ = _np_sort(a, False)
        assert np.array_equal(vals, np.sort(a))
        vals, perm = _np_sort(a, True)
        assert np.array_equal(vals, np.sort(a)) and np.array_equal(a[perm], vals)


def test_position_marking_torch_path_matches_cpu_path():
    """The torch-op paths (used on CUDA) give what the numpy CPU paths give."""
    from deltastream.tracking import positions, sorted_ids

    g = torch.Generator().manual_seed(11)
    cap = 300
    pos = [torch.randint(0, cap, (n,), generator=g) for n in (50, 1, 80, 0, 40)]
    states = [torch.randn(q.numel(), 3, generator=g) for q in pos]
    for q, st in zip(pos, states, strict=True):  # one lookup: a repeated position has one row value
        st.copy_(torch.arange(cap, dtype=torch.float32)[q].unsqueeze(1) * torch.ones(3))
    states[2] += 1000  # later lookups return other values: FIRST must pick the earliest
    marks = torch.zeros(cap, dtype=torch.bool)
    want = torch.cat(pos).unique()
    for fn in (positions.mark_positions, positions.mark_positions_torch):
        assert torch.equal(fn(marks, pos), want) and not bool(marks.any())
    results = []
    for fn in (positions.first_states_cpu, positions.first_states_torch):
        touched, rows, src = fn(marks, pos, states)
        assert torch.equal(touched, want) and not bool(marks.any())
        results.append(rows.index_select(0, src))
    assert torch.equal(results[0], results[1])
    first_run = {}
    for q, st in zip(pos, states, strict=True):
        for j, x in enumerate(q.tolist()):
            first_run.setdefault(x, st[j])
    assert torch.equal(results[0], torch.stack([first_run[x] for x in want.tolist()]))
    assert torch.equal(sorted_ids.sort_ids(want.flip(0)), want)


def test_row_positions_of_a_delta_just_read_and_never_stale():
    """row_positions gives the storage positions of the ids get_delta returned (no probe),
    and None once they may be stale (a row freed) or for any other tensor."""
    table = HashTable(DIM, name="t", initializer=normal_initializer(0.1, seed=5))
    t = DeltaTracker(torch.nn.ModuleDict({"t": table}), mode=EMB)
    table(torch.tensor([30, 10, 20, 10]))
    d = t.get_delta()["t"]
    pos = t.row_positions("t", d.ids)
    assert d.ids.tolist() == [10, 20, 30]
    assert torch.equal(pos, table.positions(d.ids))
    assert t.row_positions("t", d.ids.clone()) is None  # not the tensor the read returned
    table(torch.tensor([40, 50]))
    d = t.get_delta()["t"]
    table.evict(torch.tensor([40]))  # position of 40 may now be reused
    assert t.row_positions("t", d.ids) is None
