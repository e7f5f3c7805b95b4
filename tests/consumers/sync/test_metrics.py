"""Pure metric logic of the sync daemon: quantiles, the freshness window, lag, exposition."""

from __future__ import annotations

import math
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from consumers.sync.metrics import (
    FRESHNESS_BUCKETS,
    METRICS,
    FreshnessHistogram,
    FreshnessWindow,
    MetricsServer,
    StatsCollector,
    partition_lag,
    quantiles,
    reached,
    summary_line,
    total_lag,
)


def test_quantiles_match_order_statistics():
    v = np.arange(101, dtype=float)  # 0..100
    assert quantiles(v, [0.5, 0.99, 0.0, 1.0]) == [50.0, 99.0, 0.0, 100.0]
    # linear interpolation between order statistics
    assert quantiles([1.0, 2.0], [0.5]) == [1.5]
    assert quantiles([3.0], [0.5, 0.99]) == [3.0, 3.0]
    rng = np.random.default_rng(0)
    x = rng.exponential(size=1000)
    assert quantiles(x, [0.99]) == pytest.approx([float(np.quantile(x, 0.99))])


def test_quantiles_of_nothing_are_none_and_bad_q_is_refused():
    assert quantiles([], [0.5, 0.99]) == [None, None]
    with pytest.raises(ValueError, match="quantile"):
        quantiles([1.0], [1.5])


def test_freshness_window_slides_with_time():
    w = FreshnessWindow(window_s=10.0, capacity=100)
    for i in range(10):
        w.add(float(i), now=100.0 + i)  # samples 0..9 at t = 100..109
    assert w.quantiles((0.5,), now=109.0) == [4.5]
    # at t = 115 only samples observed at t >= 105 (values 5..9) are in the window
    np.testing.assert_array_equal(np.sort(w.values(now=115.0)), [5, 6, 7, 8, 9])
    assert w.quantiles((0.5, 0.99), now=115.0) == [7.0, pytest.approx(8.96)]
    assert w.quantiles((0.5,), now=200.0) == [None]


def test_freshness_window_keeps_the_newest_when_full():
    w = FreshnessWindow(window_s=1e9, capacity=4)
    for i in range(10):
        w.add(float(i), now=float(i))
    np.testing.assert_array_equal(np.sort(w.values(now=10.0)), [6, 7, 8, 9])
    assert w.quantiles((1.0,), now=10.0) == [9.0]


def test_freshness_from_trainer_timestamps():
    w = FreshnessWindow(window_s=60.0)
    ts = 1_700_000_000 * 10**9
    assert w.add_ts(ts, wall_now=1_700_000_002.5, now=0.0) == pytest.approx(2.5)
    assert w.add_ts(ts + 500_000_000, wall_now=1_700_000_001.0, now=0.0) == pytest.approx(0.5)
    assert w.quantiles((0.5,), now=1.0) == [pytest.approx(1.5)]


def test_freshness_window_arguments():
    with pytest.raises(ValueError, match="window_s"):
        FreshnessWindow(window_s=0)
    with pytest.raises(ValueError, match="capacity"):
        FreshnessWindow(capacity=0)


def test_partition_lag_math():
    positions = {0: 10, 1: 50, 2: 7, 3: None}
    ends = {0: 15, 1: 50, 2: 3, 3: 9}
    lag = partition_lag(positions, ends)
    # behind by 5; at the end; past the end (the broker lost its log) counts 0; unknown
    assert lag == {0: 5, 1: 0, 2: 0, 3: None}
    assert partition_lag({4: 1}, {}) == {4: None}
    assert total_lag(lag.values()) == 5
    assert total_lag([None, None]) is None
    assert total_lag([]) is None


def test_reached_needs_every_position_at_its_target():
    assert reached({0: 5, 1: 3}, {0: 5, 1: 3})
    assert reached({0: 6}, {0: 5, 1: 9})  # only the assigned partitions count
    assert not reached({0: 4, 1: 3}, {0: 5, 1: 3})
    assert not reached({0: 5, 2: 0}, {0: 5})  # a position without a target: not measured
    assert not reached({}, {0: 0})


def test_freshness_histogram_buckets_are_cumulative_from_1ms_to_10min():
    assert FRESHNESS_BUCKETS[0] == 0.001 and FRESHNESS_BUCKETS[-1] == 600.0
    h = FreshnessHistogram()
    for v in (0.0005, 0.001, 0.003, 0.2, 7.0, 900.0, -2.0):
        h.observe(v)
    snap = h.snapshot()
    cum = dict((le, c) for le, c in snap["buckets"])
    assert cum[0.001] == 3  # 0.0005, 0.001 (le is inclusive) and -2 counted as 0
    assert cum[0.005] == 4 and cum[0.25] == 5 and cum[10.0] == 6 and cum[600.0] == 6
    assert cum["+Inf"] == snap["count"] == 7
    assert snap["sum"] == pytest.approx(0.0005 + 0.001 + 0.003 + 0.2 + 7.0 + 900.0)
    with pytest.raises(ValueError, match="buckets"):
        FreshnessHistogram([1.0, 0.5])


