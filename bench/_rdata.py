"""Read data frames out of an installed R package's lazy-load database, without R.

R packages built with ``LazyData`` keep their data sets in ``data/Rdata.rdb`` (each object
serialized in R's XDR format and zlib-compressed) with an index ``data/Rdata.rdx`` (a
gzip-compressed serialized list: ``variables`` maps each name to its ``(offset, length)``
in the ``.rdb``). This module reads that index and unserializes one object — enough of the
format for data frames of logical, integer, double, character and factor columns (what
the benchmarks read); any other R type raises ``ValueError`` naming it.

Format: R Internals, "Serialization Formats" and "Lazy loading".
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

__all__ = ["RValue", "unserialize", "lazyload_object", "data_frame_columns", "NA_INTEGER"]

#: R's integer NA (INT_MIN), kept as is in the int64 arrays this module returns
NA_INTEGER = -(2 ** 31)

# SEXP types (R Internals 1.1) and the serialization's special codes
_SYM, _LIST, _CHAR, _LGL, _INT, _REAL, _STR, _VEC = 1, 2, 9, 10, 13, 14, 16, 19
_ALTREP, _REF, _NIL = 238, 255, 254
_SINGLETONS = {241, 242, 247, 251, 252, 253}  # base/empty/global env, namespace, missing
_LENGTH_LONG = -1  # a length >= 2^31 follows as two ints


@dataclass
class RValue:
    """A vector with attributes (``names``, ``class``, ``levels``, ``row.names`` ...)."""

    value: object
    attrs: dict = field(default_factory=dict)


def _plain(x):
    return x.value if isinstance(x, RValue) else x


class _Reader:
    """One pass over an XDR serialization stream (format versions 2 and 3)."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError(f"not an R XDR serialization (starts {data[:2]!r})")
        self.b, self.p, self.refs = data, 2, []
        version = self._int()
        self.p += 8  # the R version that wrote it, the oldest that can read it
        if version == 3:
            self.p += 4 + self._int()  # the native encoding's name
        elif version != 2:
            raise ValueError(f"R serialization version {version} is not supported")

    def _int(self) -> int:
        v = struct.unpack_from(">i", self.b, self.p)[0]
        self.p += 4
        return v

    def _length(self) -> int:
        n = self._int()
        if n == _LENGTH_LONG:
            hi, lo = self._int(), self._int()
            n = (hi << 32) + (lo & 0xFFFFFFFF)
        return n

    def _array(self, dtype: str, width: int) -> np.ndarray:
        n = self._length()
        v = np.frombuffer(self.b, dtype, n, self.p)
        self.p += width * n
        return v

    def item(self):
        """The next object: ``None`` (NULL), ``str`` (a symbol or string), int64 / float64
        numpy arrays, lists, pairlists as ``[(tag, value), ...]``, or :class:`RValue`."""
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == _NIL or kind in _SINGLETONS:
            return None
        if kind == _REF:  # a symbol seen before
            return self.refs[(flags >> 8 or self._int()) - 1]
        if kind == _SYM:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == _CHAR:
            n = self._int()
            if n == -1:
                return None  # NA_character_
            s = self.b[self.p:self.p + n].decode("utf-8", errors="replace")
            self.p += n
            return s
        if kind == _LIST:
            attrs = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            head = [(tag, self.item())]
            rest = self.item()
            del attrs  # a pairlist's own attributes: none in the objects read here
            return head + (rest if isinstance(rest, list) else [])
        if kind in (_LGL, _INT):
            return self._with_attrs(self._array(">i4", 4).astype(np.int64), has_attr)
        if kind == _REAL:
            return self._with_attrs(self._array(">f8", 8).astype(np.float64), has_attr)
        if kind in (_STR, _VEC):
            n = self._length()
            return self._with_attrs([self.item() for _ in range(n)], has_attr)
        if kind == _ALTREP:
            return self._altrep()
        raise ValueError(f"R object type {kind} at byte {self.p - 4} is not supported")

    def _with_attrs(self, value, has_attr: int):
        if not has_attr:
            return value
        return RValue(value, {str(k): v for k, v in self.item()})

    def _altrep(self):
        info, state = self.item(), self.item()
        attrs = self.item()
        cls = info[0][1] if isinstance(info, list) and info else info
        if cls == "compact_intseq":  # state: (length, first, step) as doubles
            n, first, step = (int(x) for x in state)
            value = np.arange(first, first + n * step, step, dtype=np.int64) if n else \
                np.zeros(0, np.int64)
        elif cls == "compact_realseq":
            n, first, step = state
            value = first + step * np.arange(int(n), dtype=np.float64)
        elif isinstance(cls, str) and cls.startswith("wrap_"):
            value = _plain(state[0])  # wrapper around an ordinary vector
        else:
            raise ValueError(f"R ALTREP class {cls!r} is not supported")
        if isinstance(attrs, list):
            return RValue(value, {str(k): v for k, v in attrs})
        return value


def unserialize(data: bytes):
    """The object serialized in ``data`` (R's XDR format; see :meth:`_Reader.item` for
    the Python shapes). Raises ``ValueError`` on another format or an unsupported type."""
    return _Reader(data).item()


def lazyload_object(rdx: bytes, rdb: bytes, name: str):
    """Object ``name`` of a lazy-load database: ``rdx`` the bytes of ``Rdata.rdx``,
    ``rdb`` those of ``Rdata.rdb``. Raises ``KeyError`` naming the objects it holds when
    ``name`` is not one, ``ValueError`` when the entry does not unpack (``zlib.error``, ``lzma.LZMAError``,
    ``OSError`` from bzip2 are passed on)."""
    index = unserialize(gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else rdx)
    entries = dict(zip(index.attrs["names"], index.value, strict=True))
    variables = entries["variables"]
    where = dict(zip(variables.attrs["names"], variables.value, strict=True))
    if name not in where:
        raise KeyError(f"no {name!r} in the database (it holds {sorted(where)})")
    offset, length = (int(x) for x in _plain(where[name]))
    blob = rdb[offset:offset + length]
    if len(blob) != length:
        raise ValueError(f"the database is truncated: {name!r} needs bytes {offset}.."
                         f"{offset + length}, it has {len(rdb)}")
    # 4 bytes: the serialized length; then a zlib stream (R's default), or a type byte
    # and the data (LazyDataCompression: '2' bzip2, 'X' xz, 'Z' zlib, '0' none)
    body, kind = blob[5:], blob[4:5]
    unpack = {b"2": bz2.decompress, b"X": lzma.decompress, b"Z": zlib.decompress,
              b"0": bytes}.get(kind)
    if unpack is None:
        body, unpack = blob[4:], zlib.decompress
    return unserialize(unpack(body))


def data_frame_columns(frame) -> dict:
    """``{column name: values}`` of an unserialized data frame: numeric columns as numpy
    arrays (integers int64 with :data:`NA_INTEGER`, doubles float64 with NaN for NA),
    character columns as lists, factors as their level strings. Raises ``ValueError``
    when ``frame`` is not a data frame."""
    if not isinstance(frame, RValue) or "data.frame" not in (frame.attrs.get("class") or []):
        raise ValueError("not an R data frame")
    out = {}
    for col, v in zip(frame.attrs["names"], frame.value, strict=True):
        if isinstance(v, RValue) and "levels" in v.attrs:  # factor: 1-based level codes
            levels = np.asarray(v.attrs["levels"], dtype=object)
            codes = np.asarray(v.value)
            out[col] = [None if c == NA_INTEGER else levels[c - 1] for c in codes]
        else:
            out[col] = _plain(v)
    return out
