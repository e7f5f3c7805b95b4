"""Wire format v1: round trips and error bounds per dtype, splitting, and strict validation."""

from __future__ import annotations

import pickle
import struct
import tracemalloc

import crc32c
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from deltastream import wire
from deltastream.wire import DeltaBatch, WireError, decode, encode, split

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
I64 = np.iinfo(np.int64)
BF16_OVERFLOW = float(np.array(0x7F7F8000, dtype=np.uint32).view(np.float32))

# ----------------------------------------------------------------------------- helpers

names = st.text(st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="/"),
                min_size=1, max_size=40)


def make(ids, rows, dtype="f32", tombstones=None, **kw) -> DeltaBatch:
    fields = dict(model="m", table="t", shard=3, epoch=11, seq=5, step=7, ts=1234)
    fields.update(kw)
    return DeltaBatch(ids=np.asarray(ids), rows=np.asarray(rows), dtype=dtype,
                      tombstones=tombstones, **fields)


def one(batch: DeltaBatch, **kw) -> bytes:
    msgs = encode(batch, **kw)
    assert len(msgs) == 1
    return msgs[0]


@st.composite
def id_arrays(draw, max_n=40):
    """Unique int64 ids in any order, over the whole int64 range."""
    ids = draw(st.lists(st.integers(int(I64.min), int(I64.max)), unique=True, max_size=max_n))
    return np.array(ids, dtype=np.int64)


@st.composite
def batches(draw, dtype=None, max_n=40, max_dim=12, elements=None):
    ids = draw(id_arrays(max_n))
    dim = draw(st.integers(1, max_dim))
    dtype = dtype or draw(st.sampled_from(sorted(wire.DTYPES)))
    if elements is None:
        elements = st.floats(-1e3, 1e3, width=32)
    rows = draw(hnp.arrays(np.float32, (ids.shape[0], dim), elements=elements))
    tomb = draw(st.one_of(st.none(), hnp.arrays(
        np.int64, st.integers(0, 20), elements=st.integers(int(I64.min), int(I64.max)))))
    assume(ids.shape[0] or tomb is not None and tomb.shape[0])
    return make(ids, rows, dtype=dtype, tombstones=tomb,
                model=draw(names), table=draw(names),
                shard=draw(st.integers(0, 2**31 - 1)), epoch=draw(st.integers(0, int(I64.max))),
                seq=draw(st.integers(0, 2**40)), step=draw(st.integers(0, int(I64.max))),
                ts=draw(st.integers(0, int(I64.max))))


def fields_of(batch: DeltaBatch) -> dict:
    """The message of ``batch`` as a plain dict (what another language's encoder would write)."""
    msg = {"v": 1, "model": batch.model, "table": batch.table, "shard": batch.shard,
           "epoch": batch.epoch, "seq": batch.seq, "step": batch.step, "ts": batch.ts,
           "n": batch.n, "dim": batch.dim, "dtype": batch.dtype}
    d = decode(one(batch))
    msg["ids"] = bytes(d.ids.data)
    msg["rows"] = bytes(np.ascontiguousarray(d.rows).data)
    if d.scale is not None:
        msg["scale"] = bytes(d.scale.data)
    if d.tombstones is not None:
        msg["del"] = bytes(d.tombstones.data)
    msg["crc"] = crc_of(msg)
    return msg


def crc_of(msg: dict) -> int:
    crc = 0
    for k in ("ids", "rows", "scale", "del"):
        if isinstance(msg.get(k), bytes):
            crc = crc32c.crc32c(msg[k], crc)
    return crc


def assert_same(a: DeltaBatch, b: DeltaBatch) -> None:
    for f in ("model", "table", "shard", "epoch", "seq", "step", "ts", "dtype"):
        assert getattr(a, f) == getattr(b, f), f
    np.testing.assert_array_equal(a.ids, b.ids)
    assert a.rows.dtype == b.rows.dtype and a.rows.shape == b.rows.shape
    np.testing.assert_array_equal(a.rows.view(np.uint8), b.rows.view(np.uint8))
    if a.scale is None:
        assert b.scale is None
    else:
        np.testing.assert_array_equal(a.scale, b.scale)
    if a.tombstones is None:
        assert b.tombstones is None
    else:
        np.testing.assert_array_equal(a.tombstones, b.tombstones)