def _stats(**over):
    s = {"broker": "connected", "messages": 12, "applied": 10, "rows": 640, "deleted": 3,
         "bytes": 9000, "duplicates": 1, "gaps": 1, "gap_messages": 2, "new_epochs": 0,
         "stale": 0, "skipped": 1, "quarantined": 0, "offsets_lost": 0, "checkpoints": 2,
         "disconnects": 0, "lag": {0: 4, 1: 0}, "lag_total": 4, "freshness_p50_s": 0.25,
         "freshness_p99_s": 1.5, "checkpoint_age_s": 3.0, "checkpoint_pending": 5,
         "uptime_s": 60.0, "tables": {"user": 100, "item": 7},
         "write_errors": {"quarantine": 2, "checkpoint": 0},
         "foreign_models": {"other": 5}, "quarantine_backlog": 1, "group_commits": 3,
         "group_commit_errors": 0, "dense_versions": 4, "dense_incomplete": 1,
         "dense_missing_chunks": 2, "dense_age_s": 7.5, "dense_age_steps": 12,
         "dense_sparse_steps": 9}
    h = FreshnessHistogram()
    for v in (0.004, 0.3, 1.2):
        h.observe(v)
    s["freshness_histogram"] = h.snapshot()
    s.update(over)
    return s


def _samples(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_collector_exposes_counters_gauges_and_labels():
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(lambda: _stats()))
    text = generate_latest(reg).decode()
    s = _samples(text)
    assert s["deltastream_sync_messages_applied_total"] == 10
    assert s["deltastream_sync_rows_applied_total"] == 640
    assert s["deltastream_sync_gap_messages_total"] == 2
    assert s["deltastream_sync_applied_bytes_total"] == 9000
    assert s['deltastream_sync_partition_lag_messages{partition="0"}'] == 4
    assert s['deltastream_sync_partition_lag_messages{partition="1"}'] == 0
    assert s["deltastream_sync_lag_messages"] == 4  # a gauge: no _total suffix
    assert "deltastream_sync_lag_messages_total" not in s
    assert s['deltastream_sync_write_errors_total{what="quarantine"}'] == 2
    assert s['deltastream_sync_write_errors_total{what="checkpoint"}'] == 0
    assert s['deltastream_sync_foreign_messages_total{model="other"}'] == 5
    assert s["deltastream_sync_quarantine_backlog_records"] == 1
    assert s["deltastream_sync_group_commits_total"] == 3
    # freshness is a histogram (aggregatable across predictors), not quantile gauges
    assert "# TYPE deltastream_sync_freshness_seconds histogram" in text
    assert s['deltastream_sync_freshness_seconds_bucket{le="0.001"}'] == 0
    assert s['deltastream_sync_freshness_seconds_bucket{le="0.005"}'] == 1
    assert s['deltastream_sync_freshness_seconds_bucket{le="0.5"}'] == 2
    assert s['deltastream_sync_freshness_seconds_bucket{le="600.0"}'] == 3
    assert s['deltastream_sync_freshness_seconds_bucket{le="+Inf"}'] == 3
    assert s["deltastream_sync_freshness_seconds_count"] == 3
    assert s["deltastream_sync_freshness_seconds_sum"] == pytest.approx(1.504)
    assert not any("quantile" in k for k in s)
    assert s['deltastream_sync_table_rows{table="item"}'] == 7
    assert s["deltastream_sync_broker_connected"] == 1
    assert "# TYPE deltastream_sync_duplicates_total counter" in text
    assert "# TYPE deltastream_sync_checkpoint_age_seconds gauge" in text
    assert s["deltastream_sync_dense_age_seconds"] == 7.5
    assert s["deltastream_sync_dense_age_steps"] == 12
    assert s["deltastream_sync_dense_sparse_step_distance"] == 9
    assert s["deltastream_sync_dense_versions_incomplete_total"] == 1


def test_exposed_names_follow_prometheus_conventions():
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(lambda: _stats()))
    text = generate_latest(reg).decode()
    types = dict(line.split()[2:4] for line in text.splitlines()
                 if line.startswith("# TYPE"))
    assert types and types == {n: t for n, t, _ in METRICS}  # METRICS is the full table
    for name, kind in types.items():
        assert name.startswith("deltastream_sync_")
        if kind == "gauge":
            assert not name.endswith("_total"), name
    counters = [n for n, t, _ in METRICS if t == "counter"]
    assert counters and all(n.endswith("_total") for n in counters)
    assert not any("bytes_applied" in n for n, _, _ in METRICS)  # unit last: applied_bytes


def test_collector_unknown_values_are_nan_and_state_is_reported():
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(lambda: _stats(broker="disconnected", lag_total=None,
                                               checkpoint_age_s=None)))
    s = _samples(generate_latest(reg).decode())
    assert s["deltastream_sync_broker_connected"] == 0
    assert math.isnan(s["deltastream_sync_lag_messages"])
    assert math.isnan(s["deltastream_sync_checkpoint_age_seconds"])


def test_collector_survives_a_failing_stats_function():
    def broken():
        raise RuntimeError("boom")

    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(broken))
    assert "deltastream_sync" not in generate_latest(reg).decode()


def test_metrics_server_serves_over_http():
    srv = MetricsServer(lambda: _stats(applied=42), port=0, addr="127.0.0.1")
    try:
        assert srv.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert _samples(body)["deltastream_sync_messages_applied_total"] == 42
        assert _samples(srv.text())["deltastream_sync_messages_applied_total"] == 42
    finally:
        srv.close()
    srv.close()  # idempotent
    with pytest.raises(ValueError, match="port"):
        MetricsServer(lambda: {}, port=70000)


def test_summary_line():
    prev = _stats(rows=140)
    line = summary_line(_stats(), prev, 10.0)
    assert "broker=connected" in line and "applied=10" in line and "rows=640" in line
    assert "rows/s=50" in line and "lag=4" in line
    assert "p50=0.25s" in line and "p99=1.5s" in line
    assert "duplicates=1" in line and "gaps=1" in line
    assert "quarantined" not in line  # zero counters are left out
    assert "write_errors=quarantine:2" in line and "checkpoint:" not in line
    assert "p50=-" in summary_line(_stats(freshness_p50_s=None))
