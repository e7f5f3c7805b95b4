"""Wire format v2 (and v3, v4, v5): one Kafka message is one msgpack map carrying a batch of rows.

Torch-free: predictor hosts import this with numpy and msgpack only.

Fields (``docs/DESIGN.md`` has them byte by byte; bins are raw little-endian arrays, never lists):

===============  ====  ================================================================
``v``            int   schema version: 2, 3, 4 or 5 (decoders also read 1)
``model``        str   model name; ``table``: table name (≤ 255 chars, no ``/``)
``shard``        int   trainer shard that owns the rows
``epoch``        int   trainer incarnation, new on every trainer start
``seq``          int   per (model, table, shard, epoch): 0, 1, 2 … one per message
``step``, ``ts`` int   trainer global step; trainer wall clock (ns) when rows were read
``n``, ``dim``   int   rows, width of the carried rows
``col``          int   v2, optional: ``rows`` are columns ``[col, col + dim)`` of rows
``width``        int   ``width`` wide (column-wise shards); default 0 and ``dim``
``dtype``        str   ``f32``, ``f16``, ``bf16``, ``i8``; v4: also ``r1``, v5 ``r1e`` (below)
``ids``          bin   n × int64
``idv``          bin   v3, instead of ``ids`` when shorter: varint ids (see below)
``rows``         bin   n × dim × itemsize, row-major (``r1``: n × ceil(dim / 8) sign bits;
                       ``r1e``: ceil(n · dim / 8))
``scale``        bin   n × float32 for ``i8``, n × float16 for ``r1``, 1 + n bytes for
                       ``r1e`` (a base exponent, a code a row), absent otherwise
``fresh``        bin   residuals only, optional: ceil(n / 8) bytes, bit i set = row i starts
                       from zeros, whatever the predictor holds for its id
``del``          bin   m × int64 tombstones (ids the trainer evicted), optional
``crc``          int   CRC-32C, see below
===============  ====  ================================================================

Integrity. **v2** (what :func:`encode` writes): ``crc`` is the map's last key and its value
a msgpack uint32, so every message ends with the 9-byte trailer ``0xa3 'crc' 0xce`` + 4
CRC bytes (big-endian), and the CRC-32C covers every byte before that trailer — all keys
and values, so a flipped model/table/shard/epoch/seq/step/ts is detected like a flipped
row. **v1** (still decoded; written only by ``encode(..., version=1)``, for tests): ``crc``
may sit anywhere and covers the bins ``ids``, ``rows``, ``scale``, ``del`` only; v1 has no
``col``/``width``.
**v3** (``encode(..., version=3)``, ``DeltaPublisher(wire_version=3)``) is v2 whose ids may
travel as ``idv``: n LEB128 varints, the zigzag of the first id then each gap to the
previous one (:func:`~deltastream.wire_codec.varint_ids`), written when shorter than 8 n
bytes (dense ids: 1–2 bytes each). Exactly one of ``ids``/``idv`` is present; the decoder
refuses an ``idv`` of another count, a varint not in its shortest form or over 64 bits, and
ids that do not ascend within int64, naming ``idv``.
**v4** (``encode(..., version=4)``, ``DeltaPublisher(wire_version=4)``) is v3 with every
key a msgpack positive fixint instead of its name — ``v`` 0, ``model`` 1, ``table`` 2,
``shard`` 3, ``epoch`` 4, ``seq`` 5, ``step`` 6, ``ts`` 7, ``n`` 8, ``dim`` 9, ``col`` 10,
``width`` 11, ``dtype`` 12, ``ids`` 13, ``idv`` 14, ``rows`` 15, ``scale`` 16, ``del`` 17,
``crc`` 18, ``fresh`` 19 (:data:`~deltastream.wire_codec.FIELD_KEYS`) — so its trailer
is ``0x12 0xce`` + 4 CRC bytes; same fields, order, types and checks, with the shortest
map and bin headers (a fixmap up to 15 fields, bin8/bin16 for small arrays), ~60 bytes
less per message (a budget's small messages are mostly header). A map's keys are all
names (v1–v3) or all ints (v4, v5). v4 also carries residuals (``r1``, with ``fresh``;
below). **v5** is v4 that may also carry the residual dtype ``r1e``: the same residuals with
a one-byte scale code a row and the sign bits packed over the message, 5 bytes for a dim-32
row instead of 6 and 1.125 for a dim-1 row instead of 3 (so bias rows go as residuals too).

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

**Residuals** (``r1``, wire v4 on; ``r1e``, v5 on; :mod:`deltastream.wire_values` has the
layouts): the
rows are *added* to the row a predictor holds (zeros for an id it does not hold; an id in
the same message's ``del`` or set in its ``fresh`` is deleted first), ``±scale`` per
element by its sign bit. The trainer mirrors what predictors hold with the same float32
additions and sends the error a residual leaves again (error feedback); a v2/v3 reader
refuses them by ``dtype`` (a v4 reader refuses v5 by its version), and a residual message
is applied exactly once and in order like any other (``BudgetPolicy.residuals``). Decoded,
both are int8 ±1 rows and a float32 scale a row.

Non-finite values (inf, NaN) pass through ``f32``/``f16``/``bf16`` unchanged; refusing
them is the publisher's job (``allow_nonfinite``).

:func:`decode` trusts nothing: every field is type- and range-checked, sizes must agree
with ``n``/``dim``/``dtype`` before any array is built, the CRC-32C must match, and any
problem raises :class:`WireError` naming the field. Decoded rows are zero-copy views in
the wire dtype; :meth:`DeltaBatch.rows_f32` dequantizes. Decoding does not check that
values are finite (the publisher refuses non-finite rows; serving tables check on apply).

This module is the format's public face; the bytes themselves are laid out by
:mod:`deltastream.wire_codec`, the one encoder (:func:`encode` and the publisher's in-place
:class:`Framer` share its layout helpers). Producers validate with the same rules the
encoder applies: :func:`check_name`, :func:`check_dtype`, :func:`row_bytes`,
:func:`max_abs_finite`.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Optional

import crc32c as _crc32c
import numpy as np

from deltastream.errors import WireError
from deltastream.wire_batch import DecodedBatch, DeltaBatch
from deltastream.wire_codec import (
    BF16_OVERFLOW,
    COMPACT_IDS_VERSION,
    DENSE_HEAD,
    DTYPES,
    F16_MAX,
    FIELD_KEYS,
    NUMPY_DTYPES,
    TOMBSTONE_BYTES,
    VERSION,
    VERSIONS,
    Framer,
    Reader,
    check_crc_trailer,
    int_keys,
    max_abs_finite,
    pack_message,
    quantize,
    read_varint_ids,
    varint_ids_size,
)
from deltastream.wire_values import (
    RESIDUAL_DTYPES,
    RESIDUAL_VERSION,
    error_bound,
    has_scale,
    pack_bits,
    pack_scale_codes,
    residual_fits,
    residual_scale,
    residual_values,
    residual_version,
    rows_nbytes,
    scale_from_codes,
    scale_nbytes,
    unpack_bits,
    unpack_residual,
    unpack_residual_e,
    value_bytes,
)

__all__ = [
    "VERSION",
    "VERSIONS",
    "COMPACT_IDS_VERSION",
    "DTYPES",
    "NUMPY_DTYPES",
    "RESIDUAL_DTYPES",
    "RESIDUAL_VERSION",
    "residual_values",
    "residual_scale",
    "residual_fits",
    "residual_version",
    "value_bytes",
    "error_bound",
    "F16_MAX",
    "BF16_OVERFLOW",
    "DeltaBatch",
    "DecodedBatch",
    "WireError",
    "Framer",
    "encode",
    "decode",
    "split",
    "message_key",
    "kafka_headers",
    "parse_headers",
    "row_bytes",
    "id_bytes",
    "TOMBSTONE_BYTES",
    "check_name",
    "check_dtype",
    "check_int",
    "max_abs_finite",
    "MAX_DIM",
    "MAX_ROWS",
    "MAX_NAME",
]

MAX_DIM = 1 << 16
MAX_ROWS = 1 << 28
MAX_NAME = 255
_INT64_MAX = (1 << 63) - 1
_NAME_RE = re.compile(r"[^/\x00-\x1f\x7f]+")  # fullmatch: "$" would accept a trailing \n
# Bytes of map keys, fixed ints and names that a message carries besides its arrays; an
# upper bound used to size chunks (checked against the real length after packing).
_FIXED_OVERHEAD = 256
_REQUIRED = {"v", "model", "table", "shard", "epoch", "seq", "step", "ts", "n", "dim",
             "dtype", "rows", "crc"}
_OPTIONAL = {"ids", "idv", "scale", "del", "col", "width", "fresh"}  # exactly one of ids / idv
_FIELD_NAMES = {k: name for name, k in FIELD_KEYS.items()}  # v4's int keys
_V2_ONLY = ("col", "width")
_WIRE_FORM = ("bf16", "i8", "r1", "r1e")  # decoded rows not in float: relayed as they are
_INT_FIELDS = ("v", "shard", "epoch", "seq", "step", "ts", "n", "dim", "crc", "col", "width")


def row_bytes(dim: int, dtype: str) -> int:
    """Bytes one row of width ``dim`` costs on the wire in ``dtype``: 8 (id) + ``dim`` ×
    itemsize (+ 4 scale for i8; ``r1``: ``ceil(dim / 8)`` + 2; ``r1e``: at most that, see
    :func:`value_bytes` for what a row adds to a message); at most that from v3 on,
    whose ids may cost less (:func:`id_bytes`). Raises :class:`WireError` for an unknown
    dtype."""
    check_dtype(dtype, residual=True)
    return 8 + rows_nbytes(1, dim, dtype) + scale_nbytes(1, dtype)


def id_bytes(ids: np.ndarray, version: int = VERSION) -> int:
    """Bytes the unique int64 ids ``[n]`` (any order) take in one message of ``version``:
    8 n, or in v3 their varints when fewer (``min(8 n, len(varint_ids(sorted ids)))``)."""
    n = int(np.asarray(ids).shape[0])
    if version < COMPACT_IDS_VERSION:
        return 8 * n
    return min(8 * n, varint_ids_size(np.sort(np.asarray(ids, dtype=np.int64))))


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
        if "kind" in h:  # row records carry no kind header; dense ones do (dense_wire)
            raise WireError(f"headers: a {h['kind']!r} record, not rows (tell the kinds apart "
                            "with deltastream.dense_wire.is_dense)")
        out: dict[str, Any] = {"model": h["model"].decode(), "table": h["table"].decode()}
        for k in ("shard", "epoch", "seq"):
            out[k] = int(h[k].decode())
            if out[k] < 0:
                raise ValueError(f"negative {k}")
    except WireError:
        raise
    except (KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise WireError(f"headers: missing or malformed ({e!r})") from None
    return out


# ----------------------------------------------------------------------------- encode


def check_name(what: str, value: Any) -> None:
    """Raise :class:`WireError` unless ``value`` is a valid model/table name: a non-empty
    str of ≤ ``MAX_NAME`` chars without ``/`` or control characters (``what`` names it)."""
    if not isinstance(value, str) or not value or len(value) > MAX_NAME \
            or not _NAME_RE.fullmatch(value):
        raise WireError(f"{what}: expected a non-empty str of ≤ {MAX_NAME} chars without '/' "
                        f"or control characters, got {value!r}")


def check_dtype(dtype: Any, *, residual: bool = False) -> None:
    """Raise :class:`WireError` unless ``dtype`` is a full-row wire dtype (a key of
    :data:`DTYPES`), or with ``residual`` also a residual one (:data:`RESIDUAL_DTYPES`)."""
    known = sorted(DTYPES) + (sorted(RESIDUAL_DTYPES) if residual else [])
    if not isinstance(dtype, str) or dtype not in known:
        raise WireError(f"dtype: expected one of {known}, got {dtype!r}")


def check_int(what: str, value: Any, lo: int = 0, hi: int = _INT64_MAX) -> int:
    """``value`` as an int, or :class:`WireError` naming ``what`` unless it is an int (not
    a bool) with ``lo ≤ value ≤ hi``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise WireError(f"{what}: expected an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise WireError(f"{what}: expected {lo} ≤ {what} ≤ {hi}, got {value}")
    return int(value)


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


def _check_columns(col: Any, width: Any, dim: int) -> None:
    """``0 ≤ col`` and ``col + dim ≤ width ≤ MAX_DIM``, else :class:`WireError`."""
    check_int("col", col, 0, MAX_DIM - 1)
    check_int("width", width, 1, MAX_DIM)
    if not col + dim <= width:
        raise WireError(f"width: expected col + dim = {col} + {dim} ≤ width ≤ {MAX_DIM}, "
                        f"got width {width}")


def _validate_batch(batch: DeltaBatch) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray],
                                                Optional[np.ndarray], Optional[np.ndarray]]:
    """Check a batch built by a producer (or decoded); returns (ids, rows, tombstones, scale,
    fresh) normalised: ids ascending int64, rows (scale, fresh) permuted with them."""
    if not isinstance(batch, DeltaBatch):
        raise WireError(f"batch: expected a DeltaBatch, got {type(batch).__name__}")
    check_name("model", batch.model)
    check_name("table", batch.table)
    check_int("shard", batch.shard, 0, (1 << 31) - 1)
    for name in ("epoch", "seq", "step", "ts"):
        check_int(name, getattr(batch, name))
    check_dtype(batch.dtype, residual=True)
    ids = _int64_ids("ids", batch.ids)
    rows = np.asarray(batch.rows)
    if rows.ndim != 2 or rows.shape[0] != ids.shape[0]:
        raise WireError(f"rows: expected shape [{ids.shape[0]}, dim], got {rows.shape}")
    scale = None
    # A decoded batch carries bf16/i8/r1 rows in their wire representation; re-encoding it
    # passes them through unchanged (a relay must not re-quantize).
    wire_form = isinstance(batch, DecodedBatch) and batch.dtype in _WIRE_FORM
    if wire_form:
        want = np.uint16 if batch.dtype == "bf16" else np.int8
        if rows.dtype != want:
            raise WireError(f"rows: a decoded {batch.dtype} batch must hold {np.dtype(want)} "
                            f"rows, got {rows.dtype}")
        if has_scale(batch.dtype):
            scale = np.asarray(batch.scale) if batch.scale is not None else None
            if scale is None or scale.shape != (ids.shape[0],):
                raise WireError(f"scale: expected float32 [{ids.shape[0]}] for a decoded "
                                f"{batch.dtype} batch")
            scale = np.ascontiguousarray(scale, dtype="<f4")
    elif rows.dtype.kind != "f":
        raise WireError(f"rows: expected a float array, got {rows.dtype}")
    if not 1 <= rows.shape[1] <= MAX_DIM:
        raise WireError(f"dim: expected 1 ≤ dim ≤ {MAX_DIM}, got {rows.shape[1]}")
    _check_columns(batch.col, rows.shape[1] if batch.width is None else batch.width,
                   rows.shape[1])
    fresh = _fresh(batch, ids.shape[0])
    if ids.size > 1 and not bool(np.all(ids[1:] > ids[:-1])):
        order = np.argsort(ids, kind="stable")
        ids, rows = ids[order], rows[order]
        if scale is not None:
            scale = scale[order]
        if fresh is not None:
            fresh = fresh[order]
        if bool(np.any(ids[1:] == ids[:-1])):
            dup = ids[1:][ids[1:] == ids[:-1]]
            raise WireError(f"ids: duplicate ids in one batch (e.g. {int(dup[0])}; "
                            f"{dup.size} duplicates)")
    tomb = None if batch.tombstones is None else _int64_ids("tombstones", batch.tombstones)
    return ids, rows, tomb, scale, fresh


