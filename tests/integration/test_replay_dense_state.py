"""deltastream-replay rebuild and diff with dense versions: a rebuild assembles them as the
daemon does and writes their state in its snapshot, --to-time and --to-step cut between versions, a
daemon resumes from that snapshot to the same state, and diff compares dense versions."""

from __future__ import annotations

import time

import numpy as np
import pytest

from consumers.dense_assembly import DenseAssembler
from consumers.replay import diff_snapshots, rebuild
from consumers.replay.diff import diff_with_rebuild
from consumers.storage.snapshot import read_snapshot
from deltastream.publishing.publisher import DeltaPublisher, ensure_topic

from .test_sync import MODEL, daemon_for

pytestmark = pytest.mark.integration


@pytest.fixture
def versions(broker, topic_name):
    """Rows and three dense versions (full 2, partial 4 over 2, full 6); the wall clock
    between versions 4 and 6."""
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((80, 30)).astype(np.float32)
    b = rng.standard_normal(30).astype(np.float32)
    with DeltaPublisher(servers, topic_name, model=MODEL, shard=0, dtype="f32",
                        max_message_bytes=4096) as pub:
        pub.publish("user", np.arange(3), np.ones((3, 4), np.float32), step=1)
        pub.publish_dense({"w": w, "b": b}, step=2)
        pub.publish("user", np.arange(2), np.zeros((2, 4), np.float32), step=3)
        pub.publish_dense({"b": b + 1}, step=4, base_step=2)
        pub.flush()
        time.sleep(0.05)
        cut = time.time_ns()
        time.sleep(0.05)
        pub.publish_dense({"w": w * 2, "b": b * 2}, step=6)
        pub.publish("user", np.arange(1), np.full((1, 4), 5, np.float32), step=7)
        pub.flush()
    return servers, topic_name, cut, {"w": w, "b": b}


def test_rebuild_assembles_dense_versions_and_to_time_cuts_between_them(versions,
                                                                      tmp_path):
    servers, topic, cut, t = versions
    whole = rebuild(servers, topic, model=MODEL, out=tmp_path / "whole")
    v = whole.dense.view()
    assert v.step == 6 and np.array_equal(v["w"], t["w"] * 2)
    assert whole.counters["quarantined"] == 0
    snap = read_snapshot(tmp_path / "whole")
    assert DenseAssembler.from_state(snap.dense).state() == whole.dense.state()
    early = rebuild(servers, topic, model=MODEL, to_time=cut, out=tmp_path / "early")
    v = early.dense.view()
    assert v.step == 4 and np.array_equal(v["b"], t["b"] + 1)
    assert np.array_equal(v["w"], t["w"])  # the partial version over its base
    rep = diff_snapshots(tmp_path / "early", tmp_path / "whole")
    assert not rep.dense.equal and rep.dense.versions_a[0][1] == 4
    assert "dense: DIFFERENT" in rep.format_text()
    # by step: versions 2 and 4 (and the rows of steps 1, 3) are in, 6 and step 7 are not
    by_step = rebuild(servers, topic, model=MODEL, to_step=5)
    v = by_step.dense.view()
    assert v.step == 4 and np.array_equal(v["b"], t["b"] + 1)
    assert by_step.tables["user"].lookup(np.arange(3)).tolist() == early.tables[
        "user"].lookup(np.arange(3)).tolist()
    assert by_step.offsets == early.offsets  # both resume at version 6's first chunk


def test_a_daemon_from_a_rebuild_snapshot_ends_where_a_whole_rebuild_does(versions,
                                                                         broker, tmp_path):
    servers, topic, cut, _ = versions
    rebuild(servers, topic, model=MODEL, to_time=cut, out=tmp_path / "early")
    rebuild(servers, topic, model=MODEL, out=tmp_path / "whole")
    d = daemon_for(broker, topic, tmp_path / "state", base=str(tmp_path / "early"))
    try:
        assert d.dense().step == 4  # from the base snapshot
        assert d.catch_up(timeout=60)
        assert d.dense().step == 6
    finally:
        d.stop()
    rep = diff_snapshots(tmp_path / "state" / "checkpoint", tmp_path / "whole")
    assert rep.dense is not None and rep.dense.equal and rep.equal, rep.format_text()
    rep = diff_with_rebuild(tmp_path / "state" / "checkpoint", bootstrap_servers=servers)
    assert rep.equal and rep.dense.equal, rep.format_text()


def test_a_daemon_from_per_shard_rebuilds_keeps_the_dense_version(broker, topic_name,
                                                                   tmp_path):
    """Two trainer shards, shard 0 publishes the dense versions (one DDP rank); a rebuild
    per shard gives one base each. A daemon given both bases serves shard 0's dense
    version at once, and the partial version published after the rebuilds on top of it
    (the merge of the bases used to drop the dense state: nothing served, that partial
    version unbased until the next full one)."""
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 2)
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 8)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    pubs = [DeltaPublisher(servers, topic_name, model=MODEL, shard=s, dtype="f32",
                           max_message_bytes=4096) for s in (0, 1)]
    try:
        for s, pub in enumerate(pubs):
            pub.publish("user", np.arange(s, 6, 2), np.ones((3, 4), np.float32), step=1)
        pubs[0].publish_dense({"w": w, "b": b}, step=2)
        for pub in pubs:
            pub.flush()
        bases = [tmp_path / f"shard-{s}" for s in (0, 1)]
        for s, base in enumerate(bases):
            rebuild(servers, topic_name, model=MODEL, shards=[s], out=base)
        pubs[0].publish_dense({"b": b + 1}, step=4, base_step=2)
        pubs[0].flush()
    finally:
        for pub in pubs:
            pub.close()
    d = daemon_for(broker, topic_name, tmp_path / "state", base=[str(p) for p in bases])
    try:
        assert d.dense() is not None and d.dense().step == 2  # from the bases
        assert len(d.tables()["user"]) == 6
        assert d.catch_up(timeout=60)
        v = d.dense()
        assert v.step == 4 and np.array_equal(v["b"], b + 1) and np.array_equal(v["w"], w)
        assert d.stats()["dense_unbased"] == 0
    finally:
        d.stop()
