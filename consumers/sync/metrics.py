"""Metrics of the sync daemon: freshness quantiles, lag math, a Prometheus endpoint, a log line.

Torch-free and free of Kafka: everything here is pure bookkeeping over numbers the
daemon hands in, so it is unit-tested on its own.

- :class:`FreshnessWindow` keeps ``now - ts`` of recently applied messages in a bounded
  ring buffer and answers quantiles (p50, p99) over a sliding time window (``stats()``);
  :class:`FreshnessHistogram` counts the same samples in fixed buckets from 1 ms to 10 min
  for Prometheus (a Histogram aggregates across predictors; quantile gauges do not).
- :func:`partition_lag` turns positions and end offsets into per-partition lag.
- :class:`MetricsServer` serves a ``stats()`` dict in the Prometheus text format
  (``prometheus_client``), read fresh on every scrape from a private registry so several
  daemons in one process never collide. Names follow Prometheus conventions: counters end
  in ``_total``, gauges never do, units are in the name (``_seconds``, ``_bytes``); the
  full table is :data:`METRICS`.
- :func:`summary_line` is the periodic one-line log summary.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional

import numpy as np

__all__ = [
    "quantiles",
    "FreshnessWindow",
    "FreshnessHistogram",
    "FRESHNESS_BUCKETS",
    "METRICS",
    "partition_lag",
    "reached",
    "total_lag",
    "MetricsServer",
    "StatsCollector",
    "summary_line",
]

log = logging.getLogger(__name__)


def quantiles(values: Sequence[float] | np.ndarray, qs: Sequence[float]) -> list[Optional[float]]:
    """Quantiles of ``values`` (linear interpolation between order statistics).

    Args:
        values: 1-D numbers. qs: quantiles in [0, 1].
    Returns:
        one float per ``q``; ``None`` for each when ``values`` is empty.
    """
    qs = list(qs)
    for q in qs:
        if not 0.0 <= float(q) <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q!r}")
    arr = np.asarray(values, dtype=np.float64).ravel()
    if arr.size == 0:
        return [None] * len(qs)
    return [float(v) for v in np.quantile(arr, qs)]


class FreshnessWindow:
    """Freshness samples (seconds from trainer read to apply) over a sliding time window.

    A ring buffer of ``capacity`` (arrival time, freshness) pairs: adding is O(1) per call,
    a quantile query is O(capacity) vectorized. When more than ``capacity`` samples arrive
    within ``window_s`` the oldest are dropped first, so quantiles then cover the most
    recent ``capacity`` samples. Thread-safe.

    Args:
        window_s: seconds of history a quantile covers (> 0).
        capacity: most samples kept (≥ 1).
    """

    def __init__(self, window_s: float = 60.0, capacity: int = 65536) -> None:
        if not isinstance(window_s, (int, float)) or not window_s > 0:
            raise ValueError(f"window_s must be positive seconds, got {window_s!r}")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int ≥ 1, got {capacity!r}")
        self.window_s = float(window_s)
        self.capacity = capacity
        self._at = np.full(capacity, -np.inf)
        self._value = np.zeros(capacity)
        self._next = 0
        self._lock = threading.Lock()

    def add(self, freshness_s: float, now: Optional[float] = None) -> None:
        """Record one sample: ``freshness_s`` seconds, observed at ``now`` (monotonic s)."""
        at = time.monotonic() if now is None else float(now)
        with self._lock:
            i = self._next % self.capacity
            self._at[i] = at
            self._value[i] = float(freshness_s)
            self._next += 1

    def add_ts(self, ts_ns: int, *, wall_now: Optional[float] = None,
               now: Optional[float] = None) -> float:
        """Record a message whose trainer timestamp is ``ts_ns`` (ns since the epoch).

        Freshness is ``wall_now - ts`` in seconds (``wall_now`` defaults to ``time.time()``);
        a clock skew that makes it negative is kept as is (it shows up in p50). Returns it.
        """
        wall = time.time() if wall_now is None else float(wall_now)
        fresh = wall - ts_ns / 1e9
        self.add(fresh, now)
        return fresh

    def values(self, now: Optional[float] = None) -> np.ndarray:
        """Samples (seconds) observed within the window ending at ``now`` (monotonic s)."""
        t = time.monotonic() if now is None else float(now)
        with self._lock:
            keep = self._at >= t - self.window_s
            return self._value[keep].copy()

    def quantiles(self, qs: Sequence[float] = (0.5, 0.99),
                  now: Optional[float] = None) -> list[Optional[float]]:
        """Quantiles of the samples in the window; ``None`` each when there are none."""
        return quantiles(self.values(now), qs)

    def __len__(self) -> int:
        return int(self.values().size)


#: upper bounds (seconds) of the freshness histogram's buckets: 1 ms .. 10 min
FRESHNESS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class FreshnessHistogram:
    """Cumulative counts of freshness samples (seconds) in :data:`FRESHNESS_BUCKETS`, with
    their count and sum, since start (a Prometheus Histogram). Thread-safe.

    A negative sample (trainer clock ahead) counts as 0 s, so the sum never decreases."""

    def __init__(self, buckets: Sequence[float] = FRESHNESS_BUCKETS) -> None:
        bounds = [float(b) for b in buckets]
        if not bounds or bounds != sorted(set(bounds)) or bounds[0] <= 0:
            raise ValueError(f"buckets: expected ascending positive bounds, got {buckets!r}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket (not cumulative); last = +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        """Count one sample."""
        v = max(0.0, float(seconds))
        i = bisect.bisect_left(self.bounds, v)  # first bound >= v ("le" semantics)
        with self._lock:
            self._counts[i] += 1
            self._sum += v

    def snapshot(self) -> dict:
        """``{"buckets": [[le, cumulative count], ..., ["+Inf", count]], "count", "sum"}``."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cum, out = 0, []
        for le, c in zip([*self.bounds, "+Inf"], counts, strict=True):
            cum += c
            out.append([le, cum])
        return {"buckets": out, "count": cum, "sum": total}