def sorted_input(batch: DeltaBatch) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(batch.ids, kind="stable")
    return batch.ids[order], np.asarray(batch.rows, dtype=np.float32)[order]


# ----------------------------------------------------------------------------- round trips


@SETTINGS
@given(batches(dtype="f32", elements=st.floats(width=32, allow_nan=False,
                                               allow_infinity=False)))
def test_f32_round_trip_is_exact(batch):
    d = decode(one(batch))
    ids, rows = sorted_input(batch)
    np.testing.assert_array_equal(d.ids, ids)
    assert d.rows.dtype == np.float32 and d.rows.shape == (batch.n, batch.dim)
    np.testing.assert_array_equal(d.rows_f32().view(np.uint32), rows.view(np.uint32))
    for f in ("model", "table", "shard", "epoch", "seq", "step", "ts"):
        assert getattr(d, f) == getattr(batch, f)
    if batch.tombstones is None:
        assert d.tombstones is None
    else:
        np.testing.assert_array_equal(d.tombstones, batch.tombstones)


@SETTINGS
@given(batches(dtype="f16", elements=st.floats(-65504, 65504, width=32)))
def test_f16_error_within_documented_bound(batch):
    d = decode(one(batch))
    _, x = sorted_input(batch)
    y = d.rows_f32()
    assert y.dtype == np.float32
    err = np.abs(y.astype(np.float64) - x)
    normal = np.abs(x) >= 2.0**-14
    assert np.all(err[normal] <= 2.0**-11 * np.abs(x[normal]))
    assert np.all(err[~normal] <= 2.0**-25)


@SETTINGS
@given(batches(dtype="bf16", elements=st.floats(
    width=32, allow_nan=False, allow_infinity=False).filter(lambda v: abs(v) < BF16_OVERFLOW)))
def test_bf16_error_within_documented_bound(batch):
    d = decode(one(batch))
    _, x = sorted_input(batch)
    assert d.rows.dtype == np.uint16
    y = d.rows_f32().astype(np.float64)
    err = np.abs(y - x)
    normal = np.abs(x) >= 2.0**-126
    assert np.all(err[normal] <= 2.0**-8 * np.abs(x[normal]))
    assert np.all(err[~normal] <= 2.0**-134)
    # round to nearest even: bit-exact against torch's independent bf16 cast
    torch = pytest.importorskip("torch")
    ref = torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).view(torch.int16)
    np.testing.assert_array_equal(d.rows.view(np.int16), ref.numpy())


@SETTINGS
@given(batches(dtype="i8", elements=st.one_of(
    st.floats(-1e3, 1e3, width=32),
    st.floats(width=32, allow_nan=False, allow_infinity=False))))
def test_i8_error_within_documented_bound(batch):
    d = decode(one(batch))
    _, x = sorted_input(batch)
    x = x.astype(np.float64)
    assert d.rows.dtype == np.int8 and d.scale.dtype == np.float32
    amax = np.max(np.abs(x), axis=1, keepdims=True) if batch.n else np.zeros((0, 1))
    np.testing.assert_allclose(d.scale, (amax[:, 0] / 127).astype(np.float32), rtol=1e-6)
    err = np.abs(d.rows_f32().astype(np.float64) - x)
    assert np.all(err <= amax / 254 + amax * 2.0**-22 + 2e-43)


def test_i8_bound_is_tight_and_zero_rows_are_exact():
    x = np.array([[127.0, 0.5, -63.5, 0.0], [0, 0, 0, 0]], dtype=np.float32)
    d = decode(one(make([1, 2], x, dtype="i8")))
    np.testing.assert_array_equal(d.rows_f32()[1], 0)
    assert d.scale[1] == 0
    err = np.abs(d.rows_f32()[0] - x[0])
    assert err.max() == pytest.approx(0.5)  # 0.5 and -63.5 sit exactly half a step away


def test_f16_subnormals_and_extremes():
    x = np.array([[65504.0, -65504.0, 2.0**-24, 3e-8, 6e-5, -1e-7]], dtype=np.float32)
    y = decode(one(make([0], x, dtype="f16"))).rows_f32()
    assert y[0, 0] == 65504 and y[0, 1] == -65504 and y[0, 2] == 2.0**-24
    assert np.all(np.abs(y - x)[0, 3:] <= 2.0**-25)


