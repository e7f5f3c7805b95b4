"""BudgetPublisher(worker="process"): rounds in a real child process, a real broker.

What the process adds over the thread worker, each checked here: the rows still arrive
(last values, exactly once: seqs continue across the child's publisher and the user's),
round records reach ``on_round`` in the training process, the hand-off files never stay
behind, and a child killed with SIGKILL is an error at the next ``tick`` / ``flush``, not
a stall or a silent loss.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from deltastream import DeltaPublisher, DeltaTracker, HashTable, TrackingMode, ensure_topic, wire
from deltastream.cores import spare_cores
from deltastream.errors import PublishError
from deltastream.publishing.budget import BudgetPolicy, BudgetPublisher
from deltastream.publishing.round_publisher import RoundPolicy, RoundPublisher
from deltastream.publishing.rounds import SelectionPolicy
from tests.integration.test_budget_outage import DIM, ROWS, assert_every_row_served, tracked_table
from tests.integration.test_publisher import read_all

pytestmark = pytest.mark.integration

logging.getLogger("kafka").setLevel(logging.CRITICAL)

def _train(table: HashTable | list[HashTable], tracker: DeltaTracker, bp: BudgetPublisher,
           steps: range, g: torch.Generator, ids: int = 200) -> None:
    """``steps`` steps: ``ids`` random rows of each table looked up and moved, a tick."""
    for step in steps:
        for t in table if isinstance(table, list) else [table]:
            got = torch.randint(0, ROWS, (ids,), generator=g).unique()
            with torch.no_grad():
                rows = t(got)
                t.insert(got, rows + torch.randn(len(got), DIM, generator=g))
        tracker.step()
        bp.tick(step)


def _handoff_files() -> set[str]:
    return set(glob.glob("/dev/shm/deltastream-handoff-*"))


@pytest.mark.parametrize("kind", ["budget", "rounds"])
def test_rows_arrive_exactly_once_and_seqs_continue_after_the_worker_process(broker,
                                                                            topic_name, kind):
    servers = broker.bootstrap_servers
    table, tracker, pub = tracked_table(servers, topic_name)
    before = _handoff_files()
    threads_before = set(threading.enumerate())  # other tests' may linger until collected
    rounds = []
    bp = BudgetPublisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=3_000),
                         worker="process", on_round=rounds.append) if kind == "budget" else \
        RoundPublisher(tracker, pub, "p", RoundPolicy(SelectionPolicy(k=100), every=4),
                       worker="process", on_round=rounds.append)
    g = torch.Generator().manual_seed(0)
    try:
        _train(table, tracker, bp, range(1, 61), g)
        # the parent gives each shipped hand-off's row buffers back to the tracker: later
        # intervals reuse them, not new memory faulted in on the training thread
        bufs0 = tracker.stats()["row_buffers"]
        for step in range(61, 81):
            _train(table, tracker, bp, range(step, step + 1), g)
            bp.drain(timeout=60)  # every tick hands off
        bufs = tracker.stats()["row_buffers"]
        assert bufs["reused"] - bufs0["reused"] >= 5, (bufs0, bufs)  # a hand-off every 4 ticks or less
        assert bufs["allocated"] - bufs0["allocated"] <= 4, (bufs0, bufs)
        with pytest.raises(RuntimeError,
                           match="lent to budget worker process.*worker=\"thread\""):
            pub.publish("emb", torch.arange(2), torch.zeros(2, DIM), step=80)  # a 2nd writer
        final = bp.flush(80, timeout=60)
        st = bp.stats()
        assert st["worker"] == "process" and st["pending"] == 0
        assert final.round.final and bp.last is not None
        # round records cross with their outcomes: offsets of every message, settled
        results = [t.result for r in rounds for t in r.round.tables if t.result is not None]
        assert results and all(len(res.offsets) == res.messages for res in results)
        offsets = sorted(o for res in results for o in res.offsets)
        assert len(set(offsets)) == len(offsets)
        # the user's publisher reports the seqs the child used (a mid-run seq snapshot)
        assert pub.stats()["next_seq"]["emb"] == max(res.last_seq for res in results) + 1
        # and with their ids as tensors, as the thread worker's (they cross as numpy)
        tables = [t for r in [*rounds, final] for t in r.round.tables]
        assert all(isinstance(t.ids, torch.Tensor) and t.ids.numel() == t.published
                   for t in tables)
        assert sum(t.published for t in tables) == sum(t.result.rows for t in tables
                                                       if t.result is not None)
        assert st["bytes"] > 0 and st["rows"] > 0
    finally:
        bp.close()
    # no thread of its own left running: one still finishing at interpreter exit freed a
    # hand-off (a tensor holding a Python hook) after finalization began and aborted the
    # process ("terminate called without an active exception", 1 run in ~40)
    assert not [t.name for t in set(threading.enumerate()) - threads_before
                if t.name.startswith("deltastream-p-")]
    assert _handoff_files() <= before  # every hand-off file it made is gone
    # the user's publisher continues the child's seqs: one more message, no repeat
    held = table.lookup(torch.arange(ROWS))
    pub.publish("emb", torch.arange(5), held[:5], step=81).wait(10)
    pub.close(timeout=10)
    records = read_all(servers, topic_name)
    batches = [wire.decode(r.value) for r in records]
    seqs = [b.seq for b in batches]
    assert seqs == list(range(len(seqs))), seqs[:20]  # in order, none repeated or missing
    assert np.count_nonzero(np.abs(held.numpy()).sum(axis=1)) > 100
    assert_every_row_served([records], table)


def test_a_hand_off_of_many_tables_read_in_parts_reaches_the_worker_process_whole(
        broker, topic_name, monkeypatch):
    """Five tables, a hand-off read a table a tick (``HANDOFF_PART_S`` 0) and shipped to
    the worker process once the last is read, the refill of its ticks with it: every row
    of every table that changed is served with its last value."""
    from deltastream.publishing import budget

    monkeypatch.setattr(budget, "HANDOFF_TABLES", 1)
    monkeypatch.setattr(budget, "HANDOFF_PART_S", 0.0)
    servers = broker.bootstrap_servers
    assert ensure_topic(servers, topic_name, 1) == 1
    tables = {}
    for name in ("t0", "t1", "t2", "t3", "t4"):
        tables[name] = HashTable(DIM, name=name, capacity=2 * ROWS)
        tables[name].insert(torch.arange(ROWS), torch.zeros(ROWS, DIM))
    tracker = DeltaTracker(torch.nn.ModuleDict(tables), consumers=["p"],
                           mode=TrackingMode.EMBEDDING)
    pub = DeltaPublisher(servers, topic_name, model="m", shard=0, dtype="f32")
    bp = BudgetPublisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=6_000),
                         worker="process")
    g = torch.Generator().manual_seed(3)
    try:
        _train(list(tables.values()), tracker, bp, range(1, 61), g, ids=100)
        bp.drain(timeout=60)
        st = bp.stats()
        # (a hand-off of five tables: four ticks read its later parts)
        assert st["worker"] == "process" and st["part_ticks"] >= 8 and st["rounds"] >= 2
        bp.flush(61, timeout=60)
    finally:
        bp.close()
    pub.close(timeout=10)
    by_table: dict[str, list] = {}
    for r in read_all(servers, topic_name):
        by_table.setdefault(wire.decode(r.value).table, []).append(r)
    for name, table in tables.items():
        assert_every_row_served([by_table[name]], table)


def test_last_is_the_latest_rounds_record_without_an_on_round(broker, topic_name):
    """Without ``on_round`` the child sends no round's record (the reader thread would
    unpickle each beside training); ``last`` asks for the latest when read."""
    table, tracker, pub = tracked_table(broker.bootstrap_servers, topic_name)
    bp = RoundPublisher(tracker, pub, "p", RoundPolicy(SelectionPolicy(k=50), every=3),
                        worker="process")
    g = torch.Generator().manual_seed(2)
    try:
        assert bp.last is None  # no round yet
        for start, end in ((1, 10), (11, 22)):
            for step in range(start, end + 1):
                _train(table, tracker, bp, range(step, step + 1), g)
                last = bp.drain(timeout=60)  # no tick deferred: a round every 3 steps
            assert last is bp.last  # read once, then kept until a later round
            assert last.round.step == end - end % 3 and not last.round.final
            (t,) = last.round.tables
            assert isinstance(t.ids, torch.Tensor) and 0 < t.ids.numel() == t.published <= 50
            assert len(t.result.offsets) == t.result.messages
        final = bp.flush(23, timeout=60)
        assert bp.last.round.final and bp.last.round.step == final.round.step == 23
        rounds = bp.stats()["rounds"]
        _train(table, tracker, bp, range(24, 27), g)  # a round at 24 (21 + 3): not read
        deadline = time.monotonic() + 60
        while bp.stats()["rounds"] == rounds and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        bp.close()
    assert bp.last.round.step == 24  # the close fetched it
    pub.close(timeout=10)


def test_a_killed_worker_process_is_an_error_at_the_next_tick_not_a_stall(broker, topic_name):
    servers = broker.bootstrap_servers
    table, tracker, pub = tracked_table(servers, topic_name)
    bp = BudgetPublisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=3_000),
                         worker="process")
    g = torch.Generator().manual_seed(1)
    try:
        _train(table, tracker, bp, range(1, 11), g)
        pid = bp.stats()["worker_pid"]
        assert pid != os.getpid()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        with pytest.raises((PublishError, RuntimeError), match="worker process"):
            step = 11
            while time.monotonic() < deadline:  # ticks go on until the death is seen
                t0 = time.perf_counter()
                _train(table, tracker, bp, range(step, step + 1), g)
                assert time.perf_counter() - t0 < 5.0
                step += 1
                time.sleep(0.01)
        with pytest.raises((PublishError, RuntimeError), match="new DeltaPublisher"):
            bp.flush(step, timeout=10)
    finally:
        bp.close()
    # the dead child's last seqs are unknown: this publisher would reuse them
    with pytest.raises(RuntimeError, match="which died .* new DeltaPublisher"):
        pub.publish("emb", torch.arange(2), torch.zeros(2, DIM), step=step)
    pub.close(timeout=5)


_UNGUARDED = """
import sys
print("TOP LEVEL", flush=True)  # a training script with no __main__ guard
import torch
from deltastream import DeltaPublisher, DeltaTracker, HashTable, TrackingMode
from deltastream.publishing.budget import BudgetPolicy, BudgetPublisher
from deltastream.publishing.round_publisher import RoundPolicy, RoundPublisher
from deltastream.publishing.rounds import SelectionPolicy
servers, topic, how = sys.argv[1:4]
if how == "main-class":
    class MyPublisher(DeltaPublisher):
        pass
    cls = MyPublisher