def _fresh(batch: DeltaBatch, n: int) -> Optional[np.ndarray]:
    """The batch's ``fresh`` flags checked (bool ``[n]``, r1 only), None when none is set."""
    if batch.fresh is None:
        return None
    if batch.dtype not in RESIDUAL_DTYPES:
        raise WireError(f"fresh: only residual batches (r1, r1e) start rows from zeros, not "
                        f"{batch.dtype}")
    fresh = np.asarray(batch.fresh)
    if fresh.dtype != np.bool_ or fresh.shape != (n,):
        raise WireError(f"fresh: expected bool [{n}], got {fresh.dtype} {fresh.shape}")
    return fresh if fresh.any() else None


def split(batch: DeltaBatch, max_message_bytes: int = 1 << 20) -> list[DeltaBatch]:
    """Split ``batch`` into batches whose messages each fit in ``max_message_bytes``.

    Rows are cut in id order; tombstones fill the first messages. The pieces get
    consecutive ``seq`` numbers starting at ``batch.seq``. An empty batch gives ``[]``.
    """
    ids, rows, tomb, scale, fresh = _validate_batch(batch)
    per_row = row_bytes(rows.shape[1], batch.dtype) + (fresh is not None)  # + its bit
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
            scale=None if scale is None else scale[r:r + r_take],
            fresh=None if fresh is None else fresh[r:r + r_take]))
        r += r_take
        t += t_take
    return pieces


