"""``hand_back_undelivered``: ids of undelivered messages come back as changed rows."""

from __future__ import annotations

import numpy as np
import torch

from deltastream import DeltaTracker, TrackingMode
from deltastream.publishing.redelivery import hand_back_undelivered
from deltastream.publishing.results import Undelivered


def _undelivered(table: str, ids: list[int], shard: int = 0) -> Undelivered:
    arr = np.array(ids, dtype=np.int64)
    return Undelivered(table, 4, 5, len(ids), 0, "down", shard=shard, ids=arr)


def test_ids_come_back_overdue_with_zero_first_states_and_others_are_left():
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 3, dtype=torch.float64)})
    tracker = DeltaTracker(model, consumers=["p"], mode=TrackingMode.EMBEDDING)
    tracker.get_delta("p")
    modules = tracker.get_tracked_modules()
    n = hand_back_undelivered(
        tracker, "p", [_undelivered("emb", [5, 3]), _undelivered("emb", [3, 7]),
                       _undelivered("other", [1])],
        {("emb", None): "emb"}, modules, age=16)
    assert n == 3
    delta = tracker.get_delta("p")["emb"]
    assert delta.ids.tolist() == [3, 5, 7]
    assert delta.states.dtype == torch.float64 and not delta.states.any()
    assert (delta.age >= 16).all()
