"""DeltaTracker on dense tables: the scan path, the lookups path and the switches between
them; nn.EmbeddingBag; embedding-like modules it cannot track; wrappers."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from deltastream.embedding.hashtable import HashTable
from deltastream.embedding.initializers import normal_initializer
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import TrackingMode

DIM = 4
EMB = TrackingMode.EMBEDDING
IDS = TrackingMode.ID_ONLY


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    return (before != after).any(1).nonzero().squeeze(1).tolist()


def train(emb: torch.nn.Module, opt, ids: torch.Tensor, offsets=None, psw=None) -> None:
    out = emb(ids) if offsets is None and psw is None else emb(ids, offsets, psw)
    (out.square().sum() + out.sum()).backward()
    opt.step()
    opt.zero_grad()


# ---------------------------------------------------------------------- scan path


@pytest.mark.parametrize("mode", [IDS, EMB])
@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=0.05),
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
])
def test_dense_optimizer_rows_moved_without_lookup_are_reported(mode, make_opt):
    """The issue's case: Adam (momentum, weight decay) keeps moving rows that were not
    looked up; every moved row is reported, FIRST = the value at the consumer's last read."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(40, DIM)
    opt = make_opt(emb.parameters())
    t = DeltaTracker(torch.nn.ModuleDict({"e": emb}), consumers=["a", "b"], mode=mode)
    assert t.paths == {"e": "scan"} and t.stats()["shadow_bytes"] >= 40 * DIM * 4
    at_read = {"a": emb.weight.detach().clone(), "b": emb.weight.detach().clone()}
    g = torch.Generator().manual_seed(1)
    for step in range(12):
        ids = torch.randint(0, 10 if step < 4 else 40, (5,), generator=g)  # subsets
        train(emb, opt, ids)
        t.step()
        for c in ("a", "b") if step % 3 == 2 else ("a",) if step % 2 else ():
            d = t.get_delta(c)["e"]
            now = emb.weight.detach()
            assert d.ids.tolist() == changed_rows(at_read[c], now)
            if mode is EMB:
                assert torch.equal(d.states, at_read[c][d.ids])
            else:
                assert d.states is None
            at_read[c] = now.clone()
    st = t.stats()
    assert st["rows_moved_without_lookup"] > 0 and st["scans"] >= 8


def test_load_state_dict_and_manual_writes_are_reported():
    emb = torch.nn.Embedding(20, DIM)
    t = DeltaTracker(torch.nn.ModuleDict({"e": emb}), mode=EMB)
    before = emb.weight.detach().clone()
    with torch.no_grad():
        emb.weight[3] += 1.0  # a manual write
        emb.weight[[7, 8]] = 0.0
    new = before.clone()
    new[11] = 5.0
    d = t.get_delta()["e"]
    assert d.ids.tolist() == [3, 7, 8] and torch.equal(d.states, before[[3, 7, 8]])
    mid = emb.weight.detach().clone()
    emb.load_state_dict({"weight": new})
    d = t.get_delta()["e"]
    assert d.ids.tolist() == changed_rows(mid, new) == [3, 7, 8, 11]
    assert torch.equal(d.states, mid[[3, 7, 8, 11]])


def test_pause_and_eval_still_report_changed_rows_but_not_plain_lookups():
    emb = torch.nn.Embedding(10, DIM)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    t = DeltaTracker(torch.nn.ModuleDict({"e": emb}))
    with t.pause():
        train(emb, opt, torch.tensor([1]))  # changes row 1: reported anyway
        emb(torch.tensor([2]))  # a paused lookup that changes nothing
    emb.eval()
    emb(torch.tensor([3]))
    emb.train()
    emb(torch.tensor([4]))  # a training lookup: reported even without a change
    assert t.get_delta_ids()["e"].tolist() == [1, 4]
    st = t.stats()
    assert st["lookups_paused"] == 2 and st["lookups_eval_skipped"] == 1


