"""One pass over candidate rows: drift ``‖current − FIRST‖₂``, ``‖current‖`` and finiteness.

The kernel path of :func:`~deltastream.publishing.selection.select_changed` (CUDA) scores
every candidate row in **one launch**: each program takes ``BLOCK_R`` rows, gathers their
current values straight from the table's storage (``storage[pos[r]]``, so the candidate
rows are never copied out of the table first), loads the matching FIRST rows, and
accumulates per row the squared difference, the squared value (for relative thresholds)
and a count of NaN/Inf elements, ``BLOCK_D`` columns at a time. Loads are row-contiguous
(coalesced); accumulation is in float32 (float64 when the FIRST states are float64), the
same compute dtype as the torch reference path.

Semantics per row (those of the reference path, ``selection._drift``):

* ``finite``: the *current* value holds no NaN/Inf;
* ``score``: ``‖current − FIRST‖₂`` (FIRST read as zeros where ``zero_new``); NaN for a
  non-finite current value; ``+inf`` where FIRST is non-finite or the sum overflowed;
* ``norm``: ``‖current‖₂`` (only when asked for).

A position outside ``[0, len(storage))`` (an id the table does not hold, or an
``nn.Embedding`` index out of range) is counted in ``counts[0]``, its outputs are
meaningless; non-finite rows are counted in ``counts[1]``. The caller reads the counts back
with the rest of its small results (no host sync in here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["RowDrift", "row_drift", "COUNT_MISSING", "COUNT_NONFINITE"]

#: index of the count of out-of-range positions in the ``counts`` tensor
COUNT_MISSING = 0
#: index of the count of rows whose current value is not finite
COUNT_NONFINITE = 1

_MAX_BLOCK_D = 128   # columns per step: 512 B of fp32 per row, one coalesced segment
_TILE = 4096         # elements per tile (BLOCK_R x BLOCK_D): 32 per thread at 4 warps
_MAX_BLOCK_R = 64


@triton.jit
def _sqrt(x, F64: tl.constexpr):
    # IEEE round-to-nearest as torch computes it (float32 `sqrt` may be approximate)
    if F64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def _row_drift_kernel(storage_ptr, stride_s, n_storage, pos_ptr, first_ptr, stride_f,
                      zero_new_ptr, score_ptr, finite_ptr, norm_ptr, counts_ptr, n, dim,
                      HAS_POS: tl.constexpr, HAS_FIRST: tl.constexpr,
                      HAS_ZERO_NEW: tl.constexpr, WANT_NORM: tl.constexpr,
                      ACC: tl.constexpr, F64: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = rows < n
    if HAS_POS:
        p = tl.load(pos_ptr + rows, mask=in_rows, other=0).to(tl.int64)
        missing = in_rows & ((p < 0) | (p >= n_storage))
        p = tl.where(missing, 0, p)
    else:
        p = rows
        missing = rows < 0  # none
    live = in_rows & ~missing
    keep_first = live
    if HAS_ZERO_NEW:
        zn = tl.load(zero_new_ptr + rows, mask=in_rows, other=0)
        keep_first = live & (zn == 0)
    sq = tl.zeros([BLOCK_R], dtype=ACC)
    nsq = tl.zeros([BLOCK_R], dtype=ACC)
    bad = tl.zeros([BLOCK_R], dtype=tl.int32)
    cols0 = tl.arange(0, BLOCK_D)
    for d0 in range(0, dim, BLOCK_D):
        cols = d0 + cols0
        m = live[:, None] & (cols[None, :] < dim)
        x = tl.load(storage_ptr + p[:, None] * stride_s + cols[None, :], mask=m,
                    other=0.0).to(ACC)
        bad += tl.sum(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1)
        if WANT_NORM:
            nsq += tl.sum(x * x, axis=1)
        if HAS_FIRST:
            f = tl.load(first_ptr + rows[:, None] * stride_f + cols[None, :],
                        mask=keep_first[:, None] & (cols[None, :] < dim), other=0.0).to(ACC)
            d = x - f
            sq += tl.sum(d * d, axis=1)
    fin = bad == 0
    if HAS_FIRST:
        s = _sqrt(sq, F64)
        # a finite row with a NaN/inf score: FIRST was not finite, or the sum overflowed
        s = tl.where(s != s, float("inf"), s)
        s = tl.where(fin, s, float("nan"))
        tl.store(score_ptr + rows, s, mask=in_rows)
    tl.store(finite_ptr + rows, fin.to(tl.int8), mask=in_rows)
    if WANT_NORM:
        tl.store(norm_ptr + rows, _sqrt(nsq, F64), mask=in_rows)
    # both counts are almost always 0: skip the atomics then (no contention on 2 words)
    n_missing = tl.sum(missing.to(tl.int32), axis=0)
    n_bad = tl.sum((live & ~fin).to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr + 0, n_missing, mask=n_missing > 0)
    tl.atomic_add(counts_ptr + 1, n_bad, mask=n_bad > 0)


@dataclass
class RowDrift:
    """Per candidate row: ``score`` (compute dtype, None for ID_ONLY), ``finite`` (bool),
    ``norm`` (compute dtype, or None) and ``counts`` (int32 ``[2]``: out-of-range
    positions, non-finite rows; still on the device)."""

    score: Optional[torch.Tensor]
    finite: torch.Tensor
    norm: Optional[torch.Tensor]
    counts: torch.Tensor


def row_drift(storage: torch.Tensor, pos: Optional[torch.Tensor], first: Optional[torch.Tensor],
              zero_new: Optional[torch.Tensor], *, want_norm: bool,
              compute_dtype: torch.dtype) -> RowDrift:
    """Score ``n`` candidate rows in one kernel launch (no host sync).

    Args:
        storage: ``[R, dim]`` float rows (unit stride along ``dim``): the table's storage,
            or the candidate rows themselves when ``pos`` is None.
        pos: int64 ``[n]`` row of each candidate in ``storage``; None: row ``i`` is ``i``.
        first: ``[n, dim]`` float FIRST states (unit stride along ``dim``), or None
            (ID_ONLY: only finiteness is computed).
        zero_new: bool ``[n]``: rows scored against zeros instead of FIRST, or None.
        want_norm: also compute ``‖current‖₂`` per row.
        compute_dtype: float32 or float64, the dtype of ``score`` and ``norm``.
    """
    dim = storage.shape[1]
    n = pos.numel() if pos is not None else storage.shape[0]
    dev = storage.device
    if storage.stride(1) != 1 or (first is not None and first.stride(1) != 1):
        raise ValueError("row_drift needs rows with unit stride along dim")
    finite = torch.empty(n, dtype=torch.bool, device=dev)
    score = torch.empty(n, dtype=compute_dtype, device=dev) if first is not None else None
    norm = torch.empty(n, dtype=compute_dtype, device=dev) if want_norm else None
    counts = torch.zeros(2, dtype=torch.int32, device=dev)
    if n == 0:
        return RowDrift(score, finite, norm, counts)
    block_d = min(triton.next_power_of_2(dim), _MAX_BLOCK_D)
    block_r = max(1, min(_MAX_BLOCK_R, _TILE // block_d))
    acc = tl.float64 if compute_dtype == torch.float64 else tl.float32
    dummy = finite  # stands in for absent pointers: never read (the constexpr flags)
    _row_drift_kernel[(triton.cdiv(n, block_r),)](
        storage, storage.stride(0), storage.shape[0],
        pos if pos is not None else dummy,
        first if first is not None else dummy, first.stride(0) if first is not None else 0,
        zero_new.view(torch.int8) if zero_new is not None else dummy,
        score if score is not None else dummy, finite.view(torch.int8),
        norm if norm is not None else dummy, counts, n, dim,
        HAS_POS=pos is not None, HAS_FIRST=first is not None,
        HAS_ZERO_NEW=zero_new is not None, WANT_NORM=want_norm, ACC=acc,
        F64=compute_dtype == torch.float64,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return RowDrift(score, finite, norm, counts)
