"""The ids a hash table inserts reach every consumer as ``new`` exactly once, however its
reads, clears and reads in parts fall: the store grows one record of them per read
interval (``DeltaStore.append(grow=True)``), and no record may span a read."""

from __future__ import annotations

import pytest
import torch

from deltastream.embedding.optim import SparseAdam
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import TrackingMode

from .test_tracker import Trainer


@pytest.mark.parametrize("seed", [0, 1])
def test_inserted_ids_are_new_to_each_consumer_once(seed):
    """Consumers ``p`` and ``q`` read (sorted, or ``p`` unordered) and clear at random
    steps; each step inserts fresh ids: every read's ``new`` ids are exactly those inserted
    since that consumer's last read or clear."""
    t = Trainer(seed=3, sparse_opt=SparseAdam)
    tracker = DeltaTracker(t.net, consumers=["p", "q"], mode=TrackingMode.EMBEDDING)
    g = torch.Generator().manual_seed(seed)
    since = {"p": set(), "q": set()}
    fresh = 1_000
    for _ in range(40):
        new = list(range(fresh, fresh + 5))
        fresh += 5
        old = torch.randint(0, 30, (10,), generator=g)
        u = torch.cat([old, torch.tensor(new)]) * 7919 + 11
        inserted = set(u.tolist()) - set(t.net.user.ids().tolist())
        t.step(u, torch.randint(0, 64, (8,)), [tracker])
        for c in since:
            since[c] |= inserted
        for c in since:
            draw = float(torch.rand(1, generator=g))
            if draw < 0.3:
                rows = tracker.get_delta(c)["user"]
                assert set(rows.ids[rows.new].tolist()) == since[c]
                since[c] = set()
            elif draw < 0.4:
                tracker.clear(c)
                since[c] = set()
