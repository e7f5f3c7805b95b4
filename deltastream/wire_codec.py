"""The bytes of one wire message: framing, CRC-32C (row values: :mod:`~deltastream.wire_values`).

This is the one encoder of the format. A version-2 message is one msgpack map: the scalar
fields (:func:`scalar_fields`, in this order), then the bin fields ``ids``, ``rows``
(``scale`` for i8 and r1) and ``del`` (tombstones), then the 9-byte trailer :data:`CRC_TRAILER`
+ the CRC-32C of every byte before it, as a msgpack uint32 (:func:`crc_trailer`). Two
writers lay a message out with the same helpers (:func:`map_header`, :func:`bin_header`,
:func:`bin_sizes`, :func:`crc_trailer`), so their bytes are identical by construction:

* :func:`pack_message` joins wire arrays into a fresh ``bytes`` (what
  :func:`deltastream.wire.encode` returns; rows already in the wire dtype cost one copy);
* :class:`Framer` casts float rows straight into a reusable buffer (what the publisher
  sends: no temporary array, no join copy).

:func:`pack_message` also writes version 1 (``version=1``: ``crc`` the last scalar, before
the bins, covering only the bins), so that decoding v1 stays tested, and both writers write
version 3: v2 with the ids as ``idv`` varints when that is shorter (:func:`id_field`,
:func:`varint_ids`; :func:`read_varint_ids` is their strict reader), and version 4: v3 with
every key a one-byte msgpack int (:data:`FIELD_KEYS`) instead of its name and the shortest
map and bin headers — the same fields, order, types and CRC, ~60 bytes less per message;
v4 also carries the residual dtype ``r1`` and its ``fresh`` bits, and version 5 is v4 that
may also carry ``r1e`` (:mod:`~deltastream.wire_values`).

:class:`Reader` is the strict msgpack reader :func:`deltastream.wire.decode` parses with.

Torch-free. Users import
the format from :mod:`deltastream.wire`; this module is its machinery.
"""

from __future__ import annotations

import struct
from typing import Any, Optional

import crc32c as _crc32c
import msgpack
import numpy as np

from deltastream.errors import WireError
from deltastream.wire_values import (
    BF16_OVERFLOW,
    DTYPES,
    F16_MAX,
    NUMPY_DTYPES,
    max_abs_finite,
    quantize,
    rows_nbytes,
    scale_nbytes,
    to_f16,
)

__all__ = [
    "VERSION",
    "VERSIONS",
    "CRC_TRAILER",
    "TRAILER_BYTES",
    "TOMBSTONE_BYTES",
    "DTYPES",
    "NUMPY_DTYPES",
    "F16_MAX",
    "BF16_OVERFLOW",
    "max_abs_finite",
    "quantize",
    "scalar_fields",
    "bin_sizes",
    "id_field",
    "COMPACT_IDS_VERSION",
    "INT_KEYS_VERSION",
    "FIELD_KEYS",
    "int_keys",
    "varint_ids",
    "varint_ids_size",
    "read_varint_ids",
    "map_header",
    "bin_header",
    "crc_trailer",
    "join_with_crc",
    "check_crc_trailer",
    "DENSE_HEAD",
    "pack_message",
    "Framer",
    "Reader",
]

#: the version encoders write by default
VERSION = 2
#: the versions decoders read (3: v2 whose ids may travel as :func:`varint_ids`; 4: v3 with
#: int keys; 5: v4 that may also carry the residual dtype ``r1e``)
VERSIONS = (1, 2, 3, 4, 5)
#: the version that may carry ids as sorted gaps in LEB128 varints (key ``idv``)
COMPACT_IDS_VERSION = 3
#: the version whose keys are msgpack positive fixints (:data:`FIELD_KEYS`), not names
INT_KEYS_VERSION = 4
#: a row message's field name -> its key from :data:`INT_KEYS_VERSION` on (one byte each)
FIELD_KEYS = {name: k for k, name in enumerate(
    ("v", "model", "table", "shard", "epoch", "seq", "step", "ts", "n", "dim", "col", "width",
     "dtype", "ids", "idv", "rows", "scale", "del", "crc", "fresh"))}