def _pack_one(b: DeltaBatch, version: int) -> bytes:
    if isinstance(b, DecodedBatch) and b.dtype == "r1":  # signs and f16 scales, repacked
        wire_rows = pack_bits(b.rows > 0)
        scale = np.ascontiguousarray(b.scale, dtype="<f2")
    elif isinstance(b, DecodedBatch) and b.dtype == "r1e":  # signs and scale codes, repacked
        wire_rows = pack_bits(np.asarray(b.rows > 0).reshape(-1))
        scale = pack_scale_codes(b.scale)
    elif isinstance(b, DecodedBatch) and b.dtype in _WIRE_FORM:
        wire_rows = np.ascontiguousarray(b.rows)
        scale = None if b.scale is None else np.ascontiguousarray(b.scale, dtype="<f4")
    else:
        wire_rows, scale = quantize(b.rows, b.dtype)
    ids = np.ascontiguousarray(b.ids, dtype="<i8")
    tomb = None if b.tombstones is None else np.ascontiguousarray(b.tombstones, dtype="<i8")
    fresh = None if b.fresh is None or not np.any(b.fresh) else \
        pack_bits(np.asarray(b.fresh, dtype=bool))
    return pack_message(b, ids, wire_rows, scale, tomb, version=version, dim=b.dim,
                        fresh=fresh)


