"""The budget and the ranking of a :class:`~deltastream.publishing.budget.BudgetPublisher`.

:class:`BudgetPolicy` is checked when it is built, so a bad budget fails at start-up rather
than at the first tick. See :mod:`deltastream.publishing.budget` for what a tick does.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from deltastream import wire

__all__ = ["BudgetPolicy", "SCALES"]

#: how errors of different tables are made comparable: ``"table"`` — divided by the table's
#: RMS row norm; ``"none"`` — raw L2 in embedding units.
SCALES = ("table", "none")

#: rounds of a ``bytes_per_s`` budget are at least this far apart by default (seconds)
DEFAULT_INTERVAL_S = 0.1
#: default BudgetPolicy.max_worker_share (a twentieth of a core)
DEFAULT_WORKER_SHARE = 0.05
#: default BudgetPolicy.read_decay: a change weighs half after 7 hand-offs
DEFAULT_READ_DECAY = 0.9

def _real(name: str, v: Any, lo: float, *, lo_open: bool = False,
          hi: float = math.inf) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)) \
            or float(v) < lo or (lo_open and float(v) == lo) or float(v) > hi:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ValueError(f"BudgetPolicy.{name} must be a finite number in {rng}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class BudgetPolicy:
    """What a :class:`BudgetPublisher` may send, and how it ranks rows.

    Exactly one of ``bytes_per_s`` (wall clock, per trainer) and ``bytes_per_step``.

    Attributes:
        bytes_per_s / bytes_per_step: the refill rate of the byte budget (``> 0``). It
            buys rows: the tombstones of evicted ids go in the next round whatever the
            budget, and their 8 bytes an id are not charged to it.
        burst_bytes: most bytes one tick may send after idling (the bucket's size);
            default one second's (``bytes_per_s``) or four steps' (``bytes_per_step``)
            budget. Must hold the largest row plus a message header or that row never fits.
            A hand-off read over several ticks (a model of many tables) brings the refill
            of those ticks on top: they were not idle.
        scale: ``"table"`` (default: errors divided by the table's RMS row norm) or
            ``"none"`` (raw L2), see :data:`SCALES`.
        weights: ``{table name: weight >= 0}`` multiplying that table's normalized errors
            (default 1): a table's share of the budget, set by name.
        min_error: normalized error below which a row is not worth bytes (it stays pending
            and tracked, and counts in the bound); 0 = spend the budget on any error.
        max_age: ticks a row may stay pending before it is overdue (``None``: never).
        overdue_share: share of each tick's tokens overdue rows may take, in ``(0, 1]``.
        new_rows: ``"drift"`` (a row predictors never received scores ``‖current‖``) or
            ``"first"`` (such rows go out before every other row).
        min_interval_s: a tick sooner than this (seconds) after the last round only
            refills; its rows wait in the tracker, where they coalesce. Default (``None``):
            0.1 s for a ``bytes_per_s`` budget — rounds ten times a second cost the worker
            a tenth of rounds after every step, and rows still reach predictors within
            the budget's own delay — and 0 for a ``bytes_per_step`` budget.
        max_worker_share: the most of one core the publisher's worker may spend merging
            and choosing (busy seconds ÷ wall seconds, ``(0, 1]``), on average over each
            round: a hand-off waits after the last round until the worker's busy time since
            then is at most this share of the gap — rows coalesce in the tracker
            meanwhile, and each round is cheaper per row than several small ones — but
            never past the moment the byte bucket is full (the bytes it would refill are
            not lost). It bounds what the worker takes from a training loop that shares its
            cores (or, for the thread worker, its GIL) when rows change faster than rounds
            every ``min_interval_s`` can merge cheaply. ``max_age`` counts hand-offs, so it
            spans more seconds when they are further apart. ``None``: rounds every
            ``min_interval_s``, whatever they cost. Default (``"auto"``): 0.05 for a
            ``bytes_per_s`` budget and ``None`` for a ``bytes_per_step`` one (its rounds
            follow steps, not the clock, and are the same in every threading mode). Only
            threaded publishers have a worker.
        window: ticks the bound quantiles of :meth:`BudgetPublisher.stats` cover.
        per_byte: rank rows by score per wire byte of the row (default: the budget buys
            the most error removed per byte, so a dim-1 bias row that is off by as much
            of its scale as a dim-32 row goes first: it costs 10 bytes, not 72); False:
            by score alone.
        charge_dense: the dense versions of ``BudgetPublisher(dense=)`` spend this budget
            too: the bytes of each version sent are taken from the bucket at the next
            tick, so rows and dense weights together stay within it (the rows get what
            the versions leave; the versions keep their own cadence). False (default):
            the budget is the rows'.
        wide_dtype: a wire dtype for the rows of every table that it carries in fewer
            bytes than the publisher's dtype: ``"i8"`` costs dim + 4 bytes a row, f16
            2 · dim, so tables wider than 4 go as i8 (error ≤ max|row| / 254 an element)
            and dim-1 bias rows stay f16. None (default): every table in the publisher's.
        residuals: the rows of every table where it is cheaper go as 1-bit residuals
            (wire dtype ``r1``, ``ceil(dim / 8)`` + 2 bytes a row: a dim-32 row costs 6
            bytes, not 36 in i8) *added* to what predictors hold. What a residual leaves
            stays pending against the value predictors now hold, ranked again (error
            feedback), until it is within the error a whole row in the table's dtype would
            leave. A row goes whole at every ``whole_every``-th send, after a send of its
            residual failed (predictors may or may not hold it) and at a final flush. Needs
            a publisher writing wire v4; with one writing v5 the residuals go as ``r1e``
            (one byte of scale a row, sign bits packed over the message: ``dim / 8 + 1``
            bytes, 5 for dim 32 and 1.125 for dim 1, so bias rows go as residuals too).
            False (default): whole rows only.
        whole_every: with ``residuals``, a row's sends from one whole row to the next
            (``>= 1``; 1: whole rows only): whatever a predictor's copy of a row became
            (a trainer restarted from a checkpoint, a predictor restored from an older
            snapshot), it is whole again within this many sends.
        read_decay: weight each row's error by how often predictors will read it, as
            estimated from the trainer's own changes: √ of a count of the hand-offs that
            changed the row, decayed by this factor at each hand-off (in ``(0, 1)``; 0.9:
            a change weighs half after 7 hand-offs). The count is in the same unit in
            every table (a user's embedding and its bias row are read together), so it is
            not normalized per table. A row that many steps change, and changed lately,
            goes before a row of equal error changed once long ago. Keys
            are kept incrementally (:mod:`~deltastream.publishing.read_weights`); the
            reported bound and ``min_error`` stay in plain error. Counts outlive a row's
            pending life and fade: memory grows by ~50 bytes an id changed in the last
            ``log(0.01) / log(read_decay)`` hand-offs. A hand-off is a step with a
            ``bytes_per_step`` budget, a round with ``bytes_per_s``. Default 0.9 (chosen
            on MovieLens-100K; BENCHMARKS.md); None: rank by error alone.

    Raises:
        ValueError / TypeError: naming the bad field and what was expected.
    """

    bytes_per_s: Optional[float] = None
    bytes_per_step: Optional[float] = None
    burst_bytes: Optional[float] = None
    scale: str = "table"
    weights: Mapping[str, float] = field(default_factory=dict)
    min_error: float = 0.0
    max_age: Optional[int] = 64
    overdue_share: float = 0.25
    new_rows: str = "drift"
    min_interval_s: Optional[float] = None
    max_worker_share: Optional[float] | str = "auto"
    window: int = 1024
    per_byte: bool = True
    charge_dense: bool = False
    wide_dtype: Optional[str] = None
    residuals: bool = False
    whole_every: int = 16
    read_decay: Optional[float] = DEFAULT_READ_DECAY

    def __post_init__(self) -> None:
        if (self.bytes_per_s is None) == (self.bytes_per_step is None):
            raise ValueError("BudgetPolicy: give exactly one of bytes_per_s and bytes_per_step, "
                             f"got bytes_per_s={self.bytes_per_s!r}, "
                             f"bytes_per_step={self.bytes_per_step!r}")
        for name in ("bytes_per_s", "bytes_per_step", "burst_bytes"):
            if getattr(self, name) is not None:
                _real(name, getattr(self, name), 0.0, lo_open=True)
        if self.scale not in SCALES:
            raise ValueError(f"BudgetPolicy.scale must be one of {list(SCALES)}, got "
                             f"{self.scale!r}")
        if not isinstance(self.weights, Mapping):
            raise TypeError(f"BudgetPolicy.weights must be a mapping of table name to weight, "
                            f"got {type(self.weights).__name__}")
        for k, w in self.weights.items():
            if not isinstance(k, str):
                raise TypeError(f"BudgetPolicy.weights keys must be table names (str), got {k!r}")
            _real(f"weights[{k!r}]", w, 0.0)
        object.__setattr__(self, "weights", dict(self.weights))
        _real("min_error", self.min_error, 0.0)
        if self.max_age is not None and (isinstance(self.max_age, bool)
                                         or not isinstance(self.max_age, numbers.Integral)
                                         or self.max_age < 0):
            raise ValueError(f"BudgetPolicy.max_age must be an int >= 0 or None, got "
                             f"{self.max_age!r}")
        _real("overdue_share", self.overdue_share, 0.0, lo_open=True, hi=1.0)
        if self.new_rows not in ("drift", "first"):
            raise ValueError(f"BudgetPolicy.new_rows must be 'drift' or 'first', got "
                             f"{self.new_rows!r}")
        if self.min_interval_s is None:
            object.__setattr__(self, "min_interval_s",
                               0.0 if self.bytes_per_step is not None else DEFAULT_INTERVAL_S)
        _real("min_interval_s", self.min_interval_s, 0.0)
        if self.max_worker_share == "auto":
            object.__setattr__(self, "max_worker_share",
                               None if self.bytes_per_step is not None else DEFAULT_WORKER_SHARE)
        if self.max_worker_share is not None:
            _real("max_worker_share", self.max_worker_share, 0.0, lo_open=True, hi=1.0)
        for name in ("per_byte", "charge_dense", "residuals"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"BudgetPolicy.{name} must be a bool, got "
                                f"{getattr(self, name)!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, numbers.Integral) \
                or self.window < 1:
            raise ValueError(f"BudgetPolicy.window must be an int >= 1, got {self.window!r}")
        if self.wide_dtype is not None and self.wide_dtype not in wire.DTYPES:
            raise ValueError(f"BudgetPolicy.wide_dtype must be None or one of "
                             f"{sorted(wire.DTYPES)}, got {self.wide_dtype!r}")
        if isinstance(self.whole_every, bool) or not isinstance(self.whole_every,
                                                                 numbers.Integral) \
                or self.whole_every < 1:
            raise ValueError(f"BudgetPolicy.whole_every must be an int >= 1, got "
                             f"{self.whole_every!r}")
        d = self.read_decay
        if d is not None and (isinstance(d, bool) or not isinstance(d, numbers.Real)
                              or not 0.0 < float(d) < 1.0):
            raise ValueError(f"BudgetPolicy.read_decay must be None or a number in (0, 1), "
                             f"got {d!r}")

    @property
    def per_step(self) -> bool:
        """True when the budget is per step, False when per second."""
        return self.bytes_per_step is not None

    @property
    def rate(self) -> float:
        """Bytes per step or per second."""
        return float(self.bytes_per_step if self.per_step else self.bytes_per_s)

    @property
    def burst(self) -> float:
        """The bucket's size in bytes (``burst_bytes`` or its default)."""
        if self.burst_bytes is not None:
            return float(self.burst_bytes)
        return self.rate * (4.0 if self.per_step else 1.0)

    def describe(self) -> dict:
        """The policy as plain values (for reports)."""
        return {"bytes_per_s": self.bytes_per_s, "bytes_per_step": self.bytes_per_step,
                "burst_bytes": self.burst, "scale": self.scale, "weights": dict(self.weights),
                "min_error": self.min_error, "max_age": self.max_age,
                "overdue_share": self.overdue_share, "new_rows": self.new_rows,
                "per_byte": self.per_byte, "min_interval_s": self.min_interval_s,
                "max_worker_share": self.max_worker_share,
                "charge_dense": self.charge_dense, "wide_dtype": self.wide_dtype,
                "residuals": self.residuals, "whole_every": self.whole_every,
                "read_decay": self.read_decay}
