"""Per-shard snapshots merge into one; overlapping ones are refused, naming both."""

from __future__ import annotations

import numpy as np
import pytest

from consumers.errors import SnapshotError
from consumers.serving.table import ServingTable
from consumers.storage.merge import merge_snapshots
from consumers.storage.snapshot import read_snapshot, write_snapshot


def _shard(path, shard: int, ids, *, partition=None, offset=10, dim=4, topic="deltas.m",
           table="user", model="m"):
    ids = np.asarray(ids, np.int64)
    rows = np.arange(ids.size * dim, dtype=np.float32).reshape(-1, dim) + shard
    write_snapshot(path, tables={table: ServingTable.from_arrays(table, ids, rows)},
                   offsets={shard if partition is None else partition: offset},
                   seqs={"version": 1, "streams": [{"table": table, "shard": shard,
                                                   "epoch": 7, "seq": 3}]},
                   meta={"model": model, "topic": topic, "shard": shard})
    return read_snapshot(path)


def test_disjoint_shards_merge(tmp_path):
    a = _shard(tmp_path / "a", 0, [0, 2, 4], offset=11)
    b = _shard(tmp_path / "b", 1, [1, 3], offset=5)
    m = merge_snapshots([a, b])
    t = m.tables["user"]
    assert sorted(t.ids().tolist()) == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(t.lookup(np.array([3])), b.tables["user"].lookup(
        np.array([3])))
    assert m.offsets == {0: 11, 1: 5}
    assert {(s["table"], s["shard"]) for s in m.seqs["streams"]} == {("user", 0), ("user", 1)}
    assert m.meta["topic"] == "deltas.m" and m.meta["model"] == "m"
    assert m.meta["sources"] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert merge_snapshots([a]) is a


@pytest.mark.parametrize("kw, words", [
    ({"ids": [4, 5]}, ["table 'user'", "1 ids in more than one snapshot", "id 4"]),
    ({"ids": [5], "partition": 0, "offset": 99}, ["partition 0 is at offset 10", "99"]),
    ({"ids": [5], "shard": 0, "partition": 1}, ["table 'user' shard 0", "seq state in both"]),
    ({"ids": [5], "dim": 8}, ["4 wide f32", "8 wide f32"]),
    ({"ids": [5], "topic": "deltas.other"}, ["different topics", "'deltas.m'",
                                              "'deltas.other'"]),
    ({"ids": [5], "model": "n"}, ["different models"]),
])
def test_overlapping_snapshots_are_refused(tmp_path, kw, words):
    a = _shard(tmp_path / "a", 0, [0, 2, 4])
    b_kw = {"shard": 1, **kw}
    b = _shard(tmp_path / "b", b_kw.pop("shard"), b_kw.pop("ids"), **b_kw)
    with pytest.raises(SnapshotError) as e:
        merge_snapshots([a, b])
    text = str(e.value)
    for w in words:
        assert w in text, text
    assert str(tmp_path / "a") in text or "table 'user' holds" in text
