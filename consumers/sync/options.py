"""SyncOptions: the settings of a :class:`~consumers.sync.SyncDaemon`, spelled and checked once.

Each setting is one field: its default, its help text and its command-line flag
(:func:`deltastream.cliargs.option`); ``SyncDaemon(...)`` keywords and ``deltastream-sync``
flags are both made from these fields. Values are validated in
``SyncOptions.__post_init__``: a bad value raises ``ValueError``/``TypeError`` naming the
argument, the value and what was expected, before the daemon touches disk or network. The
checkpoint sizing (``checkpoint_max_segments``, ``checkpoint_segment_fraction``), the
quarantine size and the metrics port are checked by the objects that use them
(:class:`~consumers.storage.checkpoint.CheckpointStore`,
:class:`~consumers.quarantine.Quarantine`, :class:`~consumers.sync.metrics.MetricsServer`).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from consumers.cpus import CpuSpec, check_cpus, cpu_list_arg
from consumers.files import PathLike
from consumers.serving.dtypes import STORAGE_DTYPES
from consumers.serving.shm import shm_base
from consumers.sync.base_snapshot import BaseArg, base_paths
from deltastream.cliargs import (
    ListAction,
    comma_list,
    existing_dir,
    fields_doc,
    non_negative_float,
    option,
    port,
    positive_float,
    positive_int,
)
from deltastream.kafka_config import check_bootstrap_servers

__all__ = ["SyncOptions", "OPTION_NAMES", "OptionAttributes", "check_positive", "parse_shards", "parse_tables"]

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


def parse_shards(text: str) -> list[int]:
    """``"0,2,5"`` -> ``[0, 2, 5]`` (non-negative ints, no repeats)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of shard numbers ≥ 0 like '0,2,5', got "
                f"{text!r}")
        if int(part) in out:
            raise argparse.ArgumentTypeError(f"shard {part} listed twice in {text!r}")
        out.append(int(part))
    return out


def parse_tables(text: str) -> dict[str, int]:
    """``"user:64,item:32"`` -> ``{"user": 64, "item": 32}``."""
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, dim = part.strip().rpartition(":")
        if not sep or not name or not dim.strip().isdigit() or int(dim) < 1:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated name:dim pairs like 'user:64,item:32', got "
                f"{text!r}")
        if name in out:
            raise argparse.ArgumentTypeError(f"table {name!r} listed twice in {text!r}")
        out[name] = int(dim)
    return out


def _quarantine_bytes(text: str) -> int:
    """A quarantine bound from the command line: an int ≥ 1, raised to the 1 KiB floor."""
    return max(1024, positive_int(text))


