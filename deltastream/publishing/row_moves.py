"""Row copies of the budget worker's merge: ``dst[dst_at[i]] = src[src_at[i]]`` in one pass.

A merge moves each changed row from the hand-off into its pending slot. Through torch that
is a gather (``index_select``) into a temporary and a scatter (``index_copy_``), which on the
CPU takes about three times as long per row as the gather alone; the C extension
(:mod:`deltastream.publishing.native`) copies each row once, prefetching a few rows ahead,
without the GIL. Without the extension (or with ``DELTASTREAM_NATIVE=0``) torch runs, with
the same result.
"""

from __future__ import annotations

from typing import Optional

import torch

from deltastream.native_ext import NativeExtension
from deltastream.tensor_views import as_bytes, numpy_view

__all__ = ["move_rows", "use_native"]

_NATIVE = NativeExtension("deltastream.publishing.native", "native row moves", "torch runs")
#: switch :func:`move_rows` to the C code (``RuntimeError`` when it is not built) or torch
use_native = _NATIVE.use


def move_rows(dst: torch.Tensor, dst_at: Optional[torch.Tensor], src: torch.Tensor,
              src_at: Optional[torch.Tensor]) -> None:
    """Copy ``src`` row ``src_at[i]`` to ``dst`` row ``dst_at[i]`` for every ``i`` (an index
    None: row ``i`` itself; not both None).

    ``dst`` ``[rows, dim]`` (written in place), ``src`` ``[rows', dim]``; ``dst_at`` /
    ``src_at`` int64 ``[n]``, each in its tensor's rows (``IndexError`` otherwise);
    ``dst_at`` unique; a tensor without an index has exactly ``n`` rows. ``src`` is
    converted to ``dst``'s dtype when they differ.
    """
    if dst_at is None and src_at is None:
        raise ValueError("move_rows needs dst_at or src_at")
    n = (dst_at if dst_at is not None else src_at).numel()
    if n == 0:
        return
    if _native_fits(dst, dst_at, src, src_at):
        _NATIVE.module.move_rows(as_bytes(dst), numpy_view(dst_at), as_bytes(src),
                                 numpy_view(src_at), dst.shape[1] * dst.element_size())
        return
    rows = src if src_at is None else src.index_select(0, src_at)
    rows = rows.to(dst.dtype)
    if dst_at is None:
        dst.copy_(rows)
    else:
        dst.index_copy_(0, dst_at, rows)


def _native_fits(dst: torch.Tensor, dst_at: Optional[torch.Tensor], src: torch.Tensor,
                 src_at: Optional[torch.Tensor]) -> bool:
    return (_NATIVE.enabled() and dst.device.type == "cpu" and src.device.type == "cpu"
            and dst.dtype == src.dtype and dst.dim() == 2 and src.dim() == 2
            and dst.shape[1] == src.shape[1] and dst.shape[1] > 0
            and dst.is_contiguous() and src.is_contiguous()
            and all(a is None or (a.device.type == "cpu" and a.dtype == torch.int64)
                    for a in (dst_at, src_at)))
