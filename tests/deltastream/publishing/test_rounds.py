"""publish_delta against the embedded broker: real tracker, tables, publisher and topic.

Every test reads the topic back and decodes it with deltastream.wire, so "published" means
the rows arrived; rows held back come back from the tracker in a later round.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consumers import TopicReader
from deltastream import (
    DeltaPublisher,
    DeltaTracker,
    HashTable,
    PublishError,
    TrackingMode,
    ensure_topic,
    publish_delta,
    wire,
)
from deltastream.publishing.rounds import SelectionPolicy, table_name

DIM = 4


def _tables(*names: str, n: int = 100) -> torch.nn.ModuleDict:
    """HashTables named ``names`` (fqn ``t_<name>``) holding ids ``0..n-1``, row i = i."""
    out = torch.nn.ModuleDict()
    for name in names:
        t = HashTable(DIM, name=name, capacity=4 * n)
        t.insert(torch.arange(n), torch.arange(n, dtype=torch.float32)[:, None].repeat(1, DIM))
        out[f"t_{name}"] = t
    return out


def _touch(table: HashTable, ids: torch.Tensor, scale: torch.Tensor) -> None:
    """Look ``ids`` up (recorded by the tracker) and move row ``ids[j]`` by ``scale[j]``."""
    with torch.no_grad():
        rows = table(ids)
        table.insert(ids, rows + scale[:, None])


def _raw(servers: str, topic: str) -> list[bytes]:
    """Every record value of ``topic`` in partition/offset order."""
    with TopicReader(servers, topic, timeout=15.0) as reader:
        start, stop = reader.beginning_offsets(), reader.end_offsets()
        return [r.value for r in reader.read(start, stop)]


def _read(servers: str, topic: str) -> list[wire.DeltaBatch]:
    """Every message of ``topic``, decoded with deltastream.wire."""
    return [wire.decode(v) for v in _raw(servers, topic)]


def _publisher(servers: str, topic: str) -> DeltaPublisher:
    return DeltaPublisher(servers, topic, model="m", shard=0, dtype="f32")


def test_round_publishes_the_selection_and_the_leftover_comes_back(broker, topic_name):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    model = _tables("user")
    table = model["t_user"]
    tracker = DeltaTracker(model, consumers=["pub"], mode=TrackingMode.EMBEDDING)
    touched = torch.arange(50)
    _touch(table, touched, torch.arange(1, 51, dtype=torch.float32))  # row i moves by i + 1
    tracker.step()
    with _publisher(servers, topic_name) as pub:
        r1 = publish_delta(tracker, pub, "pub", SelectionPolicy(k=10), step=7)
        pub.flush()
        (t1,) = r1.tables
        assert (t1.fqn, t1.table) == ("t_user", "user")
        assert (r1.tracked, r1.published, r1.carried, r1.rejected) == (50, 10, 40, 0)
        assert t1.ids.tolist() == list(range(40, 50))  # the 10 that drifted most
        msgs = _read(servers, topic_name)
        assert [m.table for m in msgs] == ["user"] * r1.messages
        assert sum(len(v) for v in _raw(servers, topic_name)) == r1.bytes
        got = np.concatenate([m.ids for m in msgs])
        assert got.tolist() == t1.ids.tolist()
        np.testing.assert_array_equal(np.concatenate([m.rows for m in msgs]),
                                      table.lookup(t1.ids).numpy())
        assert {m.step for m in msgs} == {7} and {m.ts for m in msgs} == {r1.ts}

        # the 40 retained rows come back next round and go out under no budget
        r2 = publish_delta(tracker, pub, "pub", step=8)
        pub.flush()
        assert (r2.tracked, r2.published, r2.carried) == (40, 40, 0)
        assert r2.totals() == {"tracked": 40, "published": 40, "tombstones": 0, "carried": 0,
                               "rejected": 0, "messages": r2.messages, "bytes": r2.bytes}
        msgs = _read(servers, topic_name)
        assert sorted(np.concatenate([m.ids for m in msgs]).tolist()) == touched.tolist()
        assert publish_delta(tracker, pub, "pub", step=9).tables == ()


def test_final_flush_publishes_everything_whatever_the_policy(broker, topic_name):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    model = _tables("item")
    tracker = DeltaTracker(model, consumers=["pub"], mode=TrackingMode.EMBEDDING)
    _touch(model["t_item"], torch.arange(30), torch.ones(30))
    with _publisher(servers, topic_name) as pub:
        r = publish_delta(tracker, pub, "pub", SelectionPolicy(k=1), step=1, final=True)
        pub.flush()
    assert r.final and (r.published, r.carried) == (30, 0)
    assert sorted(np.concatenate([m.ids for m in _read(servers, topic_name)]).tolist()) \
        == list(range(30))
    assert tracker.get_delta("pub")["t_item"].ids.numel() == 0


def test_weights_hook_and_tombstones(broker, topic_name):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    model = _tables("user")
    table = model["t_user"]
    tracker = DeltaTracker(model, consumers=["pub"], mode=TrackingMode.EMBEDDING)
    _touch(table, torch.arange(20), torch.ones(20))
    table.evict(torch.tensor([90, 91]))
    calls = []

    def even_only(fqn: str, ids: torch.Tensor) -> torch.Tensor:
        calls.append((fqn, ids.clone()))
        return (ids % 2 == 0).to(torch.float32)

    policy = SelectionPolicy(threshold=0.5, weights=even_only)
    with _publisher(servers, topic_name) as pub:
        r = publish_delta(tracker, pub, "pub", policy, step=3)
        pub.flush()
    (fqn, ids), = calls
    assert fqn == "t_user" and ids.tolist() == list(range(20))
    assert r.tables[0].ids.tolist() == list(range(0, 20, 2))
    assert (r.published, r.carried, r.tombstones) == (10, 10, 2)
    msgs = _read(servers, topic_name)
    assert sorted(np.concatenate([m.tombstones for m in msgs if m.tombstones is not None])
                  .tolist()) == [90, 91]
    assert sorted(tracker.get_delta("pub")["t_user"].ids.tolist()) == list(range(1, 20, 2))


class _ClosesAfterFirstPublish:
    """A real DeltaPublisher that is closed right after its first publish call, so the
    next call raises the publisher's own PublishError."""

    def __init__(self, pub: DeltaPublisher) -> None:
        self.pub, self.dtype, self.calls = pub, pub.dtype, 0

    def publish(self, *args, **kwargs):
        self.calls += 1
        res = self.pub.publish(*args, **kwargs)
        self.pub.close()
        return res


