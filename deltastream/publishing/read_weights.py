"""How often each pending row is read, as a weight on its serving error: keys that stay put.

A row's serving error costs as much as the requests that read it before it is published.
The requests predictors serve are the traffic the trainer learns from, so the hand-offs
that touched an id estimate it: each id keeps a count, decayed by ``decay`` every hand-off
and incremented by one at each hand-off that changed it. A pending row is then ranked by
``error · √count`` (the square root as :mod:`~deltastream.publishing.lookup_rate` argues:
the expected squared error a read sees, summed over reads, then the root).

The count of a row that waits decays every hand-off, so its key would change at every
hand-off, and an incremental order (:class:`~deltastream.publishing.score_order.ScoreOrder`)
could not keep it. But a row's count decays by the same factor as every other row's, so
the order only needs each key up to a factor common to the table::

    √count_i(t) = √count_i(t_i) · d^((t − t_i)/2) = w_i · d^((t − base)/2)
    w_i = √count_i(t_i) · d^(−(t_i − base)/2)

``w_i`` is fixed from the row's last change at hand-off ``t_i`` until its next one. It
grows with ``t_i`` (by 2× every ``2·ln 2 / −ln d`` hand-offs: 13 at ``d = 0.9``), so
:meth:`ReadWeights.rebase` moves ``base`` up before float64 runs out of range, which
multiplies every stored weight by one factor (the owner re-keys its order once, O(pending),
every few hundred hand-offs).

:class:`ReadWeights` is the id-keyed count store of one table. It outlives a row's pending
life (a row published and changed again keeps its history), and forgets counts that faded
below ``min_count`` (a sweep each time the store doubled since the last), so its memory is
bounded by the ids changed in the last ``log(min_count) / log(d)`` hand-offs (44 at 0.9),
times two.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from deltastream.publishing.slot_pool import SlotPool

__all__ = ["ReadWeights", "REBASE_SPAN"]

#: weights stay below 2**REBASE_SPAN (× √count): a rebase comes before they pass it
REBASE_SPAN = 64


class ReadWeights:
    """Decayed change counts per id of one table, as order-stable weights (see the module
    docstring).

    Args:
        decay: a count's factor per hand-off, in ``(0, 1)``.
        min_count: counts that fell below this are forgotten (``> 0``); a forgotten id
            weighs as a count of ``min_count`` now.
    """

    def __init__(self, decay: float, *, min_count: float = 0.01, capacity: int = 1024) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        if not min_count > 0.0:
            raise ValueError(f"min_count must be > 0, got {min_count!r}")
        self.decay, self.min_count = float(decay), float(min_count)
        self._half_ln = -0.5 * math.log(self.decay)  # > 0: ln of √(1/d)
        self._pool = SlotPool({"count": np.zeros(capacity, dtype=np.float64),
                               "at": np.zeros(capacity, dtype=np.int64)}, "reads")
        self.base = 0  #: the hand-off at which a count of 1 weighs 1
        self._swept = 0  # ids held after the last sweep
        self.sweeps = 0

    def __len__(self) -> int:
        """Ids with a count held."""
        return len(self._pool)

    def memory_bytes(self) -> int:
        """Bytes held for the counts (slots, columns, index)."""
        return self._pool.capacity * 49

    def _faded(self, count: np.ndarray, at: np.ndarray, tick: int) -> np.ndarray:
        """Counts last changed at hand-offs ``at``, as of hand-off ``tick``."""
        return count * np.exp((at - tick) * (2.0 * self._half_ln))

    def _weight(self, count: np.ndarray, at: np.ndarray | int) -> np.ndarray:
        return np.sqrt(count) * np.exp((np.asarray(at, dtype=np.float64) - self.base)
                                       * self._half_ln)

    def touch(self, ids: torch.Tensor, tick: int) -> np.ndarray:
        """Count one change of each of ``ids`` (int64 ``[n]``, unique) at hand-off ``tick``
        (not before the last one); their weights (float64 ``[n]``)."""
        s = self._pool.find(ids).numpy()
        miss = np.flatnonzero(s < 0)
        c, at = self._pool.cols["count"], self._pool.cols["at"]
        if miss.size:
            new = self._pool.add(ids.index_select(0, torch.from_numpy(miss))).numpy()
            c, at = self._pool.cols["count"], self._pool.cols["at"]  # grown with the pool
            s[miss] = new
            c[new], at[new] = 0.0, tick
        c[s] = self._faded(c[s], at[s], tick) + 1.0
        at[s] = tick
        if len(self._pool) > 2 * self._swept + 4096:
            self._sweep(tick)
        return self._weight(c[s], tick)

    def weights(self, ids: torch.Tensor, tick: int) -> np.ndarray:
        """The weights of ``ids`` (int64 ``[n]``) as of their last change (float64 ``[n]``;
        a forgotten id's as a count of ``min_count`` at hand-off ``tick``)."""
        pos = self._pool.find(ids).numpy()
        hit = pos >= 0
        s = pos[hit]
        out = np.full(pos.size, self._weight(np.float64(self.min_count), tick))
        out[hit] = self._weight(self._pool.cols["count"][s], self._pool.cols["at"][s])
        return out

    def due(self, tick: int) -> bool:
        """Whether a weight given at ``tick`` would pass ``2**REBASE_SPAN`` × √count."""
        return (tick - self.base) * self._half_ln > REBASE_SPAN * math.log(2.0)

    def rebase(self, tick: int) -> float:
        """Move ``base`` to ``tick`` (not before the last one); the factor (``<= 1``) every
        weight given so far must be multiplied by to stay comparable with the new ones."""
        factor = math.exp(-(tick - self.base) * self._half_ln)
        self.base = tick
        return factor

    def _sweep(self, tick: int) -> None:
        """Forget the counts that faded below ``min_count`` by ``tick`` (O(ids held))."""
        s = self._pool.live_slots()
        c = self._faded(self._pool.cols["count"][s], self._pool.cols["at"][s], tick)
        gone = s[c < self.min_count]
        self._pool.remove_slots(gone)
        self._swept = len(self._pool)
        self.sweeps += 1
