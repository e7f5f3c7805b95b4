"""Seeded synthetic click stream for the demo and the benchmarks (numpy only, no torch).

Every example is ``(user_id, item_id, dense features) -> click``. The stream is built so
that online updates matter and AUC means something:

* **Zipf popularity that drifts.** A user (item) is drawn by sampling a popularity *rank*
  from a Zipf law and mapping the rank to an entity through a fixed random permutation that
  is rotated as the stream advances: at stream position ``t`` rank ``r`` is entity
  ``perm[(r + floor(t × drift)) mod n]``. Entities therefore climb from the tail to the head
  over time and then drop out — new ids keep arriving in the head, old ones go cold.
* **Sessions.** Users come back: with probability ``session_return`` the user of the example
  at position ``t`` is the user of an earlier position ``t − δ`` (δ uniform in
  ``[1, session_window]``), so a user active a moment ago is likely to be active again —
  the reason fresh embeddings matter. User draws are keyed by stream position (a
  counter-based hash of ``(seed, t)``), so every process sees the same user at ``t``.
* **A hidden ground-truth model.** Users have latent vectors ``u``; items have two latent
  vectors ``a``, ``b`` that the item's true taste vector rotates between over time
  (``v(t) = cos θ·a + sin θ·b``, θ advancing with ``t``, a random phase per item), so an
  item's best embedding keeps changing (concept drift). The click logit is
  ``signal·⟨u, v(t)⟩/√k + bias_item + ⟨w, x⟩ + offset`` and the label is a Bernoulli draw
  of its sigmoid. :attr:`Batch.true_logits` gives the Bayes-optimal score (the AUC ceiling).

Reproducible: the hidden parameters come from ``seed``; a batch is a pure function of
``(seed, start, count, salt)``, so any process can generate any slice on its own (each
trainer rank its share of a step, the predictor the held-out slice) without coordination.
All generation is vectorized.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["StreamConfig", "Batch", "ClickStream", "entity_ids"]

_MIX = 0x9E3779B97F4A7C15  # odd: multiplication by it is a bijection mod 2**63
_MASK63 = (1 << 63) - 1
_SALT_USER = 0x5BD1E9955BD1E995 & _MASK63
_SALT_ITEM = 0x27D4EB2F165667C5 & _MASK63
#: session links followed from a position at most (the chain's cap)
_MAX_LINKS = 256
#: positions whose session root a stream remembers (direct-mapped by position): a new
#: position's chain then ends at the first remembered one it reaches, a link or two back,
#: instead of walking ~10 links (and, for the longest of a batch's chains, ~50)
_ROOT_SLOTS = 1 << 18


@dataclass(frozen=True)
class StreamConfig:
    """Shape of the synthetic stream. Rates are per example of stream position.

    Attributes:
        seed: seeds the hidden model and every batch.
        n_users, n_items: population sizes (distinct ids that can ever appear).
        n_dense: dense (context) features per example.
        latent_dim: width ``k`` of the hidden taste vectors.
        user_zipf, item_zipf: Zipf exponents of the popularity by rank (> 0).
        user_drift, item_drift: popularity ranks the permutation rotates per example.
        concept_period: examples for one full rotation of an item's taste vector.
        session_return: probability that an example continues an earlier user's session.
        session_window: how far back (examples) a continued session may reach.
        signal: scale of the user–item interaction term of the true logit.
        offset: constant of the true logit (sets the base click rate).
        dense_ids: ids are the entity indices ``[0, n)`` themselves (fixed-size tables,
            e.g. TorchRec's); otherwise well-spread int64 ids (:func:`entity_ids`).
    """

    seed: int = 0
    n_users: int = 200_000
    n_items: int = 20_000
    n_dense: int = 4
    latent_dim: int = 8
    user_zipf: float = 1.05
    item_zipf: float = 1.1
    user_drift: float = 0.02
    item_drift: float = 0.002
    concept_period: float = 2_000_000.0
    session_return: float = 0.9
    session_window: int = 2_000
    signal: float = 2.5
    offset: float = -1.0
    dense_ids: bool = False

    def __post_init__(self) -> None:
        for f in ("n_users", "n_items", "n_dense", "latent_dim", "session_window"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"StreamConfig.{f} must be a positive int, got {v!r}")
        for f in ("user_zipf", "item_zipf", "concept_period"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"StreamConfig.{f} must be a finite number > 0, got {v!r}")
        for f in ("user_drift", "item_drift", "signal", "offset"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v)):
                raise ValueError(f"StreamConfig.{f} must be a finite number, got {v!r}")
        if not (isinstance(self.session_return, (int, float))
                and 0.0 <= self.session_return < 1.0):
            raise ValueError(f"StreamConfig.session_return must be in [0, 1), got "
                             f"{self.session_return!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"StreamConfig.seed must be an int >= 0, got {self.seed!r}")

    def to_dict(self) -> dict:
        """Plain dict (JSON-able), e.g. for a report."""
        return asdict(self)


class Batch(NamedTuple):
    """``count`` examples of the stream (all arrays aligned on the first axis).

    Attributes:
        user_ids, item_ids: int64 ``[count]`` global ids (non-negative, sparse in int64).
        dense: float32 ``[count, n_dense]`` context features.
        labels: float32 ``[count]`` clicks (0 or 1).
        true_logits: float32 ``[count]`` the hidden model's logit (the Bayes-optimal score).
        positions: int64 ``[count]`` stream positions of the examples.
    """

    user_ids: np.ndarray
    item_ids: np.ndarray
    dense: np.ndarray
    labels: np.ndarray
    true_logits: np.ndarray
    positions: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def entity_ids(index: np.ndarray, salt: int) -> np.ndarray:
    """Map entity indices ``[0, n)`` to distinct, well-spread non-negative int64 ids.

    ``(index × odd) mod 2**63`` and the xor with a 63-bit salt are both bijections, so
    distinct indices give distinct ids.
    """
    idx = np.asarray(index, dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = (idx * np.uint64(_MIX)) & np.uint64(_MASK63)
    return (mixed ^ np.uint64(salt & _MASK63)).astype(np.int64)


def _hash_uniform(seed: int, tag: int, pos: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) per position from a counter-based hash (splitmix64) of (seed, tag, pos)."""
    with np.errstate(over="ignore"):
        x = (pos.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             + np.uint64((seed * 0x632BE59BD9B4E019 + tag * 0x85EBCA77C2B2AE63)
                         & 0xFFFFFFFFFFFFFFFF))
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _zipf_cdf(n: int, a: float) -> np.ndarray:
    w = np.arange(1, n + 1, dtype=np.float64) ** (-a)
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    return cdf


class ClickStream:
    """The synthetic click stream of :class:`StreamConfig`; see the module docstring.

    Example::

        stream = ClickStream(StreamConfig(seed=7))
        b = stream.batch(start=0, count=1024)        # examples 0..1023
        held_out = stream.batch(start=10**6, count=20_000, salt=1)
    """

    def __init__(self, config: StreamConfig | None = None) -> None:
        self.config = cfg = config or StreamConfig()
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([cfg.seed, 0])))
        k = cfg.latent_dim
        self._user_cdf = _zipf_cdf(cfg.n_users, cfg.user_zipf)
        self._item_cdf = _zipf_cdf(cfg.n_items, cfg.item_zipf)
        self._user_perm = rng.permutation(cfg.n_users)
        self._item_perm = rng.permutation(cfg.n_items)
        self._u = rng.standard_normal((cfg.n_users, k)).astype(np.float32)
        self._a = rng.standard_normal((cfg.n_items, k)).astype(np.float32)
        self._b = rng.standard_normal((cfg.n_items, k)).astype(np.float32)
        self._phase = rng.uniform(0.0, 2 * math.pi, cfg.n_items)
        self._bias = rng.normal(0.0, 0.5, cfg.n_items).astype(np.float32)
        self._w = rng.normal(0.0, 0.5, cfg.n_dense).astype(np.float32)
        # remembered session roots: slot = position mod _ROOT_SLOTS holds a position (-1:
        # none), its root and the links to it (a chain reuses one only within its cap)
        self._root_pos = np.full(_ROOT_SLOTS, -1, np.int64)
        self._root_of = np.zeros(_ROOT_SLOTS, np.int64)
        self._root_links = np.zeros(_ROOT_SLOTS, np.int64)
        self._root_lock = threading.Lock()  # batch() may run on several threads
        if cfg.dense_ids:
            self._user_ids = np.arange(cfg.n_users, dtype=np.int64)
            self._item_ids = np.arange(cfg.n_items, dtype=np.int64)
        else:
            self._user_ids = entity_ids(np.arange(cfg.n_users), _SALT_USER)
            self._item_ids = entity_ids(np.arange(cfg.n_items), _SALT_ITEM)

    def _user_at(self, pos: np.ndarray) -> np.ndarray:
        """Fresh (non-session) user index drawn at stream positions ``pos``."""
        cfg = self.config
        rank = np.searchsorted(self._user_cdf, _hash_uniform(cfg.seed, 1, pos), side="right")
        rank = np.minimum(rank, cfg.n_users - 1)
        shift = np.floor(pos.astype(np.float64) * cfg.user_drift).astype(np.int64)
        return self._user_perm[(rank + shift) % cfg.n_users]

    def _session_root(self, pos: np.ndarray) -> np.ndarray:
        """Position whose fresh draw gives the user at ``pos`` (follows session links back).

        Each position continues an earlier one with probability ``session_return``; the
        chains are followed for all positions at once (geometric length, mean
        ``1 / (1 − session_return)``), capped at 256 links. A chain stops early at a
        position whose root an earlier call found (within the cap: the result is the same
        as without the memory, which only saves walking).
        """
        cfg = self.config
        cur = pos.copy()
        if cfg.session_return <= 0:
            return cur
        links = np.zeros(cur.shape, np.int64)  # links followed from pos to cur
        active = np.ones(cur.shape, bool)
        mask = _ROOT_SLOTS - 1
        with self._root_lock:
            for _ in range(_MAX_LINKS):
                idx = np.flatnonzero(active)
                if idx.size == 0:
                    break
                c = cur[idx]
                slot = c & mask
                n = self._root_links[slot]
                known = (self._root_pos[slot] == c) & (links[idx] + n <= _MAX_LINKS)
                if known.any():
                    k = idx[known]
                    cur[k] = self._root_of[slot[known]]
                    links[k] += n[known]
                    active[k] = False
                    idx, c = idx[~known], c[~known]
                back = _hash_uniform(cfg.seed, 2, c) < cfg.session_return
                delta = 1 + np.floor(_hash_uniform(cfg.seed, 3, c)
                                     * cfg.session_window).astype(np.int64)
                move = back & (c - delta >= 0)
                cur[idx[move]] = c[move] - delta[move]
                links[idx[move]] += 1
                active[idx[~move]] = False
            # remember every chain: one cut by the cap (256 links) is only ever reused
            # for its own position, where the answer is the same
            slot = pos & mask
            self._root_pos[slot] = pos
            self._root_of[slot] = cur
            self._root_links[slot] = links
        return cur

    def batch(self, start: int, count: int, *, salt: int = 0) -> Batch:
        """Examples at stream positions ``[start, start + count)``.

        ``salt`` selects an independent draw of the same positions (use a different salt
        for held-out data): items, features and clicks change, users are keyed by position
        only (so held-out traffic continues the sessions of the training traffic before it).
        Deterministic in ``(seed, start, count, salt)``.
        """
        if not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        if not isinstance(count, (int, np.integer)) or count <= 0:
            raise ValueError(f"count must be a positive int, got {count!r}")
        if not isinstance(salt, (int, np.integer)) or salt < 0:
            raise ValueError(f"salt must be an int >= 0, got {salt!r}")
        cfg = self.config
        rng = np.random.Generator(np.random.PCG64(
            np.random.SeedSequence([cfg.seed, 1, int(salt), int(start), int(count)])))
        pos = np.arange(start, start + count, dtype=np.int64)
        posf = pos.astype(np.float64)

        # users: a session continues an earlier position's user, else a fresh Zipf draw
        users = self._user_at(self._session_root(pos))
        # items: popularity rank -> entity through the drifting (rotated) permutation
        i_rank = np.searchsorted(self._item_cdf, rng.random(count), side="right")
        i_rank = np.minimum(i_rank, cfg.n_items - 1)
        i_shift = np.floor(posf * cfg.item_drift).astype(np.int64)
        items = self._item_perm[(i_rank + i_shift) % cfg.n_items]

        dense = rng.standard_normal((count, cfg.n_dense)).astype(np.float32)
        theta = (2 * math.pi / cfg.concept_period) * posf + self._phase[items]
        v = (np.cos(theta)[:, None].astype(np.float32) * self._a[items]
             + np.sin(theta)[:, None].astype(np.float32) * self._b[items])
        inter = np.einsum("nk,nk->n", self._u[users], v) / math.sqrt(cfg.latent_dim)
        logits = (cfg.signal * inter + self._bias[items] + dense @ self._w
                  + cfg.offset).astype(np.float32)
        labels = (rng.random(count) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        return Batch(self._user_ids[users], self._item_ids[items], dense, labels, logits, pos)
