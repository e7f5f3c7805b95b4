"""Applier: raw record bytes -> table changes; bad data quarantined, never half-applied."""

from __future__ import annotations

import numpy as np
import pytest

from consumers.applier import Applier, Outcome
from consumers.dense_assembly import DenseAssembler
from consumers.sequencing import SeqTracker
from consumers.serving.table import ServingTable
from deltastream.dense_wire import chunk_version, dense_headers, encode_dense
from deltastream.wire import DeltaBatch, decode, encode, kafka_headers


def msg(ids, rows, *, table="emb", model="m", shard=0, epoch=1, seq=0, dtype="f16",
        tombstones=None, step=7, ts=123, version=2, **columns):
    ids = np.asarray(ids, np.int64)
    rows = np.asarray(rows, np.float32).reshape(len(ids), -1)
    b = DeltaBatch(model, table, shard, epoch, seq, step, ts, ids=ids, rows=rows,
                   dtype=dtype, tombstones=tombstones, **columns)
    (m,) = encode(b, max_message_bytes=64 << 20, version=version)
    return m


def fresh(**kw):
    tables: dict[str, ServingTable] = {}
    return Applier("m", tables, SeqTracker(), **kw), tables


def test_applies_and_creates_table():
    ap, tables = fresh()
    m = msg([1, 2], [[1, 2], [3, 4]])
    out = ap.process(m)
    assert out == Outcome("applied", table="emb", shard=0, epoch=1, seq=0, step=7, ts=123,
                          model="m", rows=2, deleted=0, bytes=len(m))
    assert tables["emb"].dim == 2
    assert np.array_equal(tables["emb"].lookup([1, 2, 3]), [[1, 2], [3, 4], [0, 0]])
    out = ap.process(msg([3], [[5, 5]], tombstones=np.array([1]), seq=1))
    assert (out.kind, out.rows, out.deleted) == ("applied", 1, 1)
    assert tables["emb"].ids().tolist() == [2, 3]
    assert ap.counters["applied"] == 2 and ap.counters["rows"] == 3
    assert ap.counters["deleted"] == 1 and ap.counters["tables_created"] == 1
    assert ap.seqs.get("emb", 0) == (1, 1)


@pytest.mark.parametrize("value", [b"", b"\x00garbage", b"\x81\xa1v\x01", None,
                                   b"\xde\x00\x01\xa1v\xcb" + b"\x00" * 8, 12345])
def test_garbage_is_quarantined(value):
    ap, tables = fresh()
    out = ap.process(value)
    assert out.kind == "quarantined" and out.reason.startswith("decode:")
    assert out.table is None and tables == {} and ap.counters["quarantined"] == 1


def test_corrupted_payload_quarantined_and_nothing_applied():
    ap, tables = fresh()
    ap.process(msg([1], [[1, 1]]))
    before = tables["emb"].digest()
    m = bytearray(msg([1, 2], [[9, 9], [9, 9]], seq=1))
    m[-12] ^= 0xFF  # inside the rows (before the 9-byte CRC trailer): CRC mismatch
    out = ap.process(bytes(m))
    assert out.kind == "quarantined" and "crc" in out.reason
    assert tables["emb"].digest() == before
    assert ap.seqs.get("emb", 0) == (1, 0)


def test_header_field_corruption_quarantined():
    """Wire v2's CRC covers every field: a flipped epoch bit is not taken for a newer
    trainer epoch (which would make every later good message look stale)."""
    ap, tables = fresh()
    ap.process(msg([1], [[1, 1]], epoch=1))
    m = msg([1], [[2, 2]], epoch=1, seq=1)
    at = m.index(b"epoch") + len(b"epoch")  # the epoch value: fixint 1 -> 65, "newer"
    forged = bytearray(m)
    forged[at] ^= 0x40
    out = ap.process(bytes(forged))
    assert out.kind == "quarantined" and "crc" in out.reason
    assert ap.process(m).kind == "applied" and ap.counters["stale"] == 0
    assert tables["emb"].lookup([1]).tolist() == [[2, 2]]


