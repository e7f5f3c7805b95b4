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
a ``torch.nn.Embedding`` or ``torch.nn.EmbeddingBag`` (ids are row indices) or a
:class:`deltastream.ShardedEmbedding` (its local shard, ``.table``, is read: delta ids of a
shard's tracker are that shard's ids).
Two paths, one contract (one test suite runs both):

* **CPU** (the torch reference, here): candidate rows are read in chunks of ``chunk_rows``
  so the drift is computed while the chunk is in cache and memory stays bounded;
* **CUDA** (:mod:`~deltastream.publishing.selection_device`, chosen by
  :func:`deltastream.kernels.runtime.use_kernels`): no chunks; one Triton kernel reads every
  candidate row straight from the table's storage and scores it, a second builds the
  priority key, ``torch.topk`` picks; one host sync per call (the counts that size the
  outputs). ``chunk_rows`` is ignored there. Which of two rows with exactly equal priority
  is picked at the budget boundary is unspecified on both paths.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from deltastream.kernels.runtime import use_kernels
from deltastream.publishing.lookup_rate import LookupRate
from deltastream.publishing.selection_checks import (
    NEW_ROW_POLICIES,
    check_budget,
    check_delta,
    check_policy,
    check_weights,
    raise_failed,
)
from deltastream.publishing.selection_rules import (
    WIRE_ITEMSIZE,
    Budget,
    Selection,
    leftover_rows,
    priority_keys,
    row_wire_bytes,
    warn_rejected,
)
from deltastream.publishing.table_rows import Reader, read_rows, row_reader
from deltastream.types import DeltaRows

__all__ = ["Selection", "select_changed", "LookupRate", "WIRE_ITEMSIZE", "NEW_ROW_POLICIES",
           "row_wire_bytes", "Drift", "read_drift", "DEFAULT_CHUNK_ROWS"]

log = logging.getLogger(__name__)

# Rows per chunk when reading current values: 16K x 128 fp32 = 8 MiB, stays in a large cache.
DEFAULT_CHUNK_ROWS = 16384


# ---------------------------------------------------------------------------- selection


