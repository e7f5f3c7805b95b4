"""Scoring the demo's CTR model on a predictor host: numpy only, no torch.

The trainer exports the model's dense part (the MLP) with
:func:`deltastream_demo.model.export_dense` as plain arrays; :func:`mlp_logits` runs the same
forward pass in numpy on embedding rows read from any table (a serving table, or the
trainer's own rows in a :class:`RowTable`). The feature layout is fixed by the model:
``concat[user_row, item_row, user_row * item_row, dense]`` → ``Linear``/``ReLU`` … →
one logit.

Also the metrics the demo reports: :func:`auc` (rank-based, ties averaged) and
:func:`logloss`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Optional

import numpy as np

__all__ = ["RowTable", "features", "mlp_logits", "score", "auc", "logloss", "DenseWeights",
           "weights_from_state_dict"]

#: ``{"w0": [h1, in], "b0": [h1], "w1": ..., ...}`` float32 arrays, layer i = ``w{i}``/``b{i}``
DenseWeights = Mapping[str, np.ndarray]


class RowTable:
    """Read-only id → row lookup over ``(ids [n], rows [n, dim])`` arrays (sorted index).

    Missing ids read as ``default`` (zeros, like a serving table and like the trainer's
    HashTable in eval mode with a zero-mean initializer).
    """

    def __init__(self, ids: np.ndarray, rows: np.ndarray, *, default: float = 0.0) -> None:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        rows = np.asarray(rows, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[0] != ids.shape[0]:
            raise ValueError(f"rows must be [n, dim] with n = len(ids) = {ids.shape[0]}, "
                             f"got shape {rows.shape}")
        order = np.argsort(ids, kind="stable")
        self._ids = ids[order]
        if self._ids.size > 1 and bool((self._ids[1:] == self._ids[:-1]).any()):
            raise ValueError("ids must be unique")
        self._rows = rows[order]
        self.dim = int(rows.shape[1])
        self._default = float(default)

    @classmethod
    def concat(cls, parts: list[tuple[np.ndarray, np.ndarray]], dim: int) -> RowTable:
        """One table from several shards' ``(ids, rows)`` (shards hold disjoint ids)."""
        if not parts:
            return cls(np.empty(0, np.int64), np.empty((0, dim), np.float32))
        return cls(np.concatenate([p[0] for p in parts]),
                   np.concatenate([np.asarray(p[1], np.float32).reshape(-1, dim)
                                   for p in parts]))

    def __len__(self) -> int:
        return int(self._ids.shape[0])

    def ids(self) -> np.ndarray:
        """All ids, ascending (int64 ``[n]``)."""
        return self._ids.copy()

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """Bool ``[m]``: which ``ids`` are present."""
        return self._find(np.asarray(ids, dtype=np.int64).reshape(-1))[1]

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._ids.size == 0:
            return np.zeros(ids.shape, np.int64), np.zeros(ids.shape, bool)
        pos = np.searchsorted(self._ids, ids)
        pos = np.minimum(pos, self._ids.size - 1)
        return pos, self._ids[pos] == ids

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows for ``ids [m]`` → float32 ``[m, dim]`` (missing ids: ``default``)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        pos, hit = self._find(ids)
        out = self._rows[pos] if self._rows.shape[0] else np.zeros((ids.size, self.dim),
                                                                   np.float32)
        out = np.array(out, dtype=np.float32, copy=True)
        out[~hit] = self._default
        return out


def features(user_rows: np.ndarray, item_rows: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """The MLP input ``[n, 3·dim + n_dense]``: ``concat[u, v, u*v, dense]`` (float32)."""
    u = np.asarray(user_rows, np.float32)
    v = np.asarray(item_rows, np.float32)
    return np.concatenate([u, v, u * v, np.asarray(dense, np.float32)], axis=1)


def mlp_logits(weights: DenseWeights, x: np.ndarray) -> np.ndarray:
    """Forward of the exported MLP: ReLU between layers, none after the last → ``[n]``."""
    n_layers = sum(1 for k in weights if k.startswith("w"))
    if n_layers == 0 or any(f"w{i}" not in weights or f"b{i}" not in weights
                            for i in range(n_layers)):
        raise ValueError(f"weights must hold w0, b0, …, w{{L-1}}, b{{L-1}}; got {sorted(weights)}")
    h = np.asarray(x, np.float32)
    for i in range(n_layers):
        w = np.asarray(weights[f"w{i}"], np.float32)
        if h.shape[1] != w.shape[1]:
            raise ValueError(f"layer {i} expects {w.shape[1]} inputs, got {h.shape[1]}")
        h = h @ w.T + np.asarray(weights[f"b{i}"], np.float32)
        if i < n_layers - 1:
            np.maximum(h, 0.0, out=h)
    return h.reshape(-1)


_MLP_KEY = re.compile(r"(?:^|\.)mlp\.(\d+)\.(weight|bias)$")


def weights_from_state_dict(tensors: Mapping[str, np.ndarray]) -> Optional[DenseWeights]:
    """The click MLP's ``{"w0", "b0", …}`` from ``state_dict``-named tensors (a streamed
    dense version: ``mlp.<j>.weight`` / ``mlp.<j>.bias``, layers in ``j`` order), or None
    when they hold no MLP."""
    layers: dict[int, dict[str, np.ndarray]] = {}
    for name, a in tensors.items():
        m = _MLP_KEY.search(name)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = np.asarray(a, np.float32)
    if not layers or any(len(p) != 2 for p in layers.values()):
        return None
    out: dict[str, np.ndarray] = {}
    for i, j in enumerate(sorted(layers)):
        out[f"w{i}"], out[f"b{i}"] = layers[j]["weight"], layers[j]["bias"]
    return out


def score(weights: DenseWeights, user_lookup: Callable[[np.ndarray], np.ndarray],
          item_lookup: Callable[[np.ndarray], np.ndarray], user_ids: np.ndarray,
          item_ids: np.ndarray, dense: np.ndarray, *, chunk: int = 65536) -> np.ndarray:
    """Logits ``[n]`` for examples, reading rows through the given lookups (in chunks)."""
    n = int(np.asarray(user_ids).shape[0])
    out = np.empty(n, np.float32)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        x = features(user_lookup(user_ids[s:e]), item_lookup(item_ids[s:e]), dense[s:e])
        out[s:e] = mlp_logits(weights, x)
    return out


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann–Whitney U, ties get the average rank); NaN if one class."""
    y = np.asarray(labels).reshape(-1) > 0.5
    s = np.asarray(scores, np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels and scores must have the same length, got {y.shape} vs {s.shape}")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ss = s[order]
    ranks = np.empty(s.size, np.float64)
    # average ranks (1-based) over runs of equal scores
    starts = np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]])
    ends = np.r_[starts[1:], ss.size]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy of ``logits`` against 0/1 ``labels`` (numerically stable)."""
    y = np.asarray(labels, np.float64).reshape(-1)
    z = np.asarray(logits, np.float64).reshape(-1)
    return float(np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))))
