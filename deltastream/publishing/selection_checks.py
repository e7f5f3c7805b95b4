"""Argument checks of :func:`~deltastream.publishing.selection.select_changed`.

Type and shape checks raise at once. Checks of tensor *values* (ids ascending, ages
``>= 0``, weights finite and ``>= 0``) need the data, which on CUDA means a host sync per
check; they are returned as :class:`ValueCheck` s instead, so that the CPU path raises them
at once (:func:`raise_failed`) while the CUDA path reads them back together with its one
count readback (no extra sync).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch

from deltastream import wire
from deltastream.types import DeltaRows

__all__ = ["ValueCheck", "check_budget", "check_policy", "check_delta", "check_weights",
           "raise_failed", "NEW_ROW_POLICIES"]

#: how ``select_changed`` treats rows the predictors have never received (``delta.new``):
#: ``"first"`` — they outrank every other row and pass any threshold; ``"drift"`` — they are
#: scored by ``‖current‖`` (a predictor serves zeros for a row it does not hold) and compete
#: like any other row.
NEW_ROW_POLICIES = ("first", "drift")


@dataclass
class ValueCheck:
    """A deferred check: ``bad`` is a 0-d bool tensor (on the data's device), True when the
    value is invalid; ``message`` is the ``ValueError`` text to raise then."""

    bad: torch.Tensor
    message: str


def raise_failed(checks: list[ValueCheck], bad: Optional[list[bool]] = None) -> None:
    """Raise ``ValueError`` for the first failed check (``bad``: their values, already read
    back; read one by one here when None)."""
    for i, check in enumerate(checks):
        if bad[i] if bad is not None else bool(check.bad):
            raise ValueError(check.message)


def check_budget(k, fraction, threshold, max_bytes, wire_dtype, max_age, chunk_rows) -> None:
    """Types and ranges of the budget arguments (see ``select_changed``)."""
    given = [name for name, v in (("k", k), ("fraction", fraction), ("threshold", threshold))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of k, fraction, threshold; got {', '.join(given)}")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise TypeError(f"k must be an int, got {type(k).__name__} {k!r}")
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
            raise TypeError(f"fraction must be a float, got {type(fraction).__name__} {fraction!r}")
        if not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
            raise TypeError(
                f"threshold must be a float, got {type(threshold).__name__} {threshold!r}")
        if not (math.isfinite(float(threshold)) and float(threshold) >= 0.0):
            raise ValueError(f"threshold must be a finite number >= 0, got {threshold}")
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Integral):
            raise TypeError(
                f"max_bytes must be an int, got {type(max_bytes).__name__} {max_bytes!r}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if wire_dtype not in wire.DTYPES:
        raise ValueError(f"wire_dtype must be one of {sorted(wire.DTYPES)}, got {wire_dtype!r}")
    if max_age is not None:
        if isinstance(max_age, bool) or not isinstance(max_age, numbers.Integral) or max_age < 1:
            raise ValueError(f"max_age must be None or an int >= 1, got {max_age!r}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral) \
            or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")


def check_policy(threshold, relative, new_rows) -> None:
    """``relative`` and ``new_rows`` (see ``select_changed``)."""
    if not isinstance(relative, bool):
        raise TypeError(f"relative must be a bool, got {type(relative).__name__} {relative!r}")
    if relative and threshold is None:
        raise ValueError("relative=True needs a threshold (it makes the threshold relative "
                         "to the row norm)")
    if new_rows not in NEW_ROW_POLICIES:
        raise ValueError(f"new_rows must be one of {list(NEW_ROW_POLICIES)}, got {new_rows!r}")


def check_weights(weights, n: int) -> list[ValueCheck]:
    """Shape and dtype of ``weights`` ``[n]``; returns the check that they are finite, >= 0."""
    if not isinstance(weights, torch.Tensor) or weights.shape != (n,) \
            or not weights.is_floating_point():
        raise ValueError(f"weights must be a float tensor [n={n}] aligned with delta.ids, got "
                         f"{getattr(weights, 'dtype', type(weights).__name__)} "
                         f"{tuple(getattr(weights, 'shape', ()))}")
    if not n:
        return []
    return [ValueCheck(~((weights >= 0) & torch.isfinite(weights)).all(),
                       "weights must be finite and >= 0")]


def check_delta(delta: DeltaRows, dim: int) -> list[ValueCheck]:
    """Types, shapes and devices of ``delta``'s fields against a table of width ``dim``;
    returns the value checks (ids unique and ascending, ages ``>= 0``)."""
    if not isinstance(delta, DeltaRows):
        raise TypeError(f"delta must be a DeltaRows, got {type(delta).__name__}")
    ids = delta.ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(
            f"delta.ids must be a 1-D int64 tensor, got "
            f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    n = ids.numel()
    checks = []
    if n > 1:
        checks.append(ValueCheck(~(ids[1:] > ids[:-1]).all(),
                                 "delta.ids must be unique and ascending (as "
                                 "DeltaStore/DeltaTracker return them)"))
    if delta.states is not None:
        st = delta.states
        if not isinstance(st, torch.Tensor) or st.dim() != 2 or st.shape[0] != n:
            raise ValueError(f"delta.states must be [n={n}, dim] aligned with ids, got "
                             f"{tuple(getattr(st, 'shape', ()))}")
        if not st.is_floating_point():
            raise ValueError(f"delta.states must be floating point, got {st.dtype}")
        if st.shape[1] != dim:
            raise ValueError(f"delta.states has dim {st.shape[1]} but the table has dim {dim}")
        if st.device != ids.device:
            raise ValueError(f"delta.states is on {st.device} but delta.ids on {ids.device}")
    if delta.new is not None:
        nw = delta.new
        if not isinstance(nw, torch.Tensor) or nw.dtype != torch.bool or nw.shape != (n,):
            raise ValueError(f"delta.new must be a bool tensor [n={n}], got "
                             f"{getattr(nw, 'dtype', type(nw).__name__)} "
                             f"{tuple(getattr(nw, 'shape', ()))}")
    if delta.age is not None:
        ag = delta.age
        if not isinstance(ag, torch.Tensor) or ag.shape != (n,) or ag.is_floating_point() \
                or ag.dtype == torch.bool:
            raise ValueError(f"delta.age must be an integer tensor [n={n}], got "
                             f"{getattr(ag, 'dtype', type(ag).__name__)} "
                             f"{tuple(getattr(ag, 'shape', ()))}")
        if n:
            checks.append(ValueCheck((ag < 0).any(), "delta.age must be >= 0"))
    if delta.tombstones is not None:
        tb = delta.tombstones
        if not isinstance(tb, torch.Tensor) or tb.dim() != 1 or tb.dtype != torch.int64:
            raise ValueError("delta.tombstones must be None or a 1-D int64 tensor")
    return checks
