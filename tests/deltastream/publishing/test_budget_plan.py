"""budget_plan.choose: a round reads about what it can take, and takes what a full sort would."""

from __future__ import annotations

import numpy as np
import torch

from deltastream.publishing.budget_plan import Candidate, choose
from deltastream.publishing.pending import PendingTable


class _CountingTable(PendingTable):
    """A pending table that counts the rows whose errors a round reads (pure logic)."""

    read = 0

    def errors(self, slots: np.ndarray) -> np.ndarray:
        type(self).read += int(slots.size)
        return super().errors(slots)


def test_the_overdue_tier_reads_one_birth_beyond_what_the_round_can_take():
    births, per_birth, dim = 400, 250, 8  # 100K overdue rows, one birth per tick
    rng = np.random.default_rng(1)
    t = _CountingTable(dim, torch.float32, capacity=births * per_birth)
    values = rng.normal(size=(births * per_birth, dim)).astype(np.float32)
    for b in range(births):  # each tick's rows moved from zeros (what predictors hold)
        ids = torch.arange(b * per_birth, (b + 1) * per_birth)
        t.merge(ids, torch.zeros(per_birth, dim), torch.from_numpy(values[ids.numpy()]),
                None, None, tick=b + 1)
    row, overhead, tokens, share = dim * 2 + 8, 100.0, 20_000.0, 0.25
    cand = Candidate(table=t, scale=1.0, weight=1.0, row_cost=row, overhead=overhead)
    _CountingTable.read = 0
    got = choose([cand], tokens, tick=births + 100, max_age=64, overdue_share=share,
                 min_error=0.0, per_byte=True, burst=tokens)
    read = _CountingTable.read
    # what a full sort of every overdue row (oldest birth, then largest error) would take
    n = int((share * tokens - overhead) // row)
    err = np.linalg.norm(values[:per_birth].astype(np.float64), axis=1)
    want = np.sort(np.argsort(-err, kind="stable")[:n])
    taken = t.take(got.slots[0][:got.overdue]).ids.numpy()
    assert got.overdue == n and np.array_equal(np.sort(taken), want)
    # it read those rows' birth and at most the next one, plus the key tier's heads — not
    # the 100K overdue rows
    assert read <= 2 * per_birth + 4 * 256, read