def encode(batch: DeltaBatch, *, max_message_bytes: int = 1 << 20,
           version: int = VERSION) -> list[bytes]:
    """Encode ``batch`` as messages of at most ``max_message_bytes`` bytes each.

    Returns one message per piece of :func:`split` (seq ``batch.seq``, ``batch.seq + 1`` …);
    ``[]`` for a batch with no rows and no tombstones. ``version`` 1 writes the old format
    (for tests of v1 decoding; it cannot carry a column slice).
    """
    if not isinstance(max_message_bytes, int) or max_message_bytes <= 0:
        raise WireError(f"max_message_bytes: expected a positive int, got {max_message_bytes!r}")
    if isinstance(version, bool) or version not in VERSIONS:
        raise WireError(f"version: expected one of {VERSIONS}, got {version!r}")
    need = residual_version(getattr(batch, "dtype", None))
    if version < need:
        raise WireError(f"version: dtype {batch.dtype} (residuals) needs wire "
                        f"v{need} or later, got v{version}")
    if version == 1 and batch.is_column_slice:
        raise WireError(f"version: wire v1 cannot carry a column slice (col {batch.col}, "
                        f"width {batch.width}); use version 2")
    out = [_pack_one(p, version) for p in split(batch, max_message_bytes)]
    for i, m in enumerate(out):
        if len(m) > max_message_bytes:  # a bug in the size estimate, never bad input
            raise WireError(f"message {i}: {len(m)} bytes exceed max_message_bytes "
                            f"{max_message_bytes}")
    return out


