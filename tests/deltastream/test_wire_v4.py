"""Wire v4: v3 with every key a one-byte msgpack int (``wire_codec.FIELD_KEYS``).

v4 decodes alongside v1–v3, carries the same rows as v3, is shorter by exactly the key
bytes and its shortest map and bin headers, and its strict decoder names what is wrong (the decode-error suite of
``test_wire_decode.py`` runs on v4 too).
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from deltastream import wire
from deltastream.wire import WireError, decode
from deltastream.wire_codec import FIELD_KEYS, Framer
from tests.deltastream.wire_messages import assert_same, make, one


def _v4_saving(message: bytes) -> int:
    """What v4 saves on a v3 ``message``: each key's msgpack str bytes minus the one byte
    of its int, 2 bytes of a fixmap header up to 15 fields, and each bin's bin32 header
    (5 bytes) minus the shortest that fits (bin8: 2, bin16: 3)."""
    fields = msgpack.unpackb(message)
    bins = [len(v) for v in fields.values() if isinstance(v, bytes)]
    return (sum(len(msgpack.packb(k)) - 1 for k in fields) + 2 * (len(fields) <= 15)
            + sum(5 - (2 if size < 256 else 3 if size < 65536 else 5) for size in bins))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i8"])
@pytest.mark.parametrize("col", [None, 2])
def test_v4_carries_v3s_rows_shorter_by_the_key_and_header_bytes(dtype, col):
    rng = np.random.default_rng(7)
    ids = np.sort(rng.choice(5000, 40, replace=False))
    extra = {} if col is None else {"col": col, "width": 9}
    b = make(ids, rng.standard_normal((40, 4)).astype(np.float32), dtype,
             tombstones=np.array([3, 77]), **extra)
    v3, v4 = one(b, version=3), one(b, version=4)
    assert len(v3) - len(v4) == _v4_saving(v3) > 40
    assert_same(decode(v3), decode(v4))
    assert one(decode(v4), version=4) == v4  # a relay re-encodes a decoded v4 batch


def test_the_framers_rows_stay_64_byte_aligned_with_v4s_shorter_headers():
    """The framer's bytes equal encode's in v4 too (``test_wire_v3``'s framer test runs on
    both versions); here: the rows still start 64-byte aligned in its buffer."""
    for ids in ([5, 6, 900], [-(1 << 63), 0, (1 << 63) - 1]):
        b = make(np.array(ids), np.arange(3 * 5, dtype=np.float32).reshape(3, 5), "f16",
                 tombstones=np.array([1, 2]))
        framer = Framer(1 << 16, version=4)
        framed = framer.frame(wire.split(b)[0])
        rows_at = bytes(framed).index(bytes([FIELD_KEYS["rows"], 0xC4, 30])) + 3  # bin8
        start = np.frombuffer(framed, np.uint8).ctypes.data \
            - np.frombuffer(framer.buf, np.uint8).ctypes.data
        assert (start + rows_at) % 64 == 0


def test_every_key_is_one_byte_and_the_crc_trailer_is_the_last_field():
    m = one(make([1, 2], np.ones((2, 3), np.float32), tombstones=np.array([9])), version=4)
    fields = msgpack.unpackb(m, strict_map_key=False)
    assert all(type(k) is int and 0 <= k < 128 for k in fields)
    assert fields[FIELD_KEYS["v"]] == 4 and list(fields)[-1] == FIELD_KEYS["crc"]
    assert m[-6:-4] == bytes([FIELD_KEYS["crc"], 0xCE])


def test_v4_crc_covers_every_byte():
    m = one(make([1, 2, 3], np.ones((3, 2), np.float32)), version=4)
    for at in range(3, len(m) - 6):  # every byte after the map header, before the trailer
        bad = bytearray(m)
        bad[at] ^= 0x01
        with pytest.raises(WireError):
            decode(bytes(bad))


def test_old_versions_still_decode_next_to_v4_and_v2_stays_the_default():
    b = make([1, 2, 3], np.ones((3, 2), np.float32))
    assert msgpack.unpackb(one(b))["v"] == wire.VERSION == 2
    for version in (1, 2, 3, 4):
        assert_same(decode(one(b, version=version)), decode(one(b)))