def test_nonfinite_pass_through_float_dtypes_and_refused_by_i8():
    x = np.array([[np.inf, -np.inf, np.nan, 1.0]], dtype=np.float32)
    for dtype in ("f32", "f16", "bf16"):
        y = decode(one(make([0], x, dtype=dtype))).rows_f32()
        assert y[0, 0] == np.inf and y[0, 1] == -np.inf and np.isnan(y[0, 2]), dtype
    with pytest.raises(WireError, match="i8 cannot carry non-finite"):
        encode(make([0], x, dtype="i8"))


def test_bf16_nan_patterns_stay_nan():
    # 0xFFFFFFFF would wrap to +0 with plain rounding; 0x7F800001 would carry into inf.
    bits = np.array([[0xFFFFFFFF, 0x7F800001, 0xFF800001, 0x7FC00000]], dtype=np.uint32)
    y = decode(one(make([0], bits.view(np.float32), dtype="bf16"))).rows_f32()
    assert np.all(np.isnan(y))


@pytest.mark.parametrize("dtype", sorted(wire.DTYPES))
def test_encode_of_decoded_batch_is_byte_identical(dtype):
    rng = np.random.default_rng(1)
    b = make(rng.permutation(50) * 7 - 100, rng.standard_normal((50, 9)), dtype=dtype,
             tombstones=np.array([5, -3]))
    msg = one(b)
    assert encode(decode(msg)) == [msg]
    # split pieces of a decoded batch keep their own scale rows (i8)
    pieces = encode(decode(msg), max_message_bytes=600)
    assert len(pieces) > 1
    got = np.concatenate([decode(p).rows_f32() for p in pieces])
    np.testing.assert_array_equal(got, decode(msg).rows_f32())


def test_ids_are_sorted_with_their_rows():
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    d = decode(one(make([30, -10, 20, 0], rows)))
    np.testing.assert_array_equal(d.ids, [-10, 0, 20, 30])
    np.testing.assert_array_equal(d.rows, rows[[1, 3, 2, 0]])


def test_tombstone_only_and_empty_batches():
    d = decode(one(make(np.zeros(0, np.int64), np.zeros((0, 4)), tombstones=np.array([9, 1]))))
    assert d.n == 0 and d.dim == 4 and d.rows.shape == (0, 4)
    np.testing.assert_array_equal(d.tombstones, [9, 1])
    assert encode(make(np.zeros(0, np.int64), np.zeros((0, 4)))) == []


def test_uint_ids_accepted_when_they_fit():
    d = decode(one(make(np.array([1, 2**63 - 1], dtype=np.uint64), np.ones((2, 2)))))
    assert d.ids.tolist() == [1, 2**63 - 1]


def test_rows_f32_on_built_and_decoded_batches():
    b = make([1], [[1.5, -2.0]], dtype="i8")
    np.testing.assert_array_equal(b.rows_f32(), [[1.5, -2.0]])
    assert b.n == 1 and b.dim == 2
    d = decode(one(b))
    np.testing.assert_allclose(d.rows_f32(), [[1.5, -2.0]], atol=2 / 254)


def test_message_key_headers_and_row_bytes():
    b = make([1], [[1.0]])
    assert wire.message_key("m", "t", 3) == b"m/t/3"
    h = wire.kafka_headers(b)
    assert all(isinstance(k, str) and isinstance(v, bytes) for k, v in h)
    assert wire.parse_headers(h) == {"model": "m", "table": "t", "shard": 3, "epoch": 11,
                                     "seq": 5}
    for bad in ([], h[:-1], h[:-1] + [("seq", b"x")], h[:-1] + [("seq", b"-1")],
                [("model", 5)] + h[1:]):
        with pytest.raises(WireError, match="headers"):
            wire.parse_headers(bad)
    assert wire.row_bytes(64, "f16") == 8 + 128
    assert wire.row_bytes(64, "i8") == 8 + 64 + 4
    assert len(one(make(np.arange(100), np.zeros((100, 64)), dtype="f16"))) \
        < 100 * wire.row_bytes(64, "f16") + 256


# ----------------------------------------------------------------------------- splitting


