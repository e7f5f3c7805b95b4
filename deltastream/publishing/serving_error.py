"""How far the predictors' copy of each changed row is from the trainer's: the serving error.

For a tracker delta in EMBEDDING mode every candidate row carries its FIRST state, the value
the predictors hold (``retain`` keeps it while the row is carried). A row predictors never
received (``delta.new``) is served as zeros there (``ServingTable`` reads a missing id as
zeros). So the serving error of a row is::

    error = ‖current − served‖₂,   served = zeros if new (new_rows="drift") else FIRST

in embedding units. :func:`serving_errors` reads the current rows chunk by chunk and
returns the errors, the row norms and which rows are finite.

:class:`TableScale` makes the error comparable across tables: ``error / scale``, ``scale``
the table's RMS row norm (an exponential average over the rows read). Widening a table or
multiplying its values by ``c`` multiplies its errors and its scale alike, so a dim-1 bias
table and a dim-64 embedding table compete on the *relative* size of their errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from deltastream.native_ext import NativeExtension
from deltastream.publishing.table_rows import read_rows, row_reader
from deltastream.tensor_views import numpy_view
from deltastream.types import DeltaRows

__all__ = ["RowErrors", "row_errors", "serving_errors", "TableScale", "use_native"]

_NATIVE = NativeExtension("deltastream.publishing.native", "native serving errors",
                          "torch runs")
#: switch :func:`row_errors` to the C code (``RuntimeError`` when it is not built) or torch
use_native = _NATIVE.use


@dataclass
class RowErrors:
    """One table's candidates with their serving errors.

    Attributes:
        delta: the candidates (``ids`` ``[n]`` ascending, FIRST ``states`` ``[n, dim]``,
            ``new``, ``age``, ``tombstones``) as the tracker handed them over.
        error: float64 ``[n]`` ``‖current − served‖₂`` (NaN where ``finite`` is False;
            ``+inf`` where the current row is finite but the served one was not).
        finite: bool ``[n]``: the current row holds no NaN/Inf.
        norm: float64 ``[n]`` ``‖current‖₂`` (NaN where not finite).
    """

    delta: DeltaRows
    error: torch.Tensor
    finite: torch.Tensor
    norm: torch.Tensor

    def __len__(self) -> int:
        return int(self.error.numel())


def serving_errors(delta: DeltaRows, table: Any, *, new_rows: str = "drift",
                   chunk_rows: int = 16384) -> RowErrors:
    """Read the current rows of ``delta.ids`` from ``table`` (``chunk_rows`` at a time, so
    memory stays bounded however many rows are pending) and their serving errors.

    Args:
        delta: an EMBEDDING-mode delta (``states`` not None) of ``table``.
        table: a :class:`~deltastream.HashTable`, ``ShardedEmbedding`` or
            ``torch.nn.Embedding``.
        new_rows: ``"drift"`` — a new row's error is ``‖current‖`` (predictors serve zeros);
            ``"first"`` — new rows get error ``+inf`` (they go out before any other row).
        chunk_rows: rows read per chunk (``>= 1``).

    Raises:
        ValueError: an ID_ONLY delta (no FIRST states: the error cannot be known), a state
            width that is not the table's, or an unknown ``new_rows``.
    """
    if new_rows not in ("drift", "first"):
        raise ValueError(f"new_rows must be 'drift' or 'first', got {new_rows!r}")
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    read, dim, dtype, _ = row_reader(table)
    if delta.states is None:
        raise ValueError("serving errors need an EMBEDDING-mode delta (FIRST states); this "
                         "delta has states=None (use DeltaTracker(mode=TrackingMode.EMBEDDING))")
    if delta.states.dim() != 2 or delta.states.shape[1] != dim \
            or delta.states.shape[0] != delta.ids.numel():
        raise ValueError(f"delta states have shape {tuple(delta.states.shape)}, expected "
                         f"({delta.ids.numel()}, {dim}) for this table")
    ids = delta.ids
    n, dev = ids.numel(), ids.device
    new = delta.new.to(device=dev, dtype=torch.bool) if delta.new is not None else None
    zero_new = new if new is not None and new_rows == "drift" else None
    error = torch.empty(n, dtype=torch.float64, device=dev)
    norm = torch.empty(n, dtype=torch.float64, device=dev)
    finite = torch.ones(n, dtype=torch.bool, device=dev)
    for start in range(0, n, chunk_rows):
        stop = min(n, start + chunk_rows)
        cur = read_rows(read, ids[start:stop], dim, dtype or delta.states.dtype, dev)
        error[start:stop], norm[start:stop], finite[start:stop] = row_errors(
            cur, delta.states[start:stop].to(dev),
            None if zero_new is None else zero_new[start:stop])
    if new is not None and new_rows == "first":
        error = torch.where(new & finite, math.inf, error)
    return RowErrors(delta=delta, error=error, finite=finite, norm=norm)


def row_errors(current: torch.Tensor, served: torch.Tensor,
               zero: Optional[torch.Tensor] = None, amax: Optional[torch.Tensor] = None, *,
               current_at: Optional[torch.Tensor] = None,
               served_at: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Serving errors of rows whose current and served values are at hand.

    Args:
        current: ``[n, dim]`` the trainer's rows (any float dtype).
        served: ``[n, dim]`` what predictors hold (same device).
        zero: bool ``[n]`` or None: rows predictors hold as zeros (``served`` ignored).
        amax: contiguous float64 ``[n]`` or None: filled with each row's largest
            ``|value|`` (for a wire dtype's range; NaN where the row is not finite).
        current_at, served_at: int64 ``[n]`` or None: row ``i`` is ``current[current_at[i]]``
            and ``served[served_at[i]]`` (the rows are read where they lie, not gathered
            first); ``n`` is then their length.

    Returns:
        ``(error, norm, finite)``: float64 ``‖current − served‖₂`` and ``‖current‖₂``
        (both NaN where the current row is not finite; the error ``+inf`` where it is
        finite but ``served`` was not: a recovered row must go out), and bool ``finite``.

    float32/float64 rows on the CPU go through the C extension
    (:mod:`deltastream.publishing.native`: one pass, without the GIL); the rest through
    torch, with the same results up to the order of the float64 sums.
    """
    if _native_fits(current, served, zero, current_at, served_at):
        return _native_row_errors(current, served, zero, amax, current_at, served_at)
    if current_at is not None:
        current = current.index_select(0, current_at)
    if served_at is not None:
        served = served.index_select(0, served_at)
    # float64 (exact differences, squares that cannot overflow for narrower floats), one
    # copy: vector_norm reduces without the [n, dim] squares a mul_ + sum would write; the
    # rows held as zeros are copied over on the CPU (a where over [n, dim] cost ~3x the rest),
    # by where elsewhere (nonzero would synchronize a CUDA stream)
    diff = current.to(torch.float64, copy=True).sub_(served)
    if zero is not None:
        if diff.device.type == "cpu":
            z = zero.nonzero().squeeze(1)
            if z.numel():
                diff.index_copy_(0, z, current.index_select(0, z).to(torch.float64))
        else:
            diff = torch.where(zero[:, None], current.to(torch.float64), diff)
    error = torch.linalg.vector_norm(diff, dim=1)
    norm = torch.linalg.vector_norm(current, dim=1, dtype=torch.float64)
    # narrower floats cannot overflow a float64 square: a non-finite norm is a NaN/Inf in
    # the row; float64 rows are checked value by value
    finite = torch.isfinite(current).all(dim=1) if current.dtype == torch.float64 \
        else torch.isfinite(norm)
    error = torch.where(finite & ~torch.isfinite(error), math.inf, error)
    if amax is not None:
        amax.copy_(current.abs().amax(dim=1).masked_fill_(~finite, math.nan))
    return error.masked_fill_(~finite, math.nan), norm.masked_fill_(~finite, math.nan), finite