def test_v1_messages_still_apply():
    ap, tables = fresh()
    assert ap.process(msg([1, 2], [[1, 2], [3, 4]], version=1)).kind == "applied"
    assert ap.process(msg([3], [[5, 6]], seq=1)).kind == "applied"  # then v2, same stream
    assert tables["emb"].lookup([1, 3]).tolist() == [[1, 2], [5, 6]]


@pytest.mark.parametrize("table_dims", [None, {"emb": 4}])
def test_column_slices_apply_to_their_columns(table_dims):
    """Column shards of one table are separate (table, shard) streams: each applies its
    columns; a slice whose width is not the table's dim is quarantined, table untouched."""
    ap, tables = fresh(table_dims=table_dims)
    out = ap.process(msg([1, 2], [[7, 7], [8, 8]], shard=1, col=2, width=4))
    assert out.kind == "applied" and out.rows == 2 and tables["emb"].dim == 4
    assert tables["emb"].lookup([1, 2]).tolist() == [[0, 0, 7, 7], [0, 0, 8, 8]]
    out = ap.process(msg([1], [[5, 6]], shard=0, col=0, width=4))
    assert out.kind == "applied" and out.gap is None
    assert tables["emb"].lookup([1, 2]).tolist() == [[5, 6, 7, 7], [0, 0, 8, 8]]
    assert ap.seqs.get("emb", 0) is not None and ap.seqs.get("emb", 1) is not None
    before = tables["emb"].digest()
    out = ap.process(msg([1], [[7, 7]], shard=2, col=0, width=2))
    assert out.kind == "quarantined" and "dim 4" in out.reason
    assert tables["emb"].digest() == before


def test_other_models_are_skipped_and_counted_by_name_not_quarantined():
    ap, tables = fresh()
    out = ap.process(msg([1], [[1]], model="other"))
    assert out.kind == "skipped" and out.model == "other" and out.table == "emb"
    assert "'other'" in out.reason and "'m'" in out.reason
    ap.process(msg([1], [[1]], model="other", seq=1))
    ap.process(msg([1], [[1]], model="third"))
    assert tables == {} and ap.seqs.get("emb", 0) is None
    c = ap.counters
    assert c["foreign_model"] == 3 and c["skipped"] == 3 and c["quarantined"] == 0
    assert ap.models == {"other": 2, "third": 1}
    assert ap.process(msg([1], [[1]])).kind == "applied"  # its own model still applies
    assert ap.models == {"other": 2, "third": 1, "m": 1}


def test_unknown_table_and_dim_mismatch_with_table_dims():
    ap, tables = fresh(table_dims={"emb": 2})
    out = ap.process(msg([1], [[1]], table="nope"))
    assert out.kind == "quarantined" and "unknown table 'nope'" in out.reason
    out = ap.process(msg([1], [[1, 2, 3]]))
    assert out.kind == "quarantined" and "dim" in out.reason
    assert tables == {}
    assert ap.process(msg([1], [[1, 2]])).kind == "applied"
    assert ap.counters["quarantined"] == 2


def test_dim_mismatch_against_existing_table():
    ap, tables = fresh()
    ap.process(msg([1], [[1, 2]]))
    before = tables["emb"].digest()
    out = ap.process(msg([1], [[1, 2, 3]], seq=1))
    assert out.kind == "quarantined" and "dim" in out.reason
    assert tables["emb"].digest() == before
    # the quarantined seq was not applied: the next message reports it as a gap
    out = ap.process(msg([1], [[5, 5]], seq=2))
    assert out.kind == "applied" and out.gap == (1, 1)


def test_non_finite_rows_quarantined():
    ap, tables = fresh()
    ap.process(msg([1], [[1, 2]], dtype="f32"))
    out = ap.process(msg([1, 2], [[np.nan, 2], [1, 1]], dtype="f32", seq=1))
    assert out.kind == "quarantined" and "NaN" in out.reason
    assert tables["emb"].ids().tolist() == [1]
    # and a first batch that fails creates no table
    out = ap.process(msg([1], [[np.inf]], table="t2", dtype="f32"))
    assert out.kind == "quarantined" and "t2" not in tables


