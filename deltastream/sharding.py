"""Partition of the slice space across trainer shards (RecIS-compatible).

An id belongs to slice ``id mod slice_size``; shard ``r`` of ``n`` owns the contiguous
slice range ``[begin, end)``. Range sizes differ by at most one and the first
``slice_size % n`` shards get the extra slice, exactly as RecIS's ``gen_slice``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Slice", "gen_slice", "slice_of", "owner_of", "DEFAULT_SLICE_SIZE"]

DEFAULT_SLICE_SIZE = 65536


@dataclass(frozen=True)
class Slice:
    """The slice range ``[begin, end)`` of a slice space of ``size`` slices."""

    begin: int
    end: int
    size: int = DEFAULT_SLICE_SIZE

    def __post_init__(self) -> None:
        for field in ("begin", "end", "size"):
            if not isinstance(getattr(self, field), int):
                raise TypeError(f"Slice.{field} must be an int, got {getattr(self, field)!r}")
        if self.size <= 0:
            raise ValueError(f"Slice.size must be positive, got {self.size}")
        if not 0 <= self.begin <= self.end <= self.size:
            raise ValueError(
                f"Slice needs 0 <= begin <= end <= size, got begin={self.begin}, "
                f"end={self.end}, size={self.size}"
            )

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool mask ``[N]``: which ``ids`` fall in this slice range."""
        s = slice_of(ids, self.size)
        return (s >= self.begin) & (s < self.end)

    @property
    def full(self) -> bool:
        return self.begin == 0 and self.end == self.size


def _check_shards(shard_num: int, slice_size: int) -> None:
    if not isinstance(shard_num, int) or shard_num <= 0:
        raise ValueError(f"shard_num must be a positive int, got {shard_num!r}")
    if not isinstance(slice_size, int) or slice_size <= 0:
        raise ValueError(f"slice_size must be a positive int, got {slice_size!r}")
    if shard_num > slice_size:
        raise ValueError(f"shard_num ({shard_num}) must not exceed slice_size ({slice_size})")


def gen_slice(shard_index: int = 0, shard_num: int = 1,
              slice_size: int = DEFAULT_SLICE_SIZE) -> Slice:
    """The :class:`Slice` owned by shard ``shard_index`` of ``shard_num``."""
    _check_shards(shard_num, slice_size)
    if not isinstance(shard_index, int) or not 0 <= shard_index < shard_num:
        raise ValueError(f"shard_index must be in [0, {shard_num}), got {shard_index!r}")
    base, extra = divmod(slice_size, shard_num)
    begin = shard_index * base + min(shard_index, extra)
    end = begin + base + (1 if shard_index < extra else 0)
    return Slice(begin, end, slice_size)


def slice_of(ids: torch.Tensor, slice_size: int = DEFAULT_SLICE_SIZE) -> torch.Tensor:
    """Slice index per id: ``ids mod slice_size``, non-negative for negative ids too."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids, dtype=torch.int64)
    # torch.remainder follows the divisor's sign, so negatives map into [0, slice_size).
    return torch.remainder(ids, slice_size)


def owner_of(ids: torch.Tensor, shard_num: int,
             slice_size: int = DEFAULT_SLICE_SIZE) -> torch.Tensor:
    """Owner shard index per id (int64, same shape as ``ids``), vectorized closed form."""
    _check_shards(shard_num, slice_size)
    s = slice_of(ids, slice_size)
    base, extra = divmod(slice_size, shard_num)
    # The first `extra` shards own base+1 slices each and end at slice `cut`.
    cut = extra * (base + 1)
    low = torch.div(s, base + 1, rounding_mode="floor")
    high = extra + torch.div(s - cut, max(base, 1), rounding_mode="floor")
    return torch.where(s < cut, low, high)
