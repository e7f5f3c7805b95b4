"""Choose which changed rows to publish this round: by drift, under a count or error budget.

The tracker hands over, per table, the ids touched since the consumer's last read and
(in EMBEDDING mode) each row's FIRST state: its value before the first update in the
interval, i.e. the value the predictors last received. :func:`select_changed` reads the
current value of every candidate from the table and scores it by how far it drifted::

    score = ‖current − FIRST‖₂          (one float per row)

and picks the rows to publish under a budget (``k``, ``fraction``, ``threshold``,
``max_bytes``). Everything it does not pick is returned as ``Selection.leftover`` with the
row's *original* FIRST state, ``new`` flag and ``age``, ready for
``DeltaTracker.retain(consumer, fqn, selection.leftover)``: the retained drift keeps
accumulating against the value predictors actually hold, so a row that keeps drifting
scores higher each round.

Priority, highest first (vectorized as one float64 key, then ``torch.topk``):

1. **new** rows (``delta.new``; predictors have never seen them), oldest first;
2. **overdue** rows (``age >= max_age``: carried that many rounds), oldest first;
3. all others by ``score × (1 + age)``: the drift, boosted by how long the row has waited.

Tier 3 alone already lets a carried row whose drift grows overtake fresh rows; tier 2 makes
the bound hard: under a fixed budget of ``k`` rows per round and ``R`` candidate rows, no row
waits more than about ``max_age + ceil(R / k)`` rounds (tested).

**Count budgets defer, they do not skip.** With ``k`` / ``fraction`` every changed row is
still published within about ``max_age`` rounds, so the bytes saved are only the rows that
change again while carried. To send fewer bytes at the same serving quality, publish by
*error* instead — ``threshold`` (bounded error):

* a row goes out when the predictors' copy is ``threshold`` away from the trainer's row:
  ``‖current − FIRST‖`` (FIRST = what predictors hold, kept by ``retain``, so small changes
  *accumulate* until they matter; nothing is dropped, only batched);
* ``new_rows="drift"``: a row predictors never received is served as zeros there
  (``ServingTable`` reads missing ids as zeros), so its error is ``‖current‖`` — it goes out
  once that reaches the threshold, like any other row (``"first"``, the default, sends every
  new row at once);
* ``relative=True``: the threshold is a fraction of the row's norm, ``‖Δ‖ / ‖current‖``;
* ``weights``: importance per row, compared is ``weight × drift``. The weight that makes the
  threshold *the* budget of serving error is the row's read rate: a row read ``λ`` times per
  round serves its error ``λ`` times. Minimizing rows published (``Σ rᵢ / εᵢ`` for rows
  drifting ``rᵢ`` per round) under a bound on the served error (``Σ λᵢ εᵢ``) gives
  ``εᵢ ∝ 1 / √λᵢ`` (equal drift speeds), i.e. ``weights = √λ``: hot rows stay fresh, rows
  nobody reads wait. :class:`LookupRate` estimates ``λ`` from the trainer's own lookups.
  Since a row only drifts when the trainer reads it, a row read in the round just ended has
  ``λ >= 1 − decay``, so after every round *every* served row is within
  ``threshold / √(1 − decay)`` of the trainer's (tested), and a row read ``λ`` times per
  round within ``threshold / √λ``.

Under a threshold, ``max_age`` does not force rows out: a row under the threshold is served
within it and goes out as soon as its (accumulated) drift crosses it, at a final flush
(call without a budget) or under a count budget; ``max_age`` only orders rows when
``max_bytes`` caps the eligible ones.

Non-finite rows: a row whose *current* value holds NaN/Inf is never published and never
retained. Its id is returned in ``Selection.rejected`` (and counted, with a warning in the
log), so it is not lost silently; the caller decides (re-initialize, evict, alert). A
rejected row becomes a candidate again the next time the trainer updates it, because the
update is a lookup the tracker records. A row whose current value is finite but whose FIRST
state is not (it recovered) gets score ``+inf`` and so goes first in tier 3; a score that
overflows float (huge finite rows) is ``+inf`` as well.

ID_ONLY deltas (``states is None``) carry no FIRST state, so no drift can be computed:
``scores`` is all NaN, ``threshold`` selects every (finite) row (``relative``/``weights``
have nothing to act on), and ``k`` / ``fraction`` / ``max_bytes`` still cap the count using
tiers 1 and 2 and then age (oldest first).

The table can be a :class:`deltastream.HashTable` (anything with ``lookup(ids) -> [n, dim]``),
a ``torch.nn.Embedding`` (ids are row indices) or a :class:`deltastream.ShardedEmbedding`
(its local shard, ``.table``, is read: delta ids of a shard's tracker are that shard's ids).
The same code runs on CPU and CUDA; candidate rows are read in chunks so the drift is
computed while the chunk is in cache.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from deltastream.embedding.hashtable import HashTable
from deltastream.types import DeltaRows

__all__ = ["Selection", "select_changed", "LookupRate", "WIRE_ITEMSIZE", "NEW_ROW_POLICIES",
           "row_wire_bytes"]

logger = logging.getLogger(__name__)

#: bytes per row element on the wire, per wire dtype (see DESIGN.md, wire format v1)
WIRE_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "i8": 1}

#: how ``select_changed`` treats rows the predictors have never received (``delta.new``):
#: ``"first"`` — they outrank every other row and pass any threshold; ``"drift"`` — they are
#: scored by ``‖current‖`` (a predictor serves zeros for a row it does not hold) and compete
#: like any other row.
NEW_ROW_POLICIES = ("first", "drift")

# Tier offsets of the priority key. Ages are clamped below _AGE_CAP so tiers never overlap
# and float64 still resolves the fractional score part (2**40 leaves ~12 fractional bits).
_TIER_NEW = float(2**40)
_TIER_OVERDUE = 2.0
_AGE_CAP = 2**30

# Rows per chunk when reading current values: 16K x 128 fp32 = 8 MiB, stays in a large cache.
_DEFAULT_CHUNK_ROWS = 16384


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


def row_wire_bytes(dim: int, wire_dtype: str = "f16") -> int:
    """Bytes one row costs on the wire: 8 (id) + ``dim`` × itemsize (+4 scale for ``i8``)."""
    if wire_dtype not in WIRE_ITEMSIZE:
        raise ValueError(f"wire_dtype must be one of {sorted(WIRE_ITEMSIZE)}, got {wire_dtype!r}")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    return 8 + dim * WIRE_ITEMSIZE[wire_dtype] + (4 if wire_dtype == "i8" else 0)


# --------------------------------------------------------------------------- validation


def _check_budget(k, fraction, threshold, max_bytes, wire_dtype, max_age, chunk_rows) -> None:
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
    if wire_dtype not in WIRE_ITEMSIZE:
        raise ValueError(f"wire_dtype must be one of {sorted(WIRE_ITEMSIZE)}, got {wire_dtype!r}")
    if max_age is not None:
        if isinstance(max_age, bool) or not isinstance(max_age, numbers.Integral) or max_age < 1:
            raise ValueError(f"max_age must be None or an int >= 1, got {max_age!r}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral) \
            or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")


def _check_policy(threshold, relative, new_rows) -> None:
    if not isinstance(relative, bool):
        raise TypeError(f"relative must be a bool, got {type(relative).__name__} {relative!r}")
    if relative and threshold is None:
        raise ValueError("relative=True needs a threshold (it makes the threshold relative "
                         "to the row norm)")
    if new_rows not in NEW_ROW_POLICIES:
        raise ValueError(f"new_rows must be one of {list(NEW_ROW_POLICIES)}, got {new_rows!r}")


def _check_weights(weights, n: int) -> None:
    if not isinstance(weights, torch.Tensor) or weights.shape != (n,) \
            or not weights.is_floating_point():
        raise ValueError(f"weights must be a float tensor [n={n}] aligned with delta.ids, got "
                         f"{getattr(weights, 'dtype', type(weights).__name__)} "
                         f"{tuple(getattr(weights, 'shape', ()))}")
    if n and not bool(((weights >= 0) & torch.isfinite(weights)).all()):
        raise ValueError("weights must be finite and >= 0")


def _check_delta(delta: DeltaRows, dim: int) -> None:
    if not isinstance(delta, DeltaRows):
        raise TypeError(f"delta must be a DeltaRows, got {type(delta).__name__}")
    ids = delta.ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(
            f"delta.ids must be a 1-D int64 tensor, got "
            f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    n = ids.numel()
    if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("delta.ids must be unique and ascending (as DeltaStore/DeltaTracker "
                         "return them)")
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
        if n and bool((ag < 0).any()):
            raise ValueError("delta.age must be >= 0")
    if delta.tombstones is not None:
        tb = delta.tombstones
        if not isinstance(tb, torch.Tensor) or tb.dim() != 1 or tb.dtype != torch.int64:
            raise ValueError("delta.tombstones must be None or a 1-D int64 tensor")


# ------------------------------------------------------------------------------ tables


def _row_reader(table) -> tuple[Callable[[torch.Tensor], torch.Tensor], int,
                                Optional[torch.dtype], bool]:
    """ids -> current rows (detached); the table's dim; its row dtype; whether every read
    returns a fresh copy that the caller may overwrite."""
    if isinstance(table, torch.nn.Embedding):
        weight = table.weight
        num = weight.shape[0]

        def read_embedding(ids: torch.Tensor) -> torch.Tensor:
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num):
                raise ValueError(f"ids must be row indices in [0, {num}) for torch.nn.Embedding, "
                                 f"got range [{int(ids.min())}, {int(ids.max())}]")
            return weight.detach().index_select(0, ids.to(weight.device))

        return read_embedding, int(table.embedding_dim), weight.dtype, True
    inner = table
    if not callable(getattr(inner, "lookup", None)) and hasattr(inner, "table"):
        inner = inner.table  # ShardedEmbedding: its local shard
    if not callable(getattr(inner, "lookup", None)):
        raise TypeError(
            "table must be a HashTable (with lookup(ids)), a ShardedEmbedding or a "
            f"torch.nn.Embedding, got {type(table).__name__}")
    dim = getattr(inner, "embedding_dim", None)
    if not isinstance(dim, int):
        raise TypeError(f"table {type(inner).__name__} has no int attribute embedding_dim")
    dtype = getattr(inner, "dtype", None)

    def read_table(ids: torch.Tensor) -> torch.Tensor:
        rows = inner.lookup(ids)
        return rows.detach()

    if not isinstance(dtype, torch.dtype):
        dtype = None  # learnt from the first read
    # HashTable.lookup documents that it returns a copy; other duck-typed tables may not
    return read_table, dim, dtype, isinstance(inner, HashTable)


# ---------------------------------------------------------------------------- selection


@torch.no_grad()
def select_changed(delta: DeltaRows, table, *, k: Optional[int] = None,
                   fraction: Optional[float] = None, threshold: Optional[float] = None,
                   max_bytes: Optional[int] = None, wire_dtype: str = "f16",
                   max_age: Optional[int] = 16, relative: bool = False,
                   new_rows: str = "first", weights: Optional[torch.Tensor] = None,
                   chunk_rows: int = _DEFAULT_CHUNK_ROWS) -> Selection:
    """Pick the rows of ``delta`` to publish now; return the rest as ``leftover``.

    Args:
        delta: candidate rows of one table (``ids`` ascending global ids ``[n]``; ``states``
            FIRST values ``[n, dim]`` or ``None`` for ID_ONLY; optional ``new`` ``[n]`` bool,
            ``age`` ``[n]`` int, ``tombstones``).
        table: where current values are read (HashTable, ShardedEmbedding, nn.Embedding).
        k: publish at most ``k`` rows.
        fraction: publish at most ``ceil(fraction × m)`` rows, ``m`` = finite candidates,
            ``0 < fraction <= 1``.
        threshold: publish rows whose drift ``‖current − FIRST‖₂ >= threshold`` (times
            ``weights``, over ``‖current‖`` with ``relative``; plus every new row with
            ``new_rows="first"``); the rest is leftover whatever its age. At most one of
            ``k`` / ``fraction`` / ``threshold``; none of them means every finite row.
        max_bytes: additionally cap the wire payload: at most ``max_bytes //
            row_wire_bytes(dim, wire_dtype)`` rows. Combines with any of the above.
        wire_dtype: the dtype rows will be published in (``f32``, ``f16``, ``bf16``, ``i8``),
            only used for ``max_bytes``.
        max_age: rows carried this many rounds or more (``delta.age``) outrank every row but
            new ones; ``None`` disables the hard bound (the ``1 + age`` boost stays). Under
            ``threshold`` it only orders the eligible rows (for ``max_bytes``).
        relative: compare ``‖current − FIRST‖ / ‖current‖`` with ``threshold`` (needs
            ``threshold``; an all-zero row counts 0 if unchanged, ``+inf`` if it moved).
        new_rows: ``"first"`` (rows predictors never received outrank all others and pass
            any threshold) or ``"drift"`` (their drift is ``‖current‖``, what predictors
            miss by serving zeros, and they compete like any other row). See
            :data:`NEW_ROW_POLICIES`.
        weights: float ``[n]`` importance per row, finite and ``>= 0``, aligned with
            ``delta.ids``: threshold and ranking use ``weight × drift`` (e.g.
            ``LookupRate.rate(ids).sqrt()``, see the module docstring). ``scores`` stay the
            unweighted drift.
        chunk_rows: rows read from the table per chunk (memory/cache trade-off).

    Returns:
        A :class:`Selection`. Every candidate id ends up in exactly one of ``ids``,
        ``leftover.ids`` and ``rejected``.
    """
    _check_budget(k, fraction, threshold, max_bytes, wire_dtype, max_age, chunk_rows)
    _check_policy(threshold, relative, new_rows)
    read, dim, table_dtype, fresh = _row_reader(table)
    _check_delta(delta, dim)
    if weights is not None:
        _check_weights(weights, delta.ids.numel())

    dev = delta.ids.device
    ids = delta.ids
    states = delta.states
    n = ids.numel()
    tombstones = delta.tombstones

    # ---- 1. read current rows chunk-wise: drift score and finiteness per row
    if states is not None:
        cdtype = torch.float64 if states.dtype == torch.float64 else torch.float32
    else:
        cdtype = torch.float32
    score = torch.empty(n, dtype=cdtype, device=dev)
    finite = torch.ones(n, dtype=torch.bool, device=dev)
    new = delta.new.to(dev) if delta.new is not None else None
    # new_rows="drift": a row the predictors never received is served as zeros there, so its
    # error is ‖current − 0‖, not ‖current − FIRST‖ (FIRST is the initializer's draw)
    zero_new = new_rows == "drift" and new is not None and states is not None
    # relative threshold: ‖current‖ per row as well (read before the in-place subtraction)
    norm = torch.empty(n, dtype=cdtype, device=dev) if relative and states is not None \
        else None
    if n:
        buf = None  # scratch for the difference when the rows cannot be overwritten
        for start in range(0, n, chunk_rows):
            stop = min(n, start + chunk_rows)
            cur = read(ids[start:stop])
            if cur.device != dev:
                cur = cur.to(dev)
            if table_dtype is None:
                table_dtype = cur.dtype
            if cur.shape != (stop - start, dim):
                raise RuntimeError(f"table returned rows of shape {tuple(cur.shape)}, "
                                   f"expected {(stop - start, dim)}")
            sc = score[start:stop]
            if norm is not None:
                torch.linalg.vector_norm(cur, dim=1, dtype=cdtype, out=norm[start:stop])
            if states is not None:
                first = states[start:stop]
                if zero_new:
                    nw = new[start:stop]
                    if bool(nw.any()):
                        first = first.masked_fill(nw[:, None], 0.0)
                if fresh and cur.dtype == cdtype:
                    # the reader returned our own copy: subtract in place, no extra buffer
                    diff = cur.sub_(first)
                else:
                    if buf is None:
                        buf = torch.empty(min(chunk_rows, n), dim, dtype=cdtype, device=dev)
                    diff = buf[: stop - start]
                    if cur.dtype == cdtype:
                        torch.sub(cur, first, out=diff)
                    else:
                        # half-precision rows: subtract in float32, not in half then widen
                        diff.copy_(cur).sub_(first)
                torch.linalg.vector_norm(diff, dim=1, out=sc)
            else:
                # A finite row sum proves every element finite (NaN/Inf propagate);
                # non-finite sums (rare: bad rows or overflow) get the exact test below.
                torch.sum(cur, dim=1, dtype=cdtype, out=sc)
            odd = (~torch.isfinite(sc)).nonzero().squeeze(1)
            if odd.numel():
                # Exact test only for the rare rows whose score is not finite: current NaN/Inf
                # -> rejected; otherwise FIRST was non-finite or the norm overflowed -> +inf.
                # (re-read: `cur` may hold the difference by now)
                ok = torch.isfinite(read(ids[start + odd]).to(dev)).all(dim=1)
                finite[start + odd] = ok
                sc[odd] = torch.where(ok, torch.tensor(math.inf, dtype=cdtype, device=dev),
                                      torch.tensor(math.nan, dtype=cdtype, device=dev))
    if table_dtype is None:
        table_dtype = states.dtype if states is not None else torch.float32

    all_finite = bool(finite.all()) if n else True
    if all_finite:
        rejected = ids.new_empty(0)
        n_fin = n
    else:
        rejected = ids[~finite]
        n_fin = n - rejected.numel()
        logger.warning("select_changed: %d of %d candidate rows have NaN/Inf current values; "
                       "they are rejected (not published, not retained)", rejected.numel(), n)

    # ---- 2. the budget
    cap = n_fin
    if k is not None:
        cap = min(cap, int(k))
    elif fraction is not None:
        # tolerance so that 0.1 * 1_000_000 gives 100000, not 100001
        cap = min(cap, math.ceil(float(fraction) * n_fin - 1e-9))
    if max_bytes is not None:
        cap = min(cap, int(max_bytes) // row_wire_bytes(dim, wire_dtype))

    age = delta.age.to(device=dev, dtype=torch.int64) if delta.age is not None else None
    # "drift": new rows compete on their drift from zeros like any other row (no tier of
    # their own); "first": they outrank everything and pass any threshold
    tier_new = new if new_rows == "first" else None

    if weights is not None and states is not None:
        w = weights.to(device=dev, dtype=cdtype)
        wscore = score * w
        # 0 × inf (a recovered row with weight 0) is NaN: such a row still goes first
        wscore = torch.where(torch.isnan(wscore) & finite, math.inf, wscore)
    else:
        wscore = score

    eligible = finite
    if threshold is not None and states is not None:
        # Bounded error: a row goes out once the predictors' copy is ε away from the
        # trainer's. No max_age forcing here: a row under ε is served within ε (its FIRST is
        # kept by retain, so drift accumulates against what predictors hold) and goes out as
        # soon as it crosses ε, at a final flush, or under a count budget.
        drift = wscore
        if norm is not None:
            # ‖Δ‖ / ‖current‖; a zero row: 0 if unchanged, +inf if it moved to zero
            drift = torch.where(norm > 0, wscore / norm,
                                torch.where(wscore > 0, math.inf, 0.0).to(cdtype))
            # inf / inf (a finite row whose norm overflowed): a huge change, publish it
            drift = torch.where(torch.isnan(drift) & finite, math.inf, drift)
        must = drift >= float(threshold)
        if tier_new is not None:
            must |= tier_new
        eligible = finite & must
    n_elig = int(eligible.sum()) if n else 0

    # ---- 3. choose positions
    if cap >= n_elig:
        sel = eligible.nonzero().squeeze(1) if n_elig != n else torch.arange(n, device=dev)
    elif cap <= 0:
        sel = torch.empty(0, dtype=torch.int64, device=dev)
    else:
        key = _priority(wscore if states is not None else None, tier_new, age, max_age, n, dev)
        key.masked_fill_(~eligible, -math.inf)
        sel = torch.topk(key, cap, sorted=False).indices
        sel, _ = torch.sort(sel)  # ids are ascending, so sorted positions = ascending ids

    # ---- 4. assemble
    chosen = torch.zeros(n, dtype=torch.bool, device=dev)
    chosen[sel] = True
    left_mask = finite & ~chosen
    sel_ids = ids.index_select(0, sel)
    rows = _read_rows(read, sel_ids, dim, table_dtype, dev)
    if states is not None:
        scores = score.index_select(0, sel).to(torch.float32)
    else:
        scores = torch.full((sel.numel(),), math.nan, dtype=torch.float32, device=dev)

    if bool(left_mask.any()):
        lpos = left_mask.nonzero().squeeze(1)
        leftover = DeltaRows(
            ids=ids.index_select(0, lpos),
            states=None if states is None else states.index_select(0, lpos),
            new=None if delta.new is None else delta.new.index_select(0, lpos.to(delta.new.device)),
            age=None if delta.age is None else delta.age.index_select(0, lpos.to(delta.age.device)),
        )
    else:
        leftover = DeltaRows(
            ids=ids.new_empty(0),
            states=None if states is None else states.new_empty(0, dim),
            new=None if delta.new is None else delta.new.new_empty(0),
            age=None if delta.age is None else delta.age.new_empty(0),
        )
    logger.debug("select_changed: %d candidates -> %d selected, %d leftover, %d rejected",
                 n, sel_ids.numel(), leftover.ids.numel(), rejected.numel())
    return Selection(ids=sel_ids, rows=rows, scores=scores, leftover=leftover,
                     rejected=rejected, tombstones=tombstones)


def _priority(score: Optional[torch.Tensor], new: Optional[torch.Tensor],
              age: Optional[torch.Tensor], max_age: Optional[int], n: int,
              dev: torch.device) -> torch.Tensor:
    """float64 ``[n]`` key: higher publishes first (tiers: new > overdue > drift x (1+age))."""
    agef = age.clamp(max=_AGE_CAP).to(torch.float64) if age is not None else None
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
            key = torch.where(overdue, _TIER_OVERDUE + agef + frac, key)
        if new is not None:
            key = torch.where(new, _TIER_NEW + agef + frac, key)
    elif new is not None:
        key = torch.where(new, _TIER_NEW + frac, key)
    return key


def _read_rows(read, ids: torch.Tensor, dim: int, dtype: torch.dtype,
               dev: torch.device) -> torch.Tensor:
    """Current values of ``ids`` as one ``[len(ids), dim]`` tensor on ``dev``."""
    if ids.numel() == 0:
        return torch.empty(0, dim, dtype=dtype, device=dev)
    rows = read(ids)
    return rows.to(dev) if rows.device != dev else rows


# --------------------------------------------------------------------------- read rates


class LookupRate:
    """How often each id of one table is read: an exponentially decayed count per round.

    The importance of a row's serving error is how many requests read the row before the
    next publish. The requests predictors serve are the traffic the trainer learns from, so
    the trainer's own lookups estimate it: :meth:`observe` the ids of every batch (or use
    :meth:`watch`), call :meth:`end_round` once per publish round, then
    ``rate(ids)`` gives lookups per round (an id looked up ``λ`` times every round reads
    ``λ``; the weight of the past halves every ``log(0.5) / log(decay)`` rounds). Pass
    ``weights=rate(delta.ids).sqrt()`` to :func:`select_changed` with a ``threshold`` to publish
    by read-weighted drift (see its docstring for why the square root).

    Ids whose decayed count falls below ``min_count`` are forgotten (they read as 0), so the
    memory is bounded by the ids read in the last few dozen rounds. Vectorized: lookups are
    buffered and merged once per round (one sort of the live ids).

    Args:
        decay: factor in ``(0, 1)`` applied to every count at each :meth:`end_round`.
        min_count: decayed counts below this are dropped (``>= 0``).
        device: where the counts live (default: the device of the first observed ids).
    """

    def __init__(self, decay: float = 0.8, *, min_count: float = 1e-3,
                 device: Optional[torch.device | str] = None) -> None:
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) \
                or not 0.0 < float(decay) < 1.0:
            raise ValueError(f"decay must be a number in (0, 1), got {decay!r}")
        if isinstance(min_count, bool) or not isinstance(min_count, numbers.Real) \
                or not (math.isfinite(float(min_count)) and float(min_count) >= 0.0):
            raise ValueError(f"min_count must be a finite number >= 0, got {min_count!r}")
        self.decay = float(decay)
        self.min_count = float(min_count)
        self._device = None if device is None else torch.device(device)
        self._ids: Optional[torch.Tensor] = None  # int64 [m], ascending
        self._count: Optional[torch.Tensor] = None  # float64 [m], decayed lookups
        self._pending: list[torch.Tensor] = []
        self.rounds = 0

    def _init(self, dev: torch.device) -> None:
        if self._ids is None:
            self._device = self._device or dev
            self._ids = torch.empty(0, dtype=torch.int64, device=self._device)
            self._count = torch.empty(0, dtype=torch.float64, device=self._device)

    def observe(self, ids: torch.Tensor) -> None:
        """Count one lookup per element of ``ids`` (int64, any shape; repeats count)."""
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
            raise ValueError(f"ids must be an int64 tensor, got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)}")
        self._init(ids.device)
        if ids.numel():
            # a copy: the caller may reuse its batch buffer before end_round
            self._pending.append(ids.detach().reshape(-1).to(self._device, copy=True))

    def watch(self, module: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
        """Observe every training-mode lookup of ``module`` (its first argument: the ids).

        Returns the hook handle (``handle.remove()`` stops observing). Eval-mode lookups
        (scoring, validation) are not counted: they do not reflect the served traffic.
        """
        def hook(mod: torch.nn.Module, args: tuple) -> None:
            if mod.training and args and isinstance(args[0], torch.Tensor):
                self.observe(args[0])

        return module.register_forward_pre_hook(hook)

    @torch.no_grad()
    def end_round(self) -> None:
        """Close a round: decay every count, add the lookups observed since, drop tiny counts."""
        self.rounds += 1
        if self._ids is None:
            return
        count = self._count * self.decay
        ids = self._ids
        if self._pending:
            fresh, n = torch.unique(torch.cat(self._pending), return_counts=True)
            self._pending = []
            both = torch.cat([ids, fresh])
            uniq, inv = torch.unique(both, return_inverse=True)  # sorted
            merged = torch.zeros(uniq.numel(), dtype=torch.float64, device=uniq.device)
            merged.index_add_(0, inv, torch.cat([count, n.to(torch.float64)]))
            ids, count = uniq, merged
        keep = count >= self.min_count
        if not bool(keep.all()):
            ids, count = ids[keep], count[keep]
        self._ids, self._count = ids, count

    @torch.no_grad()
    def rate(self, ids: torch.Tensor) -> torch.Tensor:
        """Estimated lookups per round of ``ids`` (float32, same shape; 0 for unknown ids).

        Counts lookups up to the last :meth:`end_round`.
        """
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
            raise ValueError(f"ids must be an int64 tensor, got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)}")
        flat = ids.reshape(-1)
        if self._ids is None or self._ids.numel() == 0 or flat.numel() == 0:
            return torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        q = flat.to(self._ids.device)
        pos = torch.searchsorted(self._ids, q).clamp_(max=self._ids.numel() - 1)
        hit = self._ids[pos] == q
        out = torch.where(hit, self._count[pos] * (1.0 - self.decay), 0.0)
        return out.to(device=ids.device, dtype=torch.float32).reshape(ids.shape)

    def __len__(self) -> int:
        """Ids with a live (not yet forgotten) count."""
        return 0 if self._ids is None else int(self._ids.numel())
