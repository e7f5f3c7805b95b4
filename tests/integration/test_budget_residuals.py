"""1-bit residuals end to end: BudgetPolicy(residuals=True) → a real broker → SyncDaemon
(stopped and restarted from its state midway) and a replay ``rebuild``.

Residuals are added, not replacing, so a message applied twice or skipped would leave a
row wrong for good. Whole rows go as f32 here: a served row must differ from the trainer's
by exactly the error the publisher still holds pending for it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consumers.replay import rebuild
from consumers.sync import SyncDaemon
from deltastream import DeltaPublisher, DeltaTracker, HashTable, TrackingMode, ensure_topic
from deltastream.publishing.budget import BudgetPolicy, BudgetPublisher
from deltastream.wire import decode
from tests.integration.test_publisher import read_all

MODEL = "res"
DIMS = {"user": 32, "user_bias": 1}


def _train(model, tracker, bp: BudgetPublisher, steps: range, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for step in steps:
        ids = torch.randint(0, 200, (40,), generator=g).unique()
        for t in model.values():
            with torch.no_grad():
                rows = t(ids)  # new ids are inserted by the lookup: rows from zeros
                t.insert(ids, rows + 0.1 * torch.randn(len(ids), t.embedding_dim,
                                                       generator=g))
        tracker.step()
        bp.tick(step)
    # a tick while the worker is behind leaves its rows in the tracker: one more tick once
    # it caught up hands the last of them over
    bp.drain(timeout=60)
    tracker.step()
    bp.tick(steps[-1] + 1)
    bp.drain(timeout=60)


def _errors(model, served) -> dict[str, float]:
    out = {}
    for name, t in model.items():
        ids = t.ids()
        want = t.lookup(ids).numpy().astype(np.float64)
        got = served[name].lookup(ids.numpy()).astype(np.float64)
        out[name] = float(np.sqrt(((want - got) ** 2).sum(1)).max())
    return out


def _catch_up(servers: str, topic: str, state) -> SyncDaemon:
    daemon = SyncDaemon(servers, topic, model=MODEL, state_dir=state, summary_interval=0)
    assert daemon.catch_up(timeout=60)
    return daemon


@pytest.mark.slow
@pytest.mark.parametrize(("worker", "version"), [("thread", 4), ("process", 5)])
def test_residuals_are_served_exactly_once_and_rebuilt_bit_identically(broker, topic_name,
                                                                        tmp_path, worker,
                                                                        version):
    """r1 (wire v4) from the worker thread, r1e (v5, bias rows as residuals too) from the
    worker process: the daemon and the replay tool hold the trainer's mirror, bit for bit."""
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    model = torch.nn.ModuleDict({n: HashTable(d, name=n, capacity=1024) for n, d in DIMS.items()})
    tracker = DeltaTracker(model, consumers=["p"], mode=TrackingMode.EMBEDDING)
    pub = DeltaPublisher(servers, topic_name, model=MODEL, shard=0, dtype="f32",
                         wire_version=version)
    policy = BudgetPolicy(bytes_per_step=1500, residuals=True, max_age=1000)
    bp = BudgetPublisher(tracker, pub, "p", policy, worker=worker)
    state = tmp_path / "state"
    try:
        _train(model, tracker, bp, range(1, 16), seed=0)
        daemon = _catch_up(servers, topic_name, state)
        assert _errors(model, daemon.tables()) == pytest.approx(bp.last.table_bounds,
                                                                rel=1e-6, abs=1e-7)
        daemon.stop()  # a restarted daemon resumes from its state: nothing applied twice
        _train(model, tracker, bp, range(17, 31), seed=1)
        daemon = _catch_up(servers, topic_name, state)
        try:
            served = daemon.tables()
            assert bp.stats()["pending"] > 0  # residuals left errors: this is no flush
            assert _errors(model, served) == pytest.approx(bp.last.table_bounds,
                                                           rel=1e-6, abs=1e-7)
            res = rebuild(servers, topic_name, model=MODEL)
            for name, table in served.items():
                ia, ra = table.items()
                ib, rb = res.tables[name].items()
                np.testing.assert_array_equal(ia, ib)
                assert np.array_equal(ra.view(np.uint8), rb.view(np.uint8)), name
            assert res.counters["quarantined"] == 0
            sent = {(decode(r.value).table, decode(r.value).dtype)
                    for r in read_all(servers, topic_name)}
            residual = "r1e" if version == 5 else "r1"
            assert ("user", residual) in sent
            # dim-1 rows: r1e (1.125 bytes) is cheaper than f32, r1 (3 bytes) too
            assert ("user_bias", residual) in sent
            bp.flush(32)  # whole rows: predictors exact
            assert daemon.catch_up(timeout=60)
            assert _errors(model, daemon.tables()) == {name: 0.0 for name in DIMS}
        finally:
            daemon.stop()
    finally:
        bp.close()
        pub.close()