def _native_fits(current: torch.Tensor, served: torch.Tensor, zero: Optional[torch.Tensor],
                 *at: Optional[torch.Tensor]) -> bool:
    return (_NATIVE.enabled() and current.device.type == "cpu"
            and current.dtype in (torch.float32, torch.float64) and served.dtype == current.dtype
            and served.device.type == "cpu" and current.dim() == 2 and served.dim() == 2
            and current.shape[1] == served.shape[1] and current.shape[1] > 0
            and (at[0] is not None or at[1] is not None or current.shape == served.shape)
            and (zero is None or zero.device.type == "cpu")
            and all(a is None or (a.device.type == "cpu" and a.dtype == torch.int64)
                    for a in at))


def _native_row_errors(current: torch.Tensor, served: torch.Tensor,
                       zero: Optional[torch.Tensor], amax: Optional[torch.Tensor],
                       current_at: Optional[torch.Tensor], served_at: Optional[torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dim = current.shape[1]
    n = current_at.numel() if current_at is not None else \
        served_at.numel() if served_at is not None else current.shape[0]
    error = torch.empty(n, dtype=torch.float64)
    norm = torch.empty(n, dtype=torch.float64)
    finite = torch.empty(n, dtype=torch.bool)
    _NATIVE.module.row_errors(
        numpy_view(current), numpy_view(served),
        None if zero is None else numpy_view(zero.to(torch.bool)), dim,
        error.numpy(), norm.numpy(), finite.numpy(), None if amax is None else amax.numpy(),
        numpy_view(current_at), numpy_view(served_at))
    return error, norm, finite


class TableScale:
    """A table's typical row norm: the RMS of ``‖row‖`` over the rows read, averaged.

    ``update(norms)`` folds in the norms of one round's finite rows (exponential average
    with weight ``alpha`` for the new round; the first round sets it). ``value`` is ``None``
    until a round with a non-zero RMS was seen.
    """

    def __init__(self, alpha: float = 0.1) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.value: Optional[float] = None

    def update(self, norms: torch.Tensor) -> Optional[float]:
        """Fold in ``norms`` (float ``[n]``, NaN entries ignored); return the new value."""
        ok = norms[torch.isfinite(norms)]
        if ok.numel():
            rms = float(torch.sqrt(torch.mean(ok.to(torch.float64) ** 2)))
            if rms > 0.0 and math.isfinite(rms):
                self.value = rms if self.value is None \
                    else (1.0 - self.alpha) * self.value + self.alpha * rms
        return self.value

    def normalize(self, error: torch.Tensor) -> torch.Tensor:
        """``error / value`` (``error`` itself while no scale is known: a table whose rows
        are all zero so far)."""
        if self.value is None:
            return error
        return error / self.value
