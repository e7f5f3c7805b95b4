"""The worker process of :class:`~.budget_process.ProcessWorker`: its entry and its loop.

The parent starts a new interpreter with ``python -c`` importing this module (nothing of
the user's ``__main__`` runs here) and one end of a socket pair. :func:`child_entry`
reads the start message, builds the user's publisher and the engine, and runs a
:class:`~.budget_worker.BudgetWorker` on the hand-offs the parent ships: each one mapped
where it lies (:func:`~.handoff_pack.unpack`), the segment said free once merged. What
goes back through the socket: every round's settlement (a snapshot of the engine's
``stats()``, and the round's record when the parent has an ``on_round``), the last
record when asked for it, each flush's record, each drain, errors, and the seqs at close.
Records cross as :func:`record_bytes`, and :func:`record_from` makes them records again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import mmap
import pickle
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch

from deltastream.errors import PublishError
from deltastream.publishing.budget_engine import BudgetTick
from deltastream.publishing.budget_policy import BudgetPolicy
from deltastream.publishing.budget_worker import BudgetWorker
from deltastream.publishing.handoff_pack import unpack
from deltastream.publishing.round_engine import RoundPolicy, engine_for

__all__ = ["child_entry", "record_bytes", "record_from", "HEAP_BYTES", "TRIM_BYTES"]

log = logging.getLogger(__name__)

#: the worker's allocations up to this size come from glibc's heap, not from new mappings
HEAP_BYTES = 32 << 20
#: the free memory at the top of the heap glibc keeps before giving it back to the system
TRIM_BYTES = 128 << 20


def child_entry(fd: int) -> None:
    """The worker interpreter's entry (the parent runs ``python -c`` importing it): read
    the start message from the socket ``fd``, then run the worker until the parent closes
    it."""
    conn = Connection(fd)
    try:
        msg = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return  # the parent went away before it said what to run
    except BaseException as e:  # e.g. a class this interpreter cannot import
        conn.send_bytes(pickle.dumps(("error", _picklable(e))))
        return
    _run(conn, *msg[1:])


def record_bytes(rec: BudgetTick) -> bytes:
    """``rec`` pickled as the worker process sends it: settled copies of its results (the
    producer's futures do not cross processes; their outcomes, offsets included, do), and
    its ids as numpy arrays — a tensor unpickles through ``torch.load`` (~150 µs each,
    against ~10). Pickled on its own, so that the parent's reader thread takes the bytes
    as they are: unpickling a round's record (~250 KB for 30K rows: its ids, and each
    message's) holds the GIL the training loop needs for 80-200 µs, a wait for the
    training thread's next op. :func:`record_from` undoes the ids part once it is read."""
    tables = tuple(dataclasses.replace(t, ids=t.ids.numpy(), result=None if t.result is None
                                       else t.result.settled()) for t in rec.round.tables)
    return pickle.dumps(dataclasses.replace(rec, round=dataclasses.replace(rec.round,
                                                                           tables=tables)),
                        protocol=pickle.HIGHEST_PROTOCOL)


def record_from(rec: Any) -> Any:
    """The record :func:`record_bytes` made of bytes ``rec``, with its ids tensors again
    (zero-copy); anything else (an error) as is."""
    if not isinstance(rec, bytes):
        return rec
    rec = pickle.loads(rec)
    tables = tuple(dataclasses.replace(t, ids=torch.from_numpy(t.ids))
                   for t in rec.round.tables)
    return dataclasses.replace(rec, round=dataclasses.replace(rec.round, tables=tables))


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return PublishError(f"{type(e).__name__}: {e}")


def _outcome(f: Future) -> Any:
    e = f.exception()
    return _picklable(e) if e is not None else record_bytes(f.result())


def _run(conn: Any, cls: type, args: dict, seqs: dict, policy: BudgetPolicy | RoundPolicy,
         specs: dict, name: str, records: bool) -> None:
    """The worker process: the user's publisher made again (``cls(**args)``, its seqs
    resumed), then :class:`_Child` until the parent closes it."""
    torch.set_num_threads(1)
    _hold_heap()
    try:
        publisher = cls(**args)
        publisher.resume_seqs(seqs)
    except BaseException as e:
        conn.send_bytes(pickle.dumps(("error", _picklable(e))))
        return
    _Child(conn, publisher, policy, specs, name, records).serve()


def _hold_heap() -> None:
    """Keep the rounds' temporaries in glibc's heap (this process only; nothing without
    glibc). Every round allocates and frees tens of megabytes (merged columns, gathered
    rows). glibc's thresholds follow what was freed: a block over the largest one freed so
    far (128 KB at first) is a new mapping, its pages faulted in (zeroed by the kernel) and
    unmapped again, and the heap's top is given back past twice that — on the core beside
    the training thread. With the mmap threshold fixed at :data:`HEAP_BYTES` and the heap
    trimmed only past :data:`TRIM_BYTES`, a round reuses the last one's memory: the
    worker's CPU per round fell ~10 % (28.6 → 25.7 ms, the README model's rounds every 10
    steps, three interleaved pairs, 2026-12-05). It may hold up to that much more memory
    when idle; there its resident size stayed the same (297 against 296 MB)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # M_MMAP_THRESHOLD (-3) and M_TRIM_THRESHOLD (-1) of malloc.h; 0 means refused
    if not (mallopt(-3, HEAP_BYTES) and mallopt(-1, TRIM_BYTES)):
        log.debug("budget worker: glibc refused the heap thresholds; defaults kept")


class _Child:
    """One engine and its worker threads, driven through ``conn``; ``records``: send every
    round's record (the parent has an ``on_round``), else only the last, when asked."""

    def __init__(self, conn: Any, publisher: Any, policy: BudgetPolicy | RoundPolicy,
                 specs: dict, name: str, records: bool) -> None:
        self.conn, self.publisher, self.records = conn, publisher, records
        self._lock = threading.Lock()  # one message at a time on the socket
        self.last: Optional[BudgetTick] = None
        self.buf: Optional[mmap.mmap] = None  # the parent's current hand-off file
        self.worker: Optional[BudgetWorker] = None
        self.engine = engine_for(publisher, policy, specs, on_round=self._settled)
        self.worker = BudgetWorker(self.engine, name)

    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.conn.send_bytes(data)

    def snapshot(self) -> dict:
        w = self.worker
        return {"engine": self.engine.stats(), "busy_s": w.busy_s if w else 0.0,
                "backlog": w.backlog() if w else {}, "next_seq": self.publisher.next_seqs()}

    def serve(self) -> None:
        """Take the parent's messages until it closes the worker (or goes away)."""
        self.send(("ready", self.snapshot()))
        try:
            while True:
                if not self.conn.poll(0.05):
                    e = self.worker.take_error()
                    if e is not None:
                        self.send(("error", _picklable(e)))
                    continue
                msg = pickle.loads(self.conn.recv_bytes())
                if msg[0] == "close":
                    break
                if msg[0] == "last":
                    rec = self.last
                    self.send(("last", msg[1], None if rec is None else record_bytes(rec)))
                elif msg[0] == "drain":
                    threading.Thread(target=self._drained, args=(msg[1],), daemon=True).start()
                else:
                    self._hand_off(*msg[1:])
        except (EOFError, OSError):
            pass
        finally:
            self._close()

    def _settled(self, rec: BudgetTick) -> None:
        self.last = rec
        self.send(("round", record_bytes(rec) if self.records else None, self.snapshot()))

    def _drained(self, tick: int) -> None:
        self.worker.wait_idle(tick)
        self.send(("drained", tick, self.snapshot()))

    def _hand_off(self, path: Optional[str], meta: dict) -> None:
        if path is not None:  # a new (larger) file: the old one is done with
            # (not closed: the worker may still hold views of its last hand-off, which
            # it no longer reads; the map goes with the last of them)
            with open(path, "r+b") as f:
                self.buf = mmap.mmap(f.fileno(), 0)
        if meta["inline"]:  # no room in shared memory: the bytes follow
            data = bytearray(meta["nbytes"])
            self.conn.recv_bytes_into(data)
            h = unpack(data, meta)
        else:
            h = unpack(self.buf, meta)
        # merged where it lies: the segment is free (the parent writes the next
        # hand-off there) once the worker is done with it
        h.merged = lambda new=path is not None: self.send(("free", new))
        fut = self.worker.put(h)
        if fut is not None:
            fut.add_done_callback(lambda f, t=h.tick: self.send(("flush", t, _outcome(f))))

    def _close(self) -> None:
        self.worker.close()
        try:
            self.publisher.close()
        finally:
            try:
                self.send(("closed", self.publisher.next_seqs()))
            except OSError:
                pass
            if self.buf is not None:
                try:
                    self.buf.close()
                except BufferError:  # the worker still holds views of its last hand-off
                    pass
