"""deltastream-replay against a real broker: rebuild, dump, stats, diff, CLI exit codes.

One realistic stream is published once per module (2 tables, 2 trainer shards on 2
partitions, two epochs of shard 0 — the second in wire v3, varint ids, its user rows i8 —,
tombstones, f16, f32 and i8 on the wire, one garbage
record, and a hand-made epoch with a seq gap and a duplicate). References are built
independently: records read with a plain KafkaConsumer and applied one by one, in
partition order, through the same Applier the daemon uses.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from consumers.applier import Applier
from consumers.replay import (
    ReplayError,
    diff_tables,
    diff_with_rebuild,
    dump,
    rebuild,
    stats,
)
from consumers.replay.cli import main
from consumers.sequencing import SeqTracker
from consumers.storage.snapshot import read_snapshot
from consumers.topic import BrokerUnavailable, OffsetError, TopicNotFound, TopicReader
from deltastream import wire
from deltastream.publishing.publisher import DeltaPublisher, ensure_topic

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MODEL = "rp"
DIMS = {"user": 8, "item": 4}
T0 = 1_700_000_000_000_000_000  # ns
STEP_NS = 1_000_000_000


@dataclass
class Stream:
    bootstrap: str
    topic: str
    # partition -> [(offset, value, headers)] read back independently
    records: dict = field(default_factory=dict)
    produced: int = 0

    def ordered(self):
        for p in sorted(self.records):
            for off, value, headers in self.records[p]:
                yield p, off, value, headers

    def ends(self) -> dict:
        return {p: (recs[-1][0] + 1 if recs else 0) for p, recs in self.records.items()}


def _ts(step: int, shard: int) -> int:
    return T0 + step * STEP_NS + shard * 1000


def _publish_stream(bootstrap: str, topic: str) -> int:
    """The realistic stream; returns the number of records produced."""
    rng = np.random.default_rng(7)
    ensure_topic(bootstrap, topic, 2)
    produced = 0
    live: dict = {}  # (table, shard) -> ids published and not evicted

    def phase(shard: int, epoch: int, steps: range, dtype: str, version: int = 2) -> None:
        nonlocal produced
        pub = DeltaPublisher(bootstrap, topic, model=MODEL, shard=shard, epoch=epoch,
                             dtype=dtype, wire_version=version)
        for step in steps:
            for table, dim in DIMS.items():
                ids = np.unique(rng.integers(0, 200, 25) * 2 + shard)  # shard owns id % 2
                rows = rng.standard_normal((ids.size, dim)).astype(np.float32)
                have = live.setdefault((table, shard), set())
                tomb = None
                if step % 3 == 2 and have:
                    cand = np.array(sorted(have - set(ids.tolist())), np.int64)
                    tomb = cand[:4] if cand.size else None
                res = pub.publish(table, ids, rows, step=step, ts=_ts(step, shard),
                                  tombstones=tomb,
                                  dtype="i8" if version == 3 and table == "user" else None)
                produced += res.messages
                have |= set(ids.tolist())
                if tomb is not None:
                    have -= set(tomb.tolist())
        pub.close()

    phase(0, 1, range(0, 6), "f16")
    phase(1, 1, range(0, 6), "f32")
    # a record that is not a wire message at all, in the middle of partition 0
    raw = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    raw.send(topic, value=b"\x93not a delta message", partition=0).get(timeout=30)
    produced += 1
    phase(0, 2, range(6, 10), "f16", version=3)  # shard 0 restarted: new epoch, wire v3
    # hand-made epoch 3 of (item, shard 1): seqs 0, 1, 3 (2 is missing), then 1 again
    for seq in (0, 1, 3, 1):
        ids = np.array([1001 + 2 * seq, 2001 + 2 * seq], np.int64)
        b = wire.DeltaBatch(model=MODEL, table="item", shard=1, epoch=3, seq=seq, step=20 + seq,
                            ts=_ts(20 + seq, 1), ids=ids,
                            rows=np.full((2, 4), seq + 0.5, np.float32), dtype="f32")
        (value,) = wire.encode(b)
        raw.send(topic, value=value, key=wire.message_key(MODEL, "item", 1),
                 headers=wire.kafka_headers(b), partition=1).get(timeout=30)
        produced += 1
    raw.close()
    return produced


def _read_all(bootstrap: str, topic: str, expected: int) -> dict:
    """Every record of the topic with a plain consumer (independent of TopicReader)."""
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic))]
    c.assign(tps)
    for tp in tps:
        c.seek(tp, 0)
    out: dict = {tp.partition: [] for tp in tps}
    n, deadline = 0, time.monotonic() + 30
    while n < expected and time.monotonic() < deadline:
        for tp, recs in c.poll(timeout_ms=300).items():
            out[tp.partition] += [(r.offset, r.value, list(r.headers or ())) for r in recs]
            n += len(recs)
    c.close()
    assert n == expected, f"read {n} of {expected} records back"
    return out


@pytest.fixture(scope="module")
def stream(broker) -> Stream:
    topic = f"deltas.replay-{uuid.uuid4().hex[:8]}"
    produced = _publish_stream(broker.bootstrap_servers, topic)
    s = Stream(broker.bootstrap_servers, topic, produced=produced)
    s.records = _read_all(s.bootstrap, topic, produced)
    return s


def _reference(stream: Stream, keep=lambda p, off, value: True) -> dict:
    """Tables built by applying the kept records one by one, in partition order."""
    tables: dict = {}
    applier = Applier(MODEL, tables, SeqTracker())
    for p, off, value, headers in stream.ordered():
        if keep(p, off, value):
            applier.process(value, headers)
    return tables


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        ia, ra = a[name].items()
        ib, rb = b[name].items()
        assert np.array_equal(ia, ib), name
        assert ra.dtype == rb.dtype and np.array_equal(ra.view(np.uint32), rb.view(np.uint32)), \
            name
        assert a[name].digest() == b[name].digest()


def _ts_of(value: bytes):
    try:
        return wire.decode(value).ts
    except wire.WireError:
        return None


# ----------------------------------------------------------------------------- topic reader


def test_topic_reader_offsets_and_errors(stream, broker):
    with TopicReader(stream.bootstrap, stream.topic, timeout=5) as r:
        assert r.partitions == [0, 1]
        assert r.beginning_offsets() == {0: 0, 1: 0}
        # exact ends although the publisher batched several records per request
        assert r.end_offsets() == stream.ends()
        start, stop = r.resolve({0: 3}, {0: 9}, partitions=[0, 1])
        assert (start, stop) == ({0: 3, 1: 0}, {0: 9, 1: stream.ends()[1]})
        got = [(x.partition, x.offset, x.value) for x in r.read({0: 3, 1: 2}, {0: 9, 1: 4})]
        want = [(0, o, v) for o, v, _ in stream.records[0][3:9]] + \
               [(1, o, v) for o, v, _ in stream.records[1][2:4]]
        assert got == want
        with pytest.raises(OffsetError, match="partition 5"):
            r.resolve(partitions=[5])
        with pytest.raises(OffsetError, match="beyond the end"):
            r.resolve({0: 10_000})
        with pytest.raises(OffsetError, match="before start"):
            r.resolve({0: 5}, {0: 2})
    with pytest.raises(TopicNotFound, match="does not exist"):
        TopicReader(stream.bootstrap, "deltas.no-such-topic-" + uuid.uuid4().hex[:6])
    with TopicReader(stream.bootstrap, stream.topic) as r:  # the check created nothing
        assert all("no-such-topic" not in t for t in r._consumer.topics())
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="no Kafka broker answered"):
        TopicReader("127.0.0.1:1", stream.topic, timeout=1)
    assert time.monotonic() - t0 < 10


# ----------------------------------------------------------------------------- rebuild


def test_rebuild_whole_topic_is_bit_identical_to_applier_and_daemon(stream, tmp_path):
    res = rebuild(stream.bootstrap, stream.topic, model=MODEL, out=tmp_path / "full")
    ref = _reference(stream)
    _assert_same(res.tables, ref)
    # both wire versions are in the topic (the byte after map16 + "v" is the version)
    assert {v[5] for _, _, v, _ in stream.ordered() if v[:5] == b"\xde\x00" + v[2:3] + b"\xa1v"} \
        == {2, 3}
    assert {wire.decode(v).dtype for _, _, v, _ in stream.ordered() if _ts_of(v) is not None} \
        == {"f16", "f32", "i8"}
    assert set(res.tables) == {"user", "item"}
    assert res.offsets == stream.ends()
    c = res.counters
    assert c["records"] == stream.produced
    assert c["quarantined"] == 1 and c["duplicates"] == 1 and c["gaps"] == 1
    assert c["new_epochs"] == 3  # user+item of shard 0 (epoch 2), item of shard 1 (epoch 3)
    assert res.quarantined[0][:2] == (0, next(o for o, v, _ in stream.records[0]
                                             if _ts_of(v) is None))
    snap = read_snapshot(tmp_path / "full")
    _assert_same(snap.tables, ref)
    assert snap.offsets == stream.ends()
    assert snap.meta["topic"] == stream.topic and snap.meta["model"] == MODEL
    assert snap.meta["range"]["stop"] == {str(p): o for p, o in stream.ends().items()}
    assert SeqTracker.from_state(snap.seqs).get("item", 1) == (3, 3)

    try:
        from consumers.sync import SyncDaemon
    except ImportError:  # pragma: no cover - the daemon is another module
        pytest.skip("consumers.sync not available")
    daemon = SyncDaemon(stream.bootstrap, stream.topic, model=MODEL,
                        state_dir=tmp_path / "daemon", summary_interval=0)
    try:
        assert daemon.catch_up(timeout=30)
    finally:
        daemon.stop()
    _assert_same(daemon.tables(), res.tables)
    # the daemon's checkpoint, and a fresh rebuild up to its offsets, agree
    rep = diff_with_rebuild(tmp_path / "daemon" / "checkpoint", bootstrap_servers=stream.bootstrap)
    assert rep.equal, rep.format_text()
    assert rep.offsets_a == stream.ends()


def test_rebuild_up_to_offsets_and_on_top_of_base(stream, tmp_path):
    stop = {0: 7, 1: 5}
    res = rebuild(stream.bootstrap, stream.topic, model=MODEL, to_offsets=stop,
                  out=tmp_path / "part")
    ref = _reference(stream, keep=lambda p, off, v: off < stop[p])
    _assert_same(res.tables, ref)
    assert res.offsets == stop and res.counters["records"] == sum(stop.values())
    # continuing from that snapshot to the end equals one rebuild of everything
    cont = rebuild(stream.bootstrap, stream.topic, model=MODEL, base=tmp_path / "part",
                   out=tmp_path / "cont")
    assert cont.plan.start == stop
    assert cont.counters["records"] == stream.produced - sum(stop.values())
    _assert_same(cont.tables, _reference(stream))
    assert read_snapshot(tmp_path / "cont").meta["base"] == str(tmp_path / "part")
    # a window of offsets from a start: only those records, applied into empty tables
    mid = rebuild(stream.bootstrap, stream.topic, model=MODEL, from_offsets={0: 4, 1: 2},
                  to_offsets={0: 10, 1: 6})
    _assert_same(mid.tables, _reference(
        stream, keep=lambda p, off, v: (4 if p == 0 else 2) <= off < (10 if p == 0 else 6)))
    with pytest.raises(ReplayError, match="exclusive"):
        rebuild(stream.bootstrap, stream.topic, model=MODEL, base=tmp_path / "part",
                from_offsets={0: 1})


def test_rebuild_up_to_a_time_and_resume(stream, tmp_path):
    cut = _ts(3, 1)  # after step 3 of shard 1, before step 4 of shard 0
    res = rebuild(stream.bootstrap, stream.topic, model=MODEL, to_time=cut,
                  out=tmp_path / "noon")

    def before(p, off, v):
        ts = _ts_of(v)
        return ts is None or ts <= cut

    _assert_same(res.tables, _reference(stream, keep=before))
    assert res.counters["outside_time"] == sum(
        1 for p, off, v, _ in stream.ordered() if _ts_of(v) is not None and _ts_of(v) > cut)
    # resume offset per partition = first record held back for being later
    for p, recs in stream.records.items():
        later = [off for off, v, _ in recs if _ts_of(v) is not None and _ts_of(v) > cut]
        assert res.offsets[p] == (later[0] if later else stream.ends()[p])
    # a rebuild on top of it reaches the same state as one full rebuild
    cont = rebuild(stream.bootstrap, stream.topic, model=MODEL, base=tmp_path / "noon")
    _assert_same(cont.tables, _reference(stream))
    # a window in time: only messages with from <= ts <= to
    lo, hi = _ts(2, 0), _ts(4, 1)
    win = rebuild(stream.bootstrap, stream.topic, model=MODEL, from_time=lo, to_time=hi)
    _assert_same(win.tables, _reference(
        stream, keep=lambda p, off, v: _ts_of(v) is None or lo <= _ts_of(v) <= hi))
    with pytest.raises(ReplayError, match="before"):
        rebuild(stream.bootstrap, stream.topic, model=MODEL, from_time=hi, to_time=lo)


def _step_of(value: bytes):
    try:
        return wire.decode(value).step
    except wire.WireError:
        return None


def test_rebuild_up_to_a_step_and_resume(stream, tmp_path):
    """--to-step: the tables the trainers had published by step 4; a partition resumes at
    its first message past it; a rebuild on top reaches the full state."""
    res = rebuild(stream.bootstrap, stream.topic, model=MODEL, to_step=4, out=tmp_path / "s4")
    _assert_same(res.tables, _reference(
        stream, keep=lambda p, off, v: _step_of(v) is None or _step_of(v) <= 4))
    later = {p: [off for off, v, _ in recs if (_step_of(v) or 0) > 4]
             for p, recs in stream.records.items()}
    assert all(later.values())  # the cut leaves messages out on both partitions
    assert res.offsets == {p: offs[0] for p, offs in later.items()}
    assert res.counters["outside_time"] == sum(len(offs) for offs in later.values())
    assert read_snapshot(tmp_path / "s4").meta["range"]["to_step"] == 4
    cont = rebuild(stream.bootstrap, stream.topic, model=MODEL, base=tmp_path / "s4")
    _assert_same(cont.tables, _reference(stream))
    for bad in (-1, 2.5, True):
        with pytest.raises(ReplayError, match="to_step"):
            rebuild(stream.bootstrap, stream.topic, model=MODEL, to_step=bad)


# ----------------------------------------------------------------------------- dump / stats


def test_dump_metadata_filters_and_rows(stream):
    lines = list(dump(stream.bootstrap, stream.topic))
    assert len(lines) == stream.produced
    assert [(x["partition"], x["offset"]) for x in lines] == \
        [(p, off) for p, off, _, _ in stream.ordered()]
    errors = [x for x in lines if "error" in x]
    assert len(errors) == 1 and errors[0]["partition"] == 0
    assert errors[0]["head"] == b"\x93not a delta message".hex()
    for x in lines:
        json.loads(json.dumps(x, allow_nan=False))
    by_pos = {(p, off): wire.decode(v) for p, off, v, _ in stream.ordered()
              if _ts_of(v) is not None}
    for x in lines:
        if "error" in x:
            continue
        b = by_pos[(x["partition"], x["offset"])]
        assert (x["table"], x["shard"], x["epoch"], x["seq"], x["step"], x["ts"], x["n"],
                x["dim"], x["dtype"]) == (b.table, b.shard, b.epoch, b.seq, b.step, b.ts, b.n,
                                          b.dim, b.dtype)
        assert x["tombstones"] == (0 if b.tombstones is None else b.tombstones.size)
        assert "rows" not in x
    assert sum(x["tombstones"] for x in lines if "error" not in x) > 0

    sel = list(dump(stream.bootstrap, stream.topic, tables=["item"], shards=[1],
                    seq_range=(1, 3)))
    want = [(p, off) for (p, off), b in by_pos.items()
            if b.table == "item" and b.shard == 1 and 1 <= b.seq <= 3]
    assert [(x["partition"], x["offset"]) for x in sel if "error" not in x] == want
    # seqs 1..3 of epoch 1 and 1, 3, 1 of epoch 3
    assert {x["epoch"] for x in sel if "error" not in x} == {1, 3}
    # a record without headers cannot be placed by the filters: it is shown, not hidden
    assert [x["offset"] for x in sel if "error" in x] == [errors[0]["offset"]]

    with_rows = list(dump(stream.bootstrap, stream.topic, partitions=[0], rows=True,
                          from_time=_ts(2, 0), to_time=_ts(2, 0)))
    # the undecodable record has no ts, so a time window does not hide it either
    assert ["error" in x for x in with_rows].count(True) == 1
    with_rows = [x for x in with_rows if "error" not in x]
    assert {x["step"] for x in with_rows} == {2} and len(with_rows) == 2
    for x in with_rows:
        b = by_pos[(0, x["offset"])]
        assert x["ids"] == b.ids.tolist()
        assert np.array_equal(np.array(x["rows"], np.float32), b.rows_f32())
        assert x["deleted"] == ([] if b.tombstones is None else b.tombstones.tolist())


def test_stats_figures(stream):
    st = stats(stream.bootstrap, stream.topic)
    assert st.records == stream.produced and st.undecodable == 1
    decoded = [(p, wire.decode(v), len(v)) for p, off, v, _ in stream.ordered()
               if _ts_of(v) is not None]
    streams = {(s.table, s.shard): s for s in st.streams}
    assert set(streams) == {("user", 0), ("item", 0), ("user", 1), ("item", 1)}
    for (table, shard), s in streams.items():
        mine = [(p, b, n) for p, b, n in decoded if b.table == table and b.shard == shard]
        assert s.messages == len(mine)
        assert s.rows == sum(b.n for _, b, _ in mine)
        assert s.bytes == sum(n for _, _, n in mine)
        assert s.tombstones == sum(0 if b.tombstones is None else b.tombstones.size
                                   for _, b, _ in mine)
        assert s.unique_ids == np.unique(np.concatenate([b.ids for _, b, _ in mine])).size
        assert s.ts_min == min(b.ts for _, b, _ in mine)
        assert s.ts_max == max(b.ts for _, b, _ in mine)
        assert s.partition == shard % 2
    assert streams[("user", 0)].epochs == [1, 2] and streams[("user", 1)].epochs == [1]
    assert streams[("user", 0)].messages == 10 and streams[("user", 1)].messages == 6
    item1 = streams[("item", 1)]
    assert item1.epochs == [1, 3]
    assert (item1.gaps, item1.missing_seqs, item1.gap_ranges) == (1, 1, [[3, 2, 2]])
    assert item1.duplicates == 1
    assert sum(s.gaps for s in st.streams) == 1
    assert sum(s.duplicates for s in st.streams) == 1
    # a range that starts mid-stream does not count the seqs before it as missing
    later = stats(stream.bootstrap, stream.topic, from_offsets={0: 3, 1: 3}, tables=["user"])
    assert later.gaps == 0 and {s.table for s in later.streams} == {"user"}
    assert later.filtered > 0
    text = st.format_table()
    assert "item" in text and "seqs 2..2 missing" in text and "1 undecodable" in text


# ----------------------------------------------------------------------------- CLI


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DELTASTREAM_")}
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "consumers.replay.cli", *args], cwd=REPO,
                          env=e, capture_output=True, text=True, timeout=60)


def test_cli_exit_codes_and_messages(stream, tmp_path):
    src = ["--bootstrap-servers", stream.bootstrap, "--topic", stream.topic, "--model", MODEL]
    # 0: stats as JSON, with the broker from the environment
    r = _cli("stats", "--topic", stream.topic, "--json",
             env={"DELTASTREAM_BOOTSTRAP_SERVERS": stream.bootstrap})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["records"] == stream.produced and doc["undecodable"] == 1 and doc["gaps"] == 1
    # 0: rebuild, then dump as JSON lines
    r = _cli("rebuild", *src, "--out", str(tmp_path / "a"), "--to-offsets", "0=5,1=4",
             "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["offsets"] == {"0": 5, "1": 4}
    assert "rebuilt 2 tables" in r.stderr and "\x1b" not in r.stderr  # no bar off a tty
    r = _cli("rebuild", *src, "--out", str(tmp_path / "s4"), "--to-step", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert read_snapshot(tmp_path / "s4").meta["range"]["to_step"] == 4
    r = _cli("dump", *src, "--table", "user", "--shard", "0", "--limit", "3")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(lines) == 3 and all(x["table"] == "user" and x["shard"] == 0 for x in lines)
    # 1 / 0: diff of different / equal snapshots
    assert _cli("rebuild", *src, "--out", str(tmp_path / "b")).returncode == 0
    r = _cli("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.returncode == 1 and "DIFFERENT" in r.stdout, r.stdout + r.stderr
    r = _cli("diff", str(tmp_path / "b"), "--rebuild", "--bootstrap-servers", stream.bootstrap)
    assert r.returncode == 0 and "no differences" in r.stdout, r.stdout + r.stderr
    # 3: nothing listens, a listener that never answers, missing topic; 2: bad offsets
    # argument, out-of-range offsets, no broker given, a bad bootstrap address
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    mute = f"127.0.0.1:{silent.getsockname()[1]}"
    with silent:
        for args, code, needle in [
            (["stats", "--bootstrap-servers", "127.0.0.1:1", "--topic", "x", "--timeout", "1"],
             3, "nothing listens on 127.0.0.1:1 (connection refused for 1 s)"),
            (["stats", "--bootstrap-servers", mute, "--topic", "x", "--timeout", "1"],
             3, f"no Kafka broker answered at {mute} within 1 s"),
            (["stats", "--bootstrap-servers", stream.bootstrap, "--topic", "deltas.nope"],
             3, "does not exist"),
            (["rebuild", *src, "--out", str(tmp_path / "c"), "--from-offsets", "0:5"],
             2, "PARTITION=OFFSET"),
            (["rebuild", *src, "--out", str(tmp_path / "c"), "--to-step", "-3"],
             2, "expected a trainer step"),
            (["dump", *src, "--from-offsets", "0=100000"], 2, "beyond the end"),
            (["stats", "--topic", stream.topic], 2, "--bootstrap-servers"),
            (["stats", "--bootstrap-servers", "127.0.0.1:99999", "--topic", "x"], 2,
             "port 99999 is outside 1..65535"),
        ]:
            r = _cli(*args)
            assert r.returncode == code, (args, r.stdout, r.stderr)
            assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert "Traceback" not in r.stderr
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("cmd", [None, "rebuild", "dump", "stats", "diff"])
def test_cli_help_names_every_flag_and_env(cmd, capsys):
    assert main(([cmd] if cmd else []) + ["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: deltastream-replay" in out
    flags = {"rebuild": ["--out", "--base", "--from-offsets", "--to-time", "--shards"],
             "dump": ["--rows", "--table", "--shard", "--seq-range", "--partitions"],
             "stats": ["--json", "--from-time"],
             "diff": ["--rebuild", "--tolerance"]}.get(cmd, ["--log-level"])
    prefix = "DELTASTREAM_REPLAY_" + (f"{cmd.upper()}_" if cmd else "")
    for f in flags:
        assert f in out
        env = prefix + f.lstrip("-").upper().replace("-", "_")
        assert env in out


def test_diff_tables_finds_a_changed_row(stream):
    res = rebuild(stream.bootstrap, stream.topic, model=MODEL)
    other = {n: t for n, t in _reference(stream).items()}
    ids, rows = other["user"].items()
    other["user"].upsert(ids[:1], rows[:1] + 0.25)
    rep = diff_tables(res.tables, other)
    user = next(t for t in rep.tables if t.table == "user")
    assert not rep.equal and user.differing == 1 and user.sample_differing == [int(ids[0])]
    assert user.max_abs_diff == pytest.approx(0.25, rel=1e-3)
    assert next(t for t in rep.tables if t.table == "item").equal


def test_progress_bar_only_on_a_terminal(stream, tmp_path, capsys, monkeypatch):
    args = ["stats", "--bootstrap-servers", stream.bootstrap, "--topic", stream.topic]
    assert main(args) == 0
    assert "msg" not in capsys.readouterr().err  # not a terminal: silent
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert f"/{stream.produced} " in err and "msg/s" in err  # drawn, then cleared
    assert main(args + ["--no-progress"]) == 0
    assert "msg" not in capsys.readouterr().err


def test_rebuild_out_never_replaces_what_deltastream_did_not_write(stream, tmp_path):
    """Issue 13, point 1: a user's file or directory at --out survives; exit 2, one line."""
    src = ["--bootstrap-servers", stream.bootstrap, "--topic", stream.topic, "--model", MODEL]
    thesis = "four years of my life\n"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text(thesis)
    afile = tmp_path / "notes.txt"
    afile.write_text(thesis)
    for out, needle in ((mine, "thesis.txt"), (afile, "is a file")):
        r = _cli("rebuild", *src, "--out", str(out))
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and str(out) in lines[0] and needle in lines[0], r.stderr
        assert "expected a deltastream snapshot" in lines[0]
    assert (mine / "thesis.txt").read_text() == thesis and afile.read_text() == thesis
    assert sorted(os.listdir(tmp_path)) == ["mine", "notes.txt"]  # no .old, no temp dir
    # an empty directory, and a snapshot deltastream wrote, are replaced
    (tmp_path / "empty").mkdir()
    for out in ("empty", "empty", "fresh"):
        r = _cli("rebuild", *src, "--out", str(tmp_path / out))
        assert r.returncode == 0, r.stderr
    assert read_snapshot(tmp_path / "empty").meta["model"] == MODEL
    assert sorted(os.listdir(tmp_path)) == ["empty", "fresh", "mine", "notes.txt"]


def test_a_wrong_model_is_an_error_naming_the_models_found(stream, tmp_path):
    """Issue 13, point 8: no empty snapshot with exit 0 for a model the topic lacks."""
    src = ["--bootstrap-servers", stream.bootstrap, "--topic", stream.topic, "--model", "nope"]
    for cmd in (["rebuild", *src, "--out", str(tmp_path / "out")], ["dump", *src],
                ["stats", *src]):
        r = _cli(*cmd)
        assert r.returncode == 2, (cmd[0], r.stdout, r.stderr)
        # one error line (the stream's one garbage record is also reported, as a warning)
        lines = [ln for ln in r.stderr.splitlines() if "WARNING" not in ln]
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"{cmd[0]}: error: topic {stream.topic} holds no records of model 'nope'" \
            in lines[0] and f"'{MODEL}'" in lines[0] and f"--model {MODEL}" in lines[0]
    assert not (tmp_path / "out").exists()
    with pytest.raises(ReplayError, match="no records of model 'nope'"):
        rebuild(stream.bootstrap, stream.topic, model="nope")
    # the right model still rebuilds, and a model that is there is never an error
    res = rebuild(stream.bootstrap, stream.topic, model=MODEL)
    assert res.counters["foreign_model"] == 0 and res.tables
