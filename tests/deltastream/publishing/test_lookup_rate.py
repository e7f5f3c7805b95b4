"""LookupRate: read counts per id, decayed per round (the weights of read-weighted
thresholds in select_changed)."""

from __future__ import annotations

import math

import pytest
import torch

from deltastream.publishing.lookup_rate import LookupRate
from tests.deltastream.publishing.selection_cases import DIM


def test_lookup_rate_counts_decays_and_forgets():
    r = LookupRate(decay=0.5, min_count=0.1)
    assert len(r) == 0 and r.rate(torch.tensor([1, 2])).tolist() == [0.0, 0.0]
    # id 7: 4 lookups per round (repeats count, any shape); id 9: 1 lookup in round 1 only
    r.observe(torch.tensor([[7, 7], [7, 9]]))
    r.observe(torch.tensor([7]))
    r.end_round()
    assert r.rate(torch.tensor([7, 9, 8])).tolist() == [2.0, 0.5, 0.0]  # (1 - 0.5) × count
    for _ in range(30):
        r.observe(torch.tensor([7, 7, 7, 7]))
        r.end_round()
    assert r.rate(torch.tensor([7])).item() == pytest.approx(4.0, rel=1e-6)  # → λ
    assert r.rate(torch.tensor([9])).item() == 0.0  # decayed below min_count: forgotten
    assert len(r) == 1 and r.rounds == 31
    # lookups count only once the round is closed
    r.observe(torch.tensor([11]))
    assert r.rate(torch.tensor([11])).item() == 0.0
    r.end_round()
    assert r.rate(torch.tensor([11])).item() == 0.5
    out = r.rate(torch.tensor([[7, 11]]))
    assert out.shape == (1, 2) and out.dtype == torch.float32


def test_lookup_rate_watch_counts_training_lookups_only():
    from deltastream.embedding.hashtable import HashTable

    table = HashTable(DIM, name="t")
    r = LookupRate(decay=0.5)
    handle = r.watch(table)
    table(torch.tensor([3, 3, 4]))
    table.eval()
    table(torch.tensor([3, 5]))  # scoring traffic: not counted
    table.train()
    r.end_round()
    assert r.rate(torch.tensor([3, 4, 5])).tolist() == [1.0, 0.5, 0.0]
    handle.remove()
    table(torch.tensor([4]))
    r.end_round()
    assert r.rate(torch.tensor([4])).item() == 0.25  # only decayed


@pytest.mark.parametrize("kwargs,match", [
    (dict(decay=0.0), r"decay must be a number in \(0, 1\)"),
    (dict(decay=1.0), r"decay must be a number in \(0, 1\)"),
    (dict(decay=True), r"decay must be a number in \(0, 1\)"),
    (dict(min_count=-1.0), "min_count must be a finite number >= 0"),
    (dict(min_count=math.inf), "min_count must be a finite number >= 0"),
])
def test_lookup_rate_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LookupRate(**kwargs)
    with pytest.raises(ValueError, match="ids must be an int64 tensor"):
        LookupRate().observe(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="ids must be an int64 tensor"):
        LookupRate().rate([1, 2])
