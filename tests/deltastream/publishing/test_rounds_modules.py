"""publish_delta for every supported module: names, widths and row dtypes (no broker)."""

from __future__ import annotations

import pytest
import torch

from deltastream import DeltaTracker, HashTable, TrackingMode, publish_delta
from deltastream.publishing.rounds import SelectionPolicy


class Recorder:
    """A publisher that keeps what it was handed."""

    dtype = "f32"

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def publish(self, table, ids, rows, *, step, tombstones=None, ts=None):
        self.calls.append((table, ids, rows))

        class Sent:
            messages, bytes = 1, 0

        Sent.rows = len(ids)
        Sent.tombstones = 0 if tombstones is None else len(tombstones)
        return Sent()


def test_names_widths_and_rows_for_every_module():
    torch.manual_seed(0)
    inner = torch.nn.ModuleDict({
        "tower": torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 3),
                                      "bag": torch.nn.EmbeddingBag(10, 5, mode="sum")}),
        "user": HashTable(4, name="users")})
    model = torch.nn.DataParallel(inner)  # names are the inner model's, wrapper or not
    tracker = DeltaTracker(model, consumers=["pub"], mode=TrackingMode.EMBEDDING)
    with torch.no_grad():
        inner["tower"]["emb"].weight[[1, 4]] += 1.0  # a manual write: no lookup at all
    inner["tower"]["bag"](torch.tensor([[2, 3]])).sum().backward()
    torch.optim.Adam(inner.parameters(), lr=0.1).step()
    inner["user"](torch.tensor([7, 8]))
    pub = Recorder()
    rnd = publish_delta(tracker, pub, "pub", step=1)
    got = {name: (ids.tolist(), rows) for name, ids, rows in pub.calls}
    assert sorted(got) == ["tower.bag", "tower.emb", "users"]
    assert got["tower.emb"][0] == [1, 4] and got["tower.emb"][1].shape == (2, 3)
    assert got["tower.bag"][0] == [2, 3] and got["tower.bag"][1].shape == (2, 5)
    assert torch.equal(got["tower.bag"][1], inner["tower"]["bag"].weight.detach()[[2, 3]])
    assert got["users"][0] == [7, 8] and got["users"][1].shape == (2, 4)
    assert {t.fqn: t.table for t in rnd.tables} == {
        "tower.emb": "tower.emb", "tower.bag": "tower.bag", "user": "users"}


def test_rows_of_other_float_dtypes_are_published_as_float32():
    emb = torch.nn.Embedding(6, 4).to(torch.bfloat16)
    tracker = DeltaTracker(torch.nn.ModuleDict({"e": emb}), consumers=["pub"])
    with torch.no_grad():
        emb.weight[2] += 1
    pub = Recorder()
    publish_delta(tracker, pub, "pub", SelectionPolicy(k=5), step=0)
    (_, ids, rows), = pub.calls
    assert ids.tolist() == [2] and rows.dtype == torch.float32
    assert torch.equal(rows, emb.weight.detach()[[2]].float())


def test_two_tables_under_one_name_are_refused_before_anything_is_read():
    model = torch.nn.ModuleDict({"a": HashTable(4, name="t"), "b": HashTable(4, name="t")})
    tracker = DeltaTracker(model, consumers=["pub"])
    model["a"](torch.tensor([1]))
    with pytest.raises(ValueError, match=r"same name: \{'t': \['a', 'b'\]\}"):
        publish_delta(tracker, Recorder(), "pub", step=0)
    assert tracker.get_delta_ids("pub")["a"].tolist() == [1]  # nothing was consumed