@SETTINGS
@given(batches(max_n=300, max_dim=40), st.integers(300, 6000))
def test_split_messages_fit_and_concatenate_to_input(batch, limit):
    per_row = wire.row_bytes(batch.dim, batch.dtype)
    assume(limit - 256 - len(batch.model.encode()) - len(batch.table.encode()) >= per_row)
    msgs = encode(batch, max_message_bytes=limit)
    assert msgs and all(len(m) <= limit for m in msgs)
    decoded = [decode(m) for m in msgs]
    assert [d.seq for d in decoded] == list(range(batch.seq, batch.seq + len(msgs)))
    ids, _ = sorted_input(batch)
    np.testing.assert_array_equal(np.concatenate([d.ids for d in decoded]), ids)
    whole = decode(one(batch, max_message_bytes=1 << 24)).rows_f32()
    np.testing.assert_array_equal(np.concatenate([d.rows_f32() for d in decoded]), whole)
    tombs = [d.tombstones for d in decoded if d.tombstones is not None]
    if batch.tombstones is None or not batch.tombstones.size:
        assert all(t.size == 0 for t in tombs)
    else:
        np.testing.assert_array_equal(np.concatenate(tombs), batch.tombstones)
    for d in decoded:  # the metadata of the batch travels in every piece
        assert (d.model, d.table, d.shard, d.epoch, d.step, d.ts) == \
            (batch.model, batch.table, batch.shard, batch.epoch, batch.step, batch.ts)
    pieces = split(batch, limit)
    assert [p.seq for p in pieces] == [d.seq for d in decoded]
    assert [p.n for p in pieces] == [d.n for d in decoded]


def test_split_fills_messages_and_uses_byte_length_of_names():
    # 4-byte UTF-8 characters: a budget counted in characters would overflow the limit.
    b = make(np.arange(5000), np.zeros((5000, 16)), dtype="f16", model="😀" * 255,
             table="😀" * 255)
    msgs = encode(b, max_message_bytes=20000)
    assert all(len(m) <= 20000 for m in msgs)
    assert all(len(m) > 20000 - 300 - 2 * 4 * 255 for m in msgs[:-1])  # nearly full


def test_split_many_tombstones_across_messages():
    tomb = np.arange(10_000, dtype=np.int64)
    msgs = encode(make(np.arange(3), np.ones((3, 2)), tombstones=tomb), max_message_bytes=4096)
    assert len(msgs) > 10
    got = [decode(m) for m in msgs]
    np.testing.assert_array_equal(np.concatenate([g.tombstones for g in got
                                                  if g.tombstones is not None]), tomb)
    assert sum(g.n for g in got) == 3


# ----------------------------------------------------------------------------- encode errors


@pytest.mark.parametrize("field,value,match", [
    ("model", "", "model"), ("model", "a/b", "model"), ("model", "x\n", "model"),
    ("model", "x" * 256, "model"), ("model", 5, "model"), ("table", "t\x00", "table"),
    ("table", None, "table"), ("shard", -1, "shard"), ("shard", 2**31, "shard"),
    ("shard", True, "shard"), ("epoch", -1, "epoch"), ("seq", 1.0, "seq"),
    ("step", "3", "step"), ("ts", 2**63, "ts"), ("dtype", "f64", "dtype"),
    ("dtype", "F16", "dtype"),
])
def test_encode_rejects_bad_fields(field, value, match):
    b = make([1, 2], np.ones((2, 3)))
    setattr(b, field, value)
    with pytest.raises(WireError, match=match):
        encode(b)


@pytest.mark.parametrize("ids,rows,match", [
    ([1, 2], np.ones(2), r"rows: expected shape \[2, dim\]"),
    ([1, 2], np.ones((3, 2)), r"rows: expected shape \[2, dim\]"),
    ([1, 2], np.ones((2, 0)), "dim"),
    (np.zeros(0, np.int64), np.ones((0, wire.MAX_DIM + 1)), "dim"),
    ([1, 2], np.ones((2, 2), dtype=np.int32), "float"),
    ([1, 2], np.ones((2, 2), dtype=np.complex64), "float"),
    ([[1, 2]], np.ones((1, 2)), "ids: expected a 1-D integer"),
    ([1.0, 2.0], np.ones((2, 2)), "ids: expected a 1-D integer"),
    ([3, 1, 3], np.ones((3, 2)), "duplicate ids"),
    ([5, 5], np.ones((2, 2)), "duplicate ids"),
    (np.array([2**63], dtype=np.uint64), np.ones((1, 2)), "does not fit in int64"),
])
def test_encode_rejects_bad_arrays(ids, rows, match):
    with pytest.raises(WireError, match=match):
        encode(make(ids, rows))


