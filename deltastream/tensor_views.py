"""The views a C extension reads a tensor through (torch side): no copies.

:func:`as_bytes` gives any C-contiguous CPU tensor's memory as ``uint8`` (the extensions
treat rows as opaque bytes, so bf16 needs no numpy dtype); :func:`numpy_view` gives an
optional tensor (rows, an index array) as the numpy array a C pass takes (None stays
None).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

__all__ = ["as_bytes", "numpy_view"]


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous CPU tensor's memory as uint8 (any dtype, bf16 included: no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def numpy_view(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    """A CPU tensor as a contiguous numpy array (a view when it is contiguous already), or
    None for None."""
    return None if t is None else t.detach().contiguous().numpy()
