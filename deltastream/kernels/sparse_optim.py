"""Fused sparse optimizer updates: one Triton kernel launch per table per step.

Each kernel updates the ``u`` touched rows of a row table in place, given the coalesced
gradient (:class:`~deltastream.embedding.sparse_grad.SparseGrad`: unique positions and one
summed gradient row each). One program owns ``BLOCK_R`` whole rows (a ``[BLOCK_R, BLOCK_D]``
tile: loads along a row are contiguous, so a warp reads whole 128-byte lines); it reads
the row, its gradient and its optimizer state, and writes the new row and state back. Math
is float32 whatever the table dtype, as on the reference path
(:mod:`deltastream.embedding.optim`), with the same operation order.

Cost on CUDA, per table per step: **1 launch, 0 host syncs** (positions are unique, so
programs never touch the same row: no atomics). Bytes moved per row: the row and its
gradient, plus the state (Adam: 2 rows and a step count; row-wise Adagrad: 4 bytes).

Scalars (``lr``, ``eps``, ...) reach the kernel as float32 (Triton passes Python floats as
fp32), as torch's fp32 kernels use them. Differences of scalars (``1 - beta``, ``1 - lr * wd``)
are taken on the host in float64 first, as the reference does: in float32, ``1 - 0.999``
is off by 1.3e-5 relative, which on CUDA moved Adam's rows by that much. Adam's bias corrections ``1 - beta**step`` are
computed per row in float32 through an accurate ``expm1`` (a plain ``1 - exp2(...)`` loses
four digits at ``beta2 = 0.999``, step 1).

Rows wider than :data:`MAX_DIM` are not handled here (a row must fit one tile): callers
check :func:`supports` and take the torch reference path otherwise.
"""

from __future__ import annotations

import logging
import math

import torch
import triton
import triton.language as tl

__all__ = ["MAX_DIM", "supports", "sgd_update", "rowwise_adagrad_update", "adam_update"]

log = logging.getLogger(__name__)

#: widest row the kernels take (one row is one tile row of up to this many elements)
MAX_DIM = 4096
_TILE = 1024  # elements per program: BLOCK_R * BLOCK_D (4 warps, 8 fp32 each per thread)
_LOG_ZERO = -1.0e30  # ln(0) stand-in: beta = 0 gives exp(step * -1e30) = 0, 1 - 0 = 1


def supports(storage: torch.Tensor) -> bool:
    """Whether the kernels can update ``storage`` ``[rows, dim]`` (row stride 1, dim fits)."""
    return storage.dim() == 2 and storage.shape[1] <= MAX_DIM and storage.stride(1) == 1