@dataclass(frozen=True)
class SyncOptions:
    """What a :class:`~consumers.sync.SyncDaemon` syncs and how. Validated on creation;
    ``tables`` becomes a dict name -> dim, ``shards`` a set, numbers plain floats/ints.

    Each field is spelled once, here: its default, its help (this docstring's list below
    and ``deltastream-sync --help`` are built from it) and its command-line flag (``flag``
    metadata: argparse keywords; fields without one are not flags).
    """

    bootstrap_servers: str = option(
        help="``host:port[,host:port]`` of the Kafka cluster (the shared "
             "``--bootstrap-servers`` flag).")
    topic: str = option(help="Topic to read (``deltas.<model>`` by convention; the command "
                             "line defaults to that).", flag={"default": None})
    model: str = option(help="Model name; messages of other models are skipped and counted "
                             "(``foreign_models``), logged once per model.",
                        flag={"required": True})
    state_dir: Path = option(
        help="Directory for the checkpoint (tables + offsets + seq state) and the "
             "quarantine file; created if missing. Restarts resume from it.",
        flag={"required": True, "metavar": "DIR"})
    tables: Optional[dict[str, int]] = option(
        None, "Serve only these tables with these row widths (``{name: dim}``); messages of "
              "other tables or dims are quarantined (default: every table of the model, "
              "created on its first message).",
        flag={"type": parse_tables, "metavar": "NAME:DIM[,...]"})
    shards: Optional[set[int]] = option(
        None, "Trainer shards to serve; only their partitions (shard mod partitions) are read "
              "and other shards' messages in them are skipped (default: all shards).",
        flag={"type": parse_shards, "metavar": "N[,N...]"})
    dtype: str = option("f32", "Storage dtype of the serving tables.",
                        flag={"choices": tuple(STORAGE_DTYPES)})
    checkpoint_interval: float = option(
        5.0, "Seconds between checkpoints while new records arrive.",
        flag={"type": positive_float, "metavar": "S"})
    checkpoint_messages: int = option(
        1000, "Also checkpoint after this many records.",
        flag={"type": positive_int, "metavar": "N"})
    checkpoint_max_segments: int = option(
        128, "A checkpoint writes only the rows changed since the previous one (a segment); "
             "after this many segments the full tables are rewritten.",
        flag={"type": positive_int, "metavar": "N"})
    checkpoint_segment_fraction: float = option(
        0.5, "Also rewrite the full tables when the segments add up to this fraction of the "
             "full tables' size.", flag={"type": positive_float, "metavar": "X"})
    base: Optional[BaseArg] = option(
        None, "Snapshot to start from when the state dir holds no checkpoint (a checkpoint, "
              "a ``deltastream-replay rebuild`` output, a trainer's snapshot or a "
              "``ServingTable.save`` directory): its tables, offsets and seq state. Several "
              "(a list; on the command line repeat the flag or separate with commas, e.g. "
              "one per trainer shard) are merged; they must not overlap. A snapshot of "
              "another topic is refused.",
        flag={"action": ListAction, "type": comma_list, "metavar": "DIR[,DIR...]"})
    base_any_topic: bool = option(
        False, "Start from a base snapshot that records another topic anyway.",
        flag={"action": "store_true"})
    poll_timeout_ms: int = option(200, "Longest wait of one poll for new records (ms).")
    max_poll_records: int = option(500, "Most records handed over per poll.")
    quarantine_max_bytes: int = option(
        64 << 20, "Size at which quarantine.jsonl is rotated to quarantine.jsonl.1 (≥ 1024; "
                  "the command line raises smaller values to that).",
        flag={"type": _quarantine_bytes, "metavar": "BYTES"})
    request_timeout: float = option(
        5.0, "Seconds one broker request may take before the broker counts as down (then "
             "retried, forever: see --startup-timeout; the one-shot tools' --timeout is "
             "their whole wait).",
        flag={"type": positive_float, "metavar": "S"})
    startup_timeout: float = option(
        0.0, "Seconds to start syncing (for scripts): past them, while no broker answers, the "
             "topic is missing or it holds only other models' messages, stop with exit code "
             "3 (2 for other models); 0 = keep retrying (the reason is logged at WARNING "
             "every minute).", flag={"type": non_negative_float, "metavar": "S"})
    backoff_max: float = option(5.0, "Cap of the exponential reconnect backoff, seconds.",
                                flag={"type": positive_float, "metavar": "S"})
    probe_interval: float = option(1.0, "Seconds between end-offset refreshes (lag, liveness).")
    summary_interval: float = option(
        30.0, "Seconds between one-line INFO summaries (0 = none).",
        flag={"type": non_negative_float, "metavar": "S"})
    freshness_window: float = option(60.0, "Seconds of history of the freshness p50/p99.")
    metrics_port: Optional[int] = option(
        None, "Serve Prometheus metrics on http://ADDR:PORT/metrics (0 = a free port, logged "
              "and in ``SyncDaemon.metrics_port``; default: no endpoint).",
        flag={"type": port, "metavar": "PORT"})
    metrics_addr: str = option("0.0.0.0", "Address the metrics endpoint binds.",
                               flag={"metavar": "ADDR"})
    on_apply: Optional[Callable[..., None]] = option(
        None, "Called as ``on_apply(outcome, partition, offset)`` in the loop thread after "
              "every record (any ``outcome.kind``; ``outcome.ts`` is the trainer's ns "
              "timestamp), e.g. to record freshness over a whole run. Keep it quick: it "
              "delays applying. An exception from it is logged (once per kind) and ignored.")
    reset_state: bool = option(
        False, "Remove the checkpoint in the state dir (e.g. a damaged one, which otherwise "
               "stops the daemon from starting) and start over from the base or empty. "
               "Removes only what deltastream wrote. Use once, not in a unit file: every "
               "start with it re-reads the topic.", flag={"action": "store_true"})
    group_id: Optional[str] = option(
        None, "Consumer group the next offsets are committed to after each checkpoint, "
              "without joining it, so Kafka lag tools see this predictor (default: "
              "deltastream-sync.<model>; '' disables). Give replicas that serve the same "
              "shards distinct groups.", flag={"metavar": "GROUP"})
    state_dir_any_owner: bool = option(
        False, "Use a state dir that another user owns. Without it such a state dir is "
               "refused: its owner could plant links or files there that the daemon would "
               "write through or serve.", flag={"action": "store_true"})
    share_tables: bool = option(
        False, "Share the tables with model-server processes of this host: they read them "
               "from shared memory (/dev/shm) with "
               "``consumers.serving.TableReader.open(STATE_DIR, TABLE)``; tables created "
               "later are shared within one poll round; ``stop()`` unshares them. Tables a killed "
               "daemon left shared stay until this one has caught up with the topic (readers "
               "never go back in time).",
        flag={"action": "store_true"})
    shm_dir: Optional[PathLike] = option(
        None, "Where shared tables live (default: $DELTASTREAM_SHM_DIR, else /dev/shm), e.g. "
              "a tmpfs mounted with huge=within_size: lookups of random ids get faster. "
              "Readers must be given the same directory.",
        flag={"type": existing_dir, "metavar": "DIR"})
    cpus: Optional[CpuSpec] = option(
        None, "Run the apply loop and the checkpoint writer only on these CPUs (e.g. 3 or "
              "2-3,6; Linux; :mod:`consumers.cpus`), leaving the others to the model "
              "servers: their lookups then seldom wait behind the daemon for a CPU "
              "(default: any CPU). Normalized to a frozenset of CPU numbers.",
        flag={"type": cpu_list_arg, "metavar": "LIST"})
    consumer_config: dict[str, Any] = option(
        help="Extra ``KafkaConsumer`` settings (security options, …); as keywords of "
             "``SyncDaemon(...)`` they are the ones that name no field.", factory=dict)

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
        for name in ("summary_interval", "startup_timeout"):
            s = getattr(self, name)
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 0:
                raise ValueError(f"{name}: expected seconds ≥ 0, got {s!r}")
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
        if not isinstance(self.state_dir_any_owner, bool):
            raise TypeError(f"state_dir_any_owner: expected a bool, got "
                            f"{self.state_dir_any_owner!r}")
        if not isinstance(self.reset_state, bool):
            raise TypeError(f"reset_state: expected a bool, got {self.reset_state!r}")
        if self.group_id is not None and not isinstance(self.group_id, str):
            raise TypeError(f"group_id: expected a str ('' disables committing offsets to "
                            f"a consumer group) or None (the default name), got "
                            f"{self.group_id!r}")
        self._set("state_dir", Path(self.state_dir))
        self._set("consumer_config", dict(self.consumer_config))
        for name in ("checkpoint_interval", "request_timeout", "backoff_max", "probe_interval",
                     "summary_interval", "freshness_window", "startup_timeout"):
            self._set(name, float(getattr(self, name)))
        for name in ("checkpoint_messages", "poll_timeout_ms", "max_poll_records"):
            self._set(name, int(getattr(self, name)))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalizing a frozen instance once, at birth

    @classmethod
    def from_keywords(cls, bootstrap_servers: Any, topic: Any,
                      settings: dict[str, Any]) -> SyncOptions:
        """SyncOptions from ``SyncDaemon``'s keyword form: keywords that name no field are
        ``KafkaConsumer`` settings."""
        known = {k: v for k, v in settings.items() if k in OPTION_NAMES}
        extra = {k: v for k, v in settings.items() if k not in OPTION_NAMES}
        if extra and "consumer_config" in known:
            raise TypeError(f"unknown SyncDaemon settings {sorted(extra)} (with "
                            "consumer_config given, every KafkaConsumer setting goes there)")
        if extra:
            known["consumer_config"] = extra
        for name in ("model", "state_dir"):
            if name not in known:
                raise TypeError(f"SyncDaemon() missing required keyword argument: {name!r}")
        if "base_any_topic" in known:
            known["base_any_topic"] = bool(known["base_any_topic"])
        return cls(bootstrap_servers, topic, **known)


SyncOptions.__doc__ = (SyncOptions.__doc__ or "") + fields_doc(SyncOptions)
#: the names of SyncOptions' fields (every setting of the daemon)
OPTION_NAMES = frozenset(f.name for f in fields(SyncOptions))


class OptionAttributes:
    """Reads an object's settings as its attributes (``daemon.topic``, ``daemon.shards``,
    ...) from its ``options`` (a :class:`SyncOptions`)."""

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options")
        if options is not None and name in OPTION_NAMES:
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
