"""Wire format: round trips and error bounds per dtype, interop with plain msgpack writers,
splitting, encode errors and the publisher's framer (strict decoding: test_wire_decode)."""

from __future__ import annotations

import struct
from dataclasses import replace

import crc32c
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from deltastream import wire
from deltastream.wire import DeltaBatch, WireError, decode, encode, split
from deltastream.wire_codec import FIELD_KEYS
from tests.deltastream.wire_messages import (
    BASE,
    assert_same,
    crc_v1,
    fields_of,
    make,
    one,
    pack_fields,
    packed,
)

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
I64 = np.iinfo(np.int64)
BF16_OVERFLOW = float(np.array(0x7F7F8000, dtype=np.uint32).view(np.float32))

# ----------------------------------------------------------------------------- helpers

names = st.text(st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="/"),
                min_size=1, max_size=40)


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
    ("dtype", "F16", "dtype"), ("col", -1, "col"), ("col", 2, "width"), ("width", 2, "width"),
    ("width", "3", "width"),
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


# ----------------------------------------------------------------------------- v2 layout


@pytest.mark.parametrize("dtype", sorted(wire.DTYPES))
def test_v2_message_ends_with_crc_trailer_over_every_byte_before_it(dtype):
    for b in (BASE, make([4, 2], np.ones((2, 3)), dtype=dtype),
              make([1], np.ones((1, 8)), dtype=dtype, col=8, width=24)):
        msg = one(b)
        assert msg[-9:-4] == b"\xa3crc\xce"
        assert int.from_bytes(msg[-4:], "big") == crc32c.crc32c(msg[:-9])
        assert msgpack.unpackb(msg)["v"] == 2
        assert list(msgpack.unpackb(msg))[-1] == "crc"


def test_column_slice_round_trip_and_defaults():
    whole = decode(one(make([1, 2], np.ones((2, 4)))))
    assert (whole.col, whole.width, whole.is_column_slice) == (0, 4, False)
    assert b"width" not in one(make([1, 2], np.ones((2, 4))))  # defaults are not written
    b = make([1, 2], np.arange(8.0).reshape(2, 4), col=12, width=32)
    assert b.is_column_slice
    d = decode(one(b))
    assert (d.col, d.width, d.dim, d.is_column_slice) == (12, 32, 4, True)
    np.testing.assert_array_equal(d.rows_f32(), b.rows)
    assert encode(d) == [one(b)]  # a relay re-encodes it byte for byte
    pieces = encode(make(np.arange(50), np.ones((50, 4)), col=4, width=8),
                    max_message_bytes=512)
    assert len(pieces) > 1 and {(decode(p).col, decode(p).width) for p in pieces} == {(4, 8)}
    # explicit defaults (another encoder may write them) decode as whole rows
    explicit = decode(packed(make([1], [[1.0, 2.0]]), col=0, width=2))
    assert (explicit.col, explicit.width, explicit.is_column_slice) == (0, 2, False)
    assert not make([1], [[1.0]], width=1).is_column_slice


@pytest.mark.parametrize("col,width,match", [
    (-1, 8, "col: expected 0 ≤ col"), (0, 3, r"width: expected col \+ dim = 0 \+ 4 ≤ width"),
    (5, 8, r"width: expected col \+ dim = 5 \+ 4"), (0, wire.MAX_DIM + 1, "width: expected"),
    (wire.MAX_DIM, wire.MAX_DIM, "col: expected"), (True, 8, "col: expected an int"),
    (0, "8", "width: expected an int"),
])
def test_bad_columns_are_refused_by_encode_and_decode(col, width, match):
    with pytest.raises(WireError, match=match):
        encode(make([1], np.ones((1, 4)), col=col, width=width))
    with pytest.raises(WireError, match=match):
        decode(packed(make([1], np.ones((1, 4))), col=col, width=width))


def test_v1_is_still_decoded_and_written_on_request():
    rng = np.random.default_rng(5)
    for dtype in sorted(wire.DTYPES):
        b = make(rng.permutation(20), rng.standard_normal((20, 6)), dtype=dtype,
                 tombstones=np.array([7, 8]))
        v1 = encode(b, version=1, max_message_bytes=400)
        v2 = encode(b, max_message_bytes=400)
        assert len(v1) == len(v2) > 1
        for m1, m2 in zip(v1, v2, strict=True):
            assert msgpack.unpackb(m1)["v"] == 1 and msgpack.unpackb(m2)["v"] == 2
            assert_same(decode(m1), decode(m2))
            assert msgpack.unpackb(m1)["crc"] == crc_v1(msgpack.unpackb(m1))
        assert encode(decode(v1[0]), max_message_bytes=400) == [v2[0]]  # relays upgrade
    with pytest.raises(WireError, match="v1 cannot carry a column slice"):
        encode(make([1], np.ones((1, 2)), col=2, width=4), version=1)
    for bad in (0, 6, True, "2"):
        with pytest.raises(WireError, match="version: expected one of"):
            encode(BASE, version=bad)


@pytest.mark.parametrize("version", [1, 2, 4])
def test_plain_msgpack_dict_decodes_like_ours(version):
    ours = decode(one(BASE))
    assert_same(decode(packed(version=version)), ours)
    # key order and int widths are free in msgpack (in v2 except the crc trailer): reverse
    # the map, widen every int
    msg = fields_of(BASE, version)
    if version == 1:
        msg["crc"] = crc_v1(msg)
    keys = FIELD_KEYS if version == 4 else {}
    body = b"".join(msgpack.packb(keys.get(k, k))
                    + (b"\xcf" + struct.pack(">Q", v) if isinstance(v, int)
                       else msgpack.packb(v))
                    for k, v in reversed(list(msg.items())))
    data = b"\xdf" + struct.pack(">I", len(msg) + (version != 1)) + body
    if version != 1:
        data += msgpack.packb(keys.get("crc", "crc")) + b"\xce" \
            + struct.pack(">I", crc32c.crc32c(data))
    assert_same(decode(data), ours)


@SETTINGS
@given(batches(max_n=20), st.sampled_from([1, 2, 4]))
def test_plain_msgpack_interop_property(batch, version):
    assert_same(decode(pack_fields(fields_of(batch, version), version)), decode(one(batch)))


# ----------------------------------------------------------------------------- framer


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
    for b in (batch, replace(batch, col=33, width=99)):
        for piece, msg in zip(split(b, 16 << 10), encode(b, max_message_bytes=16 << 10),
                              strict=True):
            assert bytes(framer.frame(piece)) == msg
    # too small: refused; the smallest buffer that fits holds the message up to its trailer
    piece, msg = split(batch, 16 << 10)[0], encode(batch, max_message_bytes=16 << 10)[0]
    assert wire.Framer(64).frame(piece) is None
    fits = [c for c in range(len(msg) - 9, len(msg) + 64) if wire.Framer(c).frame(piece)]
    assert fits and fits[0] >= len(msg)
    assert bytes(wire.Framer(fits[0]).frame(piece)) == msg


def test_public_checks_name_dtype_and_row_size():
    wire.check_name("model", "ranker")
    with pytest.raises(WireError, match="model: expected a non-empty str"):
        wire.check_name("model", "a/b")
    with pytest.raises(WireError, match="dtype: expected one of"):
        wire.check_dtype("f64")
    with pytest.raises(WireError, match="dtype: expected one of"):
        wire.row_bytes(8, "f64")
    assert wire.max_abs_finite(np.array([[1.0, -3.0], [np.inf, 2.0]])) == (3.0, False)
