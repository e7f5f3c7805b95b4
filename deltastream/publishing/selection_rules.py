"""What both paths of :func:`~deltastream.publishing.selection.select_changed` share: the
:class:`Selection` result, the row cap a budget allows, the priority tiers and the
leftover rows handed back for ``retain``.

The torch reference path (chunked, CPU) lives in :mod:`~deltastream.publishing.selection`,
the kernel path (CUDA) in :mod:`~deltastream.publishing.selection_device`; this module
keeps the rules they must agree on in one place.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from deltastream import wire
from deltastream.types import DeltaRows

__all__ = ["Selection", "Budget", "WIRE_ITEMSIZE", "row_wire_bytes", "row_cap",
           "leftover_rows", "priority_keys", "warn_rejected", "TIER_NEW", "TIER_OVERDUE",
           "AGE_CAP"]

log = logging.getLogger(__name__)

#: bytes per row element on the wire, per wire dtype (:data:`deltastream.wire.DTYPES`)
WIRE_ITEMSIZE = wire.DTYPES

# Tier offsets of the priority key. Ages are clamped below AGE_CAP so tiers never overlap
# and float64 still resolves the fractional score part (2**40 leaves ~12 fractional bits).
TIER_NEW = float(2**40)
TIER_OVERDUE = 2.0
AGE_CAP = 2**30


@dataclass
class Selection:
    """The rows chosen for publishing, and what happens to the others.

    Attributes:
        ids: int64 ``[s]`` selected global ids, ascending.
        rows: ``[s, dim]`` their *current* values (table dtype, delta's device).
        scores: float ``[s]`` drift ``‖current − FIRST‖₂`` of each selected row
            (``‖current‖`` for new rows with ``new_rows="drift"``; unweighted); NaN for an
            ID_ONLY delta; ``+inf`` where FIRST was non-finite or the norm overflowed.
        leftover: rows not selected (finite, not rejected), with their original FIRST
            states, ``new`` flags and ages: hand to ``DeltaTracker.retain``.
        rejected: int64 ``[r]`` ascending ids whose current value holds NaN/Inf; never
            published, not part of ``leftover`` (see the module docstring).
        tombstones: the delta's evicted ids, passed through for the publisher (or ``None``).
    """

    ids: torch.Tensor
    rows: torch.Tensor
    scores: torch.Tensor
    leftover: DeltaRows
    rejected: torch.Tensor
    tombstones: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return int(self.ids.numel())

    @property
    def n_rejected(self) -> int:
        """How many candidate rows were rejected as non-finite."""
        return int(self.rejected.numel())


@dataclass(frozen=True)
class Budget:
    """The budget arguments of ``select_changed`` (already checked), as one value."""

    k: Optional[int] = None
    fraction: Optional[float] = None
    threshold: Optional[float] = None
    max_bytes: Optional[int] = None
    wire_dtype: str = "f16"
    max_age: Optional[int] = 16
    relative: bool = False
    new_rows: str = "first"

    def cap(self, n_fin: int, dim: int) -> int:
        """Most rows this budget lets out of ``n_fin`` finite candidates of width ``dim``."""
        return row_cap(n_fin, self.k, self.fraction, self.max_bytes, dim, self.wire_dtype)


def row_wire_bytes(dim: int, wire_dtype: str = "f16") -> int:
    """Bytes one row costs on the wire: 8 (id) + ``dim`` × itemsize (+4 scale for ``i8``)."""
    if wire_dtype not in wire.DTYPES:
        raise ValueError(f"wire_dtype must be one of {sorted(wire.DTYPES)}, got {wire_dtype!r}")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    return wire.row_bytes(dim, wire_dtype)


def row_cap(n_fin: int, k: Optional[int], fraction: Optional[float],
            max_bytes: Optional[int], dim: int, wire_dtype: str) -> int:
    """Most rows the budget lets out of ``n_fin`` finite candidates."""
    cap = n_fin
    if k is not None:
        cap = min(cap, int(k))
    elif fraction is not None:
        # tolerance so that 0.1 * 1_000_000 gives 100000, not 100001
        cap = min(cap, math.ceil(float(fraction) * n_fin - 1e-9))
    if max_bytes is not None:
        cap = min(cap, int(max_bytes) // row_wire_bytes(dim, wire_dtype))
    return cap


def leftover_rows(delta: DeltaRows, lpos: torch.Tensor, dim: int) -> DeltaRows:
    """The rows of ``delta`` at positions ``lpos`` (int64, ascending), with their FIRST
    states, ``new`` flags and ages (no host sync: sizes follow ``lpos``)."""
    ids, states = delta.ids, delta.states
    if lpos.numel():
        return DeltaRows(
            ids=ids.index_select(0, lpos),
            states=None if states is None else states.index_select(0, lpos),
            new=None if delta.new is None else delta.new.index_select(0, lpos.to(delta.new.device)),
            age=None if delta.age is None else delta.age.index_select(0, lpos.to(delta.age.device)),
        )
    return DeltaRows(
        ids=ids.new_empty(0),
        states=None if states is None else states.new_empty(0, dim),
        new=None if delta.new is None else delta.new.new_empty(0),
        age=None if delta.age is None else delta.age.new_empty(0),
    )


def priority_keys(score: Optional[torch.Tensor], new: Optional[torch.Tensor],
                  age: Optional[torch.Tensor], max_age: Optional[int], n: int,
                  dev: torch.device) -> torch.Tensor:
    """float64 ``[n]`` key: higher publishes first (tiers: new > overdue > drift x (1+age)).

    ``score``: drift ``[n]`` (None: ID_ONLY); ``new``: bool ``[n]`` rows of the new tier (or
    None); ``age``: int64 ``[n]`` rounds carried (or None). Elementwise: a row's key does not
    depend on the other rows, so keys of any subset are the keys of the whole set.
    """
    agef = age.clamp(max=AGE_CAP).to(torch.float64) if age is not None else None
    if score is not None:
        s = score.to(torch.float64)
        # 1 - 1/(1+x) maps [0, inf] monotonically onto [0, 1] (inf -> 1, no NaN)
        frac = 1.0 - 1.0 / (1.0 + s)
        if agef is not None:
            boosted = s * (1.0 + agef)
            key = 1.0 - 1.0 / (1.0 + boosted)
        else:
            key = frac.clone()
    else:
        frac = torch.zeros(n, dtype=torch.float64, device=dev)
        # ID_ONLY: no drift; older rows first
        key = (1.0 - 1.0 / (1.0 + agef)) if agef is not None else frac.clone()
    if agef is not None:
        if max_age is not None:
            overdue = age >= max_age
            key = torch.where(overdue, TIER_OVERDUE + agef + frac, key)
        if new is not None:
            key = torch.where(new, TIER_NEW + agef + frac, key)
    elif new is not None:
        key = torch.where(new, TIER_NEW + frac, key)
    return key


def warn_rejected(n_rejected: int, n: int, logger: logging.Logger) -> None:
    """Log that ``n_rejected`` of ``n`` candidates are non-finite (neither sent nor kept)."""
    if n_rejected:
        logger.warning("select_changed: %d of %d candidate rows have NaN/Inf current values; "
                       "they are rejected (not published, not retained)", n_rejected, n)
