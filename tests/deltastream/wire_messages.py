"""Wire messages built by hand, as another language's msgpack encoder would write them.

Shared by the wire tests: :func:`fields_of` gives a batch's message as a plain dict (no
``crc``), :func:`pack_fields` packs such a dict as a v2 message (a generic map writer: the
fields in dict order, then ``crc`` as msgpack uint32 over every byte before it) or a v1
message (``msgpack.packb`` with the v1 CRC of the bins), and :func:`packed` does both
with fields changed.
"""

from __future__ import annotations

import struct
from typing import Any

import crc32c
import msgpack
import numpy as np

from deltastream.wire import DeltaBatch, decode, encode
from deltastream.wire_codec import FIELD_KEYS, INT_KEYS_VERSION

__all__ = ["DROP", "BASE", "make", "one", "fields_of", "wire_fields", "crc_v1", "pack_fields",
           "packed", "assert_same"]

#: a value for :func:`packed` that removes the field
DROP = object()


def make(ids, rows, dtype="f32", tombstones=None, **kw) -> DeltaBatch:
    """A batch of model "m", table "t", shard 3, epoch 11, seq 5, step 7, ts 1234."""
    fields = dict(model="m", table="t", shard=3, epoch=11, seq=5, step=7, ts=1234)
    fields.update(kw)
    return DeltaBatch(ids=np.asarray(ids), rows=np.asarray(rows), dtype=dtype,
                      tombstones=tombstones, **fields)


def one(batch: DeltaBatch, **kw) -> bytes:
    """The one message ``encode`` makes of ``batch``."""
    msgs = encode(batch, **kw)
    assert len(msgs) == 1
    return msgs[0]


BASE = make(np.array([1, 5, 9]), np.arange(12, dtype=np.float32).reshape(3, 4), dtype="i8",
            tombstones=np.array([2, 3]))


def fields_of(batch: DeltaBatch, version: int = 2) -> dict:
    """The message of ``batch`` as a plain dict without ``crc``."""
    msg: dict[str, Any] = {"v": version, "model": batch.model, "table": batch.table,
                           "shard": batch.shard, "epoch": batch.epoch, "seq": batch.seq,
                           "step": batch.step, "ts": batch.ts, "n": batch.n, "dim": batch.dim}
    if batch.is_column_slice:
        msg["col"], msg["width"] = batch.col, batch.width
    msg["dtype"] = batch.dtype
    d = decode(one(batch))
    msg["ids"] = bytes(d.ids.data)
    msg["rows"] = bytes(np.ascontiguousarray(d.rows).data)
    if d.scale is not None:
        msg["scale"] = bytes(d.scale.data)
    if d.tombstones is not None:
        msg["del"] = bytes(d.tombstones.data)
    return msg


def wire_fields(message: bytes) -> dict:
    """An int-keyed (v4, v5) message's fields by name (``crc`` left out), bins as bytes."""
    names = {k: name for name, k in FIELD_KEYS.items()}
    raw = msgpack.unpackb(message, strict_map_key=False)
    return {names[k]: v for k, v in raw.items() if names[k] != "crc"}


def crc_v1(msg: dict) -> int:
    """The v1 CRC: CRC-32C of the bins ids, rows, scale, del."""
    crc = 0
    for k in ("ids", "rows", "scale", "del"):
        if isinstance(msg.get(k), bytes):
            crc = crc32c.crc32c(msg[k], crc)
    return crc


_COMPUTE = object()


def pack_fields(msg: dict, version: int = 2, crc: Any = _COMPUTE,
                with_crc: bool = True) -> bytes:
    """Pack ``msg`` (no ``crc`` key) as a message of ``version``; ``crc`` overrides the
    computed value (any msgpack value; a v2 uint32 is packed as ``0xce`` + 4 bytes),
    ``with_crc=False`` leaves the field out. From v4 the known field names are packed as
    their int keys (other keys as given)."""
    if version == 1:
        out = dict(msg)
        if with_crc:
            out["crc"] = crc_v1(msg) if crc is _COMPUTE else crc
        return msgpack.packb(out)
    keys = FIELD_KEYS if version >= INT_KEYS_VERSION else {}
    packer = msgpack.Packer()
    data = packer.pack_map_header(len(msg) + with_crc) + b"".join(
        packer.pack(keys.get(k, k)) + packer.pack(v) for k, v in msg.items())
    if not with_crc:
        return data
    value = crc32c.crc32c(data) if crc is _COMPUTE else crc
    crc_key = packer.pack(keys.get("crc", "crc"))
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32:
        return data + crc_key + b"\xce" + struct.pack(">I", value)
    return data + crc_key + packer.pack(value)


def packed(base: DeltaBatch = BASE, *, version: int = 2, **changes) -> bytes:
    """The message of ``base`` with fields changed (``DROP`` = removed); the CRC is
    recomputed over the changed message unless ``crc`` is given."""
    msg = fields_of(base, version)
    crc = changes.pop("crc", _COMPUTE)
    for k, v in changes.items():
        if v is DROP:
            msg.pop(k, None)
        else:
            msg[k] = v
    return pack_fields(msg, version, crc=_COMPUTE if crc is DROP else crc,
                       with_crc=crc is not DROP)


def assert_same(a: DeltaBatch, b: DeltaBatch) -> None:
    """Same header fields, ids, wire rows, scale and tombstones."""
    for f in ("model", "table", "shard", "epoch", "seq", "step", "ts", "dtype", "col", "width"):
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