else:
    cls = DeltaPublisher
table = HashTable(4, name="emb", capacity=64)
tracker = DeltaTracker(torch.nn.ModuleDict({"emb": table}), consumers=["p"],
                       mode=TrackingMode.EMBEDDING)
pub = cls(servers, topic, model="m", shard=0)
try:
    bp = BudgetPublisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=1000),
                         worker="process")
except TypeError as e:
    print("REFUSED", e, flush=True)
    sys.exit(0)
for step in range(5):
    table.insert(torch.arange(step, step + 3), torch.full((3, 4), step + 1.0))
    tracker.step()
    bp.tick(step)
bp.flush(5)
print("PUBLISHED", bp.stats()["rows"] + bp.stats()["final_rows"], flush=True)
bp.close()
pub.close()
"""


@pytest.mark.parametrize("how", ["plain", "main-class"])
def test_a_script_without_a_main_guard_runs_once(broker, topic_name, tmp_path, how):
    """The worker process is a new interpreter that imports deltastream, not the user's
    ``__main__`` (multiprocessing's spawn re-ran an unguarded script's whole job in the
    child, which then died); a publisher class defined in ``__main__`` is refused, naming
    why, before any process starts."""
    import subprocess
    import sys

    from deltastream import ensure_topic

    ensure_topic(broker.bootstrap_servers, topic_name, 1)
    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED)
    r = subprocess.run([sys.executable, str(script), broker.bootstrap_servers, topic_name,
                        how], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("TOP LEVEL") == 1, r.stdout
    if how == "plain":  # ids 0..6, each published once at least
        assert int(r.stdout.split("PUBLISHED ")[1].split()[0]) >= 7, r.stdout
    else:
        assert "REFUSED" in r.stdout and "defined in __main__" in r.stdout, r.stdout


class _FailsInTheChild(DeltaPublisher):
    """A real publisher whose copy in a worker process fails to start (a module class, so
    the child can import it)."""

    def spawn_args(self) -> dict:
        return dict(super().spawn_args(), model=None)  # the child's __init__ rejects it


@pytest.fixture
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_auto_runs_rounds_in_a_worker_process_when_a_core_is_spare(broker, topic_name,
                                                                   one_torch_thread):
    if spare_cores() == 0:
        pytest.skip("one core: torch's thread leaves none spare")
    servers = broker.bootstrap_servers
    table, tracker, pub = tracked_table(servers, topic_name)
    bp = BudgetPublisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=3_000))
    try:
        assert bp.stats()["worker"] == "process" and bp.stats()["worker_pid"] != os.getpid()
        _train(table, tracker, bp, range(1, 21), torch.Generator().manual_seed(2))
        bp.flush(20, timeout=60)
    finally:
        bp.close()
    pub.close(timeout=10)
    assert_every_row_served([read_all(servers, topic_name)], table)


def test_auto_falls_back_to_the_thread_when_the_worker_process_cannot_start(
        broker, topic_name, one_torch_thread, caplog):
    if spare_cores() == 0:
        pytest.skip("one core: auto would not try a worker process")
    servers = broker.bootstrap_servers
    table, tracker, _ = tracked_table(servers, topic_name)
    pub = _FailsInTheChild(servers, topic_name, model="m", shard=0, dtype="f32")
    with caplog.at_level(logging.WARNING, "deltastream.publishing.budget"):
        bp = BudgetPublisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=3_000))
    try:
        assert bp.stats()["worker"] == "thread"
        assert "no worker process" in caplog.text
        _train(table, tracker, bp, range(1, 21), torch.Generator().manual_seed(3))
        bp.flush(20, timeout=60)  # the user's publisher was given back: it sends
    finally:
        bp.close()
    pub.close(timeout=10)
    assert_every_row_served([read_all(servers, topic_name)], table)


_SMALL_SHM = """
import sys
import numpy as np
import torch
from deltastream import DeltaPublisher, DeltaTracker, HashTable, TrackingMode
from deltastream.publishing.budget import BudgetPolicy, BudgetPublisher
from deltastream.publishing.round_publisher import RoundPolicy, RoundPublisher
from deltastream.publishing.rounds import SelectionPolicy
servers, topic, out = sys.argv[1:4]
rows, dim = 20_000, 32
table = HashTable(dim, name="emb", capacity=2 * rows)
table.insert(torch.arange(rows), torch.zeros(rows, dim))
tracker = DeltaTracker(torch.nn.ModuleDict({"emb": table}), consumers=["p"],
                       mode=TrackingMode.EMBEDDING)
