"""SyncOptions: the settings of a :class:`~consumers.sync.SyncDaemon`, checked once.

Every argument of ``SyncDaemon(...)`` lands here and is validated in
``SyncOptions.__post_init__``: a bad value raises ``ValueError``/``TypeError`` naming the
argument, the value and what was expected, before the daemon touches disk or network. The
checkpoint sizing (``checkpoint_max_segments``, ``checkpoint_segment_fraction``), the
quarantine size and the metrics port are checked by the objects that use them
(:class:`~consumers.storage.checkpoint.CheckpointStore`,
:class:`~consumers.quarantine.Quarantine`, :class:`~consumers.sync.metrics.MetricsServer`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from consumers.cpus import CpuSpec, check_cpus
from consumers.files import PathLike
from consumers.serving.dtypes import STORAGE_DTYPES
from consumers.serving.shm import shm_base
from consumers.sync.base import BaseArg, base_paths
from deltastream.kafka_config import check_bootstrap_servers

__all__ = ["SyncOptions", "check_positive"]

log = logging.getLogger(__name__)


def check_positive(name: str, value: Any, *, integer: bool = False) -> Any:
    """``value`` when it is a positive number (an int with ``integer``), else
    ``ValueError`` naming ``name``."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        what = "a positive int" if integer else "a positive number"
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return value


def _table_dims(tables: Optional[Mapping[str, int]]) -> Optional[dict[str, int]]:
    if tables is None:
        return None
    if not isinstance(tables, Mapping) or not tables:
        raise ValueError(f"tables: expected a non-empty mapping name -> dim, got {tables!r}")
    dims = {}
    for name, dim in tables.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tables: table names must be non-empty str, got {name!r}")
        check_positive(f"tables[{name!r}]", dim, integer=True)
        dims[name] = int(dim)
    return dims


def _shard_set(shards: Optional[Iterable[int]]) -> Optional[set[int]]:
    if shards is None:
        return None
    out = set()
    for s in shards:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"shards: expected non-negative ints, got {s!r}")
        out.add(s)
    if not out:
        raise ValueError("shards: expected at least one shard (None serves all)")
    return out


@dataclass(frozen=True)
class SyncOptions:
    """What a :class:`~consumers.sync.SyncDaemon` syncs and how (see its docstring for the
    meaning of each field). Built from the daemon's arguments and validated on creation;
    ``tables`` becomes a dict name -> dim, ``shards`` a set, numbers plain floats/ints."""

    bootstrap_servers: str
    topic: str
    model: str
    state_dir: Path
    tables: Optional[dict[str, int]] = None
    shards: Optional[set[int]] = None
    dtype: str = "f32"
    checkpoint_interval: float = 5.0
    checkpoint_messages: int = 1000
    checkpoint_max_segments: int = 128
    checkpoint_segment_fraction: float = 0.5
    base: Optional[BaseArg] = None  # a snapshot directory or a list (consumers.sync.base)
    base_any_topic: bool = False
    poll_timeout_ms: int = 200
    max_poll_records: int = 500
    quarantine_max_bytes: int = 64 << 20
    request_timeout: float = 5.0
    backoff_max: float = 5.0
    probe_interval: float = 1.0
    summary_interval: float = 30.0
    freshness_window: float = 60.0
    metrics_port: Optional[int] = None
    metrics_addr: str = "0.0.0.0"
    on_apply: Optional[Callable[..., None]] = None
    reset_state: bool = False
    group_id: Optional[str] = None
    share_tables: bool = False
    shm_dir: Optional[PathLike] = None
    cpus: Optional[CpuSpec] = None  # normalized to a frozenset of CPU numbers
    consumer_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_bootstrap_servers(self.bootstrap_servers)
        for name, v in (("topic", self.topic), ("model", self.model)):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name}: expected a non-empty str, got {v!r}")
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(STORAGE_DTYPES)}, got "
                             f"{self.dtype!r}")
        if self.base is not None:
            base_paths(self.base)  # a path or a non-empty list of paths
        self._set("tables", _table_dims(self.tables))
        self._set("shards", _shard_set(self.shards))
        check_positive("checkpoint_interval", self.checkpoint_interval)
        check_positive("checkpoint_messages", self.checkpoint_messages, integer=True)
        check_positive("poll_timeout_ms", self.poll_timeout_ms, integer=True)
        check_positive("max_poll_records", self.max_poll_records, integer=True)
        check_positive("request_timeout", self.request_timeout)
        check_positive("backoff_max", self.backoff_max)
        check_positive("probe_interval", self.probe_interval)
        check_positive("freshness_window", self.freshness_window)
        s = self.summary_interval
        if isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0:
            raise ValueError(f"summary_interval: expected seconds ≥ 0, got {s!r}")
        if not isinstance(self.share_tables, bool):
            raise TypeError(f"share_tables: expected a bool, got {self.share_tables!r}")
        if self.shm_dir is not None:
            shm_base(self.shm_dir)  # an existing directory
        if self.cpus is not None:
            self._set("cpus", check_cpus(self.cpus))
        if self.on_apply is not None and not callable(self.on_apply):
            raise TypeError(f"on_apply: expected a callable(outcome, partition, offset) or "
                            f"None, got {type(self.on_apply).__name__}")
        from kafka import KafkaConsumer  # imported when a daemon is built, not with the module

        unknown = set(self.consumer_config) - set(KafkaConsumer.DEFAULT_CONFIG)
        if unknown:
            raise TypeError(f"unknown SyncDaemon/KafkaConsumer settings: {sorted(unknown)}")
        if "group_id" in self.consumer_config:
            raise TypeError("group_id: pass it as SyncDaemon(group_id=...) (the daemon "
                            "commits offsets to it without joining), not as a consumer "
                            "setting")
        if not isinstance(self.reset_state, bool):
            raise TypeError(f"reset_state: expected a bool, got {self.reset_state!r}")
        if self.group_id is not None and not isinstance(self.group_id, str):
            raise TypeError(f"group_id: expected a str ('' disables committing offsets to "
                            f"a consumer group) or None (the default name), got "
                            f"{self.group_id!r}")
        self._set("state_dir", Path(self.state_dir))
        self._set("consumer_config", dict(self.consumer_config))
        for name in ("checkpoint_interval", "request_timeout", "backoff_max", "probe_interval",
                     "summary_interval", "freshness_window"):
            self._set(name, float(getattr(self, name)))
        for name in ("checkpoint_messages", "poll_timeout_ms", "max_poll_records"):
            self._set(name, int(getattr(self, name)))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalizing a frozen instance once, at birth
