"""Shared pieces of the publish_delta round tests: a publisher that records what it is
handed (pure selection logic), small HashTable models and random sequences of changes
(lookups and moves, inserts, evictions) applied to twins."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from deltastream import DeltaTracker, HashTable

DIM = 6


class Recorder:
    """A RowPublisher that keeps what each call hands it: ``(table, ids, rows, tombs)``."""

    dtype = "f16"

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[int], torch.Tensor, list[int]]] = []

    def publish(self, table, ids, rows, *, step, tombstones=None, ts=None, **kw):
        tombs = [] if tombstones is None else sorted(tombstones.tolist())
        self.sent.append((table, ids.tolist(), rows.clone(), tombs))
        return SimpleNamespace(rows=int(ids.numel()), tombstones=len(tombs), messages=1,
                               bytes=int(ids.numel()) * (8 + 2 * DIM))


def twin_model(n: int, seed: int) -> torch.nn.ModuleDict:
    gen = torch.Generator().manual_seed(seed)
    out = torch.nn.ModuleDict()
    for name in ("u", "v"):
        t = HashTable(DIM, name=name, capacity=8 * n)
        t.insert(torch.arange(n), torch.randn(n, DIM, generator=gen))
        out[name] = t
    return out


def random_steps(rng: np.random.Generator, n: int, rounds: int, steps: int):
    """A random sequence of table changes per round: per step, per table, the ids looked up
    and moved (Zipf-like: some hot, most cold), ids inserted, ids evicted."""
    plan, next_id = [], n
    for _ in range(rounds):
        rnd = []
        for _ in range(steps):
            step = {}
            for name in ("u", "v"):
                touch = np.unique(np.minimum(rng.zipf(1.3, size=rng.integers(1, 40)) - 1,
                                             next_id - 1))
                fresh = np.arange(next_id, next_id + rng.integers(0, 4))
                next_id += fresh.size
                evict = rng.choice(next_id, size=rng.integers(0, 3), replace=False)
                step[name] = (touch, fresh, evict, rng.normal(size=(touch.size, DIM)),
                              rng.normal(size=(fresh.size, DIM)))
            rnd.append(step)
        plan.append(rnd)
    return plan


def apply_step(model: torch.nn.ModuleDict, tracker: DeltaTracker, step: dict) -> None:
    with torch.no_grad():
        for name, (touch, fresh, evict, moves, values) in step.items():
            t = model[name]
            ids = torch.from_numpy(touch)
            live = ids[t.contains(ids)]
            if live.numel():
                rows = t(live)  # a recorded lookup, then the "optimizer" moves the rows
                move = torch.from_numpy(moves[:live.numel()]).float()
                t.insert(live, rows + move)
            if fresh.size:  # inserted, then moved by a write without a lookup: reported
                # with the inserted row as FIRST, a drift of its own (no ties to break)
                value = torch.from_numpy(values).float()
                t.insert(torch.from_numpy(fresh), value)
                t.insert(torch.from_numpy(fresh), 2 * value)
            t.evict(torch.from_numpy(evict))
    tracker.step()
