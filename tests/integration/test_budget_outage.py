"""BudgetPublisher and RoundPublisher (threaded, the default, and with a worker process)
across a real broker outage: the training loop keeps its pace while the broker is down, the pending set stays bounded, a ``flush`` during
the outage raises and loses nothing, and once the broker is back every row's last value
reaches a predictor.

The embedded broker keeps data in memory, so what predictors read is collected per broker
lifetime (flushed and read before the stop, read again at the end) and replayed in order.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from deltastream import DeltaTracker, HashTable, TrackingMode, wire
from deltastream.errors import PublishError
from deltastream.publishing.budget import BudgetPolicy, BudgetPublisher
from deltastream.publishing.publisher import DeltaPublisher, ensure_topic
from deltastream.publishing.round_publisher import RoundPolicy, RoundPublisher
from deltastream.publishing.rounds import SelectionPolicy
from tests.integration.test_publisher import read_all

pytestmark = pytest.mark.integration

logging.getLogger("kafka").setLevel(logging.CRITICAL)

DIM, ROWS, SEND_TIMEOUT = 8, 3000, 1.5


def _served(lifetimes: list[list]) -> dict[int, np.ndarray]:
    """``{id: row}`` a predictor holds after applying every lifetime's records in order
    (each partition's offset order; one shard, one partition per table stream)."""
    out: dict[int, np.ndarray] = {}
    for records in lifetimes:
        for r in records:
            b = wire.decode(r.value)
            for i, row in zip(b.ids.tolist(), b.rows_f32(), strict=True):
                out[i] = row
    return out


def tracked_table(servers: str, topic: str
                  ) -> tuple[HashTable, DeltaTracker, DeltaPublisher]:
    """A one-partition ``topic``, a zeroed table ``emb`` of ``ROWS`` rows tracked in
    EMBEDDING mode for consumer ``"p"``, and an f32 publisher to ``topic``."""
    assert ensure_topic(servers, topic, 1) == 1
    table = HashTable(DIM, name="emb", capacity=2 * ROWS)
    table.insert(torch.arange(ROWS), torch.zeros(ROWS, DIM))
    tracker = DeltaTracker(torch.nn.ModuleDict({"emb": table}), consumers=["p"],
                           mode=TrackingMode.EMBEDDING)
    pub = DeltaPublisher(servers, topic, model="m", shard=0, send_timeout=SEND_TIMEOUT,
                         dtype="f32")
    return table, tracker, pub


def assert_every_row_served(lifetimes: list[list], table: HashTable) -> None:
    """Every row of ``table`` that changed (not zero) is served with its last value."""
    assert_rows_served(lifetimes, table.lookup(torch.arange(ROWS)).numpy())


def assert_rows_served(lifetimes: list[list], held: np.ndarray) -> None:
    """Every row of ``held`` (``[ids, dim]``, row i is id i) that is not zero is served
    with that value."""
    served = _served(lifetimes)
    changed = np.flatnonzero(np.abs(held).sum(axis=1) > 0)
    missing = [i for i in changed.tolist() if i not in served]
    assert not missing, f"{len(missing)} changed rows never reached a predictor"
    stale = [i for i in changed.tolist() if not np.array_equal(served[i], held[i])]
    assert not stale, f"{len(stale)} rows served with an old value, e.g. {stale[:5]}"


def _step(table: HashTable, g: torch.Generator) -> None:
    ids = torch.randint(0, ROWS, (300,), generator=g).unique()
    with torch.no_grad():
        rows = table(ids)  # a recorded lookup, then the "optimizer" writes the rows
        table.insert(ids, rows + torch.randn(len(ids), DIM, generator=g))


#: the publishers that run rounds off the training loop: a byte budget, publish_delta's
#: rounds (a count budget every 3 steps)
KINDS = {"budget": lambda *a, **kw: BudgetPublisher(*a, BudgetPolicy(bytes_per_step=4_000),
                                                    **kw),
         "rounds": lambda *a, **kw: RoundPublisher(*a, RoundPolicy(SelectionPolicy(k=150),
                                                                   every=3), **kw)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_broker_outage_never_stalls_the_loop_and_every_row_arrives(own_broker, topic_name,
                                                                     worker, kind):
    servers = own_broker.bootstrap_servers
    table, tracker, pub = tracked_table(servers, topic_name)
    bp = KINDS[kind](tracker, pub, "p", worker=worker)
    g = torch.Generator().manual_seed(0)
    errors: list[PublishError] = []

    def run(steps: range) -> list[float]:
        """Train and tick ``steps``; the training thread's seconds per tick."""
        took = []
        for step in steps:
            _step(table, g)
            tracker.step()
            t0 = time.perf_counter()
            try:
                bp.tick(step)
            except PublishError as e:  # a failed round: its rows are pending again
                assert "pending again" in "".join(e.__notes__), e.__notes__
                errors.append(e)
            took.append(time.perf_counter() - t0)
        return took

    try:
        run(range(1, 41))
        bp.flush(40)
        lifetimes = [read_all(servers, topic_name)]
        assert lifetimes[0], "nothing reached the broker before the outage"

        own_broker.stop()
        t_down = time.monotonic()
        outage = run(range(41, 81))
        while time.monotonic() - t_down < 3.0:  # down for several seconds, loop going on
            outage += run(range(81, 82))
        # the loop never waited for the broker: no tick took a send timeout
        assert max(outage) < SEND_TIMEOUT, max(outage)
        with pytest.raises(PublishError) as failed:  # a flush while down raises ...
            bp.flush(82, timeout=60)
        assert "pending again" in "".join(failed.value.__notes__)
        pending = bp.stats()["pending"]
        assert 0 < pending <= ROWS  # ... and keeps every row: bounded by the table

        own_broker.start()  # same port, empty: the operator re-creates the topic
        assert ensure_topic(servers, topic_name, 1) == 1
        run(range(83, 121))
        for _attempt in range(10):  # the first flush may still meet the old producer
            try:
                bp.flush(121, timeout=60)
                break
            except PublishError as e:
                errors.append(e)
                time.sleep(0.5)
        else:
            pytest.fail(f"flush kept failing after the broker came back: {errors[-1]}")
        assert bp.stats()["pending"] == 0
        lifetimes.append(read_all(servers, topic_name))
    finally:
        bp.close()
        pub.close(timeout=5)
    assert_every_row_served(lifetimes, table)