# ----------------------------------------------------------------------------- decode


def _bin(msg: dict, key: str, expected: int) -> memoryview:
    value = msg[key]
    if not isinstance(value, memoryview):
        raise WireError(f"{key}: expected bin, got {type(value).__name__}")
    if len(value) != expected:
        raise WireError(f"{key}: expected {expected} bytes, got {len(value)}")
    return value


def _read_map(view: memoryview) -> dict:
    """The message's map with its keys, int types, version and (v2) CRC trailer checked."""
    if bytes(view[3:3 + len(DENSE_HEAD)]) == DENSE_HEAD:
        # Another message kind on the same topic: say so rather than "missing fields".
        raise WireError("kind: a dense-weights message, not rows; decode it with "
                        "deltastream.dense_wire.decode_dense (tell the kinds apart from the "
                        "Kafka headers with dense_wire.is_dense)")
    reader = Reader(view, len(_REQUIRED | _OPTIONAL))
    msg = reader.top_map(_FIELD_NAMES)
    keys = set(msg)
    if not _REQUIRED <= keys:
        raise WireError(f"message: missing fields {sorted(_REQUIRED - keys)}")
    if keys - _REQUIRED - _OPTIONAL:
        raise WireError(f"message: unknown fields {sorted(map(str, keys - _REQUIRED - _OPTIONAL))}")
    for k in _INT_FIELDS:
        if k in msg and (isinstance(msg[k], bool) or not isinstance(msg[k], int)):
            raise WireError(f"{k}: expected an int, got {type(msg[k]).__name__}")
    version = msg["v"]
    if version not in VERSIONS:
        raise WireError(f"v: unsupported schema version {version} (this reader knows "
                        f"{', '.join(map(str, VERSIONS))})")
    if ("ids" in msg) == ("idv" in msg):
        raise WireError("ids: a message carries exactly one of ids and idv, got "
                        f"{'both' if 'ids' in msg else 'neither'}")
    if reader.int_keys != int_keys(version):
        raise WireError(f"v: wire v{version} keys its fields by "
                        f"{'int' if int_keys(version) else 'name'}, this message by "
                        f"{'int' if reader.int_keys else 'name'}")
    if "idv" in msg and version < COMPACT_IDS_VERSION:
        raise WireError(f"idv: not a field of wire v{version} (varint ids need v3)")
    if version != 1:
        # The trailer is the map's last field, byte for byte; the CRC covers all before it.
        check_crc_trailer(view, reader.last_key_at, msg["crc"], ints=reader.int_keys)
    else:
        for k in _V2_ONLY:
            if k in msg:
                raise WireError(f"{k}: not a field of wire v1 (column slices need v2)")
    return msg


