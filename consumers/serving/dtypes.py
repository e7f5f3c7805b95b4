"""The dtypes a serving table stores its rows in (in memory, in shared memory and on disk)."""

from __future__ import annotations

import numpy as np

__all__ = ["STORAGE_DTYPES", "F16_MAX"]

#: storage dtype name -> numpy dtype (rows of serving tables, in memory and on disk)
STORAGE_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2")}
#: largest finite f16 value: rows of an f16 table must stay within ±F16_MAX
F16_MAX = 65504.0
