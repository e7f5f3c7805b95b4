"""Value types shared by the tracker, the store and the selection code."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["TrackingMode", "UpdateMode", "DeltaRows"]


class TrackingMode(enum.Enum):
    """What the tracker records per lookup."""

    ID_ONLY = "id_only"  #: only which ids were touched
    EMBEDDING = "embedding"  #: ids plus the row value before the first update (FIRST)


class UpdateMode(enum.Enum):
    """Which state a :class:`DeltaStore` keeps when an id is appended more than once."""

    NONE = "none"  #: ids only
    FIRST = "first"  #: the state of the earliest append
    LAST = "last"  #: the state of the latest append


@dataclass
class DeltaRows:
    """Rows of one table that changed in an interval.

    Attributes:
        ids: int64 ``[n]`` **global** ids, ascending and unique.
        states: ``None`` (ID_ONLY) or ``[n, dim]`` states aligned with ``ids``
            (FIRST: the value before the first update in the interval).
        new: ``None`` or bool ``[n]``: True for ids inserted into the table in the
            interval (never handed to this consumer before), aligned with ``ids``.
        tombstones: ``None`` or int64 ``[m]`` ascending ids evicted in the interval
            (never also present in ``ids``).
        age: ``None`` or int64 ``[n]``: how many consecutive reads each row has been
            handed back through ``DeltaTracker.retain`` without being published
            (0 = fresh). Selection uses it so that no row starves.
    """

    ids: torch.Tensor
    states: Optional[torch.Tensor] = None
    new: Optional[torch.Tensor] = None
    tombstones: Optional[torch.Tensor] = None
    age: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return int(self.ids.numel())

    @staticmethod
    def empty(dim: Optional[int] = None, *, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> DeltaRows:
        """An empty delta; with ``dim`` it carries an empty ``[0, dim]`` state tensor."""
        ids = torch.empty(0, dtype=torch.int64, device=device)
        states = None if dim is None else torch.empty(0, dim, dtype=dtype, device=device)
        return DeltaRows(ids=ids, states=states)