def test_clear_all_makes_the_current_weights_the_read_state():
    emb = torch.nn.Embedding(10, DIM)
    t = DeltaTracker(torch.nn.ModuleDict({"e": emb}), consumers=["a", "b"], mode=EMB)
    with torch.no_grad():
        emb.weight[2] += 1
    t.clear()
    assert all(len(t.get_delta(c)["e"]) == 0 for c in ("a", "b"))
    with torch.no_grad():
        emb.weight[4] += 1
    t.clear("a")  # b still gets it
    assert t.get_delta_ids("a")["e"].tolist() == []
    assert t.get_delta_ids("b")["e"].tolist() == [4]


# ---------------------------------------------------------------------- lookups path


def test_sparse_updates_only_uses_lookups_and_validates_names():
    model = torch.nn.ModuleDict({"e": torch.nn.Embedding(8, DIM),
                                 "b": torch.nn.EmbeddingBag(8, DIM),
                                 "h": HashTable(DIM, name="h")})
    assert DeltaTracker(model).paths == {"e": "scan", "b": "scan", "h": "lookups"}
    t = DeltaTracker(model, sparse_updates_only=True)
    assert t.paths == {"e": "lookups", "b": "lookups", "h": "lookups"}
    assert t.stats()["shadow_bytes"] == 0
    assert DeltaTracker(model, sparse_updates_only=["b"]).paths["e"] == "scan"
    with pytest.raises(ValueError, match=r"does not track: \['x'\]"):
        DeltaTracker(model, sparse_updates_only=["x"])


@pytest.mark.parametrize("module,why", [
    (torch.nn.Embedding(8, DIM, max_norm=1.0), "max_norm"),
    (torch.nn.EmbeddingBag(8, DIM, max_norm=1.0), "max_norm"),
])
def test_declarations_that_cannot_be_exact_are_refused(module, why):
    with pytest.raises(ValueError, match=rf"cannot track table 'e' exactly: {why}.*leave it"):
        DeltaTracker(torch.nn.ModuleDict({"e": module}), sparse_updates_only=True)
    assert DeltaTracker(torch.nn.ModuleDict({"e": module})).paths == {"e": "scan"}


def test_tied_weight_cannot_use_lookups():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.Embedding(8, DIM)
            self.out = torch.nn.Linear(DIM, 8, bias=False)
            self.out.weight = self.e.weight  # output projection tied to the table

    with pytest.raises(ValueError, match="shared with out.weight"):
        DeltaTracker(Tied(), sparse_updates_only=True)


def test_watch_optimizer_moves_sparse_only_tables_to_lookups_and_back():
    torch.manual_seed(2)
    e, s = torch.nn.Embedding(30, DIM), torch.nn.Embedding(30, DIM, sparse=True)
    model = torch.nn.ModuleDict({"e": e, "s": s})
    sgd = torch.optim.SGD(e.parameters(), lr=0.1)
    sparse = torch.optim.SparseAdam(s.parameters(), lr=0.1)
    t = DeltaTracker(model, mode=EMB)
    assert t.watch_optimizer(sgd) == {"e": "lookups"}
    assert t.watch_optimizer(sparse) == {"s": "lookups"}
    assert t.paths == {"e": "lookups", "s": "lookups"} and t.stats()["shadow_bytes"] == 0
    w0 = e.weight.detach().clone()
    train(e, sgd, torch.tensor([1, 2]))
    train(s, sparse, torch.tensor([3]))
    t.step()
    d = t.get_delta()
    assert d["e"].ids.tolist() == [1, 2] and torch.equal(d["e"].states, w0[[1, 2]])
    assert d["s"].ids.tolist() == [3]
    # the user turns momentum on: the next step moves rows without lookups -> back to scan
    sgd.param_groups[0]["momentum"] = 0.9
    at_read = e.weight.detach().clone()
    train(e, sgd, torch.tensor([4]))
    assert t.paths["e"] == "scan"
    train(e, sgd, torch.tensor([5]))  # momentum keeps moving row 4
    d = t.get_delta()["e"]
    assert d.ids.tolist() == changed_rows(at_read, e.weight.detach()) == [4, 5]
    assert torch.equal(d.states, at_read[[4, 5]])
    sgd.param_groups[0]["momentum"] = 0.0
    assert t.watch_optimizer(sgd) == {"e": "scan"}  # it was not sparse-only once: pinned
    with pytest.raises(TypeError):
        t.watch_optimizer(object())