#: most bytes one LEB128 varint of a uint64 takes
_VARINT_MAX = 10
#: the smallest value of each varint length past one byte: 2^7, 2^14, … 2^63
_VARINT_STEPS = np.array([1 << (7 * k) for k in range(1, _VARINT_MAX)], dtype=np.uint64)
#: how every v2 message ends, before the 4 CRC bytes: the key ``"crc"`` (fixstr) and the
#: msgpack uint32 type byte
CRC_TRAILER = b"\xa3crc\xce"
#: bytes of the v2 trailer: :data:`CRC_TRAILER` + the big-endian CRC-32C
TRAILER_BYTES = len(CRC_TRAILER) + 4
#: bytes one tombstone id takes in a message (``del``: int64 each)
TOMBSTONE_BYTES = 8
#: the v4 trailer before the CRC bytes: the key of ``crc`` and the uint32 type byte
_CRC_TRAILER_INT = bytes([FIELD_KEYS["crc"], 0xCE])
#: how every dense-weights message (:mod:`deltastream.dense_wire`) begins after its map16
#: header: ``v`` 2, then ``kind`` "dense". Row messages have no ``kind``; the row decoder
#: looks for these bytes to refuse a dense message by name instead of as a malformed row.
DENSE_HEAD = b"\xa1v\x02\xa4kind\xa5dense"
_U32 = struct.Struct(">I")
# ----------------------------------------------------------------------------- ids


def varint_ids(ids: np.ndarray) -> np.ndarray:
    """Strictly ascending int64 ids ``[n]`` as uint8 bytes: the zigzag of the first id, then
    each gap to the previous id (≥ 1, as uint64), each a canonical LEB128 varint (7 bits a
    byte, low first, high bit set on every byte but a value's last). Small dense ids cost
    1–2 bytes instead of 8; hashed ids up to 10 (the encoder then keeps them raw)."""
    v, lens = _gaps(ids)
    if not v.size:
        return np.empty(0, np.uint8)
    j = np.arange(int(lens.max()))
    # [n, longest] bytes of every value, continuation bits set; a row-major boolean
    # selection keeps each value's own bytes, in order
    mat = ((v[:, None] >> (7 * j).astype(np.uint64)) & np.uint64(0x7F)).astype(np.uint8)
    mat |= np.where(j < lens[:, None] - 1, 0x80, 0).astype(np.uint8)
    return mat[j < lens[:, None]]


