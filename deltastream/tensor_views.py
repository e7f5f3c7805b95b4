"""The views a C extension reads a tensor through (torch side): no copies.

:func:`as_bytes` gives any C-contiguous CPU tensor's memory as ``uint8`` (the extensions
treat rows as opaque bytes, so bf16 needs no numpy dtype); :func:`as_buffer` gives the
same memory in one call where numpy has the tensor's dtype (a hot path's view: the C code
reads any C-contiguous buffer as bytes); :func:`numpy_view` gives an
optional tensor (rows, an index array) as the numpy array a C pass takes (None stays
None).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

__all__ = ["NUMPY_DTYPES", "as_buffer", "as_bytes", "head_rows", "numpy_view"]

#: dtypes ``Tensor.numpy()`` takes (bf16 has no numpy dtype)
NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64,
                           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous CPU tensor's memory as uint8 (any dtype, bf16 included: no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def as_buffer(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous CPU tensor's memory as a numpy array, for C code that reads it as
    bytes: of the tensor's own dtype and shape where numpy has the dtype (one call: a
    lookup hook's view, taken every step), else :func:`as_bytes`."""
    if t.dtype in NUMPY_DTYPES and not t.requires_grad:
        return t.numpy()
    return as_bytes(t)


def head_rows(buf: np.ndarray, n: int, row_bytes: int) -> np.ndarray:
    """The first ``n`` rows of a C-contiguous 2-D CPU tensor's :func:`as_buffer` ``buf``
    (rows of ``row_bytes`` bytes), sliced in numpy: a torch slice and its view cost more than
    the rest of a hand-off's per-table bookkeeping; a caller keeps ``buf`` between calls."""
    return buf[:n] if buf.ndim == 2 else buf[:n * row_bytes]


def numpy_view(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    """A CPU tensor as a contiguous numpy array (a view when it is contiguous already), or
    None for None."""
    return None if t is None else t.detach().contiguous().numpy()
