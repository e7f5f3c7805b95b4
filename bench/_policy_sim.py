"""Idealized budget policies beside ``freshness-per-byte``'s trainer (``--sim-budgets``).

**A model of a publisher, not deltastream's.** It answers one question before anything is
built: how much would the transports issue 29 proposes buy on the bench's own training run
(the same trajectory, the same ratings scored)? Each :class:`SimBudget` holds what a
predictor would hold (dense arrays: the bench's tables are small) and, every tick,
re-scores every row the trainer has looked up against it, ranks them as the default
:class:`~deltastream.BudgetPolicy` does (``‖current − held‖ / table RMS norm / row
bytes``) and spends a token bucket (refill ``B`` bytes a step, burst four steps). Unlike
the real publisher it has no ``max_age`` tier, no rejects and no in-flight rows.

Transports (``kind``):

* ``i8`` — full rows: the wide tables as i8 with a per-row f32 scale (``dim + 4`` bytes),
  the dim-1 bias rows as f16 (what ``--wire-version 3 --wide-dtype i8`` sends);
* ``res1`` — **1-bit residuals with error feedback** for the wide tables: the predictor adds
  ``sign(current − held) · mean|current − held|`` (``dim / 8`` bytes of signs and an f16
  scale), and what the residual does not remove stays the row's error, to be sent again
  when it ranks. Biases as f16 full rows;
* ``res1b`` — ``res1`` with a one-byte scale (a power of 2^(1/16): 4.4 % steps), ``dim / 8
  + 1`` bytes. Built as wire v5's ``r1e`` (which also sends dim-1 rows as residuals: not
  modelled here);
* ``res2`` — 2-bit residuals: the sign and which of two f16 magnitudes (the means of
  ``|current − held|`` below and above its mean), ``dim / 4 + 4`` bytes. Modelled only.

Reads (``reads``, res1 only in :func:`sim_budgets`): ``none`` ranks as above; the others
also weight each row's key by how often it is read — the square root of a decayed count of
the steps that touched it (× :data:`READS_DECAY` a step), as
:class:`~deltastream.LookupRate` argues — normalized within its table so the tables'
balance stays: ``decayed`` by the mean over the candidates every tick (the count decays
while a row waits), ``at-change`` with the weight a row had at its last change, normalized
by a running mean of the weights of the rows each step changed (a form an incremental
order could keep: a pending row's key changes only when the row does); ``raw`` as
``decayed`` without normalizing (a count is in the same unit in every table: what
``BudgetPolicy(read_decay=)`` builds). The decay was chosen on MovieLens-100K (0.8, 0.9 and
0.97 tried).

Framing: ``per-table`` charges each table's message its real fixed cost (the bytes of that
message of the bench's wire version, 3 at least, beyond its ids and values, measured with
the encoder; residuals as ``r1`` messages from v4 on, as i8 ones before); ``one`` charges
one such cost per tick plus ``len(name) + 8`` bytes for each further table (an estimate of
a message that carries every table). Ids cost what the wire encodes for each table's
batch (:func:`deltastream.wire.id_bytes`: v3 varints of the sorted ids, when shorter).
"""

from __future__ import annotations

import numpy as np

from deltastream import wire
from deltastream.wire_values import rows_nbytes, scale_nbytes

__all__ = ["SimBudget", "sim_budgets", "KINDS", "FRAMINGS", "READS"]

KINDS = ("i8", "res1", "res1b", "res2")
FRAMINGS = ("per-table", "one")
READS = ("none", "decayed", "at-change", "raw")
READS_DECAY = 0.9  # a step's weight in a row's read count (chosen on MovieLens-100K)
BURST_STEPS = 4
RMS_ALPHA = 0.1  # EMA weight of a tick's RMS row norm (the real TableScale's)


def message_overhead(table: str, dim: int, dtype: str, ids: np.ndarray | None = None,
                     version: int = 3) -> int:
    """Bytes of the message of ``table`` carrying ``ids`` (default: one id) in ``dtype``
    (wire ``version`` >= 3) beyond its ids and row values: keys, names, counters, bin
    headers (v4: the shortest that fit), CRC — measured by encoding it."""
    ids = np.array([1], np.int64) if ids is None else np.asarray(ids, np.int64)
    n = int(ids.size)
    # a real publisher's fields: an epoch in ms, seqs and steps in the thousands
    batch = wire.DeltaBatch(model="mf", table=table, shard=0, epoch=1_700_000_000_000,
                            seq=1000, step=1000,
                            ts=1_700_000_000_000_000_000, ids=ids,
                            rows=np.zeros((n, dim), np.float32), dtype=dtype)
    (msg,) = wire.encode(batch, version=version, max_message_bytes=1 << 30)
    return len(msg) - wire.id_bytes(ids, version) - rows_nbytes(n, dim, dtype) \
        - scale_nbytes(n, dtype)


