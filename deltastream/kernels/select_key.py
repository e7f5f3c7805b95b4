"""Which candidate rows a budget may pick, and in what order: one elementwise kernel.

The kernel path of :func:`~deltastream.publishing.selection.select_changed` turns the per
row results of :mod:`deltastream.kernels.row_diff` into one float64 priority **key** per row
in **one launch** (the torch reference builds it from about twenty elementwise ops):

* eligibility: finite rows; under a ``threshold`` only those whose (weighted, optionally
  relative) drift reaches it, plus new rows with ``new_rows="first"``;
* the key of an eligible row, highest first: new rows (``TIER_NEW + age + frac``), overdue
  rows (``TIER_OVERDUE + age + frac``), the rest ``1 − 1/(1 + drift × (1 + age))``, with
  ``frac = 1 − 1/(1 + drift)`` and ages clamped to ``AGE_CAP`` (see
  :mod:`deltastream.publishing.selection_rules`); an ineligible row's key is ``-inf``.

The eligible rows are counted into ``counts[0]`` (an atomic add per program), read back by
the caller with its other counts: no host sync in here. The float arithmetic is IEEE
round-to-nearest throughout (``div_rn`` / ``sqrt_rn`` for float32), so keys match the
reference path's bit for bit given the same drift.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["priority_key"]

_BLOCK = 1024  # rows per program: 8 KiB of float64 keys, 8 per thread at 4 warps


@triton.jit
def _div(a, b, F64: tl.constexpr):
    # float32 `/` lowers to an approximate division on NVIDIA; the reference divides exactly
    if F64:
        return a / b
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def _select_key_kernel(score_ptr, finite_ptr, norm_ptr, weights_ptr, new_ptr, age_ptr,
                       thr_ptr, key_ptr, counts_ptr, n, max_age, tier_new, tier_overdue,
                       age_cap,
                       HAS_SCORE: tl.constexpr, HAS_W: tl.constexpr, RELATIVE: tl.constexpr,
                       HAS_THR: tl.constexpr, HAS_NEW: tl.constexpr, HAS_AGE: tl.constexpr,
                       HAS_MAX_AGE: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    fin = tl.load(finite_ptr + offs, mask=inb, other=0) != 0
    inf = float("inf")
    if HAS_NEW:
        new = tl.load(new_ptr + offs, mask=inb, other=0) != 0
    if HAS_AGE:
        age = tl.load(age_ptr + offs, mask=inb, other=0).to(tl.int64)
        # (negative ages are invalid input, rejected by the caller's deferred check)
        agef = tl.minimum(tl.maximum(age, 0), age_cap).to(tl.float64)
    eligible = fin
    if HAS_SCORE:
        ws = tl.load(score_ptr + offs, mask=inb, other=0.0)
        if HAS_W:
            w = tl.load(weights_ptr + offs, mask=inb, other=0.0).to(ws.dtype)
            ws = ws * w
            # 0 x inf (a recovered row with weight 0) is NaN: such a row still goes first
            ws = tl.where((ws != ws) & fin, inf, ws)
        if HAS_THR:
            drift = ws
            if RELATIVE:
                nrm = tl.load(norm_ptr + offs, mask=inb, other=1.0)
                # ‖Δ‖ / ‖current‖; a zero row: 0 if unchanged, +inf if it moved to zero
                zero_row = tl.where(ws > 0, inf, 0.0).to(ws.dtype)
                drift = tl.where(nrm > 0, _div(ws, tl.where(nrm > 0, nrm, 1.0), F64),
                                 zero_row)
                # inf / inf (a finite row whose norm overflowed): a huge change
                drift = tl.where((drift != drift) & fin, inf, drift)
            thr = tl.load(thr_ptr)
            must = drift >= thr
            if HAS_NEW:
                must = must | new
            eligible = fin & must
        s = ws.to(tl.float64)
        # 1 - 1/(1+x) maps [0, inf] monotonically onto [0, 1] (inf -> 1, no NaN)
        frac = 1.0 - 1.0 / (1.0 + s)
        if HAS_AGE:
            key = 1.0 - 1.0 / (1.0 + s * (1.0 + agef))
        else:
            key = frac
    else:
        # ID_ONLY: no drift; older rows first
        frac = tl.zeros([BLOCK], dtype=tl.float64)
        if HAS_AGE:
            key = 1.0 - 1.0 / (1.0 + agef)
        else:
            key = frac
    if HAS_AGE:
        if HAS_MAX_AGE:
            key = tl.where(age >= max_age, tier_overdue + agef + frac, key)
        if HAS_NEW:
            key = tl.where(new, tier_new + agef + frac, key)
    else:
        if HAS_NEW:
            key = tl.where(new, tier_new + frac, key)
    key = tl.where(eligible, key, -inf)
    tl.store(key_ptr + offs, key, mask=inb)
    tl.atomic_add(counts_ptr, tl.sum((eligible & inb).to(tl.int32), axis=0))


def priority_key(finite: torch.Tensor, score: Optional[torch.Tensor], *,
                 norm: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                 new: Optional[torch.Tensor], age: Optional[torch.Tensor],
                 threshold: Optional[float], max_age: Optional[int], tier_new: float,
                 tier_overdue: float, age_cap: int, counts: torch.Tensor) -> torch.Tensor:
    """float64 ``[n]`` priority key (``-inf``: not eligible) in one launch, no host sync.

    Args:
        finite: bool ``[n]``, the current value holds no NaN/Inf.
        score: ``[n]`` drift (float32/64; the compute dtype), or None for ID_ONLY (no
            drift: ``weights``, ``norm`` and ``threshold`` are then ignored).
        norm: ``[n]`` ``‖current‖`` (compute dtype): the threshold is relative; or None.
        weights: float ``[n]`` importance per row, or None.
        new: bool ``[n]`` rows of the new-row tier (they also pass any threshold), or None.
        age: integer ``[n]`` rounds each row was carried, or None.
        threshold: eligibility threshold on the (weighted, relative) drift, or None.
        max_age: rows with ``age >= max_age`` are overdue; None disables the tier.
        tier_new, tier_overdue, age_cap: the tier constants of the selection rules.
        counts: int32 tensor; ``counts[0]`` gets the number of eligible rows added.
    """
    n = finite.numel()
    key = torch.empty(n, dtype=torch.float64, device=finite.device)
    if n == 0:
        return key
    has_score = score is not None
    dummy = finite.view(torch.int8)  # stands in for absent pointers (never read)
    thr = None
    if has_score and threshold is not None:
        # a tensor, not a kernel scalar: Triton passes Python floats as float32
        thr = torch.full((1,), float(threshold), dtype=score.dtype, device=finite.device)
    _select_key_kernel[(triton.cdiv(n, _BLOCK),)](
        score if has_score else dummy, dummy,
        norm if has_score and norm is not None else dummy,
        weights if has_score and weights is not None else dummy,
        new.view(torch.int8) if new is not None else dummy,
        age if age is not None else dummy,
        thr if thr is not None else dummy, key, counts, n,
        int(max_age) if max_age is not None else 0, float(tier_new), float(tier_overdue),
        int(age_cap),
        HAS_SCORE=has_score, HAS_W=has_score and weights is not None,
        RELATIVE=has_score and norm is not None, HAS_THR=thr is not None,
        HAS_NEW=new is not None, HAS_AGE=age is not None, HAS_MAX_AGE=max_age is not None,
        F64=has_score and score.dtype == torch.float64, BLOCK=_BLOCK, num_warps=4)
    return key