def test_encode_rejects_bad_tombstones_and_limits():
    with pytest.raises(WireError, match="tombstones"):
        encode(make([1], np.ones((1, 2)), tombstones=np.ones(2)))
    with pytest.raises(WireError, match="tombstones"):
        encode(make([1], np.ones((1, 2)), tombstones=np.ones((2, 2), np.int64)))
    with pytest.raises(WireError, match="max_message_bytes"):
        encode(make([1], np.ones((1, 2))), max_message_bytes=100)
    with pytest.raises(WireError, match="max_message_bytes"):
        encode(make([1], np.ones((1, 2))), max_message_bytes=0)
    with pytest.raises(WireError, match="max_message_bytes"):
        encode(make([1], np.ones((1, 2))), max_message_bytes=1.5e6)
    with pytest.raises(WireError, match="DeltaBatch"):
        encode({"ids": [1]})


@pytest.mark.parametrize("value", [65520.0, -7e4, 1e30])
def test_encode_refuses_f16_overflow(value):
    with pytest.raises(WireError, match="f16 range"):
        encode(make([1], np.array([[1.0, value]], dtype=np.float32), dtype="f16"))
    # f32 and bf16 carry it
    assert decode(one(make([1], [[1.0, value]], dtype="bf16"))).rows_f32()[0, 1] \
        == pytest.approx(value, rel=2**-8)


def test_encode_refuses_bf16_overflow():
    just_below = np.nextafter(np.float32(BF16_OVERFLOW), np.float32(0))
    d = decode(one(make([1], np.array([[just_below]], dtype=np.float32), dtype="bf16")))
    assert np.isfinite(d.rows_f32()).all()
    with pytest.raises(WireError, match="bf16 range"):
        encode(make([1], np.array([[BF16_OVERFLOW]], dtype=np.float32), dtype="bf16"))


# ----------------------------------------------------------------------------- decode errors

BASE = make(np.array([1, 5, 9]), np.arange(12, dtype=np.float32).reshape(3, 4), dtype="i8",
            tombstones=np.array([2, 3]))


DROP = object()


def packed(base: DeltaBatch = BASE, **changes) -> bytes:
    """A message of ``base`` as a plain msgpack dict, with fields changed (DROP = removed);
    the CRC is recomputed unless ``crc`` is given."""
    msg = fields_of(base)
    for k, v in changes.items():
        if v is DROP:
            msg.pop(k, None)
        else:
            msg[k] = v
    if "crc" not in changes:
        msg["crc"] = crc_of(msg)
    return msgpack.packb(msg)


def test_plain_msgpack_dict_decodes_like_ours():
    ours = decode(one(BASE))
    theirs = decode(packed())
    assert_same(ours, theirs)
    # key order and int widths are free in msgpack: reverse the map, widen every int
    msg = fields_of(BASE)
    body = b"".join(msgpack.packb(k) + (b"\xcf" + struct.pack(">Q", v) if isinstance(v, int)
                                         else msgpack.packb(v))
                    for k, v in reversed(list(msg.items())))
    assert_same(decode(b"\xdf" + struct.pack(">I", len(msg)) + body), ours)


@SETTINGS
@given(batches(max_n=20))
def test_plain_msgpack_interop_property(batch):
    assert_same(decode(msgpack.packb(fields_of(batch))), decode(one(batch)))


@pytest.mark.parametrize("key", sorted(wire._REQUIRED))
def test_decode_missing_field(key):
    with pytest.raises(WireError, match=f"missing fields.*{key}"):
        decode(packed(**{key: DROP}))


@pytest.mark.parametrize("field,value,match", [
    ("v", "1", "v: expected an int"), ("v", True, "v: expected an int"),
    ("shard", "0", "shard: expected an int"), ("epoch", None, "epoch: expected an int"),
    ("seq", -1, "seq"), ("step", b"\x00", "step: expected an int"),
    ("ts", 2**64 - 1, "ts"), ("n", -3, "n"), ("dim", 0, "dim"),
    ("dim", wire.MAX_DIM + 1, "dim"), ("crc", 2**33, "crc"), ("crc", "x", "crc"),
    ("model", 7, "model"), ("model", b"m", "model"), ("model", "", "model"),
    ("table", "a/b", "table"), ("dtype", "f64", "dtype"), ("dtype", 1, "dtype"),
    ("ids", "abc", "ids: expected bin"), ("rows", 5, "rows: expected bin"),
    ("scale", "x" * 12, "scale: expected bin"), ("del", "abcdefgh", "del"),
    ("del", b"\x00" * 7, "del"), ("shard", 2**31, "shard"),
])
def test_decode_wrong_types_and_ranges(field, value, match):
    with pytest.raises(WireError, match=match):
        decode(packed(**{field: value}))


