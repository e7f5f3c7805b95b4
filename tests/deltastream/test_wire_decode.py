"""Wire decoding trusts nothing: every field is type-, range- and size-checked, the CRC
must match (v2: over every byte before its trailer; v1: over the bins), and anything else
is a WireError naming the field. Messages are built by hand (tests.deltastream.wire_messages)
as another encoder would write them; most checks run on both versions."""

from __future__ import annotations

import pickle
import struct
import tracemalloc

import crc32c
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastream import wire
from deltastream.wire import WireError, decode
from deltastream.wire_codec import FIELD_KEYS, INT_KEYS_VERSION
from tests.deltastream.wire_messages import (
    BASE,
    DROP,
    assert_same,
    crc_v1,
    fields_of,
    make,
    one,
    pack_fields,
    packed,
)

VERSIONS = pytest.mark.parametrize("version", [1, 2, 4])


@VERSIONS
@pytest.mark.parametrize("key", sorted(wire._REQUIRED))
def test_decode_missing_field(key, version):
    with pytest.raises(WireError, match=f"missing fields.*{key}"):
        decode(packed(version=version, **{key: DROP}))


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
    ("del", b"\x00" * 7, "del"), ("shard", 2**31, "shard"), ("crc", -1, "crc"),
    ("crc", True, "crc"), ("crc", None, "crc"),
])
@VERSIONS
def test_decode_wrong_types_and_ranges(field, value, match, version):
    with pytest.raises(WireError, match=match):
        decode(packed(version=version, **{field: value}))


@VERSIONS
def test_decode_sizes_that_disagree(version):
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
            decode(packed(version=version, **changes))
    with pytest.raises(WireError, match="scale: only allowed for dtype i8"):
        decode(packed(make([1], [[1.0]]), version=version, scale=b"\x00" * 4))


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


def _key(name: str, version: int):
    """A field's key in a message of ``version`` (its name, or from v4 its int)."""
    return FIELD_KEYS[name] if version >= INT_KEYS_VERSION else name


@VERSIONS
def test_decode_crc_mismatch_and_version(version):
    good = packed(version=version)
    crc = msgpack.unpackb(good, strict_map_key=False)[_key("crc", version)]
    with pytest.raises(WireError, match="crc: CRC-32C mismatch"):
        decode(packed(version=version, crc=crc ^ 1))
    msg = fields_of(BASE, version)
    msg["rows"] = b"\x01" + msg["rows"][1:]  # payload changed, crc kept
    with pytest.raises(WireError, match="crc: CRC-32C mismatch"):
        decode(pack_fields(msg, version, crc=crc))
    for v in (0, 6, 255):
        with pytest.raises(WireError, match="unsupported schema version (0|6|255)"):
            decode(packed(version=version, v=v))
    other, keyed = (3, "int") if version >= INT_KEYS_VERSION else (4, "name")
    with pytest.raises(WireError, match=f"v: wire v{other} keys its fields by .*, this "
                                        f"message by {keyed}"):
        decode(packed(version=version, v=other))


def test_v2_crc_covers_every_field_v1_only_the_bins():
    """A changed header field under an unchanged CRC: v2 refuses it, v1 cannot tell."""
    for field, value in [("model", "n"), ("table", "u"), ("shard", 4), ("epoch", 12),
                         ("seq", 6), ("step", 8), ("ts", 1235)]:
        for version in (1, 2):
            crc = msgpack.unpackb(packed(version=version))["crc"]
            forged = packed(version=version, crc=crc, **{field: value})
            if version == 2:
                with pytest.raises(WireError, match="crc: CRC-32C mismatch"):
                    decode(forged)
            else:
                assert getattr(decode(forged), field) == value


def test_v2_crc_must_be_the_uint32_trailer():
    msg = fields_of(BASE)
    data = pack_fields(msg)
    crc = int.from_bytes(data[-4:], "big")
    trailer_free = data[:-9]
    # the same CRC as a uint64 / a uint8-sized value as fixint: not the 9-byte trailer
    for tail in (b"\xa3crc\xcf" + crc.to_bytes(8, "big"),
                 b"\xa3crc\xd3" + crc.to_bytes(8, "big")):
        with pytest.raises(WireError, match="crc"):
            decode(trailer_free + tail)
    # a small CRC still takes 5 bytes (0xce 00 00 00 05): wrong here, but framed right
    with pytest.raises(WireError, match="CRC-32C mismatch"):
        decode(packed(make([1], [[1.0]]), crc=5))
    with pytest.raises(WireError, match="crc: a v2 message must end"):
        decode(trailer_free + b"\xa3crc\x05")  # fixint
    # crc first, then the other fields: refused even with the right CRC of what follows
    packer = msgpack.Packer()
    body = b"".join(packer.pack(k) + packer.pack(v) for k, v in msg.items())
    head = packer.pack_map_header(len(msg) + 1)
    for first in (head + b"\xa3crc\xce" + crc32c.crc32c(head + body).to_bytes(4, "big") + body,
                  head + packer.pack("crc") + packer.pack(crc32c.crc32c(body)) + body):
        with pytest.raises(WireError, match="crc: a v2 message must end with the crc field"):
            decode(first)


