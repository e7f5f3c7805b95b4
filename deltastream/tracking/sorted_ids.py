"""Sorted id sets: the sort a tracker read pays for, and set operations on sorted ids.

Ids here are int64 tensors. :func:`sort_ids` / :func:`sort_ids_with_perm` sort unique ids
(an LSD radix sort on CPU, :func:`radix_sort`); :func:`member` and :func:`union` work on
ascending unique ids (``searchsorted``, no re-sort), which is how the store and the tracker
keep every record and carry; on the CPU :func:`union` (and :func:`member_sorted`) is one
linear merge in the C extension (:mod:`deltastream.tracking.native`): 0.38 ms against its
torch twin's 2.8 for 25K + 25K ids.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from deltastream.native_ext import NativeExtension

__all__ = ["radix_sort", "sort_ids", "sort_ids_with_perm", "group_mask", "first_occurrences",
           "member", "member_sorted", "union", "use_native"]

_NATIVE = NativeExtension("deltastream.tracking.native", "native id merge", "torch merges")
#: switch :func:`union` to the C code (``RuntimeError`` when it is not built) or torch
use_native = _NATIVE.use


#: Below this many ids a comparison sort beats the radix passes of :func:`radix_sort`.
_RADIX_MIN = 2048


def radix_sort(a: np.ndarray, want_perm: bool) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Ascending sort of int64 ``a`` [n] (and the permutation when ``want_perm``).

    This sort is the largest cost of a read, and numpy's (like torch's) int64 sort is a
    scalar comparison sort here (~26 ns per id at 12K ids). An LSD radix sort over 16-bit
    digits is about twice as fast: numpy's stable argsort of 16-bit keys is a counting/radix
    sort, and only the digits spanned by ``max - min`` need a pass (3 for 40-bit ids).
    Correct whatever numpy's algorithm is: every pass is a stable sort by one digit.
    """
    if a.size < _RADIX_MIN:
        if want_perm:
            order = np.argsort(a)
            return a[order], order
        return np.sort(a), None
    lo, hi = int(a.min()), int(a.max())
    lo_u = np.uint64(lo % (1 << 64))
    u = a.view(np.uint64) - lo_u  # offsets from the minimum: wrap-free order, < 2**64
    perm = None
    for k in range(max(1, ((hi - lo).bit_length() + 15) // 16)):
        digit = (u >> np.uint64(16 * k)).astype(np.uint16)  # the cast keeps the low 16 bits
        order = np.argsort(digit, kind="stable")
        u = u[order]
        if want_perm:
            perm = order if perm is None else perm[order]
    return (u + lo_u).view(np.int64), perm


def sort_ids(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` (unique int64 [n]) in ascending order (a new tensor)."""
    if ids.device.type == "cpu":
        return torch.from_numpy(radix_sort(ids.numpy(), False)[0])
    return torch.sort(ids).values


def sort_ids_with_perm(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids ascending, permutation)`` for unique int64 ``ids`` [n]."""
    if ids.device.type == "cpu":
        out, order = radix_sort(ids.numpy(), True)
        return torch.from_numpy(out), torch.from_numpy(order)
    return torch.sort(ids)


def group_mask(sorted_ids: torch.Tensor, last: bool) -> torch.Tensor:
    """Bool mask over sorted ids: True at the first (or last) element of each equal group."""
    n = sorted_ids.numel()
    mask = torch.ones(n, dtype=torch.bool, device=sorted_ids.device)
    if n > 1:
        if last:
            torch.ne(sorted_ids[1:], sorted_ids[:-1], out=mask[:-1])
        else:
            torch.ne(sorted_ids[1:], sorted_ids[:-1], out=mask[1:])
    return mask


def first_occurrences(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique, where)`` for int64 ``ids`` [n] with repeats: the distinct ids ascending
    and, for each, the index of its first occurrence in ``ids`` (int64, aligned)."""
    ordered, order = torch.sort(ids, stable=True)  # equal ids keep their order: first first
    start = group_mask(ordered, last=False)
    return ordered[start], order[start]


def member(sorted_ids: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query id: (is it in ``sorted_ids``, its position there when it is)."""
    if sorted_ids.numel() == 0:
        z = torch.zeros(query.shape, dtype=torch.int64, device=query.device)
        return torch.zeros(query.shape, dtype=torch.bool, device=query.device), z
    pos = torch.searchsorted(sorted_ids, query)
    pos.clamp_(max=sorted_ids.numel() - 1)
    return sorted_ids[pos] == query, pos


def member_sorted(sorted_ids: torch.Tensor, query: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`member`, in one linear merge of the C code (:func:`union`'s ``in_a`` and
    ``at_a``) on the CPU when ``query`` is ascending and unique (checked: else a binary
    search per id, as :func:`member`)."""
    if _native_fits(sorted_ids, query) and (
            query.numel() < 2 or bool((query[1:] > query[:-1]).all())):
        got = _merged(sorted_ids.contiguous(), query.contiguous())
        return got[4], got[5]
    return member(sorted_ids, query)


def union(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Union of two ascending unique id tensors, ``a`` taking precedence.

    Returns ``(out, pos_a, b_only, pos_b, in_a, at_a)``: ``out`` ascending unique; ``pos_a``
    the position in ``out`` of every ``a``; ``b_only`` indices into ``b`` of ids not in ``a``
    and ``pos_b`` their positions in ``out``; ``in_a`` bool per ``b`` and ``at_a`` the index
    in ``a`` of each ``b`` found there. ``out`` is ``a`` itself when ``b`` adds nothing.
    """
    if _native_fits(a, b):
        return _merged(a.contiguous(), b.contiguous())
    in_a, at_a = member(a, b)
    b_only = (~in_a).nonzero().squeeze(1)
    n_a, n_new = a.numel(), b_only.numel()
    if n_new == 0:
        return a, torch.arange(n_a, device=a.device), b_only, b_only, in_a, at_a
    bo = b.index_select(0, b_only)
    # Each element lands at (its rank in its own run) + (how many of the other run precede it).
    pos_a = torch.arange(n_a, device=a.device) + torch.searchsorted(bo, a)
    pos_b = torch.arange(n_new, device=a.device) + torch.searchsorted(a, bo)
    out = torch.empty(n_a + n_new, dtype=a.dtype, device=a.device)
    out[pos_a] = a
    out[pos_b] = bo
    return out, pos_a, b_only, pos_b, in_a, at_a


def _native_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # an empty side: the torch path allocates nothing (the C call's outputs cost more)
    return (_NATIVE.enabled() and a.device.type == "cpu" and b.device.type == "cpu"
            and a.dtype == torch.int64 and b.dtype == torch.int64
            and a.numel() > 0 and b.numel() > 0)


def _merged(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`union` of CPU int64 ``a`` and ``b`` in one pass of the C code (``ValueError``
    naming the first id out of order when either is not strictly ascending)."""
    n_a, n_b = a.numel(), b.numel()
    i64 = torch.int64
    out, pos_a = torch.empty(n_a + n_b, dtype=i64), torch.empty(n_a, dtype=i64)
    b_only, pos_b, at_a = (torch.empty(n_b, dtype=i64) for _ in range(3))
    in_a = torch.empty(n_b, dtype=torch.bool)
    m = _NATIVE.module.merge_sorted(*(x.numpy() for x in (a, b, out, pos_a, b_only, pos_b,
                                                          in_a, at_a)))
    if m == 0:
        return a, pos_a, b_only[:0], pos_b[:0], in_a, at_a
    return out[:n_a + m], pos_a, b_only[:m], pos_b[:m], in_a, at_a