@torch.no_grad()
def select_changed(delta: DeltaRows, table, *, k: Optional[int] = None,
                   fraction: Optional[float] = None, threshold: Optional[float] = None,
                   max_bytes: Optional[int] = None, wire_dtype: str = "f16",
                   max_age: Optional[int] = 16, relative: bool = False,
                   new_rows: str = "first", weights: Optional[torch.Tensor] = None,
                   chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Selection:
    """Pick the rows of ``delta`` to publish now; return the rest as ``leftover``.

    Args:
        delta: candidate rows of one table (``ids`` ascending global ids ``[n]``; ``states``
            FIRST values ``[n, dim]`` or ``None`` for ID_ONLY; optional ``new`` ``[n]`` bool,
            ``age`` ``[n]`` int, ``tombstones``).
        table: where current values are read (HashTable, ShardedEmbedding, nn.Embedding,
            nn.EmbeddingBag).
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
        chunk_rows: rows read from the table per chunk on the CPU path (memory/cache
            trade-off); the CUDA kernel path reads all candidates in one pass.

    Returns:
        A :class:`Selection`. Every candidate id ends up in exactly one of ``ids``,
        ``leftover.ids`` and ``rejected``.
    """
    check_budget(k, fraction, threshold, max_bytes, wire_dtype, max_age, chunk_rows)
    check_policy(threshold, relative, new_rows)
    budget = Budget(k, fraction, threshold, max_bytes, wire_dtype, max_age, relative, new_rows)
    read, dim, table_dtype, fresh = row_reader(table)
    checks = check_delta(delta, dim)
    if weights is not None:
        checks += check_weights(weights, delta.ids.numel())
    if use_kernels(delta.ids):
        # imported here: it imports triton, which only the kernel path needs
        from deltastream.publishing.selection_device import select_on_device

        return select_on_device(delta, table, read, dim, table_dtype, checks, budget, weights)
    raise_failed(checks)
    return _select_on_cpu(delta, (read, dim, table_dtype, fresh), budget, weights, chunk_rows)


def _select_on_cpu(delta: DeltaRows, reader: tuple[Reader, int, Optional[torch.dtype], bool],
                   budget: Budget, weights: Optional[torch.Tensor],
                   chunk_rows: int) -> Selection:
    """``select_changed`` on the torch reference path (arguments checked; ``reader`` as
    :func:`~deltastream.publishing.table_rows.row_reader` returns it)."""
    read, dim, table_dtype, fresh = reader
    ids, states = delta.ids, delta.states
    n, dev = ids.numel(), ids.device
    new = delta.new.to(dev) if delta.new is not None else None
    # new_rows="drift": a row the predictors never received is served as zeros there, so its
    # error is ‖current − 0‖, not ‖current − FIRST‖ (FIRST is the initializer's draw)
    zero_new = new if budget.new_rows == "drift" and states is not None else None

    # ---- 1. read current rows chunk-wise: drift score and finiteness per row
    drift = read_drift(read, fresh, table_dtype, dim, ids, states, zero_new,
                       budget.relative and states is not None, chunk_rows)
    rejected = ids[~drift.finite] if n and not bool(drift.finite.all()) else ids.new_empty(0)
    warn_rejected(rejected.numel(), n, log)

    # ---- 2. the budget, and which rows it may pick
    cap = budget.cap(n - rejected.numel(), dim)
    age = delta.age.to(device=dev, dtype=torch.int64) if delta.age is not None else None
    # "drift": new rows compete on their drift from zeros like any other row (no tier of
    # their own); "first": they outrank everything and pass any threshold
    tier_new = new if budget.new_rows == "first" else None
    if states is None:  # ID_ONLY: no drift to weigh or to hold against a threshold
        wscore, eligible = None, drift.finite
    else:
        wscore = _weighted(drift.score, weights, drift.finite)
        eligible = _eligible(drift.finite, wscore, budget.threshold, drift.norm, tier_new)

    # ---- 3. choose positions
    sel = _choose(eligible, cap,
                  lambda: priority_keys(wscore, tier_new, age, budget.max_age, n, dev))

    # ---- 4. assemble
    chosen = torch.zeros(n, dtype=torch.bool, device=dev)
    chosen[sel] = True
    sel_ids = ids.index_select(0, sel)
    rows = read_rows(read, sel_ids, dim, drift.table_dtype, dev)
    if states is not None:
        scores = drift.score.index_select(0, sel).to(torch.float32)
    else:
        scores = torch.full((sel.numel(),), math.nan, dtype=torch.float32, device=dev)
    leftover = leftover_rows(delta, (drift.finite & ~chosen).nonzero().squeeze(1), dim)
    log.debug("select_changed: %d candidates -> %d selected, %d leftover, %d rejected",
              n, sel_ids.numel(), leftover.ids.numel(), rejected.numel())
    return Selection(ids=sel_ids, rows=rows, scores=scores, leftover=leftover,
                     rejected=rejected, tombstones=delta.tombstones)


# ------------------------------------------------------------------------ select phases


@dataclass
class Drift:
    """Per candidate row: drift ``score`` (``[n]``, the compute dtype), whether its current
    value is ``finite``, ``‖current‖`` (relative thresholds only) and the table's row dtype."""

    score: torch.Tensor
    finite: torch.Tensor
    norm: Optional[torch.Tensor]
    table_dtype: torch.dtype


def read_drift(read: Reader, fresh: bool, table_dtype: Optional[torch.dtype], dim: int,
               ids: torch.Tensor, states: Optional[torch.Tensor],
               zero_new: Optional[torch.Tensor], want_norm: bool, chunk_rows: int) -> Drift:
    """Read the current rows of ``ids`` chunk by chunk and score each against its FIRST
    state (``states``; rows flagged in ``zero_new`` against zeros); ID_ONLY (``states``
    None) only tests finiteness."""
    n, dev = ids.numel(), ids.device
    cdtype = torch.float64 if states is not None and states.dtype == torch.float64 \
        else torch.float32
    score = torch.empty(n, dtype=cdtype, device=dev)
    finite = torch.ones(n, dtype=torch.bool, device=dev)
    # relative threshold: ‖current‖ per row as well (read before the in-place subtraction)
    norm = torch.empty(n, dtype=cdtype, device=dev) if want_norm else None
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
        if states is None:
            # A finite row sum proves every element finite (NaN/Inf propagate);
            # non-finite sums (rare: bad rows or overflow) get the exact test below.
            torch.sum(cur, dim=1, dtype=cdtype, out=sc)
        else:
            first = _first_chunk(states, zero_new, start, stop)
            if fresh and cur.dtype == cdtype:
                # the reader returned our own copy: subtract in place, no extra buffer
                diff = cur.sub_(first)
            else:
                if buf is None:
                    buf = torch.empty(min(chunk_rows, n), dim, dtype=cdtype, device=dev)
                diff = _subtract_into(buf[: stop - start], cur, first)
            torch.linalg.vector_norm(diff, dim=1, out=sc)
        _settle_nonfinite(read, ids[start:stop], sc, finite[start:stop])
    if table_dtype is None:
        table_dtype = states.dtype if states is not None else torch.float32
    return Drift(score, finite, norm, table_dtype)


def _first_chunk(states: torch.Tensor, zero_new: Optional[torch.Tensor], start: int,
                 stop: int) -> torch.Tensor:
    """FIRST states of rows ``start:stop``, zeros for the rows flagged in ``zero_new``."""
    first = states[start:stop]
    if zero_new is not None:
        nw = zero_new[start:stop]
        if bool(nw.any()):
            first = first.masked_fill(nw[:, None], 0.0)
    return first


def _subtract_into(out: torch.Tensor, cur: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``cur − first`` into ``out`` (the compute dtype)."""
    if cur.dtype == out.dtype:
        return torch.sub(cur, first, out=out)
    # half-precision rows: subtract in float32, not in half then widen
    return out.copy_(cur).sub_(first)


def _settle_nonfinite(read, ids: torch.Tensor, sc: torch.Tensor, finite: torch.Tensor) -> None:
    """Exact test for the rare rows of a chunk whose score is not finite: a NaN/Inf current
    value marks the row not ``finite`` (score NaN); otherwise FIRST was non-finite or the
    norm overflowed: score +inf. ``sc`` and ``finite`` are the chunk's views."""
    odd = (~torch.isfinite(sc)).nonzero().squeeze(1)
    if odd.numel():
        # re-read: the chunk's rows may hold the difference by now
        ok = torch.isfinite(read(ids[odd]).to(sc.device)).all(dim=1)
        finite[odd] = ok
        sc[odd] = torch.where(ok, torch.tensor(math.inf, dtype=sc.dtype, device=sc.device),
                              torch.tensor(math.nan, dtype=sc.dtype, device=sc.device))


def _weighted(score: torch.Tensor, weights: Optional[torch.Tensor],
              finite: torch.Tensor) -> torch.Tensor:
    """``weight × drift`` (the drift itself without weights)."""
    if weights is None:
        return score
    wscore = score * weights.to(device=score.device, dtype=score.dtype)
    # 0 × inf (a recovered row with weight 0) is NaN: such a row still goes first
    return torch.where(torch.isnan(wscore) & finite, math.inf, wscore)


def _eligible(finite: torch.Tensor, wscore: torch.Tensor, threshold: Optional[float],
              norm: Optional[torch.Tensor], tier_new: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows a budget may pick: every finite row, or under a threshold those past it.

    Bounded error: a row goes out once the predictors' copy is ε away from the trainer's.
    No max_age forcing here: a row under ε is served within ε (its FIRST is kept by retain,
    so drift accumulates against what predictors hold) and goes out as soon as it crosses
    ε, at a final flush, or under a count budget.
    """
    if threshold is None:
        return finite
    drift = wscore
    if norm is not None:
        # ‖Δ‖ / ‖current‖; a zero row: 0 if unchanged, +inf if it moved to zero
        drift = torch.where(norm > 0, wscore / norm,
                            torch.where(wscore > 0, math.inf, 0.0).to(wscore.dtype))
        # inf / inf (a finite row whose norm overflowed): a huge change, publish it
        drift = torch.where(torch.isnan(drift) & finite, math.inf, drift)
    must = drift >= float(threshold)
    if tier_new is not None:
        must |= tier_new
    return finite & must


def _choose(eligible: torch.Tensor, cap: int,
            priority: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Ascending positions of the (at most ``cap``) eligible rows to publish, by
    ``priority()`` (computed only when the budget does not take every eligible row)."""
    n, dev = eligible.numel(), eligible.device
    n_elig = int(eligible.sum()) if n else 0
    if cap >= n_elig:
        return eligible.nonzero().squeeze(1) if n_elig != n else torch.arange(n, device=dev)
    if cap <= 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    key = priority()
    key.masked_fill_(~eligible, -math.inf)
    sel = torch.topk(key, cap, sorted=False).indices
    return torch.sort(sel).values  # ids are ascending, so sorted positions = ascending ids