def test_v1_refuses_column_fields():
    for field in ("col", "width"):
        with pytest.raises(WireError, match=f"{field}: not a field of wire v1"):
            decode(packed(make([1], [[1.0]]), version=1, **{field: 0}))


@VERSIONS
def test_decode_unknown_and_duplicate_fields(version):
    if version >= INT_KEYS_VERSION:  # an unknown field is an int that names no field
        extra = fields_of(make([1], [[1.0]]), version)
        extra[99] = 1
        with pytest.raises(WireError, match=r"key 13: unknown field number 99"):
            decode(pack_fields(extra, version))
        with pytest.raises(WireError, match="key 13: expected an int key like the map's "
                                            "first, got str"):
            decode(packed(make([1], [[1.0]]), version=version, extra=1))
    else:
        with pytest.raises(WireError, match="unknown fields.*extra"):
            decode(packed(make([1], [[1.0]]), version=version, extra=1))
    msg = fields_of(make([1], [[1.0]]), version)
    msg["crc"] = crc_v1(msg)
    body = b"".join(msgpack.packb(_key(k, version)) + msgpack.packb(v) for k, v in msg.items())
    dup = msgpack.packb(_key("seq", version)) + msgpack.packb(1)
    with pytest.raises(WireError, match="seq: duplicate field"):
        decode(b"\xde" + struct.pack(">H", len(msg) + 1) + body + dup)
    too_many = len(wire._REQUIRED | wire._OPTIONAL) + 1
    with pytest.raises(WireError, match="at most"):
        decode(b"\xde" + struct.pack(">H", too_many) + body + dup * 5)
    with pytest.raises(WireError, match="key 0: expected a str key, got NoneType"):
        decode(msgpack.packb({None: 2}))
    with pytest.raises(WireError, match="key 0: unknown field number 99"):
        decode(msgpack.packb({99: 2}))  # int keys are v4's, and 99 is none of them


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
    fields = fields_of(BASE, 1)
    fields["crc"] = crc_v1(fields)
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
    for data in (bytearray(packed(version=1)), memoryview(packed(version=1))):
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



def test_decode_returns_the_validated_batch_type():
    """decode's result is a DecodedBatch (what consumers trust without checking again); a
    batch built by hand is a plain DeltaBatch; no private flag tells them apart."""
    built = wire.DeltaBatch("m", "t", 0, 0, 0, 0, 0, ids=np.array([3, 1]),
                            rows=np.ones((2, 2), np.float32), dtype="f16")
    got = decode(wire.encode(built)[0])
    assert isinstance(got, wire.DecodedBatch) and not isinstance(built, wire.DecodedBatch)
    assert got.ids.tolist() == [1, 3] and got.width == 2 and got.rows.dtype == np.float16
    assert not any(f.startswith("_") for f in wire.DeltaBatch.__dataclass_fields__)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_decoded_batch_counts_non_finite_rows_on_its_wire_form(dtype):
    rows = np.array([[1, 2], [np.inf, 0], [0, np.nan]], np.float32)
    # the encoder refuses non-finite rows; build the wire form as a foreign encoder might
    wire_rows = {"f32": rows, "f16": rows.astype(np.float16),
                 "bf16": (rows.view(np.uint32) >> 16).astype(np.uint16)}[dtype]
    b = wire.DecodedBatch("m", "t", 0, 0, 0, 0, 0, ids=np.array([1, 2, 3]), rows=wire_rows,
                          dtype=dtype)
    assert b.nonfinite_rows() == 2
    assert wire.DecodedBatch("m", "t", 0, 0, 0, 0, 0, ids=np.array([1]),
                             rows=wire_rows[:1], dtype=dtype).nonfinite_rows() == 0
