"""Multi-table checkpoints: round trip, damage detection, crash at any instant."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from consumers.sequencing import SeqTracker
from consumers.serving.table import ServingTable
from consumers.storage.snapshot import (
    Snapshot,
    SnapshotError,
    read_snapshot,
    snapshot_exists,
    write_snapshot,
)

REPO = Path(__file__).resolve().parents[3]


def make_state(version: int, n: int = 200):
    """Tables whose every value is ``version``, offsets and seqs derived from it."""
    rng = np.random.default_rng(version)
    tables = {}
    for name, dim in (("user", 4), ("item/v2", 3)):
        t = ServingTable(name, dim)
        t.upsert(rng.choice(1 << 40, n, replace=False), np.full((n, dim), float(version)))
        tables[name] = t
    seqs = SeqTracker()
    seqs.commit("user", 0, 1, version)
    return dict(tables=tables, offsets={0: version, 3: 2 * version}, seqs=seqs.state(),
                meta={"version": version, "topic": "deltas.m"})


def check_state(snap: Snapshot, version: int) -> None:
    """``snap`` is exactly the state make_state(version) wrote."""
    exp = make_state(version)
    assert snap.meta == exp["meta"]
    assert snap.offsets == exp["offsets"]
    assert SeqTracker.from_state(snap.seqs).state() == exp["seqs"]
    assert sorted(snap.tables) == sorted(exp["tables"])
    for name, t in exp["tables"].items():
        assert snap.tables[name].digest() == t.digest()


def test_round_trip(tmp_path):
    path = tmp_path / "ckpt"
    assert not snapshot_exists(path)
    write_snapshot(path, **make_state(1))
    assert snapshot_exists(path)
    snap = read_snapshot(path)
    check_state(snap, 1)
    assert snap.path == path
    assert isinstance(next(iter(snap.offsets)), int)
    write_snapshot(path, **make_state(2))
    check_state(read_snapshot(path), 2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_empty_snapshot(tmp_path):
    write_snapshot(tmp_path / "c", tables={}, offsets={}, seqs={}, meta={})
    snap = read_snapshot(tmp_path / "c")
    assert (snap.tables, snap.offsets, snap.seqs, snap.meta) == ({}, {}, {}, {})


def test_reads_single_table_save_dir(tmp_path):
    t = make_state(3)["tables"]["user"]
    t.save(tmp_path / "t")
    snap = read_snapshot(tmp_path / "t")
    assert list(snap.tables) == ["user"] and snap.offsets == {}
    assert snap.tables["user"].digest() == t.digest()


@pytest.mark.parametrize("kw, exc", [
    (dict(offsets={-1: 3}), ValueError),
    (dict(offsets={0: "3"}), ValueError),
    (dict(meta={"x": object()}), ValueError),
    (dict(meta={"x": float("nan")}), ValueError),
    (dict(seqs=[1]), TypeError),
    (dict(tables={"other": ServingTable("user", 2)}), ValueError),
    (dict(tables={"user": "nope"}), TypeError),
])
def test_write_validates_arguments(tmp_path, kw, exc):
    state = make_state(1) | kw
    with pytest.raises(exc):
        write_snapshot(tmp_path / "c", **state)
    assert not snapshot_exists(tmp_path / "c")
    assert os.listdir(tmp_path) == []  # no temp dir left


def test_damaged_table_file_named(tmp_path):
    path = tmp_path / "c"
    write_snapshot(path, **make_state(1))
    f = path / "tables" / "0001" / "rows.npy"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match=r"tables/0001/rows.npy: crc32c checksum mismatch"):
        read_snapshot(path)


def test_replaced_table_manifest_detected(tmp_path):
    """Swapping a whole table directory for another valid one is caught by the top
    manifest's checksum of each table manifest."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_snapshot(a, **make_state(1))
    write_snapshot(b, **make_state(2))
    shutil.rmtree(a / "tables" / "0000")
    shutil.copytree(b / "tables" / "0000", a / "tables" / "0000")
    with pytest.raises(SnapshotError, match="tables/0000/manifest.json"):
        read_snapshot(a)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(version=3), "not supported"),
    (lambda d: d.update(format="x"), "format"),
    (lambda d: d["tables"][0].update(dir="../../etc"), "tables/NNNN"),
    (lambda d: d.update(offsets={"a": 1}), "offsets"),
    (lambda d: d["tables"][0].update(name="zzz"), "manifest says"),
])
def test_malformed_manifest(tmp_path, mutate, match):
    from consumers.files import seal

    path = tmp_path / "c"
    write_snapshot(path, **make_state(1))
    doc = json.loads((path / "manifest.json").read_text())
    body = {k: v for k, v in doc.items() if k != "checksum"}
    mutate(body)
    (path / "manifest.json").write_text(json.dumps(seal(body)))
    with pytest.raises(SnapshotError, match=match):
        read_snapshot(path)


def test_missing_manifest_and_half_written_dir(tmp_path):
    path = tmp_path / "c"
    write_snapshot(path, **make_state(1))
    (path / "manifest.json").unlink()
    with pytest.raises(SnapshotError, match="manifest missing"):
        read_snapshot(path)
    assert not snapshot_exists(path)


# ----------------------------------------------------------------------------- crashes


