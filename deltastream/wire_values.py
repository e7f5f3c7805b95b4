"""Row values on the wire: the full-row dtypes and the 1-bit residual, their sizes and codecs.

Full rows (``dtype`` one of :data:`DTYPES`) replace what a predictor holds; a **residual**
(``dtype`` ``"r1"``, :data:`RESIDUAL_DTYPES`, wire v4 on) is *added* to it. ``r1`` carries
one sign bit per element and one float16 scale per row::

    s = f16(mean |r|)                      (computed in float32, then rounded to float16)
    applied = +s where r >= 0, else -s     (float32; what the predictor adds)

so a dim-32 row costs 4 bytes of signs and 2 of scale. The bits are packed 8 to a byte,
little bit order (element ``j`` is bit ``j % 8`` of byte ``j // 8``), ``ceil(dim / 8)``
bytes a row, the unused high bits of the last byte zero. The trainer mirrors what
predictors hold with :func:`residual_values` — the same float32 additions the predictor
makes — so it knows the error the residual left, and sends it again (error feedback).

``r1e`` (wire v5 on) is ``r1`` in fewer bytes: the sign bits are packed over the whole
message (element ``j`` of row ``i`` is bit ``i · dim + j``: ``ceil(n · dim / 8)`` bytes, so
a dim-1 row costs one bit, not a byte), and each row's scale is one byte, a code ``c`` on
a grid of sixteenth octaves above the message's base exponent ``b`` (an int8, the scale
bin's first byte)::

    c = 0:  s = 0 (the row is unchanged)
    c ≥ 1:  s = 2^(b + (c − 1) / 16)       (float32: a table of 2^(k/16), times 2^e exactly)
    b = floor(log2 max_rows mean|r|) − 14, clamped to [−128, 127]
    c = round(16 · (log2 mean|r| − b)) + 1, 0 when that is below 1
    then b is raised to the octave of the smallest scale sent (and the codes lowered with
    it), so that a message has one encoding

so a scale is within 2.2 % of ``mean |r|`` (2^(1/32) − 1), rows more than 14–15 octaves
below the message's largest go as 0 (their residual stays with the trainer), and a dim-32
row costs 5 bytes, a dim-1 row 1.125. What the residual misses stays pending like any other
(error feedback).

Torch-free (:func:`to_f16` uses torch only when the caller has already imported it).
"""

from __future__ import annotations

import sys
from typing import Optional

import numpy as np

from deltastream.errors import WireError

__all__ = [
    "DTYPES",
    "NUMPY_DTYPES",
    "RESIDUAL_DTYPES",
    "RESIDUAL_VERSION",
    "RESIDUAL_VERSIONS",
    "F16_MAX",
    "BF16_OVERFLOW",
    "max_abs_finite",
    "error_bound",
    "quantize",
    "to_f16",
    "rows_nbytes",
    "scale_nbytes",
    "has_scale",
    "pack_bits",
    "unpack_bits",
    "unpack_residual",
    "residual_scale",
    "residual_values",
    "residual_fits",
    "residual_version",
    "value_bytes",
    "pack_scale_codes",
    "scale_from_codes",
]

#: wire dtype -> bytes per element
DTYPES = {"f32": 4, "f16": 2, "bf16": 2, "i8": 1}
#: wire dtype -> numpy dtype of its rows on the wire (bf16 as its uint16 bit pattern)
NUMPY_DTYPES = {"f32": "<f4", "f16": "<f2", "bf16": "<u2", "i8": "i1"}
#: largest finite float16 magnitude; larger values are refused for dtype f16
F16_MAX = 65504.0
#: smallest float32 that rounds to inf in bf16 (0x7F7F8000: a tie that rounds to even = up)
BF16_OVERFLOW = float(np.array(0x7F7F8000, dtype=np.uint32).view(np.float32))

