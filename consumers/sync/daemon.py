"""SyncDaemon: keep a predictor's serving tables in sync with a deltas topic.

One loop, one thread (the caller's of :meth:`SyncDaemon.run`):

1. **connect** and **seek** to the next offset per partition from the last checkpoint
   (earliest when none) — :class:`~consumers.sync.source.KafkaSource`, which also
   reconnects after broker trouble and handles offsets the broker no longer has;
2. **poll** and hand each record, partition by partition in offset order (apply order is
   partition order), to :class:`~consumers.applier.Applier`, which decodes, validates,
   sequence-checks and applies it atomically; bad records go to the quarantine file (once,
   also across a crash: :class:`~consumers.quarantine.Quarantine`); records of other models
   are skipped and counted by model (``foreign_models``), logged once per model;
3. **checkpoint** tables + next offset per partition + seq state atomically every
   ``checkpoint_interval`` seconds or ``checkpoint_messages`` records, and on :meth:`stop`
   (:class:`~consumers.sync.checkpointer.Checkpointer`): the rows changed since the
   previous one as a delta segment, a new full base when the segments grow large next to
   it, committed by a small manifest replaced atomically. The loop freezes it between two
   records (O(changes)); a background thread writes it while the loop applies on (one in
   flight at a time). Once durable, the offsets are committed to a consumer group (without
   joining it) for lag tools.

State is never destroyed or silently replaced: a damaged checkpoint (unreadable, a file
where its directory should be, files without a manifest) makes the constructor raise
:class:`~consumers.errors.SnapshotError` naming the path, unless ``reset_state=True``
removes it (only what deltastream wrote) to start from ``base`` or empty. A failing state
disk (full, read-only) is counted (``write_errors``), logged and retried; serving goes on.

Exactly once in effect: offsets, tables and seq state are frozen together, between two
records, by the only thread that applies, and written as one checkpoint; after a crash the
daemon reloads the last complete one and re-reads from its offsets (re-applying is exact).

Lookups never stop while the broker is away (tables live in memory). Arguments: checked by
:class:`~consumers.sync.options.SyncOptions`; ``cpus``: :mod:`consumers.cpus`."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from consumers.applier import Applier, Outcome
from consumers.cpus import pin_thread
from consumers.quarantine import Quarantine
from consumers.serving.dense_shm import dense_left
from consumers.serving.shm import left_behind, remove_tables
from consumers.serving.stop_mark import clear_stopped, leave_stop_mark
from consumers.serving.table import ServingTable
from consumers.storage.checkpoint import CheckpointStore
from consumers.sync.checkpointer import Checkpointer
from consumers.sync.daemon_stats import daemon_stats
from consumers.sync.dense import ConsistentView, DenseSide
from consumers.sync.failures import FailureLog
from consumers.sync.group_offsets import GroupCommitter, default_group_id
from consumers.sync.metrics import MetricsServer, reached, summary_line
from consumers.sync.options import OptionAttributes, SyncOptions, check_positive
from consumers.sync.outcomes import RecordReport
from consumers.sync.progress import wait_for_end
from consumers.sync.record_step import RecordStep
from consumers.sync.share_gate import ShareGate
from consumers.sync.source import BROKER_STATES, KafkaSource
from consumers.sync.stall import StallWatch
from consumers.sync.state import CHECKPOINT_KIND, load_start_state
from consumers.sync.state_lock import check_owner, lock_state_dir
from deltastream.stop_flag import StopFlag

__all__ = ["SyncDaemon", "CHECKPOINT_DIR", "QUARANTINE_FILE", "BROKER_STATES"]

log = logging.getLogger(__name__)

#: sub-paths of ``state_dir``
CHECKPOINT_DIR = "checkpoint"
QUARANTINE_FILE = "quarantine.jsonl"


class SyncDaemon(OptionAttributes):
    """Consume a deltas topic into serving tables, with atomic checkpoints.

    Args:
        options: the daemon's settings, a :class:`~consumers.sync.options.SyncOptions`
            (each field's meaning is documented there, once). The keyword form builds it:
            ``SyncDaemon(bootstrap_servers, topic, model=..., state_dir=..., **settings)``,
            where keywords that name no field are extra ``KafkaConsumer`` settings
            (``consumer_config``). Every setting also reads as an attribute
            (``daemon.topic``, ``daemon.shards``, ...).

    Raises:
        ValueError/TypeError: a bad setting, or a checkpoint in ``state_dir`` written for
            another model or topic (or with tables of other dims).
        consumers.errors.SnapshotError: a damaged checkpoint (without ``reset_state``) or
            base snapshot; with ``reset_state``, a checkpoint path holding files deltastream
            did not write (never removed).
    """

    def __init__(self, options: Any = None, topic: Optional[str] = None,
                 **settings: Any) -> None:
        if options is None:  # SyncDaemon(bootstrap_servers=..., ...)
            options = settings.pop("bootstrap_servers", None)
        if isinstance(options, SyncOptions):
            if topic is not None or settings:
                raise TypeError("SyncDaemon(options): give a SyncOptions alone, or the "
                                "settings as arguments, not both")
            o = options
        else:
            o = SyncOptions.from_keywords(options, topic, settings)
        self.options = o  #: the validated settings
        self.checkpoint_path = self.state_dir / CHECKPOINT_DIR
        # validates its arguments; nothing is read or written before load/write
        self._store = CheckpointStore(self.checkpoint_path,
                                      max_segment_fraction=o.checkpoint_segment_fraction,
                                      max_segments=o.checkpoint_max_segments)

        self.state_dir.mkdir(parents=True, exist_ok=True)
        check_owner(self.state_dir, any_owner=o.state_dir_any_owner)
        self._state_lock = lock_state_dir(self.state_dir)  # one daemon per state dir
        try:
            self._start(o)
        except BaseException:
            self._state_lock.release()
            raise

    def _start(self, o: SyncOptions) -> None:
        """Load the state and build the parts (the state dir is locked)."""
        clear_stopped(self.state_dir)  # readers wait for this daemon's tables again
        if o.reset_state:  # only what deltastream wrote; SnapshotError for anything else
            log.warning("reset_state: removed %s %s; starting over", self.checkpoint_path,
                        self._store.reset() or "(nothing there)")
            remove_tables(self.state_dir, o.shm_dir)  # shared copies of the old state
            DenseSide.reset(self.state_dir, o.shm_dir)
        start = load_start_state(self._store, o.base, model=o.model, topic=o.topic,
                                 table_dims=o.tables, base_any_topic=o.base_any_topic)
        self.source = start.source  #: where the state came from: checkpoint | base | empty
        self._tables: dict[str, ServingTable] = start.tables
        for name, dim in (o.tables or {}).items():
            if name not in self._tables:
                self._tables[name] = ServingTable(name, dim, dtype=o.dtype)
        self._dense = DenseSide(o.model, start.dense, self.state_dir, o.shm_dir)
        # a killed daemon's shared tables may be newer than the checkpoint: see ShareGate
        self._share_gate = ShareGate(bool(o.share_tables and (
            left_behind(self.state_dir, o.shm_dir) or dense_left(self.state_dir, o.shm_dir))))
        if o.share_tables and not self._share_gate.waiting:
            self._share_tables()
        self._seqs = start.seqs
        self._applier = Applier(o.model, self._tables, self._seqs, table_dims=o.tables,
                                shards=o.shards, dtype=o.dtype, dense=self._dense.assembler)
        self._quarantine = Quarantine(self.state_dir / QUARANTINE_FILE, o.quarantine_max_bytes)
        self._failures = FailureLog(("quarantine", "checkpoint", "apply"), logger=log)
        self._records = RecordStep(self._applier, self._dense, self._failures,
                                   o.freshness_window)
        self._report = RecordReport(o.topic, o.model, self._quarantine, o.on_apply,
                                    self._failures, log)
        self.group_id = default_group_id(o.model) if o.group_id is None else o.group_id
        self._ckpt = Checkpointer(
            self._store, self._quarantine, self._failures,
            GroupCommitter(o, self.group_id) if self.group_id else None,
            interval=o.checkpoint_interval, messages=o.checkpoint_messages,
            total=start.checkpoints, written_at=start.written_at, dirty=self.source == "base")
        self._kafka = KafkaSource(o, offsets=start.offsets, topic_id=start.topic_id,
                                  partitions=start.partitions, on_moved=self._moved,
                                  on_reset=self._quarantine.forget)
        # loop state (owned by the loop thread)
        self._next_summary = time.monotonic() + self.summary_interval
        self._prev_summary: Optional[tuple[float, dict]] = None
        self._started = time.monotonic()
        self._stall = StallWatch(o.startup_timeout, self._started)
        self._next_stall_check = 0.0
        self._stop_event = StopFlag()  # signal handlers set it: a threading.Event could hang
        self._loop_lock = threading.Lock()
        self._loop_thread: Optional[int] = None
        self._unpin: Optional[frozenset[int]] = None  # CPUs of the loop's caller, given back
        self._closed = False

        self.metrics_port: Optional[int] = None  #: bound port of the metrics endpoint
        self._metrics: Optional[MetricsServer] = None
        if o.metrics_port is not None:
            self._metrics = MetricsServer(self.stats, o.metrics_port, o.metrics_addr)
            self.metrics_port = self._metrics.port

    def _share_tables(self) -> None:
        """Share the tables not shared yet (new ones) and the dense versions with reader
        processes."""
        for t in [t for t in self._tables.values() if t.shared is None]:
            t.share(self.state_dir, shm_dir=self.options.shm_dir)
        self._dense.share()

    def _moved(self) -> None:
        """The source changed position or log identity: the next checkpoint must say so."""
        self._ckpt.note(0)

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_locked(self, wait: bool = True) -> bool:
        """Start a checkpoint (loop thread, between records): frozen now, written in the
        background; see :meth:`Checkpointer.checkpoint` (``wait``: until written)."""
        if not self._ckpt.ready(wait):
            return False  # one still in flight: the next try covers these records too
        offsets = self._kafka.resume_offsets()
        meta = {"kind": CHECKPOINT_KIND, "model": self.model, "topic": self.topic,
                "topic_id": self._kafka.topic_id, "partitions": self._kafka.partitions_total,
                "shards": None if self.shards is None else sorted(self.shards),
                "checkpoints": self._ckpt.total + 1, "written_at": time.time()}
        # only the partitions this daemon reads: others' group offsets are not its own
        commit = {p: offsets[p] for p in self._kafka.positions() if p in offsets} \
            if self._kafka.state == "connected" else None
        return self._ckpt.checkpoint(dict(self._tables), offsets, self._seqs.state(), meta,
                                     commit=commit, wait=wait, dense=self._dense.state())

    def checkpoint(self) -> bool:
        """Write a checkpoint now. True when written.

        Raises ``RuntimeError`` while :meth:`run` works in another thread (the loop
        checkpoints on its own schedule) or after :meth:`stop`.
        """
        self._enter("checkpoint")
        try:
            return self._checkpoint_locked()
        finally:
            self._release()

    # ------------------------------------------------------------------ the loop

    def _record(self, partition: int, rec: Any) -> Optional[Outcome]:
        """Apply one record and move on past it; None when the host has no room for it now
        (the record is not done: the partition waits at it)."""
        out = self._records.apply(partition, rec)
        if out is None:
            return None
        self._kafka.advance(partition, rec.offset + 1)
        self._ckpt.note()
        self._ckpt.settle()  # one the writer finished is counted (and logged) at once
        self._report.report(out, partition, rec.offset, rec.value)
        return out

    def _step(self, max_records: int) -> int:
        """One poll + apply + housekeeping round. Returns records read."""
        if not self._kafka.ready(self._stop_event.wait):
            self._housekeeping()
            return 0
        batches = self._kafka.poll(max_records)
        if batches is None:
            return 0
        n = 0
        debug = log.isEnabledFor(logging.DEBUG)
        for p, records in batches:
            for rec in records:
                if rec.offset < self._kafka.position(p):
                    continue  # a fetch may start inside a batch that began earlier
                out = self._record(p, rec)
                if out is None:  # no room: the partition waits at this record
                    self._kafka.rewind(p)
                    break
                n += 1
                if debug:
                    log.debug("partition %d offset %d: %s %s/%s epoch %s seq %s %s", p,
                              rec.offset, out.kind, out.table, out.shard, out.epoch, out.seq,
                              f"dense {out.dense}" if out.dense else "")
                if self._ckpt.pending >= self.checkpoint_messages and self._ckpt.due_now():
                    self._checkpoint_locked(wait=False)
                if self._stop_event.is_set():
                    break
            if self._stop_event.is_set():
                break
        if self._stop_event.is_set() and n:
            return n  # the consumer is closed right after; no need to re-seek
        self._kafka.refresh()
        self._housekeeping()
        if self._records.no_room:
            self._stop_event.wait(0.2)  # memory may be freed; the records are fetched again
        return n

    def _housekeeping(self) -> None:
        if self.options.share_tables and self._share_gate.open(self._kafka):
            try:
                self._share_tables()
            except Exception as e:  # /dev/shm full: serving in-process goes on
                log.error("sharing tables failed (retried next round): %s", e)
        now = time.monotonic()
        if now >= self._next_stall_check:  # why nothing is served, said every minute
            self._next_stall_check = now + 1.0
            self._stall.check(now, self.stats(), self._kafka.detail, self.bootstrap_servers)
        self._ckpt.settle()
        if self._ckpt.due_now(now):
            self._checkpoint_locked(wait=False)
        if self.summary_interval and now >= self._next_summary:
            s = self.stats()
            prev = self._prev_summary
            log.info("sync %s: %s", self.topic, summary_line(
                s, prev[1] if prev else None, now - prev[0] if prev else None))
            self._prev_summary = (now, s)
            self._next_summary = now + self.summary_interval

    def _enter(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: the daemon was stopped")
        unpin = None if self.options.cpus is None else pin_thread(self.options.cpus)
        if not self._loop_lock.acquire(blocking=False):
            if unpin is not None:
                pin_thread(unpin)
            raise RuntimeError(f"{what}: the daemon is already running in another thread")
        self._loop_thread, self._unpin = threading.get_ident(), unpin

    def _leave(self) -> None:
        try:
            if self._stop_event.is_set():
                self._shutdown_locked()
            else:  # between runs nothing is in flight: the checkpoint's outcome is counted
                self._ckpt.ready()
        finally:
            self._release()

    def _release(self) -> None:
        if self._unpin is not None:  # the caller's thread runs where it ran before
            pin_thread(self._unpin)
        self._loop_thread = None
        self._loop_lock.release()

    def _shutdown_locked(self) -> None:
        if self._closed:
            return
        self._kafka.close()
        self._ckpt.wait()  # the one in flight first: a failed one leaves dirty set
        self._ckpt.settle()
        if self._ckpt.dirty or not self._store.exists():
            self._checkpoint_locked()  # a failing disk: counted and logged, restart re-reads
        self._ckpt.close()
        self._closed = True
        for t in self._tables.values():
            t.unshare()  # readers keep what they mapped; a restart shares anew
        self._dense.unshare()
        if self.options.share_tables:  # readers opened from now on learn it is stopped
            leave_stop_mark(self.state_dir)
        self._kafka.mark_stopped()
        if self._metrics is not None:
            self._metrics.close()
        self._state_lock.release()  # the next daemon may start now
        log.info("sync %s stopped: %s", self.topic, summary_line(self.stats()))

    def run(self) -> None:
        """Sync until :meth:`stop`; then close the consumer and write a final checkpoint."""
        self._enter("run")
        try:
            while not self._stop_event.is_set():
                self._step(self.max_poll_records)
        finally:
            self._stop_event.set()
            self._leave()

    def run_for(self, seconds: Optional[float] = None, messages: Optional[int] = None) -> int:
        """Sync for ``seconds`` or until ``messages`` records were read (whichever first).

        Checkpoints happen on their schedule meanwhile; call :meth:`stop` for the final
        one. Returns the number of records read.
        """
        if seconds is None and messages is None:
            raise ValueError("run_for: give seconds, messages or both")
        if seconds is not None:
            check_positive("seconds", seconds)
        if messages is not None:
            check_positive("messages", messages, integer=True)
        self._enter("run_for")
        deadline = None if seconds is None else time.monotonic() + seconds
        done = 0
        try:
            while not self._stop_event.is_set():
                if messages is not None and done >= messages:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    break
                room = self.max_poll_records if messages is None else \
                    min(self.max_poll_records, messages - done)
                done += self._step(room)
        finally:
            self._leave()
        return done

    def catch_up(self, timeout: float = 60.0) -> bool:
        """Sync in this thread until every assigned partition reaches the end offsets
        measured now (see :meth:`end_offsets`). True when caught up within ``timeout`` s."""
        check_positive("timeout", timeout)
        return wait_for_end(self.end_offsets, self._kafka.positions, timeout=timeout,
                            step=lambda s: self.run_for(seconds=s),
                            stopped=self._stop_event.is_set)

    def end_offsets(self) -> dict[int, int]:
        """Exact end offset of each partition this daemon assigns, measured now.

        Uses its own short-lived reader (safe from any thread). Raises
        ``consumers.topic.TopicError`` when the broker or topic is unavailable.
        """
        return self._kafka.measure_end_offsets()

    def caught_up(self) -> bool:
        """True when the position of every assigned partition is at the end offsets
        measured now (so everything published before this call has been read). Safe from
        any thread; False while disconnected."""
        try:
            target = self.end_offsets()
        except Exception as e:
            log.debug("caught_up: end offsets unavailable: %s", e)
            return False
        return self._kafka.state == "connected" and reached(self._kafka.positions(), target)

    def wait_caught_up(self, timeout: float = 30.0, interval: float = 0.1) -> bool:
        """Wait (while :meth:`run` works in another thread) until everything published
        before this call is applied: True when every assigned partition reached the end
        offsets measured at the call within ``timeout`` s (checked every ``interval`` s)."""
        check_positive("timeout", timeout)
        return wait_for_end(self.end_offsets, self._kafka.positions, timeout=timeout,
                            step=lambda s: time.sleep(min(s, interval)),
                            ready=lambda: self._kafka.state == "connected")

    def request_stop(self) -> None:
        """Ask the loop to stop and return at once (safe in signal handlers and before
        :meth:`run` starts: :meth:`run` then returns right away, after the final
        checkpoint)."""
        self._stop_event.set()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop syncing: close the consumer and write the final checkpoint.

        Thread-safe. Called from another thread while :meth:`run` works, it waits up to
        ``timeout`` s for the loop to finish its record and checkpoint. From a signal
        handler in the loop's own thread it only asks the loop to stop (the loop then
        checkpoints before :meth:`run` returns). Idempotent.
        """
        self._stop_event.set()
        if self._loop_thread == threading.get_ident():
            return  # signal handler inside the loop: the loop finishes the job
        if not self._loop_lock.acquire(timeout=timeout):
            log.error("stop: the sync loop did not finish within %g s", timeout)
            return
        try:
            self._shutdown_locked()
        finally:
            self._loop_lock.release()

    close = stop

    def __enter__(self) -> SyncDaemon:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ serving

    def table(self, name: str) -> ServingTable:
        """The serving table ``name`` (lookups are safe while the daemon applies).

        A table configured with ``tables=`` or loaded from the checkpoint or base exists
        from the start (empty until its first message: lookups read zeros); with
        ``tables=None`` a table appears with its first message. Raises ``KeyError`` naming
        the known tables for any other name."""
        t = self._tables.get(name)
        if t is None:
            raise KeyError(f"no table {name!r}: known tables are {sorted(self._tables)} "
                           "(pass tables={name: dim} to serve a table before its first "
                           "message arrives)")
        return t

    def dense(self, shard: Optional[int] = None) -> Any:
        """The newest complete dense version (a read-only
        :class:`~consumers.dense_assembly.DenseView`: ``.version`` (epoch, step), ``.ts``,
        ``view[name]`` → float32 array) of ``shard`` (None: the one shard publishing
        them), or None before the first. Safe from any thread; never half a version."""
        return self._dense.assembler.view(shard)

    def consistent(self, *, shard: Optional[int] = None, max_ahead: Optional[int] = None,
                   timeout: float = 0.0) -> ConsistentView:
        """The dense version and each shard's sparse step at one instant, with the policy
        ``max_ahead`` (see :mod:`consumers.sync.dense`; the README states the guarantee)."""
        return self._dense.consistent(self._seqs, shard=shard, max_ahead=max_ahead,
                                      timeout=timeout)

    def tables(self) -> dict[str, ServingTable]:
        """name -> :class:`ServingTable` (a new dict; the tables are the live ones)."""
        return dict(self._tables)

    @property
    def running(self) -> bool:
        """True while :meth:`run` or :meth:`run_for` works."""
        return self._loop_thread is not None

    def stats(self) -> dict:
        """Counters and gauges (safe from any thread): the keys are listed in
        :mod:`consumers.sync.daemon_stats`, plus ``tables`` (rows per table) and the
        ``dense_*`` keys of :meth:`consumers.sync.dense.DenseSide.stats`."""
        out = daemon_stats(model=self.model, topic=self.topic, source=self.source,
                           records=self._records, kafka=self._kafka.view(), ckpt=self._ckpt,
                           quarantine=self._quarantine, failures=self._failures,
                           group_id=self.group_id, share_waiting=self._share_gate.waiting,
                           uptime_s=time.monotonic() - self._started)
        out["tables"] = {name: len(t) for name, t in list(self._tables.items())}
        out.update(self._dense.stats(self._seqs))
        return out

    def __repr__(self) -> str:
        return (f"SyncDaemon({self.topic!r} on {self.bootstrap_servers}, model={self.model!r}, "
                f"state_dir={str(self.state_dir)!r}, {self._kafka.state})")