def _blocks(dim: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(max(dim, 1))
    return max(1, _TILE // block_d), block_d


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


@triton.jit
def _one_minus_exp(x):
    """``1 - exp(x)`` for ``x <= 0`` without cancellation near 0 (``-expm1(x)``)."""
    # Taylor series of expm1 to x**9 for |x| < 0.5 (error < 3e-10), exp(x) - 1 beyond;
    # the series is evaluated at max(x, -0.5) so the unused branch never overflows.
    xs = tl.maximum(x, -0.5)
    p = 1.0 / 362880.0
    p = p * xs + 1.0 / 40320.0
    p = p * xs + 1.0 / 5040.0
    p = p * xs + 1.0 / 720.0
    p = p * xs + 1.0 / 120.0
    p = p * xs + 1.0 / 24.0
    p = p * xs + 1.0 / 6.0
    p = p * xs + 0.5
    p = p * xs + 1.0
    small = p * xs
    return -tl.where(x > -0.5, small, tl.exp(x) - 1.0)


@triton.jit
def _tile(pid, n, dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    rmask = r < n
    mask = rmask[:, None] & (c < dim)[None, :]
    return r, c, rmask, mask


@triton.jit
def _load_rows(w_ptr, pos_ptr, g_ptr, r, c, rmask, mask, w_stride, g_stride):
    """(table positions, their element offsets, their weights and gradients in fp32) of
    tile rows ``r`` x columns ``c``: the loads every optimizer kernel starts with."""
    pos = tl.load(pos_ptr + r, mask=rmask, other=0).to(tl.int64)
    w_off = pos[:, None] * w_stride + c[None, :]
    w = tl.load(w_ptr + w_off, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r[:, None].to(tl.int64) * g_stride + c[None, :], mask=mask,
                other=0.0).to(tl.float32)
    return pos, w_off, w, g


@triton.jit
def _sgd_kernel(w_ptr, pos_ptr, g_ptr, n, dim, w_stride, g_stride, lr, wd,
                HAS_WD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r, c, rmask, mask = _tile(tl.program_id(0), n, dim, BLOCK_R, BLOCK_D)
    pos, w_off, w, g = _load_rows(w_ptr, pos_ptr, g_ptr, r, c, rmask, mask, w_stride, g_stride)
    if HAS_WD:
        g = g + wd * w
    w = w - lr * g
    tl.store(w_ptr + w_off, w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adagrad_kernel(w_ptr, sum_ptr, pos_ptr, g_ptr, n, dim, w_stride, g_stride, lr, eps, wd,
                    init, HAS_WD: tl.constexpr, HAS_INIT: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r, c, rmask, mask = _tile(tl.program_id(0), n, dim, BLOCK_R, BLOCK_D)
    pos, w_off, w, g = _load_rows(w_ptr, pos_ptr, g_ptr, r, c, rmask, mask, w_stride, g_stride)
    if HAS_WD:
        g = g + wd * w
    acc = tl.load(sum_ptr + pos, mask=rmask, other=0.0)
    if HAS_INIT:  # zero state means "fresh row" (also after eviction): start at init
        acc = tl.where(acc == 0.0, init, acc)
    acc = acc + tl.sum(g * g, axis=1) / dim  # masked columns are 0: a mean over dim
    tl.store(sum_ptr + pos, acc, mask=rmask)
    w = w - lr * g / (tl.sqrt(acc) + eps)[:, None]
    tl.store(w_ptr + w_off, w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adam_kernel(w_ptr, m_ptr, v_ptr, step_ptr, pos_ptr, g_ptr, n, dim, w_stride, g_stride,
                 s_stride, lr, b1, b2, omb1, omb2, ln_b1, ln_b2, eps, decay,
                 HAS_WD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r, c, rmask, mask = _tile(tl.program_id(0), n, dim, BLOCK_R, BLOCK_D)
    pos, w_off, w, g = _load_rows(w_ptr, pos_ptr, g_ptr, r, c, rmask, mask, w_stride, g_stride)
    s_off = pos[:, None] * s_stride + c[None, :]
    step = tl.load(step_ptr + pos, mask=rmask, other=0) + 1
    tl.store(step_ptr + pos, step, mask=rmask)
    m = tl.load(m_ptr + s_off, mask=mask, other=0.0) * b1 + g * omb1
    v = tl.load(v_ptr + s_off, mask=mask, other=0.0) * b2 + g * g * omb2
    tl.store(m_ptr + s_off, m, mask=mask)
    tl.store(v_ptr + s_off, v, mask=mask)
    t = step.to(tl.float32)
    bc1 = _one_minus_exp(t * ln_b1)
    bc2 = _one_minus_exp(t * ln_b2)
    if HAS_WD:  # decoupled (AdamW): decay = 1 - lr * wd
        w = w * decay
    denom = tl.sqrt(v) / tl.sqrt(bc2)[:, None] + eps
    w = w - (lr / bc1)[:, None] * m / denom
    tl.store(w_ptr + w_off, w.to(w_ptr.dtype.element_ty), mask=mask)


def _launch_args(storage: torch.Tensor, positions: torch.Tensor, grad: torch.Tensor):
    n, dim = positions.numel(), storage.shape[1]
    if grad.shape != (n, dim):
        raise ValueError(f"grad must be [{n}, {dim}] (one row per position), got "
                         f"{tuple(grad.shape)}")
    block_r, block_d = _blocks(dim)
    grid = (triton.cdiv(n, block_r),)
    return n, dim, _contig(positions), _contig(grad), grid, block_r, block_d


def sgd_update(storage: torch.Tensor, positions: torch.Tensor, grad: torch.Tensor, *,
               lr: float, weight_decay: float) -> None:
    """``w -= lr * (g + weight_decay * w)`` on rows ``positions`` (int64 ``[u]``, unique) of
    ``storage`` ``[rows, dim]``, in place; ``grad`` ``[u, dim]``. One launch, no sync."""
    n, dim, pos, g, grid, br, bd = _launch_args(storage, positions, grad)
    if n == 0:
        return
    _sgd_kernel[grid](storage, pos, g, n, dim, storage.stride(0), g.stride(0), float(lr),
                      float(weight_decay), HAS_WD=bool(weight_decay), BLOCK_R=br, BLOCK_D=bd)


def rowwise_adagrad_update(storage: torch.Tensor, acc: torch.Tensor, positions: torch.Tensor,
                           grad: torch.Tensor, *, lr: float, eps: float, weight_decay: float,
                           initial_accumulator_value: float) -> None:
    """Row-wise Adagrad on rows ``positions`` of ``storage`` and their accumulators ``acc``
    (float32 ``[rows]``), in place; see :class:`~deltastream.RowWiseAdagrad`. One launch."""
    n, dim, pos, g, grid, br, bd = _launch_args(storage, positions, grad)
    if n == 0:
        return
    _adagrad_kernel[grid](storage, acc, pos, g, n, dim, storage.stride(0), g.stride(0),
                          float(lr), float(eps), float(weight_decay),
                          float(initial_accumulator_value), HAS_WD=bool(weight_decay),
                          HAS_INIT=bool(initial_accumulator_value), BLOCK_R=br, BLOCK_D=bd)


def adam_update(storage: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: torch.Tensor, positions: torch.Tensor, grad: torch.Tensor, *, lr: float,
                betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Lazy Adam on rows ``positions`` of ``storage``, in place, with per-row moments
    ``exp_avg``/``exp_avg_sq`` (float32 ``[rows, dim]``, contiguous) and step counts ``step``
    (int64 ``[rows]``); see :class:`~deltastream.SparseAdam`. One launch, no sync."""
    n, dim, pos, g, grid, br, bd = _launch_args(storage, positions, grad)
    if n == 0:
        return
    if not (exp_avg.is_contiguous() and exp_avg_sq.is_contiguous()):
        raise ValueError("exp_avg and exp_avg_sq must be contiguous [rows, dim]")
    b1, b2 = float(betas[0]), float(betas[1])
    ln_b1 = math.log(b1) if b1 > 0 else _LOG_ZERO
    ln_b2 = math.log(b2) if b2 > 0 else _LOG_ZERO
    _adam_kernel[grid](storage, exp_avg, exp_avg_sq, step, pos, g, n, dim, storage.stride(0),
                       g.stride(0), exp_avg.stride(0), float(lr), b1, b2, 1.0 - b1, 1.0 - b2,
                       ln_b1, ln_b2, float(eps), 1.0 - float(lr) * float(weight_decay),
                       HAS_WD=bool(weight_decay),
                       BLOCK_R=br, BLOCK_D=bd)