def test_duplicates_gaps_and_epochs():
    ap, tables = fresh()
    assert ap.process(msg([1], [[1]], seq=0)).kind == "applied"
    assert ap.process(msg([1], [[2]], seq=1)).kind == "applied"
    dup = ap.process(msg([1], [[99]], seq=1))
    assert dup.kind == "duplicate"
    assert tables["emb"].lookup([1])[0, 0] == 2  # the duplicate was not applied
    gap = ap.process(msg([1], [[3]], seq=5))
    assert gap.kind == "applied" and gap.gap == (2, 4)
    new = ap.process(msg([1], [[4]], epoch=2, seq=0))
    assert new.kind == "applied" and new.gap is None
    stale = ap.process(msg([1], [[98]], epoch=1, seq=6))
    assert stale.kind == "stale"
    assert tables["emb"].lookup([1])[0, 0] == 4
    new2 = ap.process(msg([1], [[5]], epoch=3, seq=2))
    assert new2.kind == "applied" and new2.gap == (0, 1)
    c = ap.counters
    assert (c["applied"], c["duplicates"], c["stale"], c["gaps"], c["missing_seqs"],
            c["new_epochs"]) == (5, 1, 1, 2, 5, 2)


def test_shard_filter_skips_with_and_without_headers():
    ap, tables = fresh(shards={1})
    m0 = msg([1], [[1]], shard=0)
    b0 = decode(m0)
    out = ap.process(m0, kafka_headers(b0))
    assert out.kind == "skipped" and out.shard == 0
    assert ap.process(m0).kind == "skipped"  # body decides without headers
    m1 = msg([1], [[1]], shard=1)
    assert ap.process(m1, kafka_headers(decode(m1))).kind == "applied"
    assert ap.counters["skipped"] == 2 and len(tables["emb"]) == 1
    # garbage whose headers name a foreign shard is skipped undecoded
    assert ap.process(b"junk", kafka_headers(b0)).kind == "skipped"


def test_headers_disagreeing_with_body_quarantined():
    ap, tables = fresh()
    m = msg([1], [[1]], seq=3)
    hdr = kafka_headers(decode(msg([1], [[1]], seq=4)))
    out = ap.process(m, hdr)
    assert out.kind == "quarantined" and "disagree" in out.reason
    assert ap.process(m, [("model", b"m")]).kind == "applied"  # malformed headers: ignored


def test_existing_tables_and_dtype():
    t = ServingTable("emb", 2, dtype="f16")
    tables = {"emb": t}
    ap = Applier("m", tables, SeqTracker(), dtype="f16")
    ap.process(msg([1], [[1, 2]]))
    ap.process(msg([1], [[1, 2, 3]], table="new"))
    assert tables["emb"] is t and len(t) == 1
    assert tables["new"].dtype == "f16"


@pytest.mark.parametrize("kw", [
    dict(model=""), dict(dtype="f64"), dict(shards={-1}), dict(table_dims={"emb": 0}),
    dict(table_dims={"emb": 3}, tables={"emb": ServingTable("emb", 2)}),
    dict(tables={"x": ServingTable("emb", 2)}),
])
def test_constructor_validates(kw):
    args = dict(model="m", tables={}, seqs=SeqTracker()) | kw
    with pytest.raises((ValueError, TypeError)):
        Applier(args.pop("model"), args.pop("tables"), args.pop("seqs"), **args)


def _stream(rng, n_msgs=60):
    """A realistic record stream: two tables, two shards, every wire dtype, tombstones,
    duplicates, a gap, a trainer restart, a zombie, garbage."""
    out = []
    seq = {}
    epoch = {0: 1, 1: 1}
    for i in range(n_msgs):
        table = ("user", "item")[i % 2]
        shard = int(rng.integers(0, 2))
        if i == 30:
            epoch[1] = 2
            seq = {k: v for k, v in seq.items() if k[1] != 1}
        key = (table, shard)
        s = seq.get(key, 0)
        seq[key] = s + 1
        dim = 8 if table == "user" else 4
        ids = np.sort(rng.choice(500, int(rng.integers(1, 60)), replace=False))
        tomb = rng.choice(500, 5, replace=False) if i % 5 == 0 else None
        m = msg(ids, rng.standard_normal((len(ids), dim)), table=table, shard=shard,
                epoch=epoch[shard], seq=s, dtype=("f32", "f16", "bf16", "i8")[i % 4],
                tombstones=tomb)
        out.append(m)
        if i % 7 == 3:
            out.append(m)  # duplicate delivery
        if i % 11 == 4:
            out.append(b"\x00junk" + m[:20])
        if i == 40:
            out.append(msg([1], [[1] * 8], table="user", shard=1, epoch=1, seq=99))  # zombie
        if i == 20:
            seq[key] += 3  # a gap
    return out