def _residual_parts(msg: dict, rows_b: memoryview, scale: np.ndarray, n: int, dim: int,
                    dtype: str) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """A residual message's rows (int8 ±1, padding bits checked), float32 scale and
    ``fresh`` flags (bool ``[n]``, or None when absent)."""
    bits = np.frombuffer(rows_b, np.uint8)
    signs = unpack_residual_e(bits, n, dim) if dtype == "r1e" else \
        unpack_residual(bits.reshape(n, -(-dim // 8)), dim)
    fresh = None
    if "fresh" in msg:
        fresh = unpack_bits(np.frombuffer(_bin(msg, "fresh", -(-n // 8)), np.uint8), n,
                            f"fresh: padding bits past n = {n}")
    return signs, scale.astype(np.float32), fresh


def decode(data: bytes) -> DecodedBatch:
    """Decode and validate one message into a :class:`DecodedBatch` (checked once, here).
    Raises :class:`WireError` naming the bad field."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"data: expected bytes, got {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except TypeError as e:  # e.g. a non-contiguous memoryview
        raise WireError(f"data: not a contiguous byte buffer ({e})") from None
    msg = _read_map(view)
    check_name("model", msg["model"])
    check_name("table", msg["table"])
    check_int("shard", msg["shard"], 0, (1 << 31) - 1)
    for k in ("epoch", "seq", "step", "ts"):
        check_int(k, msg[k])
    check_int("n", msg["n"], 0, MAX_ROWS)
    check_int("dim", msg["dim"], 1, MAX_DIM)
    check_int("crc", msg["crc"], 0, (1 << 32) - 1)
    dtype = msg["dtype"]
    check_dtype(dtype, residual=True)
    if msg["v"] < residual_version(dtype):
        raise WireError(f"dtype: {dtype} (residuals) is not a dtype of wire v{msg['v']} "
                        f"(needs v{residual_version(dtype)})")
    n, dim = msg["n"], msg["dim"]
    col, width = msg.get("col", 0), msg.get("width", dim)
    _check_columns(col, width, dim)
    # Sizes are checked against the bytes actually present before any array is built,
    # so a message claiming 10^12 rows allocates nothing.
    ids_b = _bin(msg, "ids", n * 8) if "ids" in msg else None
    rows_b = _bin(msg, "rows", rows_nbytes(n, dim, dtype))
    bins = [ids_b, rows_b]
    scale = None
    if has_scale(dtype):
        if "scale" not in msg:
            raise WireError(f"scale: required for dtype {dtype}")
        scale_b = _bin(msg, "scale", scale_nbytes(n, dtype))
        bins.append(scale_b)
        scale = scale_from_codes(np.frombuffer(scale_b, np.uint8)) if dtype == "r1e" else \
            np.frombuffer(scale_b, dtype="<f4" if dtype == "i8" else "<f2")
    elif "scale" in msg:
        raise WireError(f"scale: only allowed for dtype i8, r1 or r1e, not {dtype}")
    tomb = None
    if "del" in msg:
        del_b = msg["del"]
        if not isinstance(del_b, memoryview) or len(del_b) % 8:
            raise WireError("del: expected bin of a multiple of 8 bytes")
        bins.append(del_b)
        tomb = np.frombuffer(del_b, dtype="<i8")
    if msg["v"] == 1:  # v1: the CRC covers the payload bins only
        crc = 0
        for b in bins:
            crc = _crc32c.crc32c(b, crc)
        if crc != msg["crc"]:
            raise WireError(f"crc: CRC-32C mismatch (message says {msg['crc']:#010x}, "
                            f"payload gives {crc:#010x})")
    if ids_b is None:  # v3 varints: read_varint_ids checks count, form and order
        ids_v = msg["idv"]
        if not isinstance(ids_v, memoryview) or len(ids_v) > 8 * n:
            raise WireError(f"idv: expected bin of at most 8 n = {8 * n} bytes")
        ids = read_varint_ids(ids_v, n)
    else:
        ids = np.frombuffer(ids_b, dtype="<i8")
        if n > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            raise WireError("ids: not strictly ascending")
    if scale is not None and not bool(np.all(np.isfinite(scale) & (scale >= 0))):
        raise WireError("scale: expected finite non-negative values")
    if dtype in RESIDUAL_DTYPES:
        rows, scale, fresh = _residual_parts(msg, rows_b, scale, n, dim, dtype)
    elif "fresh" in msg:
        raise WireError(f"fresh: only allowed for dtypes r1 and r1e, not {dtype}")
    else:
        rows, fresh = np.frombuffer(rows_b, dtype=NUMPY_DTYPES[dtype]).reshape(n, dim), None
    if n == 0 and (tomb is None or tomb.size == 0):
        raise WireError("n: a message with no rows must carry tombstones")
    return DecodedBatch(model=msg["model"], table=msg["table"], shard=msg["shard"],
                        epoch=msg["epoch"], seq=msg["seq"], step=msg["step"], ts=msg["ts"],
                        ids=ids, rows=rows, dtype=dtype, scale=scale, tombstones=tomb,
                        col=col, width=width, fresh=fresh)
