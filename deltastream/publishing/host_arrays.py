"""Rows and ids a caller hands to :meth:`DeltaPublisher.publish`, checked and brought to host
memory (numpy), on their own device first where that halves the copy.

Torch is never imported here: tensors (CPU or CUDA) are recognised by duck typing
(``.detach()``).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from deltastream import wire

__all__ = ["host_ids", "host_rows"]


def host_ids(x: Any, what: str) -> np.ndarray:
    """``x`` (numpy or torch, any device) as host int64 ids ``[n]``; ``ValueError`` /
    ``TypeError`` for another shape or dtype, or a uint64 id beyond int64."""
    if hasattr(x, "detach"):  # torch tensor, CPU or CUDA (duck-typed: no torch import)
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D array of int64 ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what}: expected integer ids (int64), got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.dtype.itemsize >= 8 \
            and int(arr.max()) > (1 << 63) - 1:
        raise ValueError(f"{what}: id {int(arr.max())} does not fit in int64")
    return arr.astype(np.int64, copy=False)


def host_rows(x: Any, n: int, table: str, *, dtype: str, allow_nonfinite: bool,
              known_dim: Optional[int]) -> np.ndarray:
    """Validate rows ``[n, dim]`` for wire ``dtype`` and bring them to host memory.

    ``known_dim``: the table's width so far in this epoch (None: any).

    For wire dtype f16, accelerator tensors are cast on their device (half the copy);
    float32 host rows stay as they are and are cast message by message in
    :meth:`DeltaPublisher.publish`, while the piece is hot in cache.
    """
    tensor = hasattr(x, "detach")
    if tensor:
        x = x.detach()
        if not x.is_floating_point():
            raise TypeError(f"rows: expected a float tensor, got {x.dtype}")
        if x.device.type == "cpu":
            # Host tensors continue as numpy views: numpy's single-threaded reductions
            # beat torch's thread pool when the trainer keeps the cores busy.
            if str(x.dtype) not in ("torch.float32", "torch.float64", "torch.float16"):
                x = x.float()  # bfloat16 has no numpy dtype
            x, tensor = x.numpy(), False
    if tensor:
        shape = tuple(x.shape)
    else:
        x = np.asarray(x)
        if x.dtype.kind != "f":
            raise TypeError(f"rows: expected a float array, got dtype {x.dtype}")
        shape = x.shape
    if len(shape) != 2 or shape[0] != n:
        raise ValueError(f"rows: expected shape [{n}, dim] (one row per id), got "
                         f"{list(shape)}")
    dim = shape[1]
    if not 1 <= dim <= wire.MAX_DIM:
        raise ValueError(f"rows: expected 1 ≤ dim ≤ {wire.MAX_DIM}, got {dim}")
    if known_dim is not None and known_dim != dim:
        raise ValueError(f"rows: table {table!r} has dim {known_dim} in this epoch, got {dim}")
    lo = hi = 0.0
    if n:
        if tensor:
            mn, mx = x.aminmax()  # one pass on the tensor's device, no temporary
            lo, hi = float(mn), float(mx)
        else:
            lo, hi = float(np.min(x)), float(np.max(x))
    finite = bool(np.isfinite(lo) and np.isfinite(hi))
    if not finite and (not allow_nonfinite or dtype == "i8"):
        host = x.float().cpu().numpy() if tensor else x
        bad = ~np.isfinite(host).all(axis=1)
        hint = ("dtype i8 cannot carry them" if allow_nonfinite
                else "pass allow_nonfinite=True to publish them anyway")
        raise ValueError(f"rows: {int(bad.sum())} of {n} rows of table {table!r} hold "
                         f"inf/NaN (first row index {int(np.argmax(bad))}); {hint}")
    if dtype == "f16":
        top = max(-lo, hi)
        if not finite:
            host = x.float().cpu().numpy() if tensor else x
            top = wire.max_abs_finite(host)[0]
        if top > wire.F16_MAX:
            raise ValueError(f"rows: value {top:g} of table {table!r} exceeds the f16 "
                             f"range (±{wire.F16_MAX:g}); use dtype='bf16' or 'f32'")
        if tensor:
            return x.half().cpu().numpy()
        return x
    if tensor:
        if str(x.dtype) != "torch.float32":
            x = x.float()
        return x.cpu().numpy()
    return x
