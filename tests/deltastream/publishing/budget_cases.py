"""Shared pieces of the BudgetPublisher tests: a loopback publisher through the real wire
codec into ``consumers.ServingTable`` s, small HashTable models and a training loop."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from consumers import ServingTable
from deltastream import DeltaTracker, HashTable, PublishError, TrackingMode, wire
from deltastream.publishing.budget import BudgetPublisher


@dataclass
class Sent:
    rows: int
    tombstones: int
    messages: int
    bytes: int


class Loopback:
    """Encode with deltastream.wire, decode, apply to serving tables; count the bytes.

    ``fail_next = (dtype, delivered)`` makes the next publish of that wire dtype raise
    ``PublishError`` once — after applying its messages when ``delivered`` (a send whose
    acknowledgement was lost), before when not."""

    def __init__(self, serving: dict, dtype: str = "f32", fail_on: str | None = None,
                 wire_version: int = 2) -> None:
        self.serving, self.dtype, self.seq, self.fail_on = serving, dtype, 0, fail_on
        self.wire_version = wire_version
        self.calls: list[tuple[str, list[int]]] = []
        self.dtypes: dict[str, set] = {}  # table -> wire dtypes of its messages
        self.log: list[tuple[str, str, list[int]]] = []  # (table, dtype, ids) per publish
        self.fail_next: tuple[str, bool] | None = None

    def publish(self, table, ids, rows, *, step, tombstones=None, ts=None, dtype=None,
                fresh=None):
        assert dtype != self.dtype  # the budget names a dtype only where it is not ours
        dtype = dtype or self.dtype
        self.dtypes.setdefault(table, set()).add(dtype)
        if table == self.fail_on:
            raise PublishError(f"broker down for {table}")
        failing = self.fail_next is not None and self.fail_next[0] == dtype
        if failing and not self.fail_next[1]:
            self.fail_next = None
            raise PublishError(f"broker down for {table} ({dtype})")
        ids, rows = ids.cpu(), rows.cpu()
        self.calls.append((table, ids.tolist()))
        self.log.append((table, dtype, ids.tolist()))
        batch = wire.DeltaBatch(model="m", table=table, shard=0, epoch=1, seq=self.seq,
                                step=step, ts=ts or time.time_ns(), ids=ids.numpy(),
                                rows=rows.numpy(), dtype=dtype,
                                tombstones=None if tombstones is None else
                                tombstones.cpu().numpy(), fresh=fresh)
        msgs = wire.encode(batch, version=self.wire_version)
        for m in msgs:
            self.seq += 1
            self.serving[table].apply(wire.decode(m))
        if failing:
            self.fail_next = None
            raise PublishError(f"acknowledgement lost for {table} ({dtype})")
        return Sent(len(ids), 0 if tombstones is None else len(tombstones), len(msgs),
                    sum(len(m) for m in msgs))


def setup(dims: dict[str, int], n: int = 100, scale: dict[str, float] | None = None,
          fail_on: str | None = None, wire_version: int = 2):
    """HashTables ``dims`` holding ids 0..n-1 (rows ~ N(0, scale)), a tracker with consumer
    ``p``, serving tables that already hold the initial rows, and a loopback publisher."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.ModuleDict()
    serving = {}
    for name, dim in dims.items():
        t = HashTable(dim, name=name, capacity=4 * n)
        rows = torch.randn(n, dim, generator=g) * (scale or {}).get(name, 1.0)
        t.insert(torch.arange(n), rows)
        model[name] = t
        serving[name] = ServingTable(name, dim)
        serving[name].upsert(np.arange(n), rows.numpy())
    tracker = DeltaTracker(model, consumers=["p"], mode=TrackingMode.EMBEDDING)
    return model, tracker, serving, Loopback(serving, fail_on=fail_on,
                                             wire_version=wire_version)


def move(table: HashTable, ids, delta) -> None:
    """Look ``ids`` up (recorded) and add ``delta`` (``[len(ids), dim]`` or broadcast)."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    with torch.no_grad():
        rows = table(ids)
        table.insert(ids, rows + torch.as_tensor(delta, dtype=torch.float32))


def train(model, tracker, bp: BudgetPublisher, steps: int, seed: int,
          threaded: bool = False) -> None:
    """``steps`` steps, each moving ~30 random ids of every table by N(0, 0.1), then a tick."""
    g = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        ids = torch.randint(0, 100, (30,), generator=g).unique()
        for t in model.values():
            move(t, ids, 0.1 * torch.randn(len(ids), t.embedding_dim, generator=g))
        tracker.step()
        tick(bp, step, threaded)


def served_error(model, serving) -> dict[str, np.ndarray]:
    out = {}
    for name, t in model.items():
        ids = t.ids()
        d = t.lookup(ids).numpy().astype(np.float64) - serving[name].lookup(ids.numpy())
        out[name] = np.sqrt((d ** 2).sum(1))
    return out


def tick(bp: BudgetPublisher, step: int, threaded: bool):
    """``bp.tick(step)``'s round record in either mode (None: the tick only refilled); a
    ``threaded`` publisher's tick only hands off, then ``drain`` waits for its round."""
    if not threaded:
        return bp.tick(step)
    before = bp.last
    assert bp.tick(step) is None  # threaded: the training thread only hands off
    after = bp.drain(timeout=30)
    return None if after is before else after
