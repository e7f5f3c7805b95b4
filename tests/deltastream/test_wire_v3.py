"""Wire v3: ids as sorted varint gaps (``idv``) when that is shorter than 8 bytes an id.

v3 decodes alongside v1 and v2, carries the same rows (ids and wire values identical to
v2's), is never longer than v2, and its decoder refuses any malformed ``idv`` by name.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastream import wire
from deltastream.wire import WireError, decode, encode
from deltastream.wire_codec import Framer, read_varint_ids, varint_ids
from tests.deltastream.wire_messages import BASE, DROP, assert_same, make, one, packed

_INT64 = st.integers(-(1 << 63), (1 << 63) - 1)


def _ids(values) -> np.ndarray:
    return np.array(sorted(set(values)), dtype=np.int64)


@settings(max_examples=200, deadline=None)
@given(st.lists(_INT64, max_size=40))
def test_varint_ids_round_trip_any_int64_ids(values):
    ids = _ids(values)
    packed_ids = varint_ids(ids)
    back = read_varint_ids(memoryview(packed_ids.tobytes()), ids.size)
    assert back.dtype == np.int64
    np.testing.assert_array_equal(back, ids)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40), st.integers(0, 12))
def test_any_bytes_read_as_varint_ids_are_refused_or_their_one_encoding(data, n):
    """Arbitrary bytes: a WireError naming idv, or ids whose encoding is exactly those bytes
    (one id set, one byte string: the form is canonical)."""
    try:
        ids = read_varint_ids(memoryview(data), n)
    except WireError as e:
        assert str(e).startswith("idv: ")
    else:
        assert ids.size == n and bool(np.all(np.diff(ids) > 0))
        assert varint_ids(ids).tobytes() == data


def test_varint_ids_cost_what_leb128_of_the_gaps_costs():
    # zigzag(3) = 6 (1 byte), gaps 1 (1), 127 (1), 128 (2), 2^14 (3)
    ids = np.cumsum([3, 1, 127, 128, 1 << 14]).astype(np.int64)
    assert varint_ids(ids).size == 1 + 1 + 1 + 2 + 3
    # the extremes of int64: zigzag(-2^63) = 2^64 - 1 and a gap of 2^64 - 1, 10 bytes each
    ext = np.array([-(1 << 63), (1 << 63) - 1], np.int64)
    assert varint_ids(ext).size == 20
    assert wire.id_bytes(ext[::-1], 3) == 16 and wire.id_bytes(ids, 2) == 8 * ids.size


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i8"])
def test_v3_carries_the_same_rows_as_v2_in_fewer_bytes(dtype):
    rng = np.random.default_rng(3)
    ids = np.sort(rng.choice(5000, 300, replace=False))
    b = make(ids, rng.standard_normal((300, 4)).astype(np.float32), dtype,
             tombstones=np.array([7, 9001]))
    v2, v3 = one(b), one(b, version=3)
    assert msgpack.unpackb(v3)["v"] == 3 and "idv" in msgpack.unpackb(v3)
    assert "ids" not in msgpack.unpackb(v3)
    assert len(v2) - len(v3) == 8 * ids.size - wire.id_bytes(ids, 3) > 0
    d2, d3 = decode(v2), decode(v3)
    assert_same(d2, d3)
    # a relay re-encodes a decoded v3 batch byte for byte
    assert one(d3, version=3) == v3


def test_v3_keeps_raw_ids_when_varints_would_cost_more():
    """Hashed ids (spread over int64) take ~9 varint bytes each: v3 then sends them as v2
    does, 8 bytes each, so v3 is never longer than v2."""
    rng = np.random.default_rng(4)
    ids = np.unique(rng.integers(-(1 << 63), (1 << 63) - 1, 200, dtype=np.int64))
    b = make(ids, np.ones((ids.size, 2), np.float32))
    v3 = one(b, version=3)
    fields = msgpack.unpackb(v3)
    assert "ids" in fields and "idv" not in fields and fields["v"] == 3
    assert len(v3) == len(one(b))
    np.testing.assert_array_equal(decode(v3).ids, ids)


@pytest.mark.parametrize("version", [3, 4])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("ids", [[5, 6, 900], [-(1 << 63), 0, (1 << 63) - 1]])
def test_framer_writes_the_bytes_encode_writes_in_v3(dtype, ids, version):
    b = make(np.array(ids), np.arange(3 * 5, dtype=np.float32).reshape(3, 5), dtype,
             tombstones=np.array([1, 2]))
    (piece,) = wire.split(b)
    assert bytes(Framer(1 << 16, version=version).frame(piece)) == one(b, version=version)


def test_old_messages_still_decode_and_v2_is_the_default():
    b = make([1, 2, 3], np.ones((3, 2), np.float32))
    assert msgpack.unpackb(one(b))["v"] == wire.VERSION == 2
    for version in (1, 2, 3):
        assert_same(decode(one(b, version=version)), decode(one(b)))


def _v3(**changes) -> bytes:
    """BASE as a hand-packed v3 message with ``idv`` instead of ``ids`` (then ``changes``)."""
    fields = {"ids": DROP, "idv": varint_ids(BASE.ids).tobytes()}
    fields.update(changes)
    return packed(version=3, **fields)


def test_hand_packed_v3_decodes():
    assert_same(decode(_v3()), decode(one(BASE)))


@pytest.mark.parametrize("changes, match", [
    ({"ids": BASE.ids.astype("<i8").tobytes()}, "exactly one of ids and idv, got both"),
    ({"idv": DROP}, "exactly one of ids and idv, got neither"),
    ({"idv": "abc"}, "idv: expected bin"),
    ({"idv": b"\x02\x04"}, r"idv: expected exactly n = 3 varints"),
    ({"idv": b"\x02\x04\x04\x04"}, r"idv: expected exactly n = 3 varints"),
    ({"idv": b"\x02\x04\x84"}, r"idv: expected exactly n = 3 varints"),  # cut mid-varint
    ({"idv": b"\x02\x84\x00\x04"}, "idv: a varint is not in its shortest form"),
    ({"idv": b"\x02" + b"\xff" * 9 + b"\x02" + b"\x04"}, "idv: a varint exceeds 64 bits"),
    ({"idv": b"\x02" + b"\xff" * 10 + b"\x01" + b"\x04"}, "idv: a varint exceeds 64 bits"),
    ({"idv": b"\x02\x04\x00"}, "idv: ids not strictly ascending"),  # a zero gap
    # 2^63 - 2, then a gap of 2: one past int64's largest id
    ({"idv": varint_ids(np.array([(1 << 63) - 2], np.int64)).tobytes() + b"\x02\x01"},
     "idv: ids not strictly ascending"),
    ({"idv": b"\x00" * 25}, "idv: expected bin of at most 8 n = 24 bytes"),
])
def test_v3_decoder_names_a_bad_idv(changes, match):
    with pytest.raises(WireError, match=match):
        decode(_v3(**changes))


def test_idv_is_refused_before_v3_and_covered_by_the_crc():
    with pytest.raises(WireError, match="idv: not a field of wire v2"):
        decode(packed(version=2, ids=DROP, idv=varint_ids(BASE.ids).tobytes()))
    msg = bytearray(one(BASE, version=3))
    at = bytes(msg).index(b"\xa3idv") + 4 + 5  # the first varint byte after its bin32 header
    msg[at] ^= 0x02  # still a valid varint stream: caught by the CRC, not by the parser
    with pytest.raises(WireError, match="crc: CRC-32C mismatch"):
        decode(bytes(msg))


def test_encode_splits_v3_within_the_limit_and_refuses_unknown_versions():
    b = make(np.arange(0, 400, 2), np.ones((200, 8), np.float32), "f16", seq=0)
    msgs = encode(b, version=3, max_message_bytes=1000)
    assert len(msgs) > 1 and max(map(len, msgs)) <= 1000
    assert [decode(m).seq for m in msgs] == list(range(len(msgs)))
    np.testing.assert_array_equal(np.concatenate([decode(m).ids for m in msgs]), b.ids)
    with pytest.raises(WireError, match="version: expected one of"):
        encode(b, version=6)