def test_a_wrong_declaration_is_caught_by_the_optimizer_guard(caplog):
    """sparse_updates_only=True with Adam: before Adam's first step the table goes back to
    the scan path (with a warning), so nothing is lost."""
    torch.manual_seed(3)
    emb = torch.nn.Embedding(20, DIM)
    adam = torch.optim.Adam(emb.parameters(), lr=0.1)
    t = DeltaTracker(torch.nn.ModuleDict({"e": emb}), mode=EMB, sparse_updates_only=True)
    at_read = emb.weight.detach().clone()
    caplog.set_level(logging.WARNING)
    train(emb, adam, torch.tensor([1]))
    train(emb, adam, torch.tensor([2]))  # Adam keeps moving row 1
    assert t.paths == {"e": "scan"} and "Adam keeps per-row state" in caplog.text
    d = t.get_delta()["e"]
    assert d.ids.tolist() == [1, 2] and torch.equal(d.states, at_read[[1, 2]])
    t.close()


def test_load_state_dict_moves_a_declared_table_to_the_scan():
    emb = torch.nn.Embedding(10, DIM)
    model = torch.nn.ModuleDict({"e": emb})
    t = DeltaTracker(model, mode=EMB, sparse_updates_only=True)
    before = emb.weight.detach().clone()
    state = {"e.weight": before.clone()}
    state["e.weight"][6] = 9.0
    model.load_state_dict(state)
    assert t.paths == {"e": "scan"}
    d = t.get_delta()["e"]
    assert d.ids.tolist() == [6] and torch.equal(d.states, before[[6]])


def test_hashtable_load_state_dict_reports_every_row_and_dropped_ids():
    table = HashTable(DIM, name="t", initializer=normal_initializer(0.1, seed=0))
    model = torch.nn.ModuleDict({"t": table})
    table.insert(torch.tensor([1, 2, 3]), torch.ones(3, DIM))
    t = DeltaTracker(model, consumers=["pub"], mode=EMB)
    other = HashTable(DIM, name="t")
    other.insert(torch.tensor([2, 3, 9]), torch.full((3, DIM), 2.0))
    model.load_state_dict({"t." + k: v for k, v in other.state_dict().items()})
    d = t.get_delta("pub")["t"]
    assert d.ids.tolist() == [2, 3, 9] and d.states is None  # ids only: publish them all
    assert d.tombstones.tolist() == [1] and d.new.tolist() == [False, False, True]
    assert t.stats()["reloads"] == 1


# ---------------------------------------------------------------------- EmbeddingBag


@pytest.mark.parametrize("mode_name", ["sum", "mean", "max"])
def test_embedding_bag_lookups_record_the_tables_rows_not_the_pooled_output(mode_name):
    torch.manual_seed(4)
    bag = torch.nn.EmbeddingBag(20, DIM, mode=mode_name, padding_idx=0)
    opt = torch.optim.SGD(bag.parameters(), lr=0.5)
    t = DeltaTracker(torch.nn.ModuleDict({"b": bag}), mode=EMB, sparse_updates_only=True)
    w0 = bag.weight.detach().clone()
    ids, offsets = torch.tensor([3, 5, 0, 5, 7, 9]), torch.tensor([0, 2, 5])
    psw = torch.rand(6) if mode_name == "sum" else None
    train(bag, opt, ids, offsets, psw)
    train(bag, opt, torch.tensor([[9, 11], [0, 3]]))  # 2-D input: a bag per row
    t.step()
    d = t.get_delta()["b"]
    assert d.ids.tolist() == [0, 3, 5, 7, 9, 11]
    assert torch.equal(d.states, w0[d.ids])  # FIRST = the table's rows, not pooled outputs
    moved = changed_rows(w0, bag.weight.detach())
    assert set(moved) <= set(d.ids.tolist()) and 0 not in moved  # padding_idx never trains