def _gaps(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 values :func:`varint_ids` writes: zigzag first id, then the gaps; their
    varint lengths in bytes) of strictly ascending int64 ``ids``."""
    u = np.ascontiguousarray(ids, dtype="<i8").view(np.uint64)
    if not u.size:
        return u, np.zeros(0, np.int64)
    first = int(u[:1].view(np.int64)[0])
    zig = np.array([(first << 1) ^ (first >> 63)], dtype=np.uint64)  # -1 -> 1, 1 -> 2
    v = np.concatenate([zig, np.diff(u)])  # uint64 differences wrap: the true gaps
    return v, np.searchsorted(_VARINT_STEPS, v, side="right") + 1


def varint_ids_size(ids: np.ndarray) -> int:
    """``len(varint_ids(ids))`` without writing the bytes."""
    return int(_gaps(ids)[1].sum())


def read_varint_ids(buf: memoryview, n: int) -> np.ndarray:
    """Inverse of :func:`varint_ids`: int64 ``[n]`` strictly ascending. Raises
    :class:`WireError` naming ``idv`` unless ``buf`` is exactly ``n`` canonical varints
    (no padding byte, no value past 64 bits) of ids that ascend within int64."""
    b = np.frombuffer(buf, np.uint8)
    ends = np.flatnonzero(b < 0x80)
    if ends.size != n or (b.size and b[-1] >= 0x80):
        raise WireError(f"idv: expected exactly n = {n} varints in {b.size} bytes")
    if not n:
        return np.empty(0, np.int64)
    lens = np.diff(ends, prepend=-1)
    last = b[ends]
    if int(lens.max()) > _VARINT_MAX or bool(np.any((lens == _VARINT_MAX) & (last > 1))):
        raise WireError("idv: a varint exceeds 64 bits")
    if bool(np.any((lens > 1) & (last == 0))):
        raise WireError("idv: a varint is not in its shortest form")
    j = np.arange(int(lens.max()))
    mine = j < lens[:, None]  # [n, longest]: which bytes belong to each value
    at = np.where(mine, (ends - lens + 1)[:, None] + j, 0)
    parts = (b[at] & np.uint8(0x7F)).astype(np.uint64) << (7 * j).astype(np.uint64)
    v = np.where(mine, parts, np.uint64(0)).sum(axis=1, dtype=np.uint64)  # disjoint bits
    z = int(v[0])
    v[0] = np.array([(z >> 1) ^ -(z & 1)], dtype=np.int64).view(np.uint64)[0]
    ids = np.cumsum(v, dtype=np.uint64).view(np.int64)  # wraps like int64 addition
    # a zero gap repeats an id, one past int64's top wraps below its predecessor
    if n > 1 and not bool(np.all(ids[1:] > ids[:-1])):
        raise WireError("idv: ids not strictly ascending within int64")
    return ids


# ----------------------------------------------------------------------------- layout


def scalar_fields(head: Any, n: int, dim: int, *, version: int = VERSION,
                  crc: int = 0) -> dict[str, Any]:
    """The scalar fields of a message, in wire order.

    ``head`` is anything with the :class:`~deltastream.wire.DeltaBatch` header attributes
    (``model``, ``table``, ``shard``, ``epoch``, ``seq``, ``step``, ``ts``, ``dtype``,
    ``col``, ``width``). Version 2 writes ``col``/``width`` only for a column slice
    (``col != 0`` or ``width`` not ``dim``); version 1 ends with ``crc``.
    """
    out = {"v": version, "model": head.model, "table": head.table, "shard": int(head.shard),
           "epoch": int(head.epoch), "seq": int(head.seq), "step": int(head.step),
           "ts": int(head.ts), "n": n, "dim": dim}
    col = int(head.col)
    width = dim if head.width is None else int(head.width)
    if version != 1 and (col or width != dim):
        out["col"] = col
        out["width"] = width
    out["dtype"] = head.dtype
    if version == 1:
        out["crc"] = crc
    return out


def id_field(ids: np.ndarray, version: int) -> tuple[str, np.ndarray]:
    """The id field of a message: ``("ids", ids)`` (``<i8 [n]``) or, from version
    :data:`COMPACT_IDS_VERSION` on and when shorter, ``("idv", varint_ids(ids))``."""
    if version >= COMPACT_IDS_VERSION:
        packed = varint_ids(ids)
        if packed.size < 8 * ids.shape[0]:
            return "idv", packed
    return "ids", ids


def bin_sizes(n: int, dim: int, dtype: str, with_scale: bool, n_tombstones: Optional[int],
              ids: Optional[tuple[str, int]] = None, fresh: bool = False
              ) -> list[tuple[str, int]]:
    """``(key, bytes)`` of each bin field, in wire order; ``ids`` is the id field's
    ``(key, bytes)`` when not ``("ids", 8 n)`` (see :func:`id_field`); ``fresh``: the
    message carries the ``fresh`` bits of an r1 message (``ceil(n / 8)`` bytes)."""
    bins = [ids or ("ids", n * 8), ("rows", rows_nbytes(n, dim, dtype))]
    if with_scale:
        bins.append(("scale", scale_nbytes(n, dtype)))
    if fresh:
        bins.append(("fresh", -(-n // 8)))
    if n_tombstones is not None:
        bins.append(("del", n_tombstones * TOMBSTONE_BYTES))
    return bins


def int_keys(version: int) -> bool:
    """Whether a row message of wire ``version`` keys its fields by int (:data:`FIELD_KEYS`)."""
    return version >= INT_KEYS_VERSION


def _key(name: str, ints: bool) -> Any:
    return FIELD_KEYS[name] if ints else name


def _trailer(ints: bool) -> bytes:
    return _CRC_TRAILER_INT if ints else CRC_TRAILER


def map_header(scalars: dict[str, Any], n_more: int, *, ints: bool = False) -> bytes:
    """The message's map header (counting the scalars and ``n_more`` fields after them:
    the bins, and the CRC trailer in v2) followed by the scalars: map16, or with ``ints``
    (v4: keyed by :data:`FIELD_KEYS`) the shortest map header, a fixmap up to 15 fields."""
    head = msgpack.packb({_key(k, ints): v for k, v in scalars.items()})
    # packb writes a fixmap header (< 16 fields) or a map16 one: replace it by one with the
    # full count
    head = head[3:] if head[0] == 0xDE else head[1:]
    count = len(scalars) + n_more
    if ints and count <= 15:
        return bytes([0x80 | count]) + head
    return b"\xde" + count.to_bytes(2, "big") + head


def bin_header(key: str, size: int, *, ints: bool = False) -> bytes:
    """msgpack str ``key`` followed by a bin32 header for ``size`` bytes; with ``ints``
    (v4) the key's :data:`FIELD_KEYS` int and the shortest bin header (bin8 below 256
    bytes, bin16 below 64 KiB)."""
    if not ints:
        return msgpack.packb(key) + b"\xc6" + _U32.pack(size)
    width = 1 if size < 1 << 8 else 2 if size < 1 << 16 else 4  # bin8, bin16, bin32
    return bytes([FIELD_KEYS[key], 0xC3 + width.bit_length()]) + size.to_bytes(width, "big")


def crc_trailer(crc: int, *, ints: bool = False) -> bytes:
    """How a v2 message ends: key ``"crc"`` (its int with ``ints``) and ``crc`` as a
    msgpack uint32 (always 5 bytes, whatever its value)."""
    return _trailer(ints) + _U32.pack(crc)


def join_with_crc(head: bytes, bins: list[tuple[str, int, Any]], *,
                  ints: bool = False) -> bytes:
    """A v2 message: ``head`` (from :func:`map_header`), then each ``(key, size, buffer)``
    as a bin32 field, then the CRC trailer over every byte before it.

    The CRC is computed part by part while the parts are listed (the payload is read once
    for the CRC and once for the join).
    """
    parts: list[Any] = [head]
    crc = _crc32c.crc32c(head)
    for key, size, buf in bins:
        hdr = bin_header(key, size, ints=ints)
        crc = _crc32c.crc32c(buf, _crc32c.crc32c(hdr, crc))
        parts += [hdr, buf]
    parts.append(crc_trailer(crc, ints=ints))
    return b"".join(parts)


def check_crc_trailer(view: memoryview, last_key_at: int, crc: Any, *,
                      ints: bool = False) -> None:
    """Raise :class:`WireError` unless the v2 message ``view`` ends with the CRC trailer
    (:func:`crc_trailer`) as its map's last field (``last_key_at`` from :class:`Reader`)
    and ``crc`` (the value read there) is the CRC-32C of every byte before it."""
    trailer = _trailer(ints)
    end = len(view) - len(trailer) - 4
    if last_key_at != end or bytes(view[end:end + len(trailer)]) != trailer:
        raise WireError(f"crc: a v2 message must end with the crc field packed as msgpack "
                        f"uint32 (trailer {trailer.hex(' ')} + 4 bytes)")
    got = _crc32c.crc32c(view[:end])
    if got != crc:
        raise WireError(f"crc: CRC-32C mismatch (message says {crc:#010x}, "
                        f"its bytes give {got:#010x})")


def pack_message(head: Any, ids: np.ndarray, rows: np.ndarray, scale: Optional[np.ndarray],
                 tombstones: Optional[np.ndarray], *, version: int = VERSION,
                 dim: Optional[int] = None, fresh: Optional[np.ndarray] = None) -> bytes:
    """One message from wire arrays: ids ``<i8 [n]``, rows ``[n, dim]`` in the wire dtype
    (``r1``: packed sign bits, so ``dim`` must be given), scale ``[n]`` (``<f4`` for i8,
    ``<f2`` for r1), ``fresh`` (r1: packed bits ``[ceil(n / 8)]``, or None) and tombstones
    ``<i8 [m]`` or None. Version 3 writes the ids as ``idv`` varints when that is shorter
    (:func:`id_field`).

    Framed by hand rather than with ``msgpack.packb``: the Packer grows its buffer by
    doubling and copies megabyte payloads several times; joining buffers copies once.
    """
    n, dim = int(ids.shape[0]), int(rows.shape[1]) if dim is None else dim
    id_key, id_buf = id_field(ids, version)
    bufs = [id_buf.data, rows.data]
    if scale is not None:
        bufs.append(scale.data)
    if fresh is not None:
        bufs.append(fresh.data)
    if tombstones is not None:
        bufs.append(tombstones.data)
    bins = bin_sizes(n, dim, head.dtype, scale is not None,
                     None if tombstones is None else int(tombstones.shape[0]),
                     (id_key, id_buf.nbytes), fresh is not None)
    ints = int_keys(version)
    if version == 1:  # CRC of the bins, written before them
        crc = 0
        for buf in bufs:
            crc = _crc32c.crc32c(buf, crc)
        parts: list[Any] = [map_header(scalar_fields(head, n, dim, version=1, crc=crc),
                                       len(bins))]
        for (key, size), buf in zip(bins, bufs, strict=True):
            parts += [bin_header(key, size), buf]
        return b"".join(parts)
    return join_with_crc(map_header(scalar_fields(head, n, dim, version=version), len(bins) + 1,
                                    ints=ints),
                         [(key, size, buf) for (key, size), buf in zip(bins, bufs, strict=True)],
                         ints=ints)


class Framer:
    """Frames f32/f16 v2 (v3, v4) messages into one reusable buffer (the publisher's fast
    path).

    Rows are cast straight into the message (no temporary array, no join copy) and the
    buffer is reused: ``KafkaProducer.send`` copies the value into its record batch before
    it returns, so the next message may overwrite it. The bytes equal
    :func:`pack_message` of the same piece (same layout helpers; tested).

    Args:
        capacity: buffer bytes; a message that does not fit is refused (``frame`` -> None).
        version: the wire version written (2; 3: ids as varints when shorter; 4: also int
            keys and the shortest headers).
    """

    def __init__(self, capacity: int, version: int = VERSION) -> None:
        self.buf = bytearray(capacity)
        self.view = memoryview(self.buf)
        self.version = version
        self.ints = int_keys(version)
        self.trailer = len(crc_trailer(0, ints=self.ints))

    def frame(self, b: Any) -> Optional[memoryview]:
        """The message of ``b`` (a piece from :func:`deltastream.wire.split` with dtype f32
        or f16 and float rows), a view into the buffer valid until the next call; None if
        it does not fit the buffer."""
        n, dim = int(b.ids.shape[0]), int(b.rows.shape[1])
        tomb = b.tombstones
        id_key, id_buf = id_field(np.ascontiguousarray(b.ids, dtype="<i8"), self.version)
        id_bytes = id_buf.view(np.uint8)
        bins = bin_sizes(n, dim, b.dtype, False, None if tomb is None else int(tomb.shape[0]),
                         (id_key, id_bytes.size))
        head = map_header(scalar_fields(b, n, dim, version=self.version), len(bins) + 1,
                          ints=self.ints)
        hdrs = [bin_header(key, size, ints=self.ints) for key, size in bins]
        # Start where the rows land 64-byte aligned in the buffer (vectorised casts): after
        # the head, the ids' bin header, the ids and the rows' bin header.
        start = -(len(head) + len(hdrs[0]) + id_bytes.size + len(hdrs[1])) % 64
        pos, regions = start + len(head), []
        buf = self.buf
        for (_, size), hdr in zip(bins, hdrs, strict=True):
            if pos + len(hdr) + size + self.trailer > len(buf):
                return None
            buf[pos:pos + len(hdr)] = hdr
            regions.append(pos + len(hdr))
            pos += len(hdr) + size
        buf[start:start + len(head)] = head
        np.frombuffer(buf, np.uint8, id_bytes.size, regions[0])[:] = id_bytes
        rows = np.frombuffer(buf, NUMPY_DTYPES[b.dtype], n * dim, regions[1]).reshape(n, dim)
        if b.dtype == "f16":
            to_f16(b.rows, out=rows)
        else:
            np.copyto(rows, b.rows, casting="same_kind")
        if tomb is not None:
            np.frombuffer(buf, "<i8", tomb.shape[0], regions[2])[:] = tomb
        crc = _crc32c.crc32c(self.view[start:pos])
        buf[pos:pos + self.trailer] = crc_trailer(crc, ints=self.ints)
        return self.view[start:pos + self.trailer]


# ----------------------------------------------------------------------------- decode


class Reader:
    """A strict reader for the msgpack subset the wire uses: one map of str keys to int,
    str, bin, nil or bool values. Bins come back as zero-copy memoryview slices of the
    input. Anything else (arrays, nested maps, floats, ext types) is refused with a
    :class:`WireError` naming the field.

    Args:
        buf: the message bytes.
        max_fields: a map with more fields is refused before any is read.

    After :meth:`top_map`, ``last_key_at`` is the offset where the map's last key starts
    (where a v2 message's CRC trailer must start) and ``int_keys`` whether its keys were
    ints.
    """

    __slots__ = ("buf", "pos", "max_fields", "last_key_at", "int_keys")

    def __init__(self, buf: memoryview, max_fields: int) -> None:
        self.buf = buf
        self.pos = 0
        self.max_fields = max_fields
        self.last_key_at = -1
        self.int_keys = False

    def _take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise WireError(f"{what}: message truncated (needs {n} bytes at offset {self.pos})")
        out = self.buf[self.pos:end]
        self.pos = end
        return out

    def _uint(self, n: int, what: str) -> int:
        return int.from_bytes(self._take(n, what), "big")

    def _sint(self, n: int, what: str) -> int:
        return int.from_bytes(self._take(n, what), "big", signed=True)

    def _str(self, n: int, what: str) -> str:
        try:
            return str(self._take(n, what), "utf-8")
        except UnicodeDecodeError:
            raise WireError(f"{what}: invalid UTF-8") from None

    def value(self, what: str) -> Any:
        """The next value (int, str, memoryview for bin, None or bool); ``what`` names it
        in errors."""
        b = self._uint(1, what)
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0xA0 <= b <= 0xBF:
            return self._str(b & 0x1F, what)
        if b == 0xC0:
            return None
        if b in (0xC2, 0xC3):
            return b == 0xC3
        if 0xC4 <= b <= 0xC6:
            return self._take(self._uint(1 << (b - 0xC4), what), what)
        if 0xCC <= b <= 0xCF:
            return self._uint(1 << (b - 0xCC), what)
        if 0xD0 <= b <= 0xD3:
            return self._sint(1 << (b - 0xD0), what)
        if 0xD9 <= b <= 0xDB:
            return self._str(self._uint(1 << (b - 0xD9), what), what)
        raise WireError(f"{what}: msgpack type byte {b:#04x} is not allowed in wire "
                        "messages (only int, str, bin, nil, bool)")

    def top_map(self, names: Optional[dict[int, str]] = None) -> dict:
        """The whole buffer as one map of unique str keys (no trailing bytes allowed). With
        ``names``, a map whose keys are all ints of ``names`` is read too, keyed by those
        names (``int_keys`` is then True)."""
        b = self._uint(1, "message")
        if 0x80 <= b <= 0x8F:
            count = b & 0x0F
        elif b in (0xDE, 0xDF):
            count = self._uint(2 if b == 0xDE else 4, "message")
        else:
            raise WireError(f"message: expected a msgpack map, got type byte {b:#04x}")
        if count > self.max_fields:
            raise WireError(f"message: {count} fields, at most {self.max_fields} allowed")
        out: dict = {}
        for i in range(count):
            self.last_key_at = self.pos
            key = self.value(f"key {i}")
            if names is not None and type(key) is int and (i == 0 or self.int_keys):
                if key not in names:
                    raise WireError(f"key {i}: unknown field number {key}")
                self.int_keys, key = True, names[key]
            elif self.int_keys:
                raise WireError(f"key {i}: expected an int key like the map's first, got "
                                f"{type(key).__name__}")
            elif not isinstance(key, str):
                raise WireError(f"key {i}: expected a str key, got {type(key).__name__}")
            if key in out:
                raise WireError(f"{key}: duplicate field")
            out[key] = self.value(key)
        if self.pos != len(self.buf):
            raise WireError(f"message: {len(self.buf) - self.pos} trailing bytes after the map")
        return out