def reached(positions: Mapping[int, int], target: Mapping[int, int]) -> bool:
    """True when every partition of ``positions`` (partition -> next offset) is in
    ``target`` and at or past its offset there; False for no positions."""
    if not positions:
        return False
    return all(p in target and pos >= target[p] for p, pos in positions.items())


def partition_lag(positions: Mapping[int, Optional[int]],
                  ends: Mapping[int, Optional[int]]) -> dict[int, Optional[int]]:
    """Messages behind per partition: ``max(0, end - position)``.

    Args:
        positions: partition -> next offset the consumer will read (None: unknown).
        ends: partition -> end offset (offset of the next message to be written).
    Returns:
        partition -> lag for every partition of ``positions``; ``None`` where either side is
        unknown. A position past the end (the broker lost its log) counts as 0 behind.
    """
    out: dict[int, Optional[int]] = {}
    for p, pos in positions.items():
        end = ends.get(p)
        out[p] = None if pos is None or end is None else max(0, int(end) - int(pos))
    return out


# ----------------------------------------------------------------------------- Prometheus

#: stats key -> (metric name, help) for monotonically growing counts (exposed with the
#: ``_total`` suffix)
_COUNTERS = {
    "messages": ("messages", "Kafka records read (applied or not)"),
    "applied": ("messages_applied", "messages applied to serving tables"),
    "rows": ("rows_applied", "rows upserted into serving tables"),
    "deleted": ("rows_deleted", "tombstone ids applied"),
    "bytes": ("applied_bytes", "bytes of applied messages"),
    "duplicates": ("duplicates", "messages skipped because their seq was already applied"),
    "gaps": ("gaps", "seq gaps seen (messages missing before an applied one)"),
    "gap_messages": ("gap_messages", "seq numbers missing in the gaps seen"),
    "new_epochs": ("new_epochs", "trainer epochs accepted after the first"),
    "stale": ("stale", "messages of an older trainer epoch, skipped"),
    "skipped": ("skipped", "messages of other shards or models, skipped"),
    "quarantined": ("quarantined", "bad messages counted and quarantined"),
    "offsets_lost": ("offsets_lost", "offset ranges that were no longer on the broker"),
    "checkpoints": ("checkpoints", "checkpoints written"),
    "disconnects": ("disconnects", "times the broker became unreachable"),
    "group_commits": ("group_commits", "next offsets committed to the consumer group"),
    "group_commit_errors": ("group_commit_errors",
                            "failed commits of next offsets to the consumer group"),
    "dense_versions": ("dense_versions", "complete dense versions served"),
    "dense_incomplete": ("dense_versions_incomplete",
                         "dense versions never served because chunks were missing"),
    "dense_missing_chunks": ("dense_missing_chunks", "dense chunks missing in seq gaps"),
}
#: stats key -> (metric name, help) for values that go up and down
_GAUGES = {
    "lag_total": ("lag_messages", "messages behind the end offsets, all partitions"),
    "checkpoint_age_s": ("checkpoint_age_seconds", "seconds since the last checkpoint"),
    "checkpoint_pending": ("checkpoint_pending_messages",
                           "messages read since the last checkpoint"),
    "uptime_s": ("uptime_seconds", "seconds since the daemon started"),
    "quarantine_backlog": ("quarantine_backlog_records",
                           "quarantine lines kept in memory because writing them failed"),
    "dense_age_s": ("dense_age_seconds", "now minus the trainer timestamp of the served "
                    "dense version"),
    "dense_age_steps": ("dense_age_steps", "newest trainer step applied minus the served "
                        "dense version's step"),
    "dense_sparse_steps": ("dense_sparse_step_distance", "newest sparse (row) step applied "
                           "minus the served dense version's step"),
}
_PREFIX = "deltastream_sync_"
#: stats key -> (metric name, help, label) for counters by label
_LABELED_COUNTERS = {
    "write_errors": ("write_errors", "failed writes, by what (quarantine, checkpoint: the "
                     "state directory; apply: no memory for a record, e.g. a full shm "
                     "tmpfs); never fatal, retried", "what"),
    "foreign_models": ("foreign_messages", "messages of other models, skipped, by model",
                       "model"),
}