def test_decode_sizes_that_disagree():
    for changes, match in [
        (dict(n=4), "ids: expected 32 bytes"),
        (dict(n=2), "ids: expected 16 bytes"),
        (dict(dim=5), "rows: expected 15 bytes"),
        (dict(dtype="f16"), "rows: expected 24 bytes"),
        (dict(rows=b"\x00" * 13), "rows: expected 12 bytes"),
        (dict(scale=b"\x00" * 8), "scale: expected 12 bytes"),
        (dict(scale=DROP), "scale: required"),
        (dict(ids=b"\x00" * 25), "ids: expected 24 bytes"),
    ]:
        with pytest.raises(WireError, match=match):
            decode(packed(**changes))
    f32 = fields_of(make([1], [[1.0]]))
    f32["scale"] = b"\x00" * 4
    f32["crc"] = crc_of(f32)
    with pytest.raises(WireError, match="scale: only allowed for dtype i8"):
        decode(msgpack.packb(f32))


def test_decode_semantic_checks():
    with pytest.raises(WireError, match="not strictly ascending"):
        decode(packed(ids=np.array([1, 9, 5], "<i8").tobytes()))
    with pytest.raises(WireError, match="not strictly ascending"):
        decode(packed(ids=np.array([1, 5, 5], "<i8").tobytes()))
    with pytest.raises(WireError, match="scale: expected finite non-negative"):
        decode(packed(scale=np.array([1, -1, 1], "<f4").tobytes()))
    with pytest.raises(WireError, match="scale: expected finite non-negative"):
        decode(packed(scale=np.array([1, np.nan, 1], "<f4").tobytes()))
    with pytest.raises(WireError, match="no rows must carry tombstones"):
        decode(packed(n=0, ids=b"", rows=b"", scale=b"", **{"del": DROP}))
    with pytest.raises(WireError, match="no rows must carry tombstones"):
        decode(packed(n=0, ids=b"", rows=b"", scale=b"", **{"del": b""}))


def test_decode_crc_mismatch_and_version():
    with pytest.raises(WireError, match="crc: CRC-32C mismatch"):
        decode(packed(crc=crc_of(fields_of(BASE)) ^ 1))
    msg = fields_of(BASE)
    msg["rows"] = b"\x01" + msg["rows"][1:]  # payload changed, crc kept
    with pytest.raises(WireError, match="crc"):
        decode(msgpack.packb(msg))
    for v in (0, 2, 255):
        with pytest.raises(WireError, match="unsupported schema version"):
            decode(packed(v=v))


def test_decode_unknown_and_duplicate_fields():
    with pytest.raises(WireError, match="unknown fields.*extra"):
        decode(packed(make([1], [[1.0]]), extra=1))
    msg = fields_of(make([1], [[1.0]]))
    body = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in msg.items())
    dup = msgpack.packb("seq") + msgpack.packb(1)
    with pytest.raises(WireError, match="seq: duplicate field"):
        decode(b"\xde" + struct.pack(">H", len(msg) + 1) + body + dup)
    with pytest.raises(WireError, match="at most"):
        decode(b"\xde\x00\x11" + body + dup * 5)
    with pytest.raises(WireError, match="str key"):
        decode(msgpack.packb({1: 2}))


