"""Wire format v1: one Kafka message is one msgpack map carrying a batch of rows.

Torch-free: predictor hosts import this with numpy and msgpack only.

Row dtypes and their worst-case error against the float32 value that was encoded
(for finite inputs in range; all are exact for ids):

========  ==================================================================
``f32``   exact.
``f16``   relative error ≤ 2⁻¹¹ (≈ 4.9e-4) for |x| ≥ 6.1e-5 (normal range),
          absolute error ≤ 2⁻²⁵ (≈ 3e-8) below it. |x| > 65504 is refused
          (it would become inf).
``bf16``  relative error ≤ 2⁻⁸ (≈ 3.9e-3), round to nearest even, for normal values
          (|x| ≥ 1.2e-38); absolute error ≤ 2⁻¹³⁴ below. |x| ≥ 3.3961514e38 is
          refused (it would round to inf).
``i8``    row-wise symmetric: ``scale = max|row| / 127``, ``q = round(x / scale)``;
          absolute error ≤ ``scale / 2 = max|row| / 254`` per element, plus float32
          rounding: ≤ 2⁻²²·max|row|, and ≤ 2e-43 when max|row| < 1.5e-36 makes the
          scale subnormal. Non-finite values are refused (the scale would be inf/NaN).
========  ==================================================================

Non-finite values (inf, NaN) pass through ``f32``/``f16``/``bf16`` unchanged; refusing
them is the publisher's job (``allow_nonfinite``).

:func:`decode` trusts nothing: every field is type- and range-checked, sizes must agree
with ``n``/``dim``/``dtype`` before any array is built, the CRC-32C must match, and any
problem raises :class:`WireError` naming the field. Decoded rows are zero-copy views in
the wire dtype; :meth:`DeltaBatch.rows_f32` dequantizes. Decoding does not check that
values are finite (the publisher refuses non-finite rows; serving tables check on apply).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import crc32c as _crc32c
import msgpack
import numpy as np

from deltastream.errors import WireError

__all__ = [
    "VERSION",
    "DTYPES",
    "DeltaBatch",
    "WireError",
    "encode",
    "decode",
    "split",
    "message_key",
    "kafka_headers",
    "parse_headers",
    "row_bytes",
    "MAX_DIM",
    "MAX_ROWS",
]

VERSION = 1
#: wire dtype -> bytes per element
DTYPES = {"f32": 4, "f16": 2, "bf16": 2, "i8": 1}
MAX_DIM = 1 << 16
MAX_ROWS = 1 << 28
MAX_NAME = 255
_INT64_MAX = (1 << 63) - 1
_F16_MAX = 65504.0
#: smallest float32 that rounds to inf in bf16 (0x7F7F8000: a tie that rounds to even = up)
_BF16_OVERFLOW = float(np.array(0x7F7F8000, dtype=np.uint32).view(np.float32))
_U32 = struct.Struct(">I")
_NAME_RE = re.compile(r"[^/\x00-\x1f\x7f]+")  # fullmatch: "$" would accept a trailing \n
# Bytes of map keys, fixed ints and names that a message carries besides its arrays; an
# upper bound used to size chunks (checked against the real length after packing).
_FIXED_OVERHEAD = 256
_REQUIRED = {"v", "model", "table", "shard", "epoch", "seq", "step", "ts", "n", "dim",
             "dtype", "ids", "rows", "crc"}
_OPTIONAL = {"scale", "del"}
_INT_FIELDS = ("v", "shard", "epoch", "seq", "step", "ts", "n", "dim", "crc")




@dataclass
class DeltaBatch:
    """Rows of one table from one trainer shard, as carried by one or more messages.

    Attributes:
        model, table: names (non-empty, ≤ 255 chars, no ``/`` or control characters).
        shard: trainer shard that owns the rows (≥ 0).
        epoch: trainer incarnation (≥ 0), new on every trainer start.
        seq: per (model, table, shard, epoch) message number; for a batch that :func:`encode`
            splits, the seq of its first message.
        step: trainer global step. ts: trainer wall clock in ns when the rows were read.
        ids: int64 ``[n]`` global ids, strictly ascending.
        rows: ``[n, dim]``. For a batch you build: any float array (it is converted to
            ``dtype`` on encode). For a decoded batch: the wire representation —
            float32/float16 arrays, bf16 bit patterns as uint16, or int8 with ``scale``.
            Use :meth:`rows_f32` for float32 values either way.
        dtype: wire dtype, one of ``f32``, ``f16``, ``bf16``, ``i8``.
        scale: float32 ``[n]`` per-row scale, decoded ``i8`` batches only.
        tombstones: int64 ``[m]`` ids the trainer evicted, or ``None``. A consumer deletes
            them before upserting ``ids`` (the two sets are disjoint when produced by
            deltastream's tracker).
    """

    model: str
    table: str
    shard: int
    epoch: int
    seq: int
    step: int
    ts: int
    ids: np.ndarray
    rows: np.ndarray
    dtype: str = "f32"
    scale: Optional[np.ndarray] = None
    tombstones: Optional[np.ndarray] = None
    _decoded: bool = field(default=False, repr=False, compare=False)

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])

    @property
    def dim(self) -> int:
        return int(self.rows.shape[1])

    def rows_f32(self) -> np.ndarray:
        """Row values as float32 ``[n, dim]`` (dequantized for decoded f16/bf16/i8)."""
        if not self._decoded:
            return np.asarray(self.rows, dtype=np.float32)
        if self.dtype == "bf16":
            return (self.rows.astype(np.uint32) << 16).view(np.float32)
        if self.dtype == "i8":
            return self.rows.astype(np.float32) * self.scale[:, None]
        return self.rows.astype(np.float32, copy=False)


def row_bytes(dim: int, dtype: str) -> int:
    """Bytes one row costs on the wire: id + values (+ scale for i8)."""
    return 8 + dim * DTYPES[dtype] + (4 if dtype == "i8" else 0)


def message_key(model: str, table: str, shard: int) -> bytes:
    """The Kafka key of every message for (model, table, shard)."""
    return f"{model}/{table}/{shard}".encode()


def kafka_headers(batch: DeltaBatch) -> list[tuple[str, bytes]]:
    """Kafka headers repeating model, table, shard, epoch, seq (so consumers skip cheaply)."""
    return [("model", batch.model.encode()), ("table", batch.table.encode()),
            ("shard", str(batch.shard).encode()), ("epoch", str(batch.epoch).encode()),
            ("seq", str(batch.seq).encode())]


def parse_headers(headers: Any) -> dict:
    """Headers of a message as ``{"model", "table", "shard", "epoch", "seq"}``.

    Raises :class:`WireError` when a header is missing or malformed.
    """
    try:
        h = {k: v for k, v in headers or ()}
        out: dict[str, Any] = {"model": h["model"].decode(), "table": h["table"].decode()}
        for k in ("shard", "epoch", "seq"):
            out[k] = int(h[k].decode())
            if out[k] < 0:
                raise ValueError(f"negative {k}")
    except (KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise WireError(f"headers: missing or malformed ({e!r})") from None
    return out


# ----------------------------------------------------------------------------- encode


def _check_name(what: str, value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME \
            or not _NAME_RE.fullmatch(value):
        raise WireError(f"{what}: expected a non-empty str of ≤ {MAX_NAME} chars without '/' "
                        f"or control characters, got {value!r}")


def _check_int(what: str, value: Any, lo: int = 0, hi: int = _INT64_MAX) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise WireError(f"{what}: expected an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise WireError(f"{what}: expected {lo} ≤ {what} ≤ {hi}, got {value}")


def _max_abs_finite(rows: np.ndarray) -> tuple[float, bool]:
    """(largest finite |value| of ``rows``, whether all values are finite)."""
    if not rows.size:
        return 0.0, True
    # min/max reduce without a temporary (np.abs would copy the whole array).
    hi = max(-float(np.min(rows)), float(np.max(rows)))
    if np.isfinite(hi):
        return hi, True
    finite = rows[np.isfinite(rows)]  # slow path: only when non-finite values are present
    return (float(np.max(np.abs(finite))) if finite.size else 0.0), False


def _quantize(rows: np.ndarray, dtype: str) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Float rows ``[n, dim]`` -> (wire array, scale or None)."""
    if dtype == "f32":
        return np.ascontiguousarray(rows, dtype="<f4"), None
    if dtype == "f16":
        if rows.dtype != np.float16:
            if _max_abs_finite(rows)[0] > _F16_MAX:
                raise WireError(f"rows: a value exceeds the f16 range (±{_F16_MAX:g}); "
                                "use dtype 'bf16' or 'f32'")
            rows = rows.astype(np.float16)
        return np.ascontiguousarray(rows, dtype="<f2"), None
    r32 = np.ascontiguousarray(rows, dtype=np.float32)
    if dtype == "bf16":
        if _max_abs_finite(r32)[0] >= _BF16_OVERFLOW:
            raise WireError(f"rows: a value exceeds the bf16 range (|x| < {_BF16_OVERFLOW:.8g}); "
                            "use dtype 'f32'")
        u = r32.view(np.uint32)
        # Round to nearest even on the 16 dropped mantissa bits. NaNs are truncated
        # instead (rounding could carry a NaN into inf, or wrap 0xFFFF.... to zero) and
        # kept NaN by setting the quiet bit when truncation would leave an inf pattern.
        rounded = ((u + (((u >> 16) & 1) + 0x7FFF).astype(np.uint32)) >> 16).astype("<u2")
        nan = np.isnan(r32)
        if nan.any():
            t = (u[nan] >> 16).astype("<u2")
            rounded[nan] = np.where(t & 0x7F, t, t | 0x40)
        return rounded, None
    # i8: row-wise symmetric
    if not _max_abs_finite(r32)[1]:
        raise WireError("rows: dtype i8 cannot carry non-finite values (inf/NaN)")
    amax = np.max(np.abs(r32), axis=1) if r32.shape[1] else np.zeros(r32.shape[0], np.float32)
    scale = (amax / 127.0).astype(np.float32)
    top = amax > np.float32(3.0e38)
    if top.any():
        # amax/127 may round up so far that 127 * scale overflows float32 on decode:
        # step those scales down one ulp (the clip below keeps q within ±127).
        with np.errstate(over="ignore"):
            over = ~np.isfinite(np.float32(127) * scale) & top
        scale[over] = np.nextafter(scale[over], np.float32(0))
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.clip(np.rint(r32 / safe[:, None]), -127, 127).astype(np.int8)
    return q, scale.astype("<f4")


def _int64_ids(what: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise WireError(f"{what}: expected a 1-D integer array, got shape {arr.shape} "
                        f"{arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8 and arr.size \
            and int(arr.max()) > _INT64_MAX:
        # astype would wrap these to negative ids silently
        raise WireError(f"{what}: id {int(arr.max())} does not fit in int64")
    return np.ascontiguousarray(arr, dtype="<i8")


def _validate_batch(batch: DeltaBatch) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray],
                                                Optional[np.ndarray]]:
    """Check a batch built by a producer (or decoded); returns (ids, rows, tombstones, scale)
    normalised: ids ascending int64, rows permuted with them."""
    if not isinstance(batch, DeltaBatch):
        raise WireError(f"batch: expected a DeltaBatch, got {type(batch).__name__}")
    _check_name("model", batch.model)
    _check_name("table", batch.table)
    _check_int("shard", batch.shard, 0, (1 << 31) - 1)
    for name in ("epoch", "seq", "step", "ts"):
        _check_int(name, getattr(batch, name))
    if batch.dtype not in DTYPES:
        raise WireError(f"dtype: expected one of {sorted(DTYPES)}, got {batch.dtype!r}")
    ids = _int64_ids("ids", batch.ids)
    rows = np.asarray(batch.rows)
    if rows.ndim != 2 or rows.shape[0] != ids.shape[0]:
        raise WireError(f"rows: expected shape [{ids.shape[0]}, dim], got {rows.shape}")
    scale = None
    # A decoded batch carries bf16/i8 rows in their wire representation; re-encoding it
    # passes them through unchanged (a relay must not re-quantize).
    wire_form = batch._decoded and batch.dtype in ("bf16", "i8")
    if wire_form:
        want = np.uint16 if batch.dtype == "bf16" else np.int8
        if rows.dtype != want:
            raise WireError(f"rows: a decoded {batch.dtype} batch must hold {np.dtype(want)} "
                            f"rows, got {rows.dtype}")
        if batch.dtype == "i8":
            scale = np.asarray(batch.scale) if batch.scale is not None else None
            if scale is None or scale.shape != (ids.shape[0],):
                raise WireError(f"scale: expected float32 [{ids.shape[0]}] for a decoded i8 "
                                "batch")
            scale = np.ascontiguousarray(scale, dtype="<f4")
    elif rows.dtype.kind != "f":
        raise WireError(f"rows: expected a float array, got {rows.dtype}")
    if not 1 <= rows.shape[1] <= MAX_DIM:
        raise WireError(f"dim: expected 1 ≤ dim ≤ {MAX_DIM}, got {rows.shape[1]}")
    if ids.size > 1 and not bool(np.all(ids[1:] > ids[:-1])):
        order = np.argsort(ids, kind="stable")
        ids, rows = ids[order], rows[order]
        if scale is not None:
            scale = scale[order]
        if bool(np.any(ids[1:] == ids[:-1])):
            dup = ids[1:][ids[1:] == ids[:-1]]
            raise WireError(f"ids: duplicate ids in one batch (e.g. {int(dup[0])}; "
                            f"{dup.size} duplicates)")
    tomb = None if batch.tombstones is None else _int64_ids("tombstones", batch.tombstones)
    return ids, rows, tomb, scale


def split(batch: DeltaBatch, max_message_bytes: int = 1 << 20) -> list[DeltaBatch]:
    """Split ``batch`` into batches whose messages each fit in ``max_message_bytes``.

    Rows are cut in id order; tombstones fill the first messages. The pieces get
    consecutive ``seq`` numbers starting at ``batch.seq``. An empty batch gives ``[]``.
    """
    ids, rows, tomb, scale = _validate_batch(batch)
    per_row = row_bytes(rows.shape[1], batch.dtype)
    # Names count in UTF-8 bytes, not characters.
    budget = (max_message_bytes - _FIXED_OVERHEAD - len(batch.model.encode())
              - len(batch.table.encode()))
    if budget < per_row:
        raise WireError(f"max_message_bytes: {max_message_bytes} cannot hold one row of "
                        f"{per_row} bytes plus the {_FIXED_OVERHEAD}-byte header")
    n, m = ids.shape[0], 0 if tomb is None else tomb.shape[0]
    pieces: list[DeltaBatch] = []
    r = t = 0
    while r < n or t < m:
        room = budget
        t_take = min(m - t, room // 8)
        room -= t_take * 8
        r_take = min(n - r, room // per_row)
        pieces.append(replace(
            batch, seq=batch.seq + len(pieces), ids=ids[r:r + r_take], rows=rows[r:r + r_take],
            tombstones=tomb[t:t + t_take] if t_take else None,
            scale=None if scale is None else scale[r:r + r_take]))
        r += r_take
        t += t_take
    return pieces


def _pack_head(key: str, size: int) -> bytes:
    """msgpack str key followed by a bin32 header for ``size`` bytes."""
    return msgpack.packb(key) + b"\xc6" + _U32.pack(size)


def _pack_one(b: DeltaBatch) -> bytes:
    # Framed by hand rather than with msgpack.packb: the Packer grows its buffer by
    # doubling and copies megabyte payloads several times; joining buffers copies once.
    if b._decoded and b.dtype in ("bf16", "i8"):
        wire_rows = np.ascontiguousarray(b.rows)
        scale = None if b.scale is None else np.ascontiguousarray(b.scale, dtype="<f4")
    else:
        wire_rows, scale = _quantize(b.rows, b.dtype)
    ids = np.ascontiguousarray(b.ids, dtype="<i8")
    bins: list[tuple[str, Any]] = [("ids", ids.data), ("rows", wire_rows.data)]
    if scale is not None:
        bins.append(("scale", scale.data))
    if b.tombstones is not None:
        bins.append(("del", np.ascontiguousarray(b.tombstones, dtype="<i8").data))
    crc = 0
    for _, buf in bins:
        crc = _crc32c.crc32c(buf, crc)
    scalars = {
        "v": VERSION, "model": b.model, "table": b.table, "shard": int(b.shard),
        "epoch": int(b.epoch), "seq": int(b.seq), "step": int(b.step), "ts": int(b.ts),
        "n": int(ids.shape[0]), "dim": int(b.rows.shape[1]), "dtype": b.dtype, "crc": crc,
    }
    head = msgpack.packb(scalars)
    # Replace the fixmap header by a map16 header counting the bin fields too.
    parts: list[Any] = [b"\xde" + (len(scalars) + len(bins)).to_bytes(2, "big"), head[1:]]
    for key, buf in bins:
        parts.append(_pack_head(key, buf.nbytes))
        parts.append(buf)
    return b"".join(parts)


def encode(batch: DeltaBatch, *, max_message_bytes: int = 1 << 20) -> list[bytes]:
    """Encode ``batch`` as messages of at most ``max_message_bytes`` bytes each.

    Returns one message per piece of :func:`split` (seq ``batch.seq``, ``batch.seq + 1`` …);
    ``[]`` for a batch with no rows and no tombstones.
    """
    if not isinstance(max_message_bytes, int) or max_message_bytes <= 0:
        raise WireError(f"max_message_bytes: expected a positive int, got {max_message_bytes!r}")
    out = [_pack_one(p) for p in split(batch, max_message_bytes)]
    for i, m in enumerate(out):
        if len(m) > max_message_bytes:  # a bug in the size estimate, never bad input
            raise WireError(f"message {i}: {len(m)} bytes exceed max_message_bytes "
                            f"{max_message_bytes}")
    return out


# ----------------------------------------------------------------------------- decode


class _Reader:
    """A strict reader for the msgpack subset v1 uses: one map of str keys to int, str,
    bin, nil or bool values. Bins come back as zero-copy memoryview slices of the input.
    Anything else (arrays, nested maps, floats, ext types) is refused.
    """

    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

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
        raise WireError(f"{what}: msgpack type byte {b:#04x} is not allowed in wire v1 "
                        "(only int, str, bin, nil, bool)")

    def top_map(self) -> dict:
        b = self._uint(1, "message")
        if 0x80 <= b <= 0x8F:
            count = b & 0x0F
        elif b in (0xDE, 0xDF):
            count = self._uint(2 if b == 0xDE else 4, "message")
        else:
            raise WireError(f"message: expected a msgpack map, got type byte {b:#04x}")
        if count > len(_REQUIRED | _OPTIONAL):
            raise WireError(f"message: {count} fields, at most {len(_REQUIRED | _OPTIONAL)} "
                            "allowed")
        out: dict = {}
        for i in range(count):
            key = self.value(f"key {i}")
            if not isinstance(key, str):
                raise WireError(f"key {i}: expected a str key, got {type(key).__name__}")
            if key in out:
                raise WireError(f"{key}: duplicate field")
            out[key] = self.value(key)
        if self.pos != len(self.buf):
            raise WireError(f"message: {len(self.buf) - self.pos} trailing bytes after the map")
        return out


def _bin(msg: dict, key: str, expected: int) -> memoryview:
    value = msg[key]
    if not isinstance(value, memoryview):
        raise WireError(f"{key}: expected bin, got {type(value).__name__}")
    if len(value) != expected:
        raise WireError(f"{key}: expected {expected} bytes, got {len(value)}")
    return value


def decode(data: bytes) -> DeltaBatch:
    """Decode and validate one message. Raises :class:`WireError` naming the bad field."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"data: expected bytes, got {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except TypeError as e:  # e.g. a non-contiguous memoryview
        raise WireError(f"data: not a contiguous byte buffer ({e})") from None
    msg = _Reader(view).top_map()
    keys = set(msg)
    if not _REQUIRED <= keys:
        raise WireError(f"message: missing fields {sorted(_REQUIRED - keys)}")
    if keys - _REQUIRED - _OPTIONAL:
        raise WireError(f"message: unknown fields {sorted(map(str, keys - _REQUIRED - _OPTIONAL))}")
    for k in _INT_FIELDS:
        if isinstance(msg[k], bool) or not isinstance(msg[k], int):
            raise WireError(f"{k}: expected an int, got {type(msg[k]).__name__}")
    if msg["v"] != VERSION:
        raise WireError(f"v: unsupported schema version {msg['v']} (this reader knows {VERSION})")
    _check_name("model", msg["model"])
    _check_name("table", msg["table"])
    _check_int("shard", msg["shard"], 0, (1 << 31) - 1)
    for k in ("epoch", "seq", "step", "ts"):
        _check_int(k, msg[k])
    _check_int("n", msg["n"], 0, MAX_ROWS)
    _check_int("dim", msg["dim"], 1, MAX_DIM)
    _check_int("crc", msg["crc"], 0, (1 << 32) - 1)
    dtype = msg["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    n, dim = msg["n"], msg["dim"]
    # Sizes are checked against the bytes actually present before any array is built,
    # so a message claiming 10^12 rows allocates nothing.
    ids_b = _bin(msg, "ids", n * 8)
    rows_b = _bin(msg, "rows", n * dim * DTYPES[dtype])
    crc = _crc32c.crc32c(rows_b, _crc32c.crc32c(ids_b))
    scale = None
    if dtype == "i8":
        if "scale" not in msg:
            raise WireError("scale: required for dtype i8")
        scale_b = _bin(msg, "scale", n * 4)
        crc = _crc32c.crc32c(scale_b, crc)
        scale = np.frombuffer(scale_b, dtype="<f4")
    elif "scale" in msg:
        raise WireError(f"scale: only allowed for dtype i8, not {dtype}")
    tomb = None
    if "del" in msg:
        del_b = msg["del"]
        if not isinstance(del_b, memoryview) or len(del_b) % 8:
            raise WireError("del: expected bin of a multiple of 8 bytes")
        crc = _crc32c.crc32c(del_b, crc)
        tomb = np.frombuffer(del_b, dtype="<i8")
    if crc != msg["crc"]:
        raise WireError(f"crc: CRC-32C mismatch (message says {msg['crc']:#010x}, "
                        f"payload gives {crc:#010x})")
    ids = np.frombuffer(ids_b, dtype="<i8")
    if n > 1 and not bool(np.all(ids[1:] > ids[:-1])):
        raise WireError("ids: not strictly ascending")
    if scale is not None and not bool(np.all(np.isfinite(scale) & (scale >= 0))):
        raise WireError("scale: expected finite non-negative values")
    wire_dt = {"f32": "<f4", "f16": "<f2", "bf16": "<u2", "i8": "i1"}[dtype]
    rows = np.frombuffer(rows_b, dtype=wire_dt).reshape(n, dim)
    if n == 0 and (tomb is None or tomb.size == 0):
        raise WireError("n: a message with no rows must carry tombstones")
    return DeltaBatch(model=msg["model"], table=msg["table"], shard=msg["shard"],
                      epoch=msg["epoch"], seq=msg["seq"], step=msg["step"], ts=msg["ts"],
                      ids=ids, rows=rows, dtype=dtype, scale=scale, tombstones=tomb,
                      _decoded=True)