#: every exposed metric: (name, type, help) — the table in the README
METRICS = sorted(
    [(_PREFIX + n + "_total", "counter", d) for n, d in _COUNTERS.values()]
    + [(_PREFIX + n + "_total", "counter", d) for n, d, _ in _LABELED_COUNTERS.values()]
    + [(_PREFIX + n, "gauge", d) for n, d in _GAUGES.values()]
    + [(_PREFIX + "broker_connected", "gauge", "1 while the broker answers, else 0"),
       (_PREFIX + "partition_lag_messages", "gauge", "messages behind the end offset, by "
        "partition"),
       (_PREFIX + "table_rows", "gauge", "rows resident in a serving table, by table"),
       (_PREFIX + "freshness_seconds", "histogram", "now minus the trainer timestamp of "
        "applied messages")])


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)


class StatsCollector:
    """A ``prometheus_client`` collector that reads ``stats_fn()`` on every scrape."""

    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]]) -> None:
        self._stats_fn = stats_fn

    def describe(self) -> list:
        # Returning nothing keeps the registry from calling collect() at registration.
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        try:
            s = self._stats_fn()
        except Exception:  # a scrape must never take the daemon down
            log.exception("stats() failed during a metrics scrape")
            return
        for key, (name, doc) in _COUNTERS.items():
            if key in s:
                yield CounterMetricFamily(_PREFIX + name, doc, value=_num(s[key]))
        for key, (name, doc, label) in _LABELED_COUNTERS.items():
            if key in s:
                fam = CounterMetricFamily(_PREFIX + name, doc, labels=[label])
                for k, v in sorted((s.get(key) or {}).items()):
                    fam.add_metric([str(k)], _num(v))
                yield fam
        for key, (name, doc) in _GAUGES.items():
            if key in s:
                yield GaugeMetricFamily(_PREFIX + name, doc, value=_num(s[key]))
        up = GaugeMetricFamily(_PREFIX + "broker_connected",
                               "1 while the broker answers, else 0")
        up.add_metric([], 1.0 if s.get("broker") == "connected" else 0.0)
        yield up
        lag = GaugeMetricFamily(_PREFIX + "partition_lag_messages",
                                "messages behind the end offset, by partition",
                                labels=["partition"])
        for p, v in sorted((s.get("lag") or {}).items()):
            lag.add_metric([str(p)], _num(v))
        yield lag
        hist = s.get("freshness_histogram")
        if hist is not None:
            yield HistogramMetricFamily(
                _PREFIX + "freshness_seconds",
                "now minus the trainer timestamp of applied messages",
                buckets=[(le if isinstance(le, str) else repr(float(le)), c)
                         for le, c in hist["buckets"]],
                sum_value=hist["sum"])
        rows = GaugeMetricFamily(_PREFIX + "table_rows", "rows resident in a serving table",
                                 labels=["table"])
        for t, v in sorted((s.get("tables") or {}).items()):
            rows.add_metric([t], _num(v))
        yield rows