pub = DeltaPublisher(servers, topic, model="m", shard=0, dtype="f32")
bp = BudgetPublisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=100_000),
                     worker="process")
g = torch.Generator().manual_seed(4)
for step in range(1, 31):  # each hand-off ~1 MB: more than the tmpfs holds
    ids = torch.randint(0, rows, (4000,), generator=g).unique()
    with torch.no_grad():
        table.insert(ids, table(ids) + torch.randn(len(ids), dim, generator=g))
    tracker.step()
    bp.tick(step)
bp.flush(30, timeout=120)
print("INLINE", bp.stats()["backlog"]["inline_handoffs"], flush=True)
bp.close()
pub.close(timeout=30)
np.save(out, table.lookup(torch.arange(rows)).numpy())
"""


def test_a_full_shm_tmpfs_ships_hand_offs_through_the_socket_and_loses_nothing(
        broker, topic_name, tmp_path):
    """/dev/shm too small for a hand-off (a real 512 KB tmpfs mounted over it in a mount
    namespace of the trainer's own; Docker's default is 64 MB): a file mapped beyond the
    tmpfs's room would kill the trainer with SIGBUS at the first write. The space is
    reserved first, and a hand-off that does not fit goes through the socket."""
    import subprocess
    import sys

    from deltastream import ensure_topic
    from tests.disk_faults import mount_namespace
    from tests.integration.test_budget_outage import assert_rows_served

    ensure_topic(broker.bootstrap_servers, topic_name, 1)
    script, out = tmp_path / "train.py", tmp_path / "held.npy"
    script.write_text(_SMALL_SHM)
    cmd = " ".join([
        "mount -t tmpfs -o size=512k tmpfs /dev/shm || exit 77;", "exec", sys.executable,
        str(script), broker.bootstrap_servers, topic_name, str(out)])
    r = subprocess.run([*mount_namespace(), "sh", "-c", cmd], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    if r.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert int(r.stdout.split("INLINE ")[1].split()[0]) > 0, r.stdout
    assert_rows_served([read_all(broker.bootstrap_servers, topic_name)], np.load(out))