# Elements per torch cast call: below torch's parallel grain size (32768), so each call
# runs in this thread instead of waking the intra-op thread pool, which on a machine whose
# cores are busy (training, the producer's sender thread) costs 10-50x.
_CAST_CHUNK = 32767

# ----------------------------------------------------------------------------- full rows


def max_abs_finite(rows: np.ndarray) -> tuple[float, bool]:
    """(largest finite ``|value|`` of ``rows``, whether all values are finite)."""
    if not rows.size:
        return 0.0, True
    # min/max reduce without a temporary (np.abs would copy the whole array).
    hi = max(-float(np.min(rows)), float(np.max(rows)))
    if np.isfinite(hi):
        return hi, True
    finite = rows[np.isfinite(rows)]  # slow path: only when non-finite values are present
    return (float(np.max(np.abs(finite))) if finite.size else 0.0), False


def quantize(rows: np.ndarray, dtype: str) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Float rows ``[n, dim]`` -> (wire array ``[n, dim]``, float32 scale ``[n]`` or None);
    for ``r1``, residuals -> (sign bits ``[n, ceil(dim/8)]``, float16 scale ``[n]``); for
    ``r1e`` (sign bits ``[ceil(n · dim / 8)]``, the uint8 scale bin ``[n + 1]``).

    Raises :class:`WireError` for values the dtype cannot carry (see
    :mod:`deltastream.wire` for each dtype's range and error bound).
    """
    if dtype == "f32":
        return np.ascontiguousarray(rows, dtype="<f4"), None
    if dtype == "f16":
        if rows.dtype != np.float16:
            if max_abs_finite(rows)[0] > F16_MAX:
                raise WireError(f"rows: a value exceeds the f16 range (±{F16_MAX:g}); "
                                "use dtype 'bf16' or 'f32'")
            rows = rows.astype(np.float16)
        return np.ascontiguousarray(rows, dtype="<f2"), None
    if dtype == "r1e":
        return _residual_r1e(rows)
    if dtype in RESIDUAL_DTYPES:
        return _residual_r1(rows)
    r32 = np.ascontiguousarray(rows, dtype=np.float32)
    if dtype == "bf16":
        return _to_bf16(r32), None
    return _to_i8(r32)


def error_bound(rows: np.ndarray, dtype: str) -> np.ndarray:
    """Largest L2 error (float64 ``[n]``) a whole row of finite ``rows`` ``[n, dim]`` may
    carry in ``dtype``, from the per-element bounds of :mod:`deltastream.wire`: 0 for
    f32; ``‖row‖ · 2⁻¹¹`` (+ ``√dim · 2⁻²⁵`` below f16's normal range) for f16;
    ``‖row‖ · 2⁻⁸`` (+ ``√dim · 2⁻¹³⁴``) for bf16; ``√dim · max|row| · (1/254 + 2⁻²²)``
    for i8."""
    r = np.asarray(rows, dtype=np.float64)
    n, dim = r.shape
    if dtype == "f32" or not n:
        return np.zeros(n)
    root = np.sqrt(dim)
    if dtype == "i8":
        return root * np.abs(r).max(axis=1) * (1 / 254 + 2.0 ** -22)
    norm = np.linalg.norm(r, axis=1)
    if dtype == "f16":
        return norm * 2.0 ** -11 + root * 2.0 ** -25
    if dtype == "bf16":
        return norm * 2.0 ** -8 + root * 2.0 ** -134
    raise WireError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")


def _to_bf16(r32: np.ndarray) -> np.ndarray:
    if max_abs_finite(r32)[0] >= BF16_OVERFLOW:
        raise WireError(f"rows: a value exceeds the bf16 range (|x| < {BF16_OVERFLOW:.8g}); "
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
    return rounded


def _to_i8(r32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise symmetric int8: ``scale = max|row| / 127``, ``q = round(x / scale)``."""
    if not max_abs_finite(r32)[1]:
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


def to_f16(rows: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """float ``[n, dim]`` -> float16 (range already checked), round to nearest even, into
    ``out`` (a C-contiguous float16 array of the same shape) when given.

    Uses torch's vectorised cast when the trainer has already imported torch (5-10x
    numpy's, which has no SIMD path for it); never imports torch itself.
    """
    torch = sys.modules.get("torch")
    if torch is None or rows.dtype not in (np.float32, np.float64):
        if out is None:
            return rows.astype(np.float16)
        np.copyto(out, rows, casting="same_kind")
        return out
    if out is None:
        out = np.empty(rows.shape, dtype=np.float16)
    src = torch.from_numpy(np.ascontiguousarray(rows)).view(-1)
    dst = torch.from_numpy(out).view(-1)
    for a in range(0, src.numel(), _CAST_CHUNK):
        dst[a:a + _CAST_CHUNK].copy_(src[a:a + _CAST_CHUNK])
    return out


# ----------------------------------------------------------------------------- residuals

#: residual dtype -> bits per element (added to the row a predictor holds, not replacing it)
RESIDUAL_DTYPES = {"r1": 1, "r1e": 1}
#: the first wire version that may carry a residual dtype
RESIDUAL_VERSION = 4
#: residual dtype -> the first wire version that carries it
RESIDUAL_VERSIONS = {"r1": 4, "r1e": 5}
#: 2^(k/16), k = 0 … 15, as float32: the mantissas of r1e's scale grid (written out, so
#: every platform decodes the same float32 scales)
_SIXTEENTHS = np.array([float.fromhex(h) for h in (
    "0x1p+0", "0x1.0b5586p+0", "0x1.172b84p+0", "0x1.2387a6p+0", "0x1.306fep+0",
    "0x1.3dea64p+0", "0x1.4bfdaep+0", "0x1.5ab07ep+0", "0x1.6a09e6p+0", "0x1.7a1148p+0",
    "0x1.8ace54p+0", "0x1.9c4918p+0", "0x1.ae89fap+0", "0x1.c199bep+0", "0x1.d5818ep+0",
    "0x1.ea4afap+0")], dtype=np.float32)
_E_SPAN = 14  # r1e's base: this many octaves below the message's largest scale


def residual_version(dtype: str) -> int:
    """The first wire version that carries ``dtype`` (1 for a full-row dtype)."""
    return RESIDUAL_VERSIONS.get(dtype, 1)


def rows_nbytes(n: int, dim: int, dtype: str) -> int:
    """Bytes of the ``rows`` bin of ``n`` rows of width ``dim`` in ``dtype`` (a full-row
    or residual dtype)."""
    if dtype == "r1e":
        return -(-n * dim // 8)
    if dtype in RESIDUAL_DTYPES:
        return n * -(-dim // 8)
    return n * dim * DTYPES[dtype]


def has_scale(dtype: str) -> bool:
    """Whether messages of ``dtype`` carry a ``scale`` bin (``i8``, ``r1``, ``r1e``)."""
    return dtype in ("i8", "r1", "r1e")


def scale_nbytes(n: int, dtype: str) -> int:
    """Bytes of the ``scale`` bin of ``n`` rows: float32 for i8, float16 for r1, the base
    and one code a row for r1e, else 0."""
    return {"i8": 4 * n, "r1": 2 * n, "r1e": n + 1}.get(dtype, 0)


def value_bytes(dim: int, dtype: str) -> float:
    """Bytes one more row of width ``dim`` adds to a message of ``dtype``, its id apart
    (r1e: ``dim / 8 + 1``, its bits shared with its neighbours')."""
    if dtype == "r1e":
        return dim / 8 + 1
    return rows_nbytes(1, dim, dtype) + scale_nbytes(1, dtype)


def pack_bits(flags: np.ndarray) -> np.ndarray:
    """bool ``[..., k]`` -> uint8 ``[..., ceil(k / 8)]``: little bit order (element ``j`` is
    bit ``j % 8`` of byte ``j // 8``), the unused high bits of the last byte zero."""
    return np.packbits(flags, axis=-1, bitorder="little")


def unpack_bits(bits: np.ndarray, count: int, padding: str) -> np.ndarray:
    """uint8 ``[..., ceil(count / 8)]`` from :func:`pack_bits` -> bool ``[..., count]``.
    Raises :class:`WireError` "``padding`` must be zero" when a bit past ``count`` is set."""
    if count % 8 and bits.size and bool(np.any(bits[..., -1] >> (count % 8))):
        raise WireError(f"{padding} must be zero")
    return np.unpackbits(bits, axis=-1, count=count, bitorder="little").view(np.bool_)


def scale_from_codes(scale: np.ndarray) -> np.ndarray:
    """An r1e ``scale`` bin (uint8 ``[n + 1]``: the base as int8, then the codes) ->
    float32 ``[n]`` (see the module docstring)."""
    base = int(scale[:1].view(np.int8)[0])
    c = scale[1:].astype(np.int64) - 1
    with np.errstate(over="ignore"):  # past float32: inf, which decode refuses by name
        out = np.ldexp(_SIXTEENTHS[c % 16], base + c // 16).astype(np.float32)
    out[c < 0] = 0.0
    return out


def pack_scale_codes(scale: np.ndarray) -> np.ndarray:
    """Float32 r1e scales ``[n]`` that are on its grid (decoded ones) -> the uint8 ``scale``
    bin ``[n + 1]`` that decodes to them, with the largest base that reaches the smallest
    (exact: a relay re-encodes a decoded message without changing what it adds)."""
    s = np.asarray(scale, dtype=np.float32)
    nz = s > 0
    frac, exp = np.frexp(s)  # s = frac · 2^exp, frac in [0.5, 1)
    octave = exp.astype(np.int64) - 1
    k = np.searchsorted(_SIXTEENTHS, (frac * 2).astype(np.float32))
    base = int(np.clip(octave[nz].min(), -128, 127)) if nz.any() else 0
    codes = np.where(nz, 16 * (octave - base) + k + 1, 0)
    if codes.size and (codes.max() > 255 or codes.min() < 0 or
                       not np.array_equal(scale_from_codes(_bin_of(base, codes)), s)):
        raise WireError("scale: r1e scales must lie on its grid within 16 octaves")
    return _bin_of(base, codes)


def _bin_of(base: int, codes: np.ndarray) -> np.ndarray:
    out = np.empty(codes.size + 1, np.uint8)
    out[:1] = np.array([base], np.int8).view(np.uint8)
    out[1:] = codes
    return out


def _r1e_scale_bin(r32: np.ndarray) -> np.ndarray:
    """r1e's ``scale`` bin (uint8 ``[n + 1]``) for float32 residuals ``[n, dim]``: codes on
    a provisional base, then in the one form :func:`pack_scale_codes` gives (a relay
    re-encodes the very bytes)."""
    if not max_abs_finite(r32)[1]:
        raise WireError("rows: dtype r1e cannot carry non-finite residuals (inf/NaN)")
    mean = residual_scale(r32)
    if not bool(np.all(np.isfinite(mean))):
        raise WireError("scale: a residual's mean magnitude overflows float32; send the "
                        "row whole")
    nz = mean > 0
    base = 0
    codes = np.zeros(mean.shape[0], np.int64)
    if nz.any():
        with np.errstate(divide="ignore"):
            lg = np.log2(mean.astype(np.float64))
        base = int(np.clip(np.floor(lg[nz].max()) - _E_SPAN, -128, 127))
        step = np.rint(16 * (lg - base))
        codes = np.where(nz & (step >= 0), np.minimum(step, 254) + 1, 0).astype(np.int64)
    return pack_scale_codes(scale_from_codes(_bin_of(base, codes)))


def _residual_r1e(residual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float ``[n, dim]`` residuals -> (sign bits over the message, uint8 ``[ceil(n · dim /
    8)]``; the scale bin, uint8 ``[n + 1]``); see the module docstring."""
    r32 = np.ascontiguousarray(residual, dtype=np.float32)
    return pack_bits((r32 >= 0).reshape(-1)), _r1e_scale_bin(r32)


def unpack_residual_e(bits: np.ndarray, n: int, dim: int) -> np.ndarray:
    """r1e's sign bits over the message (uint8 ``[ceil(n · dim / 8)]``) -> int8 ``[n,
    dim]`` of ±1. Raises :class:`WireError` naming ``rows`` when a padding bit is set."""
    signs = unpack_bits(bits, n * dim, f"rows: r1e padding bits past n · dim = {n * dim}")
    return (signs.view(np.int8) * np.int8(2) - np.int8(1)).reshape(n, dim)


def residual_fits(residual: np.ndarray, dtype: str) -> np.ndarray:
    """bool ``[n]``: rows of ``residual`` ``[n, dim]`` whose scale ``dtype`` can carry (r1:
    ``mean |r|`` within f16; r1e: finite), the others must go whole."""
    mean = residual_scale(residual)
    return mean <= F16_MAX if dtype == "r1" else np.isfinite(mean)


def residual_scale(residual: np.ndarray) -> np.ndarray:
    """The float32 ``mean |r|`` ``[n]`` of residuals ``[n, dim]``, as ``r1`` takes it
    before rounding it to f16 (inf where the float32 sum overflows)."""
    r32 = np.asarray(residual, dtype=np.float32)
    if not r32.shape[1]:
        return np.zeros(r32.shape[0], np.float32)
    with np.errstate(over="ignore"):
        return np.abs(r32).mean(axis=1, dtype=np.float32)


def _r1_scale(r32: np.ndarray) -> np.ndarray:
    """r1's float16 scales ``[n]`` of float32 residuals ``[n, dim]``, checked."""
    if not max_abs_finite(r32)[1]:
        raise WireError("rows: dtype r1 cannot carry non-finite residuals (inf/NaN)")
    mean = residual_scale(r32)
    if mean.size and float(mean.max()) > F16_MAX:
        raise WireError(f"scale: a residual's mean magnitude exceeds the f16 range "
                        f"(±{F16_MAX:g}); send the row whole")
    return mean.astype("<f2")


def _residual_r1(residual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float ``[n, dim]`` residuals -> (sign bits uint8 ``[n, ceil(dim/8)]``, float16 scale
    ``[n]``); see the module docstring."""
    r32 = np.ascontiguousarray(residual, dtype=np.float32)
    return pack_bits(r32 >= 0), _r1_scale(r32)


def unpack_residual(bits: np.ndarray, dim: int) -> np.ndarray:
    """Packed sign bits ``[n, ceil(dim/8)]`` -> int8 ``[n, dim]`` of ±1. Raises
    :class:`WireError` naming ``rows`` when a padding bit past ``dim`` is set."""
    signs = unpack_bits(bits, dim, f"rows: r1 padding bits past dim {dim}").view(np.int8)
    return signs * np.int8(2) - np.int8(1)


def residual_values(residual: np.ndarray, dtype: str = "r1") -> np.ndarray:
    """What a predictor adds for ``residual`` (float ``[n, dim]``) sent as ``dtype``:
    float32 ``[n, dim]``, exactly the decoded message's ``rows_f32()``. Raises
    :class:`WireError` as encoding would."""
    if dtype not in RESIDUAL_DTYPES:
        raise WireError(f"dtype: expected one of {sorted(RESIDUAL_DTYPES)}, got {dtype!r}")
    r32 = np.ascontiguousarray(residual, dtype=np.float32)
    scale = scale_from_codes(_r1e_scale_bin(r32)) if dtype == "r1e" else \
        _r1_scale(r32).astype(np.float32)
    # the signs as the encoder packs them (r >= 0: +1, -0.0 included), not packed and read
    return np.where(r32 >= 0, np.float32(1), np.float32(-1)) * scale[:, None]