def test_embedding_bag_scan_with_adam():
    torch.manual_seed(5)
    bag = torch.nn.EmbeddingBag(30, DIM, mode="mean")
    opt = torch.optim.Adam(bag.parameters(), lr=0.1)
    t = DeltaTracker(torch.nn.ModuleDict({"b": bag}), mode=EMB)
    w0 = bag.weight.detach().clone()
    train(bag, opt, torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]))
    train(bag, opt, torch.tensor([8]), torch.tensor([0]))
    d = t.get_delta()["b"]
    assert d.ids.tolist() == changed_rows(w0, bag.weight.detach()) == [1, 2, 3, 4, 8]
    assert torch.equal(d.states, w0[d.ids])


# ---------------------------------------------------------------------- discovery


class QuantEmbedding(torch.nn.Module):
    """Embedding-like (its name and num_embeddings) but nothing the tracker understands."""

    def __init__(self):
        super().__init__()
        self.num_embeddings = 8
        self.register_buffer("packed", torch.zeros(8, 2))


class Holder(torch.nn.Module):
    """A container named like an embedding whose table is tracked (like ShardedEmbedding)."""

    def __init__(self):
        super().__init__()
        self.embedding_dim = DIM
        self.table = HashTable(DIM, name="h")


def test_untrackable_embedding_modules_are_named_in_a_warning():
    model = torch.nn.ModuleDict({"q": QuantEmbedding(), "tower": torch.nn.ModuleDict(
        {"q2": QuantEmbedding()}), "held": Holder(), "e": torch.nn.Embedding(4, DIM)})
    with pytest.warns(UserWarning) as rec:
        t = DeltaTracker(model)
    texts = [str(w.message) for w in rec]
    assert len(texts) == 2
    assert "cannot track q (QuantEmbedding)" in texts[0] and "fqns_to_skip" in texts[0]
    assert "cannot track tower.q2" in texts[1]
    assert sorted(t.tracked_fqns) == ["e", "held.table"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DeltaTracker(model, fqns_to_skip=["q", "tower"])


def test_wrappers_keep_inner_names_and_table_resolves_them():
    inner = torch.nn.ModuleDict({"e": torch.nn.Embedding(8, DIM), "h": HashTable(DIM, name="h")})
    dp = torch.nn.DataParallel(inner)  # on CPU: calls the module itself
    t = DeltaTracker(dp)
    assert t.tracked_fqns == ["e", "h"]
    assert t.table("e") is inner["e"] and t.table("h") is inner["h"]
    with pytest.raises(KeyError, match="unknown table 'module.e'"):
        t.table("module.e")
    dp.module["e"](torch.tensor([1, 2]))
    dp.module["h"](torch.tensor([5]))
    assert {k: v.tolist() for k, v in t.get_delta_ids().items()} == {"e": [1, 2], "h": [5]}


def test_torch_compile_wrapper():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.Embedding(16, DIM)
            self.b = torch.nn.EmbeddingBag(16, DIM)

        def forward(self, ids):
            return (self.e(ids).sum(1) + self.b(ids)).sum()

    torch.manual_seed(6)
    net = Net()
    compiled = torch.compile(net, backend="eager")  # dynamo tracing, no code generation
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    t = DeltaTracker(compiled, mode=EMB)
    assert t.tracked_fqns == ["e", "b"] and t.table("e") is net.e
    w0 = {n: m.weight.detach().clone() for n, m in (("e", net.e), ("b", net.b))}
    for ids in (torch.tensor([[1, 2]]), torch.tensor([[3, 4]])):
        compiled(ids).backward()
        opt.step()
        opt.zero_grad()
    d = t.get_delta()
    for n, m in (("e", net.e), ("b", net.b)):
        assert d[n].ids.tolist() == changed_rows(w0[n], m.weight.detach()) == [1, 2, 3, 4]
        assert torch.equal(d[n].states, w0[n][d[n].ids])


def test_the_process_wide_optimizer_guard_does_not_keep_a_tracker_alive():
    import gc
    import weakref

    model = torch.nn.ModuleDict({"e": torch.nn.Embedding(4, DIM)})
    t = DeltaTracker(model, sparse_updates_only=True)
    ref = weakref.ref(t)
    del t, model
    gc.collect()
    assert ref() is None
    p = torch.nn.Parameter(torch.zeros(2))
    torch.optim.SGD([p], lr=0.1, momentum=0.9).step()  # no guard of a dead tracker runs