def test_decode_huge_claims_allocate_nothing():
    tracemalloc.start()
    try:
        for changes, match in [
            (dict(n=10**12), "n: expected"),
            (dict(n=wire.MAX_ROWS, dim=wire.MAX_DIM), "ids: expected"),
        ]:
            msg = packed(**changes)
            tracemalloc.reset_peak()
            with pytest.raises(WireError, match=match):
                decode(msg)
            assert tracemalloc.get_traced_memory()[1] < 1 << 20
        # a bin header claiming 4 GiB in a 40-byte message
        head = b"\x81" + msgpack.packb("ids") + b"\xc6\xff\xff\xff\xff" + b"\x00" * 30
        tracemalloc.reset_peak()
        with pytest.raises(WireError, match="truncated"):
            decode(head)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
        tracemalloc.reset_peak()
        with pytest.raises(WireError, match="at most"):
            decode(b"\xdf\xff\xff\xff\xff")
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_decode_trailing_garbage_and_truncation():
    msg = one(BASE)
    with pytest.raises(WireError, match="trailing bytes"):
        decode(msg + b"\x00")
    with pytest.raises(WireError, match="trailing bytes"):
        decode(msg + msg)
    for cut in (0, 1, 3, len(msg) // 2, len(msg) - 1):
        with pytest.raises(WireError):
            decode(msg[:cut])


@pytest.mark.parametrize("value,match", [
    (msgpack.ExtType(1, b"\x00" * 24), "type byte"),
    ([1, 5, 9], "type byte"),
    ({"a": 1}, "type byte"),
    (1.5, "type byte"),
])
def test_decode_refuses_ext_arrays_maps_floats(value, match):
    with pytest.raises(WireError, match=match):
        decode(packed(ids=value))


def test_decode_refuses_non_messages():
    fields = fields_of(BASE)
    for data, match in [
        (pickle.dumps(fields), "message"),
        (pickle.dumps(decode(one(BASE))), "message"),
        (msgpack.packb([fields]), "expected a msgpack map"),
        (msgpack.packb(fields, use_bin_type=False), "expected bin|invalid UTF-8"),
        (b"", "truncated"),
        (b"\xc1", "message"),
    ]:
        with pytest.raises(WireError, match=match):
            decode(data)
    with pytest.raises(WireError, match="invalid UTF-8"):
        decode(_with_raw_model(b"\xff\xfe"))
    for bad in ("text", None, 42, [1]):
        with pytest.raises(WireError, match="data: expected bytes"):
            decode(bad)
    with pytest.raises(WireError, match="contiguous"):
        decode(memoryview(one(BASE))[::2])


def _with_raw_model(raw: bytes) -> bytes:
    msg = fields_of(BASE)
    body = b"".join(msgpack.packb(k) + (b"\xd9" + bytes([len(raw)]) + raw if k == "model"
                                         else msgpack.packb(v)) for k, v in msg.items())
    return b"\xde" + struct.pack(">H", len(msg)) + body


def test_decode_accepts_bytearray_and_memoryview_zero_copy():
    msg = one(BASE)
    for data in (bytearray(msg), memoryview(msg)):
        assert_same(decode(data), decode(msg))
    d = decode(msg)
    assert not d.rows.flags.owndata  # a view into the message, no copy


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decode_random_bytes_only_raise_wire_error(data):
    try:
        decode(data)
    except WireError:
        pass


@pytest.mark.parametrize("dtype", ["f16", "f32"])
@pytest.mark.parametrize("n,tombs", [(0, 3), (1, None), (257, 5), (1000, None)])
def test_framer_bytes_equal_encode(dtype, n, tombs):
    """The publisher's in-place framer writes exactly what encode returns (one layout)."""
    rng = np.random.default_rng(n)
    batch = DeltaBatch(model="m", table="t", shard=3, epoch=2**40, seq=7, step=2**33, ts=5,
                       ids=np.sort(rng.choice(1 << 50, n, replace=False)).astype(np.int64),
                       rows=rng.standard_normal((n, 33)).astype(np.float32), dtype=dtype,
                       tombstones=None if tombs is None else np.arange(tombs, dtype=np.int64))
    framer = wire.Framer(1 << 20)
    for piece, msg in zip(split(batch, 16 << 10), encode(batch, max_message_bytes=16 << 10),
                          strict=True):
        assert bytes(framer.frame(piece)) == msg
    assert wire.Framer(64).frame(split(batch, 16 << 10)[0]) is None  # too small: refused


def test_public_checks_name_dtype_and_row_size():
    wire.check_name("model", "ranker")
    with pytest.raises(WireError, match="model: expected a non-empty str"):
        wire.check_name("model", "a/b")
    with pytest.raises(WireError, match="dtype: expected one of"):
        wire.check_dtype("f64")
    with pytest.raises(WireError, match="dtype: expected one of"):
        wire.row_bytes(8, "f64")
    assert wire.max_abs_finite(np.array([[1.0, -3.0], [np.inf, 2.0]])) == (3.0, False)