def test_publish_error_retains_every_row_not_handed_over(broker, topic_name):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    model = _tables("a", "b", "c")
    tracker = DeltaTracker(model, consumers=["pub"], mode=TrackingMode.EMBEDDING)
    for name in ("a", "b", "c"):
        _touch(model[f"t_{name}"], torch.arange(20), torch.arange(1, 21, dtype=torch.float32))
    failing = _ClosesAfterFirstPublish(_publisher(servers, topic_name))
    with pytest.raises(PublishError, match="closed") as info:
        publish_delta(tracker, failing, "pub", SelectionPolicy(k=5), step=1)
    assert failing.calls == 2  # table a went out, table b failed, table c was not tried
    # b's selection (5; its leftover was retained before publishing) and c's 20 candidates
    assert any("25 unpublished rows" in n for n in info.value.__notes__)
    first = _read(servers, topic_name)
    assert [m.table for m in first] == ["a"]
    assert first[0].ids.tolist() == list(range(15, 20))

    with _publisher(servers, topic_name) as pub:
        r = publish_delta(tracker, pub, "pub", step=2)
        pub.flush()
    per = {t.table: t for t in r.tables}
    # a: its 15-row leftover; b: leftover 15 + the failed selection 5; c: all 20 candidates
    assert {k: t.tracked for k, t in per.items()} == {"a": 15, "b": 20, "c": 20}
    msgs = _read(servers, topic_name)
    for name in ("a", "b", "c"):
        ids = np.concatenate([m.ids for m in msgs if m.table == name])
        assert sorted(ids.tolist()) == list(range(20)), name


def test_table_name_prefers_the_tables_own_name():
    assert table_name("model.user.local", HashTable(2, name="user")) == "user"
    assert table_name("emb.items", torch.nn.Embedding(3, 2)) == "emb.items"


@pytest.mark.parametrize("kwargs, words", [
    ({"k": 1, "fraction": 0.5}, "at most one of k, fraction, threshold"),
    ({"k": -1}, "k must be >= 0"),
    ({"k": 1.5}, "k must be an int"),
    ({"fraction": 0.0}, "fraction must be a number in (0, 1]"),
    ({"fraction": 1.5}, "fraction must be a number in (0, 1]"),
    ({"threshold": float("nan")}, "threshold must be a finite number >= 0"),
    ({"threshold": -1.0}, "threshold must be a finite number >= 0"),
    ({"max_bytes": -1}, "max_bytes must be >= 0"),
    ({"max_age": -2}, "max_age must be >= 0"),
    ({"relative": True}, "relative=True needs a threshold"),
    ({"threshold": 0.1, "relative": 1}, "relative must be a bool"),
    ({"new_rows": "last"}, "new_rows must be one of ['first', 'drift'], got 'last'"),
    ({"weights": 3}, "weights must be callable"),
])
def test_selection_policy_is_checked_when_built(kwargs, words):
    with pytest.raises((TypeError, ValueError)) as info:
        SelectionPolicy(**kwargs)
    assert words in str(info.value)


def test_column_shards_publish_their_columns_as_separate_streams(broker, topic_name):
    """Two column shards of one table on one rank (columns [2, 4) as shard 0, [0, 2) as
    shard 1: out of order) go out with col/width under their own shard ids and seqs; an
    Applier rebuilds the full rows."""
    from consumers import Applier, SeqTracker

    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 2)
    full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    model = torch.nn.ModuleDict()
    for fqn, shard_id, (c0, c1) in (("right", 0, (2, 4)), ("left", 1, (0, 2))):
        t = HashTable(c1 - c0, name="w", capacity=64)
        t.column_offset, t.full_width, t.shard_id = c0, 4, shard_id
        model[fqn] = t
    tracker = DeltaTracker(model, consumers=["pub"], mode=TrackingMode.EMBEDDING)
    ids = torch.arange(10)
    for fqn, c0 in (("right", 2), ("left", 0)):
        model[fqn].insert(ids, full[:, c0:c0 + 2])
        _touch(model[fqn], ids, torch.ones(10))
    with _publisher(servers, topic_name) as pub:
        rnd = publish_delta(tracker, pub, "pub", step=3, final=True)
        pub.flush()
        assert pub.stats()["next_seq"] == {"w": 1, "w/1": 1}
    assert sorted(t.published for t in rnd.tables) == [10, 10]
    got = _read(servers, topic_name)
    assert sorted((b.shard, b.seq, b.col, b.width, b.dim) for b in got) == [
        (0, 0, 2, 4, 2), (1, 0, 0, 4, 2)]
    tables: dict = {}
    ap = Applier("m", tables, SeqTracker())
    for v in _raw(servers, topic_name):
        assert ap.process(v).kind == "applied"
    assert np.array_equal(tables["w"].lookup(ids.numpy()), (full + 1).numpy())