class _Crash(BaseException):
    """Simulated process death: not an Exception, so no cleanup handler runs."""


def _count_ops(monkeypatch, crash_at: int | None) -> list[str]:
    """Patch the filesystem steps write_snapshot takes; raise _Crash at step ``crash_at``."""
    ops: list[str] = []

    def wrap(name, fn):
        def inner(*a, **k):
            if crash_at is not None and len(ops) == crash_at:
                raise _Crash(name)
            ops.append(name)
            return fn(*a, **k)
        return inner

    monkeypatch.setattr(os, "rename", wrap("rename", os.rename))
    monkeypatch.setattr(os, "replace", wrap("replace", os.replace))
    # fsync is counted as a step but not performed: durability against power loss is not
    # what this simulates, and real fsyncs make the many rounds slow
    monkeypatch.setattr(os, "fsync", wrap("fsync", lambda fd: None))
    monkeypatch.setattr(os, "mkdir", wrap("mkdir", os.mkdir))
    monkeypatch.setattr(shutil, "rmtree", wrap("rmtree", shutil.rmtree))
    return ops


@pytest.mark.parametrize("leftover", ["none", "old", "tmp"])
def test_crash_at_every_step_leaves_old_or_new(tmp_path, monkeypatch, leftover):
    """Crash write_snapshot at each of its filesystem steps, starting from a clean state and
    from states an earlier crash leaves: the snapshot read back is always the old or the
    new one, complete, and the next write recovers."""
    path = tmp_path / "c"

    def prepare():
        shutil.rmtree(tmp_path)
        tmp_path.mkdir()
        write_snapshot(path, **make_state(1))
        if leftover == "old":  # crash between the two renames of an earlier write
            os.rename(path, str(path) + ".old")
        elif leftover == "tmp":  # crash while an earlier write was filling its temp dir
            (tmp_path / "c.tmp-999-abc").mkdir()
            (tmp_path / "c.tmp-999-abc" / "junk").write_bytes(b"x")

    with monkeypatch.context() as m:
        prepare()
        ops = _count_ops(m, None)
        write_snapshot(path, **make_state(2))
    assert "fsync" in ops and "rename" in ops
    n_steps = len(ops)
    outcomes = set()
    for k in range(n_steps + 1):
        prepare()
        with monkeypatch.context() as m:
            _count_ops(m, k)
            try:
                write_snapshot(path, **make_state(2))
                crashed = False
            except _Crash:
                crashed = True
        assert crashed == (k < n_steps)
        assert snapshot_exists(path)
        snap = read_snapshot(path)
        version = snap.meta["version"]
        assert version in (1, 2), k
        check_state(snap, version)
        outcomes.add(version)
        # after the write returned, the new snapshot is the one read
        if not crashed:
            assert version == 2
        # recovery: the next write succeeds and cleans up
        write_snapshot(path, **make_state(3))
        check_state(read_snapshot(path), 3)
        assert sorted(os.listdir(tmp_path)) == ["c"], (k, os.listdir(tmp_path))
    assert outcomes == {1, 2}


def test_crash_during_first_write_leaves_nothing_or_new(tmp_path, monkeypatch):
    path = tmp_path / "c"
    with monkeypatch.context() as m:
        ops = _count_ops(m, None)
        write_snapshot(path, **make_state(1))
    shutil.rmtree(path)
    for k in range(len(ops)):
        with monkeypatch.context() as m:
            _count_ops(m, k)
            with pytest.raises(_Crash):
                write_snapshot(path, **make_state(1))
        if snapshot_exists(path):
            check_state(read_snapshot(path), 1)
        else:
            with pytest.raises(SnapshotError, match="no snapshot"):
                read_snapshot(path)
        shutil.rmtree(path, ignore_errors=True)


_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {tests!r})
    from test_snapshot import make_state
    from consumers.storage.snapshot import read_snapshot, snapshot_exists, write_snapshot
    path = sys.argv[1]
    v = read_snapshot(path).meta["version"] + 1 if snapshot_exists(path) else 1
    while True:
        write_snapshot(path, **make_state(v, n=3000))
        print(v, flush=True)
        v += 1
""")


def test_sigkill_while_writing(tmp_path):
    """A real process writing checkpoints in a loop is killed with SIGKILL at random
    instants and restarted; every time, the snapshot on disk is complete, consistent and
    at least as new as the last write that returned."""
    path = tmp_path / "c"
    code = _CHILD.format(repo=str(REPO), tests=str(Path(__file__).parent))
    rng = np.random.default_rng(0)
    last_done = 0
    versions = []
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)],
                                stdout=subprocess.PIPE, text=True)
        try:
            first = proc.stdout.readline()  # one write completed in this incarnation
            assert first.strip(), "child failed to start"
            time.sleep(float(rng.uniform(0.0, 0.3)))
            proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        done = [int(x) for x in (first + out).split()]
        last_done = max([last_done, *done])
        snap = read_snapshot(path)
        v = snap.meta["version"]
        assert v >= last_done  # a returned write is durable (possibly a newer one landed)
        versions.append(v)
        for t in snap.tables.values():
            assert (t.rows() == v).all()
            assert len(t) == 3000
        assert snap.offsets == {0: v, 3: 2 * v}
    assert versions == sorted(versions) and versions[-1] > versions[0]