class MetricsServer:
    """An HTTP endpoint serving ``stats_fn()`` as Prometheus text on ``/metrics``.

    Args:
        stats_fn: returns the daemon's stats dict (called from the server thread).
        port: TCP port (0 picks a free one; see :attr:`port`).
        addr: address to bind.
    """

    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]], port: int,
                 addr: str = "0.0.0.0") -> None:
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"metrics port must be an int in 0..65535, got {port!r}")
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatsCollector(stats_fn))
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = int(self._server.server_address[1])
        self.addr = addr
        log.info("metrics on http://%s:%d/metrics", addr, self.port)

    def text(self) -> str:
        """The exposition text a scrape would get now."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None


# ----------------------------------------------------------------------------- log line


def _fmt(v: Optional[float], unit: str = "s") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3g}{unit}"


def summary_line(s: Mapping[str, Any], previous: Optional[Mapping[str, Any]] = None,
                 elapsed_s: Optional[float] = None) -> str:
    """One log line summarising a stats dict; rates when ``previous`` and ``elapsed_s`` given."""
    parts = [f"broker={s.get('broker', '?')}",
             f"applied={s.get('applied', 0)}", f"rows={s.get('rows', 0)}"]
    if previous is not None and elapsed_s and elapsed_s > 0:
        rate = (s.get("rows", 0) - previous.get("rows", 0)) / elapsed_s
        parts.append(f"rows/s={rate:.0f}")
    parts.append(f"lag={s.get('lag_total', '-')}")
    parts.append(f"fresh p50={_fmt(s.get('freshness_p50_s'))} p99={_fmt(s.get('freshness_p99_s'))}")
    for key in ("duplicates", "gaps", "stale", "quarantined", "foreign_model",
                "offsets_lost"):
        if s.get(key):
            parts.append(f"{key}={s[key]}")
    errors = {k: v for k, v in (s.get("write_errors") or {}).items() if v}
    if errors:
        parts.append("write_errors=" + ",".join(f"{k}:{v}" for k, v in sorted(errors.items())))
    parts.append(f"checkpoint_age={_fmt(s.get('checkpoint_age_s'))}")
    return " ".join(parts)


def total_lag(lags: Iterable[Optional[int]]) -> Optional[int]:
    """Sum of the known lags; ``None`` when none is known."""
    known = [v for v in lags if v is not None]
    return sum(known) if known else None

