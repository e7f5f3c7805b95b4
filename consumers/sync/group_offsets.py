"""GroupCommitter: publish the sync daemon's position to a Kafka consumer group.

The checkpoint stays the source of truth for where the daemon resumes. After each
checkpoint the daemon also commits its next offsets to a consumer group (``group_id``,
``deltastream-sync.<model>`` by default) so standard tools (``kafka-consumer-groups
--describe``, lag exporters) see its lag. It never *joins* the group — the daemon assigns
its partitions itself — so no rebalance ever happens; a commit from a consumer that is not a
member is accepted by Kafka as long as no active member owns the group (the "simple
consumer" case). Predictor replicas that serve the same shards should use distinct group
ids, or their commits overwrite each other's.

The embedded broker (Tansu) supports OffsetCommit / OffsetFetch, so the committed offsets
can be read back (``KafkaConsumer(group_id=...).committed(tp)``); it does not support group
membership, which this code never uses. A failed commit is counted and never stops syncing;
after k failures in a row, commits pause for ``min(300 s, 5 s × 2^(k-1))`` so a broker that
cannot take them does not slow applying down (a commit blocks the loop up to
``request_timeout``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Optional

from consumers.sync.options import SyncOptions
from deltastream.kafka_compat import forbid_auto_create
from deltastream.kafka_config import bootstrap_list

__all__ = ["GroupCommitter", "default_group_id"]

log = logging.getLogger(__name__)

_PAUSE_S, _PAUSE_MAX_S = 5.0, 300.0  # commit pause after a failure, doubling, capped


def default_group_id(model: str) -> str:
    """The consumer group a daemon of ``model`` commits to by default."""
    return f"deltastream-sync.{model}"


class GroupCommitter:
    """Commits next offsets of ``options.topic`` to consumer group ``group_id`` (without
    joining it) through a commit-only ``KafkaConsumer`` created on first use.

    One thread calls :meth:`commit` (the daemon's loop); :attr:`commits` and
    :attr:`errors` count the outcomes.
    """

    def __init__(self, options: SyncOptions, group_id: str) -> None:
        if not isinstance(group_id, str) or not group_id:
            raise ValueError(f"group_id: expected a non-empty str, got {group_id!r}")
        self.options = options
        self.group_id = group_id
        self.commits = 0  #: successful commits
        self.errors = 0  #: failed commits
        self.last_error: Optional[str] = None
        self._consumer: Any = None
        self._failed_in_row = 0
        self._next_try = 0.0  # monotonic

    def _client(self) -> Any:
        if self._consumer is None:
            from kafka import KafkaConsumer

            o = self.options
            ms = int(o.request_timeout * 1000)
            cfg = dict(o.consumer_config)
            cfg.update(bootstrap_servers=bootstrap_list(o.bootstrap_servers),
                       group_id=self.group_id, enable_auto_commit=False,
                       allow_auto_create_topics=False, bootstrap_timeout_ms=ms,
                       request_timeout_ms=max(ms, 1000), reconnect_backoff_ms=50,
                       reconnect_backoff_max_ms=int(o.backoff_max * 1000),
                       client_id=f"deltastream-sync-{o.model}-offsets")
            consumer = KafkaConsumer(**cfg)
            forbid_auto_create(consumer)  # a commit's metadata lookup must not create topics
            self._consumer = consumer
        return self._consumer

    def commit(self, offsets: Mapping[int, int]) -> bool:
        """Commit partition -> next offset. True when the broker acknowledged (or there was
        nothing to commit); False when it failed or commits pause after failures."""
        if not offsets:
            return True
        if time.monotonic() < self._next_try:
            return False
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        topic = self.options.topic
        data = {TopicPartition(topic, int(p)): OffsetAndMetadata(int(o), "", -1)
                for p, o in sorted(offsets.items())}
        try:
            self._client().commit(data, timeout_ms=int(self.options.request_timeout * 1000))
        except Exception as e:  # any client failure: counted, retried after a pause
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            self._failed_in_row += 1
            self._next_try = time.monotonic() + min(
                _PAUSE_MAX_S, _PAUSE_S * 2 ** min(self._failed_in_row - 1, 16))
            self.close()
            return False
        self.commits += 1
        self.last_error = None
        self._failed_in_row = 0
        return True

    def close(self) -> None:
        """Close the commit-only consumer (a later :meth:`commit` opens a new one)."""
        c, self._consumer = self._consumer, None
        if c is not None:
            try:
                c.close(autocommit=False, timeout_ms=1000)
            except Exception:  # closing a broken connection must not raise
                log.debug("closing the offset-commit consumer failed", exc_info=True)