def test_same_records_give_bit_identical_tables():
    """The daemon and the replay tool rely on this: same records, same order -> same bits."""
    records = _stream(np.random.default_rng(7))
    results = []
    for _ in range(2):
        ap, tables = fresh()
        kinds = [ap.process(r).kind for r in records]
        results.append(({n: t.digest() for n, t in tables.items()}, kinds, dict(ap.counters),
                        ap.seqs.state()))
    assert results[0] == results[1]
    digests, kinds, counters, _ = results[0]
    assert set(digests) == {"user", "item"}
    assert {"applied", "duplicate", "quarantined", "stale"} <= set(kinds)
    assert counters["gaps"] >= 1 and counters["new_epochs"] >= 1
    # replay in two halves with the state carried over (a restart from a checkpoint)
    ap, tables = fresh()
    half = len(records) // 2
    for r in records[:half]:
        ap.process(r)
    saved = {n: ServingTable.from_arrays(n, *t.items()) for n, t in tables.items()}
    ap2 = Applier("m", saved, SeqTracker.from_state(ap.seqs.state()))
    for r in records[half:]:
        ap2.process(r)
    assert {n: t.digest() for n, t in saved.items()} == digests


# ----------------------------------------------------------------------------- dense chunks


def _dense_msgs(model="m", shard=0, step=5):
    t = {"w": np.arange(40, dtype=np.float32).reshape(8, 5), "b": np.ones(3, np.float32)}
    cs = chunk_version(t, model=model, shard=shard, epoch=1, seq=0, step=step, ts=9,
                       max_message_bytes=600)
    return t, cs, encode_dense(cs)


@pytest.mark.parametrize("with_headers", [True, False])
def test_dense_chunks_go_to_the_assembler_with_or_without_headers(with_headers):
    dense = DenseAssembler()
    ap, tables = fresh(dense=dense)
    t, cs, msgs = _dense_msgs()
    outs = [ap.process(m, dense_headers(c) if with_headers else None)
            for c, m in zip(cs, msgs, strict=True)]
    assert [o.dense for o in outs] == ["taken"] * (len(msgs) - 1) + ["served"]
    assert {o.kind for o in outs} == {"applied"} and outs[0].table is None
    assert np.array_equal(dense.view()["w"], t["w"]) and tables == {}
    assert ap.counters["quarantined"] == 0


def test_dense_chunks_of_another_model_or_shard_are_skipped_and_damaged_ones_quarantined():
    dense = DenseAssembler()
    ap, _ = fresh(dense=dense, shards={1})
    _, cs, msgs = _dense_msgs(model="other")
    assert ap.process(msgs[0], dense_headers(cs[0])).model == "other"
    _, cs, msgs = _dense_msgs(shard=0)
    assert ap.process(msgs[0], dense_headers(cs[0])).reason == "shard 0 not served"
    bad = bytearray(msgs[1])
    bad[-1] ^= 1
    out = ap.process(bytes(bad), dense_headers(cs[1]))
    assert out.kind == "quarantined" and out.reason.startswith("decode dense:")
    assert dense.view() is None and ap.counters["skipped"] == 2


def test_without_an_assembler_a_dense_chunk_is_quarantined_never_read_as_rows():
    ap, tables = fresh()
    _, _, msgs = _dense_msgs()
    out = ap.process(msgs[0])
    assert out.kind == "quarantined" and "dense" in out.reason and tables == {}
