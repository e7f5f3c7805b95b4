"""Wire dtype ``r1e`` (wire v5): ``r1``'s 1-bit residuals in fewer bytes.

The sign bits are packed over the whole message (element ``j`` of row ``i`` is bit
``i · dim + j``) and each row's scale is one byte, a code on a grid of sixteenth octaves
above the message's base exponent (the scale bin's first byte, an int8): a dim-32 row adds
5 bytes to a message, a dim-1 row 1.125 (``deltastream.wire_values``). Hand-built messages
check what the strict decoder refuses, with valid CRCs.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from consumers.serving.table import ServingTable
from deltastream import wire
from deltastream.wire import WireError, decode
from deltastream.wire_values import pack_scale_codes, residual_values, scale_from_codes
from tests.deltastream.wire_messages import fields_of, make, one, pack_fields, wire_fields

DIMS = pytest.mark.parametrize("dim", [1, 3, 8, 13, 32])


def _residuals(n: int, dim: int, seed: int = 0, octaves: float = 12.0) -> np.ndarray:
    """float32 residuals ``[n, dim]`` whose rows' magnitudes span ``octaves`` octaves, with
    exact (and negative) zeros in them."""
    rng = np.random.default_rng(seed + dim)
    r = rng.standard_normal((n, dim)) * np.exp2(rng.uniform(-octaves, 0, (n, 1)))
    r = r.astype(np.float32)
    r[rng.random((n, dim)) < 0.1] = -0.0
    return r


@DIMS
def test_round_trip_values_and_scale_within_a_32nd_octave(dim):
    r = _residuals(40, dim)
    d = decode(one(make(np.arange(40) * 5, r, "r1e"), version=5))
    assert d.dtype == "r1e" and d.additive and d.rows.dtype == np.int8
    got = d.rows_f32()
    # what predictors add is what the trainer's mirror computes, bit for bit
    assert np.array_equal(got.view(np.uint32), residual_values(r, "r1e").view(np.uint32))
    assert np.array_equal(d.rows, np.where(r >= 0, 1, -1))  # -0.0 counts as >= 0
    mean = np.abs(r).mean(1)
    coded = d.scale > 0  # the others are 14+ octaves below the largest (next test)
    assert np.all(mean[~coded] < mean.max() * 2.0 ** -14) and coded.sum() >= 36
    assert np.all(np.abs(d.scale[coded] / mean[coded] - 1) <= 2 ** (1 / 32) - 1 + 1e-6)


def test_rows_far_below_the_largest_go_as_zero():
    """Scales more than 14–15 octaves below the message's largest are not coded: the row
    adds nothing (what it misses stays with the trainer's error feedback)."""
    r = np.array([[1.0, -1.0], [2.0 ** -16, 2.0 ** -16], [2.0 ** -10, 0.0]], np.float32)
    d = decode(one(make([1, 2, 3], r, "r1e"), version=5))
    assert d.scale[1] == 0 and np.all(d.rows_f32()[1] == 0)
    assert d.scale[0] == 1.0 and d.scale[2] == np.float32(2.0 ** -11)  # on the grid: exact


@DIMS
def test_bits_are_shared_across_rows_and_the_scale_is_a_byte_a_row(dim):
    n = 11
    m = one(make(np.arange(n), _residuals(n, dim, seed=1), "r1e"), version=5)
    f = wire_fields(m)
    assert len(f["rows"]) == -(-n * dim // 8) and len(f["scale"]) == n + 1
    # element j of row i is bit i·dim + j, little bit order
    bits = np.unpackbits(np.frombuffer(f["rows"], np.uint8), bitorder="little")[:n * dim]
    assert np.array_equal(bits.reshape(n, dim), decode(m).rows > 0)
    assert wire.value_bytes(32, "r1e") == 5 and wire.value_bytes(1, "r1e") == 1.125
    assert wire.value_bytes(32, "r1") == 6 and wire.value_bytes(1, "f16") == 2
    # 32 dim-1 rows: 4 bytes of signs, 33 of scale, against r1's 32 + 64 (and the name
    # "r1e" is a byte longer)
    ones = make(np.arange(32), _residuals(32, 1), "r1e")
    r1 = one(replace(ones, dtype="r1"), version=5)
    assert len(r1) - len(one(ones, version=5)) == 96 - 37 - 1


def test_the_scale_grid_is_the_same_on_every_platform():
    """Scales are a written-out float32 table of 2^(k/16) times exact powers of two."""
    codes = np.arange(256, dtype=np.uint8)
    for base in (-100, -20, 0, 100):  # normal float32 range: 2^(k/16) rounded, scaled
        s = scale_from_codes(np.concatenate([np.array([base], np.int8).view(np.uint8),
                                             codes]))
        want = np.where(codes == 0, 0.0, np.exp2(base + (codes.astype(np.float64) - 1) / 16))
        assert np.array_equal(s, want.astype(np.float32))
    tiny = scale_from_codes(np.concatenate([np.array([-128], np.int8).view(np.uint8), codes]))
    assert tiny[0] == 0 and np.all(np.diff(tiny) > 0)  # subnormal too: ordered, finite


@DIMS
def test_a_relay_re_encodes_byte_for_byte(dim):
    rng = np.random.default_rng(dim)
    for extra in ({}, {"tombstones": np.array([999, 1000])},
                  {"fresh": rng.random(17) < 0.3}, {"col": 2, "width": dim + 5}):
        m = one(make(np.arange(17) * 3, _residuals(17, dim, seed=2), "r1e", **extra),
                version=5)
        assert wire.encode(decode(m), version=5) == [m]
    with pytest.raises(WireError, match="on its grid"):
        pack_scale_codes(np.array([1.0, 1.01], np.float32))


def test_a_big_batch_splits_and_every_piece_decodes_to_its_rows():
    r = _residuals(3000, 32, seed=3)
    fresh = np.arange(3000) % 7 == 0
    msgs = wire.encode(make(np.arange(3000) * 2, r, "r1e", fresh=fresh, seq=9), version=5,
                       max_message_bytes=4096)
    parts = [decode(m) for m in msgs]
    assert len(parts) > 1 and [p.seq for p in parts] == list(range(9, 9 + len(parts)))
    assert all(len(m) <= 4096 for m in msgs)
    assert np.array_equal(np.concatenate([p.ids for p in parts]), np.arange(3000) * 2)
    assert np.array_equal(np.concatenate([p.fresh for p in parts]), fresh)
    # each piece is coded on its own base: values match encoding the piece's rows alone
    k = 0
    for p in parts:
        assert np.array_equal(p.rows_f32(), residual_values(r[k:k + p.n], "r1e"))
        k += p.n


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_r1e_needs_wire_v5(version):
    b = make([1, 2], np.ones((2, 8), np.float32), "r1e")
    with pytest.raises(WireError, match="needs wire v5"):
        wire.encode(b, version=version)
    if version >= 4:  # a v4 message claiming r1e is refused by name
        msg = fields_of(replace(b, dtype="f32"), version)
        f = wire_fields(one(b, version=5))
        msg.update(dtype="r1e", rows=f["rows"], scale=f["scale"])
        with pytest.raises(WireError, match=r"dtype: r1e .* not a dtype of wire v4"):
            decode(pack_fields(msg, version))


def test_v5_still_carries_every_other_dtype():
    for dtype in ("f32", "f16", "bf16", "i8", "r1"):
        b = make([3, 9], np.array([[0.5, -1.0], [2.0, 0.25]], np.float32), dtype)
        d = decode(one(b, version=5))
        assert d.dtype == dtype and np.array_equal(d.rows_f32(), decode(one(b, version=4))
                                                   .rows_f32())


def test_decode_refuses_bad_bins_naming_them():
    b = make([1, 5, 9], _residuals(3, 5, seed=4), "r1e")
    f = wire_fields(one(b, version=5))

    def packed(**changes) -> bytes:
        msg = fields_of(replace(b, dtype="f32"), 5)
        msg.update(dtype="r1e", rows=f["rows"], scale=f["scale"])
        msg.update(changes)
        return pack_fields(msg, 5)

    assert decode(packed()).dtype == "r1e"
    pad = bytearray(f["rows"])
    pad[-1] |= 0x80  # bit 15 of 16: past n · dim = 15
    with pytest.raises(WireError, match="rows: r1e padding bits past n · dim = 15"):
        decode(packed(rows=bytes(pad)))
    with pytest.raises(WireError, match="rows: expected 2 bytes"):
        decode(packed(rows=f["rows"] + b"\0"))
    with pytest.raises(WireError, match="scale: expected 4 bytes"):
        decode(packed(scale=f["scale"][:3]))
    with pytest.raises(WireError, match="scale: expected finite"):  # 2^(127 + 15.9)
        decode(packed(scale=bytes([127, 255, 1, 1])))


def test_non_finite_residuals_are_refused():
    r = np.ones((2, 4), np.float32)
    r[1, 2] = np.nan
    with pytest.raises(WireError, match="r1e cannot carry non-finite"):
        wire.encode(make([1, 2], r, "r1e"), version=5)


def test_a_serving_table_adds_r1e_rows_and_fresh_ones_start_from_zeros():
    t = ServingTable("emb", 3)
    t.upsert(np.array([1, 2]), np.ones((2, 3), np.float32))
    r = np.array([[0.5, -0.5, 0.5], [1.0, 1.0, -1.0], [0.25, 0.25, 0.25]], np.float32)
    d = decode(one(make([1, 2, 7], r, "r1e", table="emb", fresh=np.array([False, True, False])),
                   version=5))
    t.apply(d)
    want = np.array([[1.5, 0.5, 1.5], [1.0, 1.0, -1.0], [0.25, 0.25, 0.25]], np.float32)
    assert np.array_equal(t.lookup(np.array([1, 2, 7])), want)