class SimBudget:
    """One simulated budget (see the module docstring).

    Args:
        kind: a transport of :data:`KINDS`. framing: one of :data:`FRAMINGS`.
        bytes_per_step: the bucket's refill. dims: ``{table: dim}``; sizes: ``{table:
            rows in its id space}``.
    """

    def __init__(self, kind: str, framing: str, bytes_per_step: float, dims: dict,
                 sizes: dict, version: int = 3, reads: str = "none") -> None:
        self.kind, self.framing, self.rate = kind, framing, float(bytes_per_step)
        self.version, self.reads = version, reads
        self.label = (f"sim-{kind}{'-one' if framing == 'one' else ''}"
                      f"{'' if reads == 'none' else '-reads-' + reads}={bytes_per_step:g}")
        self.dims = dims
        # reads: each row's decayed count of steps that touched it, as of step ``at``
        self.now = 0
        self.count = {t: np.zeros(sizes[t]) for t in dims}
        self.at = {t: np.zeros(sizes[t], np.int64) for t in dims}
        self.weight_at_change = {t: np.ones(sizes[t]) for t in dims}
        self.weight_mean: dict = {t: None for t in dims}
        self.held = {t: np.zeros((sizes[t], d), np.float32) for t, d in dims.items()}
        self.rms: dict = {t: None for t in dims}
        self.overhead = {t: message_overhead(t, d, self._dtype(t), version=version)
                         for t, d in dims.items()}
        self.tokens = 0.0
        self.sent = {"bytes": 0, "rows": 0, "messages": 0, "rounds": 0}
        self.table_rows = {t: 0 for t in dims}
        self.logits: list = []

    def _dtype(self, table: str) -> str:
        """The wire dtype of ``table``'s messages (res1 before v4: priced as i8 headers)."""
        if self.dims[table] <= 4:
            return "f16"
        residual = self.kind != "i8" and self.version >= wire.RESIDUAL_VERSION
        return "r1" if residual else "i8"

    def value_bytes(self, table: str) -> int:
        """Wire bytes of one row's value (its id apart)."""
        d = self.dims[table]
        if d <= 4:
            return 2 * d
        return {"res1": d // 8 + 2, "res1b": d // 8 + 1, "res2": d // 4 + 4}.get(self.kind,
                                                                                d + 4)

    def lookup(self, table: str, ids: np.ndarray) -> np.ndarray:
        """What the predictor serves for ``ids`` ``[n, dim]`` (0 for rows never sent)."""
        return self.held[table][ids]

    def _count_reads(self, changed: dict) -> None:
        self.now += 1
        if self.reads == "none":  # unweighted keys read no counts
            return
        for t, ids in changed.items():
            c = self.count[t]
            c[ids] = c[ids] * READS_DECAY ** (self.now - self.at[t][ids]) + 1.0
            self.at[t][ids] = self.now
            w = np.sqrt(c[ids])
            self.weight_at_change[t][ids] = w
            if w.size:
                m = self.weight_mean[t]
                self.weight_mean[t] = float(w.mean()) if m is None else \
                    (1 - RMS_ALPHA) * m + RMS_ALPHA * float(w.mean())

    def _read_weight(self, table: str, rows: np.ndarray) -> np.ndarray | float:
        if self.reads in ("decayed", "raw"):
            w = np.sqrt(self.count[table][rows] * READS_DECAY ** (self.now - self.at[table][rows]))
            return w if self.reads == "raw" else w / max(float(w.mean()), 1e-12)
        if self.reads == "at-change":
            return self.weight_at_change[table][rows] / max(self.weight_mean[table] or 1.0,
                                                            1e-12)
        return 1.0

    def tick(self, current: dict, seen: dict, changed: dict) -> None:
        """One round: ``current`` ``{table: [rows, dim]}`` the trainer's rows now,
        ``seen`` ``{table: bool [rows]}`` the rows it has looked up, ``changed`` ``{table:
        ids}`` the rows this step touched."""
        self._count_reads(changed)
        self.tokens = min(self.tokens + self.rate, BURST_STEPS * self.rate)
        keys, tabs, rows = [], [], []
        for t, cur in current.items():
            r = np.flatnonzero(seen[t])
            err = np.linalg.norm(cur[r] - self.held[t][r], axis=1)
            live = err > 0
            if not live.any():
                continue
            r, err = r[live], err[live]
            rms = float(np.sqrt((np.linalg.norm(cur[r], axis=1) ** 2).mean()))
            self.rms[t] = rms if self.rms[t] is None else \
                (1 - RMS_ALPHA) * self.rms[t] + RMS_ALPHA * rms
            keys.append(err * self._read_weight(t, r) / max(self.rms[t], 1e-12)
                        / (self.value_bytes(t) + 1.5))
            tabs.append(np.full(r.size, len(tabs)))
            rows.append((t, r))
        if not keys:
            return
        key, tab = np.concatenate(keys), np.concatenate(tabs)
        every = np.concatenate([r for _, r in rows])
        chosen = self._spend(np.argsort(-key, kind="stable"), tab, every, [t for t, _ in rows])
        for j, (t, _) in enumerate(rows):
            ids = np.sort(every[chosen[tab[chosen] == j]])
            if ids.size:
                self._apply(t, ids, current[t][ids])

    def _spend(self, order: np.ndarray, tab: np.ndarray, every: np.ndarray,
               names: list) -> np.ndarray:
        """The leading entries of ``order`` (indices into ``every``, the candidate ids, and
        ``tab``, their tables' indices into ``names``) that fit the bucket, ids priced at
        ~1.5 B while ranking; charges the batches' real bytes (ids as the wire encodes them), counts them."""
        spent, used, take = 0.0, set(), []
        for o in order:
            t = names[tab[o]]
            cost = self.value_bytes(t) + 1.5
            if t not in used:
                cost += self._head(t, first=not used)
            if spent + cost > self.tokens:
                break
            spent += cost
            used.add(t)
            take.append(o)
        take = np.asarray(take, np.int64)
        real, tables = 0, 0
        for j, t in enumerate(names):
            ids = np.sort(every[take[tab[take] == j]])
            if ids.size:
                head = message_overhead(t, self.dims[t], self._dtype(t), ids, self.version) \
                    if self.framing == "per-table" or not tables else len(t) + 8
                real += head + wire.id_bytes(ids, self.version) + ids.size * self.value_bytes(t)
                tables += 1
                self.table_rows[t] += int(ids.size)
                self.sent["rows"] += int(ids.size)
        self.sent["messages"] += tables if self.framing == "per-table" else int(tables > 0)
        self.sent["rounds"] += int(tables > 0)
        self.tokens -= real
        self.sent["bytes"] += real
        return take

    def _head(self, table: str, *, first: bool) -> int:
        """Fixed bytes of ``table``'s batch in a tick's messages (for one row)."""
        return self.overhead[table] if self.framing == "per-table" or first else len(table) + 8

    def _apply(self, table: str, ids: np.ndarray, cur: np.ndarray) -> None:
        held = self.held[table]
        if self.dims[table] <= 4:
            held[ids] = cur.astype(np.float16).astype(np.float32)
        elif self.kind == "i8":
            m = np.abs(cur).max(1, keepdims=True) / 127
            m = np.where(m > 0, m, 1.0)
            held[ids] = (np.round(cur / m) * m).astype(np.float32)
        elif self.kind in ("res1", "res1b"):  # error feedback: the rest stays pending
            r = cur - held[ids]
            scale = np.abs(r).mean(1, keepdims=True)
            if self.kind == "res1":
                scale = scale.astype(np.float16).astype(np.float32)
            else:  # one byte: a power of 2^(1/16), 256 steps (a 65536× range a message)
                scale = np.exp2(np.round(16 * np.log2(np.maximum(scale, 1e-30))) / 16)
            held[ids] += np.sign(r) * scale
        else:  # 2 bits: sign, and which of two f16 magnitudes (means below/above mean|r|)
            r = cur - held[ids]
            a = np.abs(r)
            big = a > a.mean(1, keepdims=True)
            lo = np.where(big, 0, a).sum(1, keepdims=True) / np.maximum((~big).sum(1, keepdims=True), 1)
            hi = np.where(big, a, 0).sum(1, keepdims=True) / np.maximum(big.sum(1, keepdims=True), 1)
            f16 = lambda x: x.astype(np.float16).astype(np.float32)  # noqa: E731
            held[ids] += np.sign(r) * np.where(big, f16(hi), f16(lo))


def sim_budgets(spec: list[float], dims: dict, sizes: dict, version: int = 3
                ) -> list[SimBudget]:
    """Every kind × framing at each budget of ``spec`` (bytes per step), messages of wire
    ``version`` (>= 3), and res1 (what is built) weighted by reads both ways."""
    return [SimBudget(k, f, b, dims, sizes, version) for b in spec for k in KINDS
            for f in FRAMINGS] + [SimBudget("res1", f, b, dims, sizes, version, reads=r)
                                  for b in spec for f in FRAMINGS for r in READS[1:]]
