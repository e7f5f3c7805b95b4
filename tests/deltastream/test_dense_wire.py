"""The dense wire kind: round trips per dtype within the documented error, chunking under
max_message_bytes, strict decoding (every field named, CRC over every byte), and the two
kinds refusing each other's messages."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest

from deltastream import dense_wire, wire
from deltastream.dense_wire import DenseChunk, chunk_version, decode_dense, encode_dense
from deltastream.errors import WireError
from tests.deltastream.wire_messages import BASE, one, pack_fields

HEAD = dict(model="m", shard=2, epoch=3, seq=10, step=40, ts=123)


def _tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"mlp.0.weight": rng.standard_normal((64, 33)).astype(np.float32),
            "mlp.0.bias": rng.standard_normal(33).astype(np.float32),
            "bn.running_var": np.float32(2.5) * np.ones((), np.float32),
            "empty": np.zeros((0, 4), np.float32)}


def _assemble(chunks: list[DenseChunk]) -> dict[str, np.ndarray]:
    """The tensors of one version, from its chunks in any order."""
    out: dict[str, np.ndarray] = {}
    for c in chunks:
        flat = out.setdefault(c.name, np.full(int(np.prod(c.shape)), np.nan, np.float32))
        flat[c.offset:c.offset + len(c.values)] = c.values_f32()
    return {k: v.reshape(next(c.shape for c in chunks if c.name == k)) for k, v in out.items()}


# bound(x) per dtype, as documented in deltastream/dense_wire.py and docs/DESIGN.md
BOUNDS = {"f32": lambda x: np.zeros_like(x),
          "f16": lambda x: np.maximum(np.abs(x) * 2.0 ** -11, 2.0 ** -25),
          "bf16": lambda x: np.abs(x) * 2.0 ** -8}


@pytest.mark.parametrize("dtype", sorted(BOUNDS))
def test_round_trip_per_dtype_within_the_documented_error(dtype):
    tensors = _tensors(np.random.default_rng(0))
    chunks = chunk_version(tensors, **HEAD, dtype=dtype, max_message_bytes=2048)
    msgs = encode_dense(chunks)
    assert all(len(m) <= 2048 for m in msgs)
    decoded = [decode_dense(m) for m in msgs]
    assert [c.seq for c in decoded] == list(range(10, 10 + len(msgs)))
    assert [c.index for c in decoded] == list(range(len(msgs)))
    assert {(c.chunks, c.tensors, c.full, c.base_step, c.step) for c in decoded} \
        == {(len(msgs), 4, True, 40, 40)}
    got = _assemble(decoded[::-1])
    assert set(got) == set(tensors)
    for name, want in tensors.items():
        assert got[name].shape == want.shape
        assert np.all(np.abs(got[name] - want) <= BOUNDS[dtype](want)), name


def test_decoded_values_are_a_zero_copy_view_in_the_wire_dtype():
    msg = encode_dense(chunk_version({"w": np.arange(6, dtype=np.float32)}, **HEAD,
                                     dtype="bf16"))[0]
    c = decode_dense(msg)
    assert c.values.dtype == np.uint16 and not c.values.flags.owndata
    np.testing.assert_array_equal(c.values_f32(), np.arange(6, dtype=np.float32))
    # a decoded bf16 chunk re-encodes byte for byte (a relay does not re-quantize)
    assert encode_dense([c]) == [msg]


def test_chunks_cut_large_tensors_in_flat_ranges_under_the_limit():
    w = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    chunks = chunk_version({"w": w, "b": np.ones(3, np.float32)}, **HEAD, max_message_bytes=4096)
    assert len(chunks) > 10
    ws = [c for c in chunks if c.name == "w"]
    assert [c.offset for c in ws] == [i * len(ws[0].values) for i in range(len(ws))]
    assert sum(len(c.values) for c in ws) == w.size
    assert all(len(m) <= 4096 for m in encode_dense(chunks))
    with pytest.raises(WireError, match="max_message_bytes"):
        chunk_version({"w": w}, **HEAD, max_message_bytes=100)


def test_a_partial_version_names_its_base():
    (c,) = chunk_version({"w": np.ones(2, np.float32)}, **HEAD, base_step=30)
    d = decode_dense(encode_dense([c])[0])
    assert (d.full, d.base_step, d.step) == (False, 30, 40)
    for bad in ({"full": True, "base_step": 30}, {"full": False, "base_step": 40},
                {"base_step": 41}):
        with pytest.raises(WireError, match="base"):
            encode_dense([_with(c, **bad)])


def _with(c: DenseChunk, **changes) -> DenseChunk:
    fields = {k: getattr(c, k) for k in DenseChunk.__dataclass_fields__}
    fields.update(changes)
    return DenseChunk(**fields)


def _fields(c: DenseChunk) -> dict:
    """The message of ``c`` as a plain dict in wire order, without crc."""
    msg = {"v": 2, "kind": "dense", "model": c.model, "shard": c.shard, "epoch": c.epoch,
           "seq": c.seq, "step": c.step, "ts": c.ts, "full": c.full, "base": c.base_step,
           "tensors": c.tensors, "chunks": c.chunks, "index": c.index, "name": c.name,
           "offset": c.offset, "n": len(c.values), "dtype": c.dtype,
           "shape": np.asarray(c.shape, "<i8").tobytes(),
           "values": np.ascontiguousarray(c.values, "<f4").tobytes()}
    return msg


CHUNK = chunk_version({"w": np.ones((4, 5), np.float32)}, **HEAD, max_message_bytes=560)[1]


def test_a_message_from_a_generic_msgpack_writer_decodes_like_the_encoders():
    ours, theirs = decode_dense(encode_dense([CHUNK])[0]), decode_dense(pack_fields(_fields(CHUNK)))
    for f in DenseChunk.__dataclass_fields__:
        assert np.array_equal(getattr(ours, f), getattr(theirs, f)), f


@pytest.mark.parametrize("field,value", [
    ("v", 1), ("v", True), ("kind", "rows"), ("kind", 1), ("model", ""), ("model", "a/b"),
    ("shard", -1), ("shard", 2**31), ("epoch", "3"), ("seq", -1), ("step", None),
    ("ts", True), ("full", 1), ("base", 41), ("base", -1), ("tensors", 0),
    ("tensors", 9), ("chunks", 0), ("index", 8), ("index", -1), ("name", ""), ("name", "a\nb"),
    ("name", 5), ("offset", 21), ("offset", -2), ("n", 99), ("n", 0), ("dtype", "i8"),
    ("dtype", 4), ("shape", b"\x00" * 7), ("shape", np.array([-1], "<i8").tobytes()),
    ("shape", "x"), ("values", b"\x00" * 3), ("values", 7),
])
def test_every_field_corrupted_is_refused_by_name(field, value):
    msg = _fields(CHUNK)
    msg[field] = value
    with pytest.raises(WireError, match=f"^{field}"):
        decode_dense(pack_fields(msg))


@pytest.mark.parametrize("field", ["kind", "name", "shape", "values", "dtype"])
def test_a_missing_field_is_named(field):
    msg = _fields(CHUNK)
    del msg[field]
    with pytest.raises(WireError, match=field):
        decode_dense(pack_fields(msg))


def test_an_unknown_field_is_refused():
    with pytest.raises(WireError, match="unknown fields.*extra"):
        decode_dense(pack_fields({("extra" if k == "ts" else k): v
                                  for k, v in _fields(CHUNK).items()}))


def test_the_crc_covers_every_byte_before_its_trailer():
    msg = encode_dense([CHUNK])[0]
    end = len(msg) - 9
    assert msg[end:end + 5] == b"\xa3crc\xce"
    assert int.from_bytes(msg[-4:], "big") == crc32c.crc32c(msg[:end])
    for pos in range(1, end):  # byte 0 is the map header; a changed one fails the map
        bad = bytearray(msg)
        bad[pos] ^= 0x01
        with pytest.raises(WireError):
            decode_dense(bytes(bad))
    with pytest.raises(WireError, match="crc"):
        decode_dense(pack_fields(_fields(CHUNK), crc=12345))


def test_the_row_decoder_refuses_a_dense_message_by_name():
    with pytest.raises(WireError, match="^kind: a dense-weights message"):
        wire.decode(encode_dense([CHUNK])[0])


def test_the_dense_decoder_refuses_a_row_message():
    with pytest.raises(WireError, match="^kind: missing"):
        decode_dense(one(BASE))


def test_kafka_key_and_headers_tell_the_kinds_apart():
    headers = dense_wire.dense_headers(CHUNK)
    assert dense_wire.is_dense(headers)
    assert not dense_wire.is_dense(wire.kafka_headers(BASE))
    assert not dense_wire.is_dense(None)
    with pytest.raises(WireError, match="not rows"):
        wire.parse_headers(headers)
    # row keys have two '/', dense keys one, and names never contain '/'
    assert dense_wire.dense_key("m", 2).count(b"/") == 1
    assert wire.message_key("m", "2", 2).count(b"/") == 2


def test_values_out_of_the_dtype_range_are_refused():
    with pytest.raises(WireError, match="values of 'w'"):
        encode_dense(chunk_version({"w": np.array([1e6], np.float32)}, **HEAD, dtype="f16"))
    with pytest.raises(WireError, match="values"):
        encode_dense(chunk_version({"w": np.arange(3)}, **HEAD))
