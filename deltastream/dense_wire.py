"""Wire kind "dense": one Kafka message carries a piece of one dense tensor of a model version.

Torch-free (numpy + msgpack), like :mod:`deltastream.wire` (the row kind), and framed the
same way: one msgpack map16, every array a bin32, and the same 9-byte CRC-32C trailer over
every byte before it (the helpers of :mod:`deltastream.wire_codec`). ``docs/DESIGN.md``
("Wire kind dense") has the fields byte by byte.

A **version** is ``(epoch, step)``: the trainer's ``state_dict`` tensors (minus the tracked
tables, or a named subset) at that step. A full version carries every tensor; a partial one
(``full`` False) only the tensors changed since the version ``(epoch, base_step)``. A version
is ``chunks`` messages (``index`` 0 … chunks-1), each one flat, row-major element range
``[offset, offset + n)`` of one tensor ``name`` of shape ``shape``; a predictor serves it
once all its chunks have arrived.

Telling kinds apart: a dense record's Kafka headers carry ``kind`` = ``dense`` (row records
have no ``kind`` header: :func:`is_dense`), its key is ``"<model>/<shard>"`` (one ``/``;
row keys ``"<model>/<table>/<shard>"`` have two, and names never contain ``/``), and its
bytes begin, after the map header, with ``v`` 2 then ``kind`` "dense"
(:data:`~deltastream.wire_codec.DENSE_HEAD`), so :func:`deltastream.wire.decode` refuses it
by name. :func:`decode_dense` refuses a row message (no ``kind``).

Dtypes and their worst-case error against the float32 value encoded (as for rows):
``f32`` exact; ``f16`` relative ≤ 2⁻¹¹ for |x| ≥ 6.1e-5, absolute ≤ 2⁻²⁵ below, |x| > 65504
refused; ``bf16`` relative ≤ 2⁻⁸ (round to nearest even) for normal values, values that
would round to inf refused.

:func:`encode_dense` takes a list of chunks and returns one message per chunk (the chunks
already fit: :func:`chunk_version` cuts them under ``max_message_bytes``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from deltastream.errors import WireError
from deltastream.wire import check_int, check_name
from deltastream.wire_codec import (
    DENSE_HEAD,
    DTYPES,
    NUMPY_DTYPES,
    VERSION,
    Reader,
    check_crc_trailer,
    join_with_crc,
    map_header,
    quantize,
)

__all__ = [
    "KIND",
    "DENSE_DTYPES",
    "MAX_TENSOR_NAME",
    "MAX_NDIM",
    "MAX_ELEMENTS",
    "DenseChunk",
    "chunk_version",
    "encode_dense",
    "decode_dense",
    "dense_key",
    "dense_headers",
    "is_dense",
    "is_dense_payload",
    "STREAM",
]

#: the ``kind`` field and Kafka header value of this message kind
KIND = "dense"
#: the dense stream's name where streams are listed by table (publisher stats, replay
#: stats, errors); the leading ``/`` keeps it apart from every table name
STREAM = "/dense"
#: wire dtypes a dense tensor may travel in (no i8: its row-wise scale has no rows here)
DENSE_DTYPES = ("f32", "bf16", "f16")
#: longest tensor name (a ``state_dict`` key), in characters
MAX_TENSOR_NAME = 1024
#: most dimensions of a tensor
MAX_NDIM = 32
#: most elements of one tensor (2⁴⁸)
MAX_ELEMENTS = 1 << 48
_TENSOR_NAME_RE = re.compile(r"[^\x00-\x1f\x7f]+")
# Bytes of a message besides its values and its name: keys, ints, shape (≤ 32 × 8), trailer.
_FIXED_OVERHEAD = 512
_SCALARS = ("v", "kind", "model", "shard", "epoch", "seq", "step", "ts", "full", "base",
            "tensors", "chunks", "index", "name", "offset", "n", "dtype")
_FIELDS = _SCALARS + ("shape", "values", "crc")
_NO_VALUES = np.empty(0, np.float32)


@dataclass(frozen=True, eq=False)
class DenseChunk:
    """One message of a dense version: elements ``[offset, offset + len(values))`` of the
    flattened (row-major) tensor ``name``.

    Attributes:
        model: model name (the row rule: non-empty, ≤ 255 chars, no ``/``).
        shard: trainer shard (rank) that publishes (≥ 0).
        epoch: trainer incarnation. seq: per (model, shard, epoch) of the dense stream,
            0, 1, 2 … one per message (its own stream, apart from the row tables' seqs).
        step: trainer global step; the version is ``(epoch, step)``. ts: trainer wall
            clock (ns) when the tensors were copied.
        full: True for a full version, False when only changed tensors are carried.
        base_step: the version ``(epoch, base_step)`` a partial version builds on
            (``== step`` for a full version).
        tensors: tensors in this version. chunks: messages in this version (all tensors).
        index: this message's index in the version, ``0 … chunks - 1``.
        name: ``state_dict`` key of the tensor. shape: the whole tensor's shape.
        offset: first flat element carried.
        dtype: wire dtype, ``f32`` (default), ``bf16`` or ``f16``.
        values: 1-D. For a chunk you build: any float array (converted to ``dtype`` on
            encode). Decoded: the wire representation, a zero-copy view (float32, float16,
            or bf16 bit patterns as uint16); :meth:`values_f32` gives float32.
    """

    model: str
    shard: int
    epoch: int
    seq: int
    step: int
    ts: int
    full: bool
    base_step: int
    tensors: int
    chunks: int
    index: int
    name: str
    shape: tuple[int, ...]
    offset: int
    dtype: str
    values: np.ndarray

    def values_f32(self) -> np.ndarray:
        """The carried values as float32 ``[n]`` (dequantized from bf16/f16)."""
        if self.dtype == "bf16" and self.values.dtype == np.uint16:
            return (self.values.astype(np.uint32) << 16).view(np.float32)
        return np.asarray(self.values, dtype=np.float32)


# ----------------------------------------------------------------------------- checks


def _check_tensor_name(value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_TENSOR_NAME \
            or not _TENSOR_NAME_RE.fullmatch(value):
        raise WireError(f"name: expected a non-empty str of ≤ {MAX_TENSOR_NAME} chars without "
                        f"control characters, got {value!r:.80}")


def _check_dtype(value: Any) -> None:
    if not isinstance(value, str) or value not in DENSE_DTYPES:
        raise WireError(f"dtype: expected one of {list(DENSE_DTYPES)}, got {value!r}")


def _check_shape(shape: Any) -> int:
    """Elements of ``shape`` (a tuple of ints ≥ 0), else :class:`WireError`."""
    if not isinstance(shape, tuple) or len(shape) > MAX_NDIM:
        raise WireError(f"shape: expected a tuple of at most {MAX_NDIM} ints, got {shape!r}")
    for d in shape:
        check_int("shape", d, 0, MAX_ELEMENTS)
    size = math.prod(int(d) for d in shape)
    if size > MAX_ELEMENTS:
        raise WireError(f"shape: {shape} has {size} elements, at most {MAX_ELEMENTS} allowed")
    return size


def _check_head(c: DenseChunk, n: int) -> None:
    """Every field of ``c`` but ``values`` (``n`` of them carried), in wire order."""
    check_name("model", c.model)
    check_int("shard", c.shard, 0, (1 << 31) - 1)
    for k in ("epoch", "seq", "step", "ts"):
        check_int(k, getattr(c, k))
    if not isinstance(c.full, (bool, np.bool_)):
        raise WireError(f"full: expected a bool, got {type(c.full).__name__}")
    check_int("base", c.base_step, 0, c.step)
    if bool(c.full) != (c.base_step == c.step):
        raise WireError(f"base: a {'full' if c.full else 'partial'} version must have base "
                        f"{'==' if c.full else '<'} step, got base {c.base_step}, step {c.step}")
    check_int("chunks", c.chunks, 1, (1 << 31) - 1)
    check_int("tensors", c.tensors, 1, c.chunks)
    check_int("index", c.index, 0, c.chunks - 1)
    _check_tensor_name(c.name)
    size = _check_shape(c.shape)
    check_int("offset", c.offset, 0, size)
    check_int("n", n, 0 if size == 0 else 1, size - c.offset)
    _check_dtype(c.dtype)


# ----------------------------------------------------------------------------- encode


def chunk_version(tensors: Mapping[str, np.ndarray], *, model: str, shard: int, epoch: int,
                  seq: int, step: int, ts: int, base_step: Optional[int] = None,
                  dtype: str = "f32", max_message_bytes: int = 1 << 20) -> list[DenseChunk]:
    """Cut one version into chunks whose messages each fit in ``max_message_bytes``.

    ``tensors`` maps names to float arrays of any shape (a partial version: only the
    changed ones), in the order they are sent. ``base_step`` None makes a full version.
    Chunks get seqs ``seq, seq + 1 …`` and indexes ``0 … chunks - 1``; each carries a
    flat element range of one tensor (a tensor with no elements: one empty chunk).
    """
    if not tensors:
        raise WireError("tensors: a version needs at least one tensor")
    _check_dtype(dtype)
    check_int("max_message_bytes", max_message_bytes, 1)
    per = DTYPES[dtype]
    plan: list[tuple[str, np.ndarray, int, int]] = []  # name, flat, offset, n
    for name, arr in tensors.items():
        _check_tensor_name(name)
        budget = (max_message_bytes - _FIXED_OVERHEAD - len(model.encode())
                  - len(name.encode())) // per
        if budget < 1:
            raise WireError(f"max_message_bytes: {max_message_bytes} cannot hold one element "
                            f"of {name!r} plus the {_FIXED_OVERHEAD}-byte header")
        flat = np.asarray(arr).reshape(-1)
        plan += [(name, flat, a, min(budget, flat.size - a))
                 for a in range(0, max(flat.size, 1), budget)]
    base = step if base_step is None else base_step
    return [DenseChunk(model=model, shard=shard, epoch=epoch, seq=seq + i, step=step, ts=ts,
                       full=base_step is None, base_step=base, tensors=len(tensors),
                       chunks=len(plan), index=i, name=name,
                       shape=tuple(int(d) for d in np.shape(tensors[name])), offset=a,
                       dtype=dtype, values=flat[a:a + n])
            for i, (name, flat, a, n) in enumerate(plan)]


def _wire_values(c: DenseChunk) -> np.ndarray:
    values = np.asarray(c.values)
    if values.ndim != 1:
        raise WireError(f"values: expected a 1-D array, got shape {values.shape}")
    if c.dtype == "bf16" and values.dtype == np.uint16:  # already bf16 bit patterns (relay)
        return np.ascontiguousarray(values, dtype="<u2")
    if values.dtype.kind != "f":
        raise WireError(f"values: expected a float array, got {values.dtype}")
    try:
        return quantize(values, c.dtype)[0]
    except WireError as e:
        raise WireError(f"values of {c.name!r}: {e}") from None


def _pack(c: DenseChunk) -> bytes:
    values = _wire_values(c)
    n = int(values.shape[0])
    _check_head(c, n)
    scalars = {"v": VERSION, "kind": KIND, "model": c.model, "shard": int(c.shard),
               "epoch": int(c.epoch), "seq": int(c.seq), "step": int(c.step), "ts": int(c.ts),
               "full": bool(c.full), "base": int(c.base_step), "tensors": int(c.tensors),
               "chunks": int(c.chunks), "index": int(c.index), "name": c.name,
               "offset": int(c.offset), "n": n, "dtype": c.dtype}
    shape = np.asarray(c.shape, dtype="<i8")
    return join_with_crc(map_header(scalars, 3), [("shape", shape.nbytes, shape.data),
                                                  ("values", values.nbytes, values.data)])


def encode_dense(chunks: Iterable[DenseChunk]) -> list[bytes]:
    """One message per chunk, in order. Raises :class:`WireError` naming the bad field.

    Each message is ``len(name) + 8 × ndim + n × itemsize`` bytes plus at most 512 (so
    chunks from :func:`chunk_version` fit its ``max_message_bytes``).
    """
    out = []
    for c in chunks:
        if not isinstance(c, DenseChunk):
            raise WireError(f"chunk: expected a DenseChunk, got {type(c).__name__}")
        out.append(_pack(c))
    return out


# ----------------------------------------------------------------------------- decode


def _read_map(view: memoryview) -> dict:
    """The message's map with its kind, keys, version and CRC trailer checked."""
    reader = Reader(view, len(_FIELDS))
    msg = reader.top_map()
    if "kind" not in msg:
        raise WireError("kind: missing, so not a dense-weights message (row messages are "
                        "decoded by deltastream.wire.decode)")
    if msg["kind"] != KIND:
        raise WireError(f"kind: expected {KIND!r}, got {msg['kind']!r}")
    keys = set(msg)
    if keys - set(_FIELDS):
        raise WireError(f"message: unknown fields {sorted(keys - set(_FIELDS))}")
    if set(_FIELDS) - keys:
        raise WireError(f"message: missing fields {sorted(set(_FIELDS) - keys)}")
    if msg["v"] != VERSION or isinstance(msg["v"], bool):
        raise WireError(f"v: expected {VERSION} for kind dense, got {msg['v']!r}")
    check_int("crc", msg["crc"], 0, (1 << 32) - 1)
    check_crc_trailer(view, reader.last_key_at, msg["crc"])
    return msg


def _bin(msg: dict, key: str, expected: Optional[int] = None) -> memoryview:
    value = msg[key]
    if not isinstance(value, memoryview):
        raise WireError(f"{key}: expected bin, got {type(value).__name__}")
    if expected is not None and len(value) != expected:
        raise WireError(f"{key}: expected {expected} bytes, got {len(value)}")
    return value


def decode_dense(payload: bytes) -> DenseChunk:
    """Decode and validate one dense message (every field type- and range-checked, sizes
    before any array is built, then the CRC-32C). Raises :class:`WireError` naming the
    field; ``values`` is a zero-copy view in the wire dtype."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise WireError(f"data: expected bytes, got {type(payload).__name__}")
    try:
        view = memoryview(payload).cast("B")
    except TypeError as e:
        raise WireError(f"data: not a contiguous byte buffer ({e})") from None
    msg = _read_map(view)
    shape_b = _bin(msg, "shape")
    if len(shape_b) % 8:
        raise WireError(f"shape: expected a multiple of 8 bytes, got {len(shape_b)}")
    shape = tuple(int(d) for d in np.frombuffer(shape_b, dtype="<i8"))
    _check_dtype(msg["dtype"])
    n = check_int("n", msg["n"], 0, MAX_ELEMENTS)
    head = DenseChunk(model=msg["model"], shard=msg["shard"], epoch=msg["epoch"],
                      seq=msg["seq"], step=msg["step"], ts=msg["ts"], full=msg["full"],
                      base_step=msg["base"], tensors=msg["tensors"], chunks=msg["chunks"],
                      index=msg["index"], name=msg["name"], shape=shape,
                      offset=msg["offset"], dtype=msg["dtype"], values=_NO_VALUES)
    _check_head(head, n)
    # sizes agree before any array is built
    values_b = _bin(msg, "values", n * DTYPES[head.dtype])
    return replace(head, values=np.frombuffer(values_b, dtype=NUMPY_DTYPES[head.dtype]))


# ----------------------------------------------------------------------------- Kafka


def dense_key(model: str, shard: int) -> bytes:
    """The Kafka key of every dense message of (model, shard): ``"<model>/<shard>"``."""
    return f"{model}/{shard}".encode()


def dense_headers(c: DenseChunk) -> list[tuple[str, bytes]]:
    """Kafka headers: ``kind`` = ``dense`` first, then model, shard, epoch, seq, step."""
    return [("kind", KIND.encode()), ("model", c.model.encode()),
            ("shard", str(c.shard).encode()), ("epoch", str(c.epoch).encode()),
            ("seq", str(c.seq).encode()), ("step", str(c.step).encode())]


def is_dense(headers: Any) -> bool:
    """True when a record's Kafka headers (``[(key, bytes)]``) mark it a dense message;
    row records carry no ``kind`` header."""
    return any(k == "kind" and v == KIND.encode() for k, v in headers or ())


def is_dense_payload(payload: Any) -> bool:
    """True when ``payload`` begins like a dense message (for records without headers;
    :func:`decode_dense` still checks everything)."""
    return isinstance(payload, (bytes, bytearray, memoryview)) \
        and bytes(payload[3:3 + len(DENSE_HEAD)]) == DENSE_HEAD
