"""The demo trainer's two tracker consumers: ``publish`` and ``snapshot`` (torch on use).

:class:`TrainerPublishing` holds one rank's :class:`~deltastream.DeltaPublisher`, its
:class:`~deltastream.DensePublisher` (rank 0 sends the MLP) and the publisher that runs its
publish rounds off the training loop: a :class:`~deltastream.BudgetPublisher` with a byte
budget, else a :class:`~deltastream.RoundPublisher` (``publish_delta``'s rounds every
``publish_every`` steps); both are ticked after every step. It also runs the snapshot rounds
(this shard's mirror written as a base snapshot with the next offset and seq state), and
counts what they did for the demo's report (see :mod:`deltastream_demo.trainer`).
"""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

__all__ = ["TrainerPublishing", "SNAPSHOT_PREFIX"]

SNAPSHOT_PREFIX = "shard-"


class TrainerPublishing:
    """Publishing and snapshots of trainer ``rank`` (``cfg``: the trainer's settings, see
    :func:`deltastream_demo.trainer.trainer_main`).

    Args:
        rank, cfg, events: the trainer's rank, settings and queue to the parent.
        tracker: the trainer's :class:`~deltastream.DeltaTracker` (consumers ``publish``
            and ``snapshot``).
        fqn_table: tracker key -> table (a HashTable, or a TorchRecTable row-wise shard).
        mlp: the MLP module (published as the dense part under the name ``mlp``).
        table_names: the tables this rank reports rows of.
        row_sharded: rows are sharded whole (a plan's column shards hold part of every
            row: no snapshots then).
    """

    def __init__(self, rank: int, cfg: dict, events: Any, tracker: Any,
                 fqn_table: dict[str, Any], mlp: Any, table_names: tuple[str, ...],
                 row_sharded: bool) -> None:
        import torch

        from consumers import ServingTable
        from deltastream import (
            BudgetPolicy,
            BudgetPublisher,
            DeltaPublisher,
            DenseOptions,
            DensePublisher,
            RoundPolicy,
            RoundPublisher,
        )
        from deltastream.publishing.rounds import SelectionPolicy

        self.rank, self.cfg, self.events = rank, cfg, events
        self.world = int(cfg["world"])
        self.tracker, self.fqn_table = tracker, fqn_table
        self.publisher = DeltaPublisher(cfg["bootstrap_servers"], cfg["topic"],
                                        model=cfg["model_name"], shard=rank,
                                        dtype=cfg["wire_dtype"],
                                        max_message_bytes=int(cfg["max_message_bytes"]),
                                        **(cfg.get("kafka_config") or {}))
        self.partition = self.publisher.partition
        # the MLP is the model's only dense part (the tables go as rows); under the name
        # "mlp" its tensors are named as in the model's state_dict ("mlp.0.weight" …)
        # without building the sharded tables' state_dict. Only rank 0 publishes: every rank
        # holds the same weights
        self.dense_pub = DensePublisher(
            self.publisher, torch.nn.ModuleDict({"mlp": mlp}),
            DenseOptions(every_steps=int(cfg["dense_every"]), rank=0))
        frac = float(cfg["topk_fraction"])
        budget = float(cfg.get("publish_budget") or 0.0)
        self.budgeted = budget > 0
        # the rounds run on the publisher's worker; their records come back through on_round
        self.worker_rounds: queue.SimpleQueue = queue.SimpleQueue()
        policy = (BudgetPolicy(bytes_per_s=budget) if self.budgeted else RoundPolicy(
            SelectionPolicy(fraction=frac) if frac < 1.0 else SelectionPolicy(),
            every=int(cfg["publish_every"])))
        kind = BudgetPublisher if self.budgeted else RoundPublisher
        self.rounds_pub = kind(tracker, self.publisher, "publish", policy, tables=fqn_table,
                               dense=self.dense_pub, on_round=self.worker_rounds.put)
        self.next_offset = self.end_offset()
        # next offsets of other partitions: a plan's shards publish under their own shard
        # ids (partition shard % partitions), e.g. a whole table on rank 1 is shard 0
        self.other_offsets: dict[int, int] = {}
        self.pending: list[Any] = []  # PublishResults not yet flushed
        # base snapshots hold each rank's full rows: row sharding only (a column shard holds
        # part of every row)
        self.mirror = {} if not row_sharded else {
            name: ServingTable(name, int(cfg["dim"])) for name in table_names}
        self.published_ids: dict[str, list[np.ndarray]] = {n: [] for n in table_names}
        self.rounds: list[dict] = []
        self.bounds: list[tuple[int, float, float, bool]] = []  # (step, t s, bound, final)
        self.totals = dict.fromkeys(("tracked", "published", "carried", "rejected", "exact",
                                     "tombstones", "messages", "bytes", "rounds",
                                     "final_flush"), 0)
        self.snapshots = {"count": 0, "last_step": None, "seconds": 0.0}
        self.snap_dir = Path(cfg["snapshot_dir"]) / f"{SNAPSHOT_PREFIX}{rank}"

    def end_offset(self) -> int:
        """Next offset of this shard's partition now (messages before it are not ours)."""
        from consumers.topic import TopicReader

        with TopicReader(self.cfg["bootstrap_servers"], self.cfg["topic"], timeout=15.0,
                         **(self.cfg.get("kafka_config") or {})) as reader:
            return int(reader.end_offsets([self.partition])[self.partition])

    def settle(self) -> None:
        """Flush the publisher; advance ``next_offset`` past every acknowledged message."""
        self.publisher.flush()
        for res in self.pending:
            offs = res.offsets
            if offs:
                if res.partition == self.partition:
                    self.next_offset = max(self.next_offset, max(offs) + 1)
                else:
                    self.other_offsets[res.partition] = max(
                        self.other_offsets.get(res.partition, 0), max(offs) + 1)
        self.pending.clear()

    def publish_round(self, step: int, *, final: bool = False) -> Optional[dict]:
        """The ``publish`` consumer's tick after ``step`` (a hand-off when a round is due:
        the round runs on the publisher's worker), or the final flush; the counters of the
        last round recorded (``None`` when no round finished since the last call)."""
        if final:
            self.rounds_pub.flush(step)
        else:
            self.rounds_pub.tick(step)
        return self._collect_rounds()

    def _collect_rounds(self) -> Optional[dict]:
        """Record the rounds that finished since the last call."""
        rec = None
        while True:
            try:
                tick = self.worker_rounds.get_nowait()
            except queue.Empty:
                return rec
            rec = self._record_round(tick.round, tick.exact,
                                     tick.bound if self.budgeted else None)

    def _record_round(self, rnd: Any, exact: int, bound: Optional[float] = None) -> dict:
        for t in rnd.tables:
            if t.result is not None:
                self.pending.append(t.result)
            if len(t.ids):
                self.published_ids[t.table].append(t.ids.detach().cpu().numpy())
        final = rnd.final
        rec = dict(step=rnd.step, t=rnd.ts / 1e9 - float(self.cfg["t0"]), final=final,
                   **rnd.totals(), exact=exact, seconds=rnd.seconds)
        if bound is not None:  # every budget tick: the serving-error bound over time
            self.bounds.append((rec["step"], rec["t"], float(bound), bool(final)))
        for k in ("tracked", "published", "carried", "rejected", "exact", "tombstones",
                  "messages", "bytes"):
            self.totals[k] += rec[k]
        self.totals["rounds"] += 1
        if final:
            self.totals["final_flush"] = rec["published"]
        if final or rec["published"] or rec["tombstones"] or not self.budgeted:
            # a budget's round may come every step: only those that sent something count
            self.rounds.append(rec)
            self.events.put(dict(rec, kind="publish", rank=self.rank))
        return rec

    def snapshot_round(self, step: int) -> None:
        """One ``snapshot`` consumer round: update this shard's mirror and write it."""
        from consumers.storage.snapshot import write_snapshot

        t0 = time.monotonic()
        self.rounds_pub.drain()  # every hand-off so far is published or pending
        self._collect_rounds()
        self.settle()  # offsets of everything published so far are now known
        delta = self.tracker.get_delta("snapshot")
        for fqn, d in delta.items():
            tbl = self.fqn_table[fqn]
            mirror = self.mirror[tbl.name]
            if d.tombstones is not None and d.tombstones.numel():
                mirror.delete(d.tombstones.cpu().numpy())
            if len(d):
                rows = tbl.lookup(d.ids).float().cpu().numpy()
                ok = np.isfinite(rows).all(axis=1)  # non-finite rows are never served
                mirror.upsert(d.ids.cpu().numpy()[ok], rows[ok])
        next_seq = self.publisher.stats()["next_seq"]
        streams = [{"table": t, "shard": self.rank, "epoch": self.publisher.epoch,
                    "seq": int(s) - 1} for t, s in sorted(next_seq.items()) if s > 0]
        write_snapshot(self.snap_dir, tables=dict(self.mirror),
                       offsets={self.partition: int(self.next_offset)},
                       seqs={"version": 1, "streams": streams} if streams else {},
                       meta={"kind": "deltastream-demo-trainer-base", "step": step,
                             "shard": self.rank, "world": self.world,
                             "epoch": self.publisher.epoch, "model": self.cfg["model_name"],
                             "topic": self.cfg["topic"], "written_at": time.time()})
        self.snapshots["count"] += 1
        self.snapshots["last_step"] = step
        self.snapshots["seconds"] += time.monotonic() - t0

    def final_flush(self, step: int) -> None:
        """Everything still retained goes out now, with a last full dense version; the
        offsets then cover every acknowledged message."""
        self.publish_round(step, final=True)
        self.rounds_pub.close()
        self.dense_pub.close()
        self.settle()
        # the dense chunks' offsets are not among the rows' results: everything is
        # acknowledged now, so the partition's end covers them (the predictor drains to it)
        self.next_offset = max(self.next_offset, self.end_offset())
