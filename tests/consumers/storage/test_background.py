"""CheckpointWriter (consumers.storage.background): checkpoints written in a background
thread hold exactly the state frozen at submit, while the tables keep changing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import consumers.storage.checkpoint as ck
from consumers.files import HashingWriter
from consumers.serving.table import ServingTable
from consumers.storage.background import CheckpointWriter
from consumers.storage.checkpoint import CheckpointResult, CheckpointStore
from consumers.storage.snapshot import read_snapshot


def _tables() -> dict[str, ServingTable]:
    a = ServingTable("a", 8)
    a.upsert(np.arange(5000), np.ones((5000, 8), np.float32))
    b = ServingTable("b", 4, dtype="f16")
    b.upsert(np.arange(10), np.ones((10, 4), np.float32))
    return {"a": a, "b": b}


def _churn(tables: dict[str, ServingTable], v: float) -> None:
    a = tables["a"]
    a.upsert(np.arange(0, 5000, 2), np.full((2500, 8), v, np.float32))
    a.delete(np.arange(1, 200, 2))
    a.upsert(np.arange(10_000, 10_050), np.full((50, 8), v, np.float32))


@pytest.mark.parametrize("kind", ["base", "segment"])
def test_the_checkpoint_holds_the_state_at_submit(tmp_path, monkeypatch, kind):
    tables = _tables()
    store = CheckpointStore(tmp_path / "ck")
    w = CheckpointWriter(store)
    if kind == "segment":
        assert w.submit(tables=tables, offsets={0: 1}, seqs={}, meta={})
        assert w.wait(30) and isinstance(w.results()[0], CheckpointResult)
        _churn(tables, 2.0)
    want = {n: t.digest() for n, t in tables.items()}
    gate, inside = threading.Event(), threading.Event()
    real_base, real_seg = HashingWriter.write, ck.write_chunks

    def slow_base(self, b):
        inside.set()
        gate.wait(30)
        return real_base(self, b)

    def slow_seg(path, chunks):
        inside.set()
        gate.wait(30)
        return real_seg(path, chunks)

    monkeypatch.setattr(HashingWriter, "write", slow_base)
    monkeypatch.setattr(ck, "write_chunks", slow_seg)
    meta = {"m": [1]}
    assert w.submit(tables=tables, offsets={0: 2}, seqs={}, meta=meta)
    assert store.plan(tables) == "segment" or kind == "base"
    assert inside.wait(30) and w.busy
    assert not w.submit(tables=tables, offsets={0: 3}, seqs={}, meta={})  # one in flight
    for v in (3.0, 4.0, 5.0):  # the tables change while the checkpoint is written
        _churn(tables, v)
    meta["m"].append(2)
    gate.set()
    assert w.wait(30)
    (res,) = w.results()
    assert isinstance(res, CheckpointResult) and res.kind == kind
    snap = read_snapshot(tmp_path / "ck")
    assert snap.offsets == {0: 2} and snap.meta == {"m": [1]}
    assert {n: t.digest() for n, t in snap.tables.items()} == want
    # the next checkpoint holds everything since
    monkeypatch.undo()
    assert w.submit(tables=tables, offsets={0: 4}, seqs={}, meta={})
    w.close(30)
    snap = read_snapshot(tmp_path / "ck")
    assert {n: t.digest() for n, t in snap.tables.items()} == \
        {n: t.digest() for n, t in tables.items()}


def test_a_failed_background_write_is_reported_and_the_next_is_a_base(tmp_path, monkeypatch):
    tables = _tables()
    store = CheckpointStore(tmp_path / "ck")
    w = CheckpointWriter(store)
    assert w.submit(tables=tables, offsets={0: 1}, seqs={}, meta={})
    w.wait(30)
    w.results()
    _churn(tables, 2.0)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "write_chunks", boom)
    assert w.submit(tables=tables, offsets={0: 2}, seqs={}, meta={})
    w.wait(30)
    (err,) = w.results()
    assert isinstance(err, OSError)
    monkeypatch.undo()
    assert store.plan(tables) == "base"
    assert w.submit(tables=tables, offsets={0: 3}, seqs={}, meta={})
    w.wait(30)
    (res,) = w.results()
    assert res.kind == "base"
    snap = read_snapshot(tmp_path / "ck")
    assert {n: t.digest() for n, t in snap.tables.items()} == \
        {n: t.digest() for n, t in tables.items()}


_KILLED_WRITER = r"""
import sys, time
import numpy as np
from consumers.serving.table import ServingTable
from consumers.storage.background import CheckpointWriter
from consumers.storage.checkpoint import CheckpointStore

path, rows = sys.argv[1], int(sys.argv[2])
t = ServingTable("a", 64)
rng = np.random.default_rng(0)
t.upsert(np.arange(rows), rng.standard_normal((rows, 64)).astype(np.float32))
# every checkpoint is a full base: the longest write there is
w = CheckpointWriter(CheckpointStore(path, max_segments=0))
k = 0
while True:
    if not w.busy:
        w.results()
        k += 1
        print("freeze", k, t.digest(), flush=True)
        assert w.submit(tables={"a": t}, offsets={0: k}, seqs={}, meta={"k": k})
    # applying goes on while the base is written
    ids = rng.integers(0, rows + 1000, 512)
    t.upsert(ids, np.full((512, 64), float(k), np.float32))
    time.sleep(0.0005)
"""


def test_sigkill_mid_background_write_leaves_the_previous_checkpoint(tmp_path):
    """A real process writes full bases in the background while it keeps applying; it is
    SIGKILLed while a base is half-written on disk: the checkpoint loads, as exactly the
    state frozen for the checkpoint its manifest names, and the leftovers go."""
    repo = Path(__file__).resolve().parents[3]
    path = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path), "200000"],
                            cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo)),
                            stdout=subprocess.PIPE, text=True)
    frozen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 120
        half = False
        while time.monotonic() < deadline and not half:
            # a base directory being written (not yet renamed into place), after at
            # least one checkpoint was committed
            half = path.is_dir() and (path / "manifest.json").is_file() and any(
                ".tmp-" in p.name and p.name.startswith("base-") for p in path.iterdir())
            if not half:
                time.sleep(0.0005)
        assert half, "never saw a base being written"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        out = proc.stdout.read() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for line in out.splitlines():
        _, k, digest = line.split()
        frozen[int(k)] = digest
    store = CheckpointStore(path)
    snap = store.load()
    assert snap is not None
    k = snap.offsets[0]
    assert snap.meta == {"k": k} and k in frozen
    assert snap.tables["a"].digest() == frozen[k]
    assert not [p.name for p in path.iterdir() if ".tmp-" in p.name]  # cleaned at load
