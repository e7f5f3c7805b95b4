"""Wire dtype ``r1``: 1-bit residuals, *added* to what a predictor holds (wire v4 on).

One sign bit per element, packed 8 to a byte in little bit order (``ceil(dim / 8)`` bytes
a row, unused high bits zero), and one float16 scale per row, ``f16(mean |r|)`` computed in
float32; a predictor adds ``+scale`` where the bit is set (``r >= 0``), ``-scale`` where it
is not (``deltastream.wire_values``, ``docs/DESIGN.md`` "Residuals"). Hand-built messages
(tests.deltastream.wire_messages) check what the strict decoder refuses, with valid CRCs.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from deltastream import wire
from deltastream.wire import DecodedBatch, WireError, decode
from deltastream.wire_codec import bin_header
from deltastream.wire_values import residual_values
from tests.deltastream.wire_messages import (
    assert_same,
    fields_of,
    make,
    one,
    pack_fields,
    wire_fields,
)

DIMS = pytest.mark.parametrize("dim", [1, 7, 8, 13, 32, 64])


def _bits(a: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns: equal means equal bit for bit (-0.0 != 0.0)."""
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _residuals(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """Random float32 residuals ``[n, dim]`` with exact zeros and negative zeros in them and
    an all-zero first row."""
    rng = np.random.default_rng(seed + dim)
    r = rng.standard_normal((n, dim)).astype(np.float32)
    r[rng.random((n, dim)) < 0.15] = 0.0
    r[rng.random((n, dim)) < 0.1] = -0.0
    r[0] = 0.0
    return r


def _r1_fields(batch, version: int) -> dict:
    """The message of r1 ``batch`` as a plain dict of ``version``, built by hand: the header
    and ids of ``fields_of`` (the same batch as f32), the ``dtype``, sign bits and f16 scales
    of the real v4 encoding, in wire order."""
    base = fields_of(replace(batch, dtype="f32"), version)
    r1 = wire_fields(one(batch, version=4))
    msg = {k: v for k, v in base.items() if k not in ("rows", "del")}
    msg.update(dtype="r1", rows=r1["rows"], scale=r1["scale"])
    if "del" in base:
        msg["del"] = base["del"]
    return msg


# ----------------------------------------------------------------------------- round trip


@DIMS
def test_round_trip_signs_scales_and_values(dim):
    r = _residuals(9, dim)
    d = decode(one(make(np.arange(9) * 3, r, "r1"), version=4))
    assert isinstance(d, DecodedBatch) and d.dtype == "r1" and d.additive
    assert d.rows.dtype == np.int8 and d.rows.shape == (9, dim)
    assert d.scale.dtype == np.float32 and d.scale.shape == (9,)
    # a zero (also -0.0) residual element counts as non-negative: +scale
    want = np.where(r > 0, 1, -1)
    want[r == 0] = 1
    assert np.array_equal(d.rows, want)
    assert np.array_equal(d.scale, np.abs(r).mean(axis=1, dtype=np.float32).astype(np.float16))
    mean64 = np.abs(r.astype(np.float64)).mean(axis=1)  # float16 rounding: ≤ 2^-11 relative
    assert np.allclose(d.scale, mean64, rtol=2.0**-11 + 1e-6, atol=0)
    assert d.scale[0] == 0 and not np.signbit(d.scale[0])  # the all-zero row
    assert np.array_equal(d.scale > 0, (r != 0).any(axis=1))
    values = d.rows_f32()
    assert values.dtype == np.float32 and values.shape == (9, dim)
    assert np.array_equal(_bits(values), _bits(residual_values(r)))
    s = d.scale[:, None]
    assert np.array_equal(_bits(values), _bits(np.where(want > 0, s, -s)))
    assert not values[0].any() and not np.signbit(values[0]).any()
    assert d.nonfinite_rows() == 0


def test_bits_are_packed_little_bit_order_with_f16_scales():
    """The bytes of the rows and scale bins, written out by hand."""
    a = -np.ones(13, np.float32)
    a[0], a[9] = 2.0, 0.0                 # elements 0 and 9 >= 0; mean |a| = 13 / 13 = 1
    b = np.full(13, -0.0, np.float32)     # -0.0 >= 0: every bit set, scale 0
    c = np.full(13, 0.1, np.float32)      # 0.1 is not a float16: scale f16(0.1)
    fields = wire_fields(one(make([4, 5, 6], np.stack([a, b, c]), "r1"), version=4))
    assert fields["dtype"] == "r1"
    assert fields["rows"] == bytes([0x01, 0x02, 0xFF, 0x1F, 0xFF, 0x1F])
    assert fields["scale"] == np.array([1.0, 0.0, np.float16(0.1)], "<f2").tobytes()
    assert fields["scale"][:4] == b"\x00\x3c\x00\x00"  # 1.0 = 0x3c00 little-endian, then 0
    d = decode(one(make([4, 5, 6], np.stack([a, b, c]), "r1"), version=4))
    s = np.float32(np.float16(0.1))
    assert s != np.float32(0.1)
    assert np.array_equal(d.rows_f32()[0], np.where(np.arange(13) % 9 == 0, 1, -1))
    assert np.array_equal(_bits(d.rows_f32()[1]), _bits(np.zeros(13)))
    assert np.array_equal(d.rows_f32()[2], np.full(13, s, np.float32))


def test_round_trip_of_a_column_slice_and_of_tombstones_alone():
    r = _residuals(4, 5, seed=1)
    d = decode(one(make([1, 2, 3, 4], r, "r1", tombstones=np.array([9, 2]), col=3, width=20),
                   version=4))
    assert (d.col, d.width, d.dim, d.is_column_slice) == (3, 20, 5, True)
    assert d.tombstones.tolist() == [9, 2]
    assert np.array_equal(_bits(d.rows_f32()), _bits(residual_values(r)))
    only = decode(one(make(np.zeros(0, np.int64), np.zeros((0, 13), np.float32), "r1",
                           tombstones=np.array([7])), version=4))
    assert (only.dtype, only.n, only.dim, only.tombstones.tolist()) == ("r1", 0, 13, [7])
    assert only.rows.shape == (0, 13) and only.scale.shape == (0,)


# ----------------------------------------------------------------------------- sizes


@DIMS
def test_rows_bin_is_a_bit_per_element_and_scale_two_bytes_a_row(dim):
    n = 37
    r = _residuals(n, dim, seed=2)
    ids = np.arange(n) * 1000
    m_r1 = one(make(ids, r, "r1"), version=4)
    fields = wire_fields(m_r1)
    assert len(fields["rows"]) == n * -(-dim // 8)
    assert len(fields["scale"]) == 2 * n
    # against i8 (same fields, same dtype string length): only the rows (1 byte an
    # element) and scale (float32) bins and their v4 headers (the shortest that fit) differ
    m_i8 = one(make(ids, r, "i8"), version=4)

    def bins(rows: int, scale: int) -> int:
        return sum(len(bin_header(k, size, ints=True)) + size
                   for k, size in (("rows", rows), ("scale", scale)))

    assert len(m_i8) - len(m_r1) == bins(n * dim, 4 * n) - bins(n * -(-dim // 8), 2 * n)
    assert wire.row_bytes(dim, "r1") == 8 + -(-dim // 8) + 2


def test_row_bytes():
    assert wire.row_bytes(32, "r1") == 8 + 4 + 2
    assert wire.row_bytes(13, "r1") == 8 + 2 + 2
    assert wire.row_bytes(1, "r1") == 8 + 1 + 2
    assert wire.row_bytes(32, "i8") == 8 + 32 + 4  # unchanged
    with pytest.raises(WireError, match="dtype"):
        wire.row_bytes(32, "r2")


# ----------------------------------------------------------------------------- versions


@pytest.mark.parametrize("version", [1, 2, 3])
def test_encode_refuses_r1_before_v4(version):
    b = make([1, 2], np.ones((2, 8), np.float32), "r1")
    with pytest.raises(WireError, match=f"version: dtype r1 .*needs wire v4.*got v{version}"):
        wire.encode(b, version=version)
    assert decode(one(b, version=4)).dtype == "r1"
    # nor is a decoded r1 batch relayed into an older version
    with pytest.raises(WireError, match="version"):
        wire.encode(decode(one(b, version=4)), version=version)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_decode_refuses_r1_in_v1_to_v3(version):
    b = make([1, 5, 9], _residuals(3, 13, seed=3), "r1", tombstones=np.array([2, 3]))
    with pytest.raises(WireError, match=f"dtype: r1 .*not a dtype of wire v{version}"):
        decode(pack_fields(_r1_fields(b, version), version))
    # the same hand-built message as v4 decodes, to the batch encode makes
    assert_same(decode(pack_fields(_r1_fields(b, 4), 4)), decode(one(b, version=4)))


# ----------------------------------------------------------------------------- refusals


def test_decode_refuses_set_padding_bits():
    b = make([1, 5, 9], _residuals(3, 13, seed=4), "r1")
    fields = _r1_fields(b, 4)
    assert decode(pack_fields(fields, 4)).dim == 13
    for row in range(3):
        for bit in range(5, 8):  # dim 13: bits 5..7 of each row's second byte are padding
            rows = bytearray(fields["rows"])
            rows[2 * row + 1] |= 1 << bit
            with pytest.raises(WireError, match="rows: r1 padding bits past dim 13"):
                decode(pack_fields(dict(fields, rows=bytes(rows)), 4))
    # dim 16 has no padding: every bit pattern is a row
    full = _r1_fields(make([1], np.ones((1, 16), np.float32), "r1"), 4)
    d = decode(pack_fields(dict(full, rows=b"\x5a\xff"), 4))
    assert np.array_equal(d.rows[0], [-1, 1, -1, 1, 1, -1, 1, -1] + [1] * 8)


def test_decode_refuses_bad_scales_and_rows_sizes():
    b = make([1, 5, 9], _residuals(3, 13, seed=5), "r1")
    fields = _r1_fields(b, 4)
    for scale in (b"\x00" * 4, b"\x00" * 8, b"\x00" * 12):  # 2n - 2, 2n + 2, 4n (i8's size)
        with pytest.raises(WireError, match="scale: expected 6 bytes"):
            decode(pack_fields(dict(fields, scale=scale), 4))
    del fields["scale"]
    with pytest.raises(WireError, match="scale: required for dtype r1"):
        decode(pack_fields(fields, 4))
    fields = _r1_fields(b, 4)
    for bad in (-1.0, np.nan, np.inf):
        scale = np.array([1.0, bad, 1.0], "<f2").tobytes()
        with pytest.raises(WireError, match="scale: expected finite non-negative"):
            decode(pack_fields(dict(fields, scale=scale), 4))
    for rows in (b"\x00" * 39, b"\x00" * 5, b"\x00" * 7):  # unpacked n·dim; one byte off
        with pytest.raises(WireError, match="rows: expected 6 bytes"):
            decode(pack_fields(dict(fields, rows=rows), 4))
    assert decode(pack_fields(fields, 4)).n == 3
    with pytest.raises(WireError, match="scale: only allowed for dtype i8, r1 or r1e"):
        decode(pack_fields(dict(_r1_fields(b, 4), dtype="f32",
                                rows=np.ones((3, 13), "<f4").tobytes()), 4))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encode_refuses_non_finite_residuals(bad):
    r = np.ones((2, 4), np.float32)
    r[1, 2] = bad
    for call in (lambda: wire.encode(make([1, 2], r, "r1"), version=4),
                 lambda: residual_values(r)):
        with pytest.raises(WireError, match="rows: dtype r1 cannot carry non-finite"):
            call()


@pytest.mark.filterwarnings("error")  # a float32 sum that overflows: WireError only
def test_encode_refuses_a_mean_magnitude_past_f16():
    ok = np.array([[65504.0] * 4, [1e5, 0, 0, 0], [-65504.0, 65504, -65504, 65504]],
                  np.float32)
    d = decode(one(make([1, 2, 3], ok, "r1"), version=4))
    assert d.scale.tolist() == [65504.0, 24992.0, 65504.0]  # f16(25000): ulp 16, tie to even
    assert np.array_equal(d.rows_f32(), residual_values(ok))
    for big in ([7e4, 7e4, 7e4, 7e4], [65505.0 * 4, 0, 0, 0], [3e38, 3e38, 3e38, 3e38]):
        r = np.vstack([ok[:1], np.array([big], np.float32)])
        with pytest.raises(WireError, match="scale: a residual's mean magnitude exceeds"):
            wire.encode(make([1, 2], r, "r1"), version=4)
        with pytest.raises(WireError, match="scale: a residual's mean magnitude exceeds"):
            residual_values(r)


# ----------------------------------------------------------------------------- fresh


def test_fresh_bits_travel_packed_and_follow_their_rows():
    r = _residuals(11, 5, seed=9)
    ids = np.arange(11)[::-1] * 10  # descending: encode sorts ids, rows and fresh together
    fresh = np.zeros(11, bool)
    fresh[[0, 1, 10]] = True  # ids 100, 90 and 0: rows 10, 9 and 0 once sorted
    m = one(make(ids, r, "r1", fresh=fresh), version=4)
    assert wire_fields(m)["fresh"] == bytes([0x01, 0x06])  # ceil(11 / 8) bytes, little order
    d = decode(m)
    assert np.flatnonzero(d.fresh).tolist() == [0, 9, 10]
    assert np.array_equal(_bits(d.rows_f32()), _bits(residual_values(r[::-1])))
    assert wire.encode(d, version=4) == [m]  # a relay keeps them
    # no bit set: no field, the message of the batch without fresh
    plain = one(make(ids, r, "r1"), version=4)
    assert one(make(ids, r, "r1", fresh=np.zeros(11, bool)), version=4) == plain
    assert "fresh" not in wire_fields(plain) and decode(plain).fresh is None


def test_fresh_is_refused_when_malformed_or_not_r1():
    b = make(np.arange(11), _residuals(11, 5, seed=10), "r1", fresh=np.arange(11) % 4 == 0)
    fields = wire_fields(one(b, version=4))
    assert np.array_equal(decode(pack_fields(fields, 4)).fresh, np.arange(11) % 4 == 0)
    for bit in range(3, 8):  # n = 11: bits 3..7 of the second byte are padding
        bad = bytearray(fields["fresh"])
        bad[1] |= 1 << bit
        with pytest.raises(WireError, match="fresh: padding bits past n = 11"):
            decode(pack_fields(dict(fields, fresh=bytes(bad)), 4))
    for size in (1, 3, 11):
        with pytest.raises(WireError, match="fresh: expected 2 bytes"):
            decode(pack_fields(dict(fields, fresh=b"\x01" * size), 4))
    i8 = wire_fields(one(make(np.arange(11), _residuals(11, 5, seed=10), "i8"), version=4))
    with pytest.raises(WireError, match="fresh: only allowed for dtypes r1 and r1e, not i8"):
        decode(pack_fields(dict(i8, fresh=fields["fresh"]), 4))
    with pytest.raises(WireError, match="fresh: only residual batches"):
        wire.encode(replace(b, dtype="i8"), version=4)
    for bad in (np.ones(11, np.int8), np.ones(10, bool)):
        with pytest.raises(WireError, match="fresh: expected bool \\[11\\]"):
            wire.encode(replace(b, fresh=bad), version=4)


# ----------------------------------------------------------------------------- relays


@DIMS
def test_a_relay_re_encodes_byte_for_byte(dim):
    r = _residuals(40, dim, seed=6)
    ids = np.random.default_rng(dim).choice(1 << 40, 40, replace=False)
    for extra in ({}, {"tombstones": np.array([5, 1 << 50])}, {"col": 2, "width": dim + 9}):
        m = one(make(ids, r, "r1", **extra), version=4)
        assert wire.encode(decode(m), version=4) == [m]


def test_a_relay_may_split_a_decoded_r1_batch():
    r = _residuals(300, 13, seed=7)
    m = one(make(np.arange(300) * 7, r, "r1", tombstones=np.arange(20) + 10_000), version=4)
    parts = [decode(p) for p in wire.encode(decode(m), version=4, max_message_bytes=1024)]
    assert len(parts) > 3
    whole = decode(m)
    assert np.array_equal(np.concatenate([p.ids for p in parts]), whole.ids)
    assert np.array_equal(np.concatenate([p.rows for p in parts]), whole.rows)
    assert np.array_equal(np.concatenate([p.scale for p in parts]), whole.scale)
    assert np.array_equal(np.concatenate([p.tombstones for p in parts if p.tombstones is not None]),
                          whole.tombstones)


# ----------------------------------------------------------------------------- split


def test_a_big_r1_batch_splits_into_messages_that_each_decode():
    rng = np.random.default_rng(8)
    n, dim = 3000, 64
    ids = rng.choice(1 << 40, n, replace=False)  # unsorted: rows are permuted with them
    r = rng.standard_normal((n, dim)).astype(np.float32)
    tomb = np.arange(100) + (1 << 41)
    fresh = rng.random(n) < 0.1
    b = make(ids, r, "r1", tombstones=tomb, seq=40, fresh=fresh)
    msgs = wire.encode(b, version=4, max_message_bytes=4096)
    assert len(msgs) > 10
    assert all(len(m) <= 4096 for m in msgs)
    parts = [decode(m) for m in msgs]
    assert [p.seq for p in parts] == list(range(40, 40 + len(msgs)))
    assert all(p.dtype == "r1" and p.additive for p in parts)
    order = np.argsort(ids)
    assert np.array_equal(np.concatenate([p.ids for p in parts]), ids[order])
    got = np.concatenate([p.rows_f32() for p in parts if p.n])
    assert np.array_equal(np.concatenate([np.zeros(p.n, bool) if p.fresh is None else p.fresh
                                          for p in parts]), fresh[order])
    assert np.array_equal(_bits(got), _bits(residual_values(r[order])))
    assert np.array_equal(np.concatenate([p.tombstones for p in parts if p.tombstones is not None]),
                          tomb)
    # the split is by r1's row size (18 bytes for dim 64), not a full-row dtype's
    assert max(p.n for p in parts) > 4096 // wire.row_bytes(dim, "i8")


def test_r1_is_not_a_storage_or_full_row_dtype():
    assert "r1" not in wire.DTYPES and wire.RESIDUAL_DTYPES == {"r1": 1, "r1e": 1}
    assert wire.RESIDUAL_VERSION == 4
    assert make([1], [[1.0]], "r1").additive and not make([1], [[1.0]], "i8").additive
    assert not decode(one(make([1], [[1.0]], "i8"), version=4)).additive
    with pytest.raises(WireError, match="dtype"):
        residual_values(np.ones((1, 2), np.float32), "i8")
