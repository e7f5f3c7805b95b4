"""``publish_delta`` across a real broker outage: messages handed to the publisher that fail
afterwards (the broker died before acknowledging them) are handed back to the tracker, so
every changed row's last value reaches a predictor once the broker is back, without the
trainer resending anything: it only catches ``PublishError`` and repeats the final round
until it returns.

Rows changed during the outage are never touched again after it, so only the hand-back can
bring them to the predictor. The embedded broker keeps data in memory: what predictors read
is collected per broker lifetime and replayed in order (as in test_budget_outage.py).
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from deltastream import HashTable
from deltastream.errors import PublishError
from deltastream.publishing.publisher import ensure_topic
from deltastream.publishing.rounds import SelectionPolicy, publish_delta
from tests.integration.test_budget_outage import (
    DIM,
    ROWS,
    SEND_TIMEOUT,
    assert_every_row_served,
    tracked_table,
)
from tests.integration.test_publisher import read_all

pytestmark = pytest.mark.integration

logging.getLogger("kafka").setLevel(logging.CRITICAL)


def _step(table: HashTable, g: torch.Generator, lo: int, hi: int) -> None:
    """Change ~200 rows with ids in ``[lo, hi)`` (a lookup, then an optimizer-like write)."""
    ids = torch.randint(lo, hi, (200,), generator=g).unique()
    with torch.no_grad():
        rows = table(ids)
        table.insert(ids, rows + torch.randn(len(ids), DIM, generator=g))


def test_rows_of_messages_failing_after_the_round_still_reach_a_predictor(own_broker,
                                                                          topic_name):
    servers = own_broker.bootstrap_servers
    table, tracker, pub = tracked_table(servers, topic_name)
    policy = SelectionPolicy(k=150)
    g = torch.Generator().manual_seed(0)
    errors: list[PublishError] = []

    def run(steps: range, lo: int, hi: int) -> None:
        for step in steps:
            _step(table, g, lo, hi)
            tracker.step()
            try:
                publish_delta(tracker, pub, "p", policy, step=step)
            except PublishError as e:
                errors.append(e)

    def final(step: int) -> None:
        for _attempt in range(20):  # the first ones may still meet the old producer
            try:
                publish_delta(tracker, pub, "p", policy, step=step, final=True)
                return
            except PublishError as e:
                errors.append(e)
                time.sleep(0.5)
        pytest.fail(f"the final round kept failing after the broker came back: {errors[-1]}")

    try:
        run(range(1, 11), 0, ROWS)
        final(11)
        lifetimes = [read_all(servers, topic_name)]
        assert lifetimes[0], "nothing reached the broker before the outage"

        own_broker.stop()
        t_down = time.monotonic()
        step = 12
        while time.monotonic() - t_down < 3 * SEND_TIMEOUT:  # rows [0, ROWS/2) change
            run(range(step, step + 1), 0, ROWS // 2)
            step += 1
        handed = [u for e in errors for u in e.undelivered if u.rows]
        assert handed, "no message failed during the outage"
        assert all(u.table == "emb" and u.shard == 0 and len(u.ids) == u.rows
                   for u in handed), handed[:3]

        own_broker.start()  # same port, empty: the operator re-creates the topic
        assert ensure_topic(servers, topic_name, 1) == 1
        run(range(step, step + 10), ROWS // 2, ROWS)  # never the outage's rows again
        final(step + 10)
        lifetimes.append(read_all(servers, topic_name))
    finally:
        pub.close(timeout=5)
    assert_every_row_served(lifetimes, table)
