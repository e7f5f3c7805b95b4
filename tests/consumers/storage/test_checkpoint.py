"""Incremental checkpoints (consumers.storage.checkpoint): chains, compaction, damage, crashes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import crc32c
import numpy as np
import pytest

import consumers.storage.checkpoint as ck
from consumers.files import seal
from consumers.serving.table import ServingTable, SnapshotError
from consumers.storage.checkpoint import CheckpointStore, read_checkpoint
from consumers.storage.snapshot import read_snapshot, write_snapshot

REPO = Path(__file__).resolve().parents[3]


def _step(tables: dict[str, ServingTable], i: int) -> None:
    """Deterministic changes of step ``i``: upserts (new and old ids), deletes, re-inserts."""
    rng = np.random.default_rng(i)
    for _name, t in sorted(tables.items()):
        ids = np.unique(rng.integers(0, 3000, 200))
        t.upsert(ids, rng.standard_normal((ids.size, t.dim)).astype(np.float32))
        t.delete(rng.integers(0, 3000, 40))


def _fresh() -> dict[str, ServingTable]:
    return {"a": ServingTable("a", 8), "b": ServingTable("b", 4, dtype="f16")}


def _digests(tables: dict[str, ServingTable]) -> dict[str, str]:
    return {n: t.digest() for n, t in tables.items()}


def _write(store: CheckpointStore, tables, i: int):
    return store.write(tables=tables, offsets={0: i}, seqs={"i": i}, meta={"step": i})


def _chain(path: Path, steps: int) -> tuple[CheckpointStore, dict[str, ServingTable]]:
    """A store at ``path`` holding a base and ``steps - 1`` segments, and its tables."""
    store = CheckpointStore(path, max_segment_fraction=100.0)
    tables = _fresh()
    for i in range(steps):
        _step(tables, i)
        _write(store, tables, i)
    return store, tables


def _damage_base_rows(path: Path) -> None:
    """Flip a bit in the rows of the first table of the checkpoint's base."""
    rows = next(path.glob("base-*/tables/0000/rows.npy"))
    raw = bytearray(rows.read_bytes())
    raw[-1] ^= 1
    rows.write_bytes(bytes(raw))


def test_chain_with_deletes_and_reinserts_loads_equal_at_every_step(tmp_path):
    path = tmp_path / "ck"
    store = CheckpointStore(path, max_segments=1000, max_segment_fraction=100.0)
    tables = _fresh()
    kinds = []
    for i in range(12):
        _step(tables, i)
        if i == 5:  # delete an id and re-insert it between two checkpoints
            tables["a"].delete([7])
            tables["a"].upsert([7], np.full((1, 8), 3.5, np.float32))
            tables["a"].upsert([99999], np.ones((1, 8), np.float32))
            tables["a"].delete([99999])  # inserted then deleted: never in a checkpoint
        kinds.append(_write(store, tables, i).kind)
        snap = read_snapshot(path)
        assert snap.offsets == {0: i} and snap.seqs == {"i": i} and snap.meta == {"step": i}
        assert _digests(snap.tables) == _digests(tables)
    assert kinds == ["base"] + ["segment"] * 11
    body = json.loads((path / "manifest.json").read_text())
    assert body["format"] == "deltastream-checkpoint" and len(body["segments"]) == 11
    assert read_snapshot(path).tables["a"].lookup([7])[0].tolist() == [3.5] * 8
    # a new store (a restarted daemon) continues the same chain
    store2 = CheckpointStore(path, max_segments=1000, max_segment_fraction=100.0)
    loaded = store2.load()
    assert _digests(loaded.tables) == _digests(tables)
    _step(loaded.tables, 100)
    _step(tables, 100)
    assert _write(store2, loaded.tables, 12).kind == "segment"
    assert _digests(read_snapshot(path).tables) == _digests(tables)


def test_segment_holds_only_changed_rows(tmp_path):
    t = ServingTable.from_arrays("e", np.arange(20000), np.ones((20000, 16), np.float32))
    store = CheckpointStore(tmp_path / "ck")
    base = store.write(tables={"e": t}, offsets={}, seqs={}, meta={})
    t.upsert(np.arange(100), np.zeros((100, 16), np.float32))
    t.delete(np.arange(100, 110))
    seg = store.write(tables={"e": t}, offsets={}, seqs={}, meta={})
    assert (base.kind, base.upserts) == ("base", 20000)
    assert (seg.kind, seg.upserts, seg.deletes) == ("segment", 100, 10)
    assert seg.bytes < base.bytes / 50
    # nothing changed: only the manifest (offsets/seqs) is written, no segment file
    idle = store.write(tables={"e": t}, offsets={0: 5}, seqs={}, meta={})
    assert idle.kind == "segment" and idle.upserts == idle.deletes == 0
    assert len(list((tmp_path / "ck").glob("seg-*"))) == 1
    assert read_snapshot(tmp_path / "ck").offsets == {0: 5}


def test_compaction_writes_a_new_base_and_drops_old_files(tmp_path):
    path = tmp_path / "ck"
    store = CheckpointStore(path, max_segments=3, max_segment_fraction=100.0)
    tables = _fresh()
    kinds = []
    for i in range(9):
        _step(tables, i)
        kinds.append(_write(store, tables, i).kind)
        assert _digests(read_snapshot(path).tables) == _digests(tables)
    assert kinds == ["base", "segment", "segment", "segment"] * 2 + ["base"]
    names = sorted(p.name for p in path.iterdir())
    assert names == ["base-000003", "manifest.json"]  # old bases and segments removed
    # the byte fraction also triggers a base: segments of 200 rows vs a ~3000-row base
    store2 = CheckpointStore(tmp_path / "ck2", max_segments=100, max_segment_fraction=0.1)
    kinds = [_write(store2, tables, 0).kind]
    for i in range(10):
        _step(tables, 50 + i)
        kinds.append(_write(store2, tables, i).kind)
    assert kinds.count("base") >= 3 and "segment" in kinds
    assert _digests(read_snapshot(tmp_path / "ck2").tables) == _digests(tables)


def test_new_or_replaced_table_forces_a_base(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    tables = _fresh()
    assert _write(store, tables, 0).kind == "base"
    tables["c"] = ServingTable("c", 2)
    tables["c"].upsert([1], [[1.0, 2.0]])
    assert store.plan(tables) == "base"
    assert _write(store, tables, 1).kind == "base"
    assert _digests(read_snapshot(tmp_path / "ck").tables) == _digests(tables)


def test_damaged_or_missing_segment_is_detected_with_a_clear_error(tmp_path):
    path = tmp_path / "ck"
    _chain(path, 3)
    seg = sorted(path.glob("seg-*.bin"))[-1]
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x40
    seg.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match=r"seg-000001-000002\.bin: crc32c checksum mismatch"):
        read_snapshot(path)
    with pytest.raises(SnapshotError, match="crc32c"):
        CheckpointStore(path).load()
    seg.write_bytes(bytes(data[:-5]))
    with pytest.raises(SnapshotError, match="truncated or half-written"):
        read_snapshot(path)
    seg.unlink()
    with pytest.raises(SnapshotError, match="file missing"):
        read_snapshot(path)


def test_edited_manifest_and_damaged_base_are_detected(tmp_path):
    path = tmp_path / "ck"
    tables = _fresh()
    _step(tables, 0)
    _write(CheckpointStore(path), tables, 0)
    _damage_base_rows(path)
    with pytest.raises(SnapshotError, match="rows.npy: crc32c"):
        read_snapshot(path)
    man = path / "manifest.json"
    man.write_text(man.read_text().replace('"step": 0', '"step": 1'))
    with pytest.raises(SnapshotError, match="manifest checksum mismatch"):
        read_snapshot(path)


def _to_format_1(root: Path) -> None:
    """Rewrite every manifest under ``root`` the way format version 1 wrote it: version 1,
    file entries with a sha256 (deepest first: a parent lists its children's manifests)."""
    def crc(b: bytes) -> tuple[str, int]:
        return f"{crc32c.crc32c(b):08x}", len(b)

    legacy = {crc(d): {"sha256": hashlib.sha256(d).hexdigest(), "bytes": len(d)}
              for d in (f.read_bytes() for f in root.rglob("*")
                        if f.is_file() and f.name != "manifest.json")}

    def convert(x):
        if isinstance(x, dict):
            if "crc32c" in x:
                return {**{k: v for k, v in x.items() if k not in ("crc32c", "bytes")},
                        **legacy[(x["crc32c"], x["bytes"])]}
            return {k: convert(v) for k, v in x.items()}
        return [convert(v) for v in x] if isinstance(x, list) else x

    for man in sorted(root.rglob("manifest.json"), key=lambda p: -len(p.parts)):
        old = man.read_bytes()
        body = convert({k: v for k, v in json.loads(old).items() if k != "checksum"})
        new = json.dumps(seal({**body, "version": 1}), indent=1, sort_keys=True).encode()
        man.write_bytes(new)
        legacy[crc(old)] = {"sha256": hashlib.sha256(new).hexdigest(), "bytes": len(new)}
    assert not any("crc32c" in m.read_text() for m in root.rglob("manifest.json"))


def test_checkpoints_of_format_version_1_load_damage_is_caught_and_writing_goes_on(tmp_path):
    """A checkpoint written before CRC-32C (sha256 entries, version 1 in every manifest:
    checkpoint, base snapshot, table directories) loads, a damaged file is still caught,
    and a store opened on it appends version 2 segments."""
    path = tmp_path / "ck"
    _, tables = _chain(path, 3)
    _to_format_1(path)
    assert _digests(read_snapshot(path).tables) == _digests(tables)
    store = CheckpointStore(path, max_segment_fraction=100.0)
    snap = store.load()
    assert _digests(snap.tables) == _digests(tables)
    _step(snap.tables, 3)
    _step(tables, 3)
    assert _write(store, snap.tables, 3).kind == "segment"
    body = json.loads((path / "manifest.json").read_text())
    assert body["version"] == ck.CHECKPOINT_FORMAT_VERSION == 2
    assert "sha256" in body["segments"][0] and "crc32c" in body["segments"][-1]
    assert _digests(read_snapshot(path).tables) == _digests(tables)
    _damage_base_rows(path)
    with pytest.raises(SnapshotError, match="rows.npy: sha256 checksum mismatch"):
        read_snapshot(path)


def test_full_snapshots_still_load_and_are_converted(tmp_path):
    path = tmp_path / "ck"
    tables = _fresh()
    _step(tables, 0)
    write_snapshot(path, tables=tables, offsets={0: 3}, seqs={}, meta={"old": True})
    assert read_snapshot(path).meta == {"old": True}  # the full format, as before
    store = CheckpointStore(path, max_segment_fraction=100.0)
    snap = store.load()
    assert snap.offsets == {0: 3} and store.plan(snap.tables) == "base"
    _step(snap.tables, 1)
    _step(tables, 1)
    assert _write(store, snap.tables, 4).kind == "base"
    assert sorted(p.name for p in path.iterdir()) == ["base-000001", "manifest.json"]
    _step(snap.tables, 2)
    _step(tables, 2)
    assert _write(store, snap.tables, 5).kind == "segment"
    assert _digests(read_snapshot(path).tables) == _digests(tables)
    # a base dir is itself a full snapshot, usable as --base
    assert read_snapshot(path / "base-000001").offsets == {0: 4}


def test_stray_files_of_a_crashed_write_are_ignored_and_cleaned(tmp_path):
    path = tmp_path / "ck"
    _, tables = _chain(path, 2)
    want = _digests(tables)
    (path / "seg-000001-000002.bin").write_bytes(b"half a segm")
    (path / "manifest.json.tmp-1-abc").write_bytes(b"{")
    (path / "base-000002.tmp-1-abc").mkdir()
    (path / "base-000002.tmp-1-abc" / "junk").write_bytes(b"x")
    assert _digests(read_snapshot(path).tables) == want
    store2 = CheckpointStore(path, max_segment_fraction=100.0)
    loaded = store2.load()
    assert _digests(loaded.tables) == want
    assert sorted(p.name for p in path.iterdir()) == \
        ["base-000001", "manifest.json", "seg-000001-000001.bin"]
    _step(loaded.tables, 7)
    assert _write(store2, loaded.tables, 2).kind == "segment"
    _step(tables, 7)
    assert _digests(read_snapshot(path).tables) == _digests(tables)


class _Boom(OSError):
    pass


def _fail_at(monkeypatch, k: int) -> list:
    """Make the k-th filesystem step of a checkpoint write raise; returns the step log."""
    seen: list = []

    def wrap(owner, name):
        real = getattr(owner, name)

        def f(*a, **kw):
            seen.append(name)
            if len(seen) == k:
                raise _Boom(f"injected failure at step {k} ({name})")
            return real(*a, **kw)
        monkeypatch.setattr(owner, name, f)

    wrap(ck, "write_chunks")
    wrap(ck, "fsync_dir")
    wrap(ck, "write_full")
    wrap(os, "replace")
    wrap(os, "rename")
    wrap(os, "fsync")
    return seen


@pytest.mark.parametrize("kind", ["segment", "base"])
def test_failure_at_each_step_leaves_previous_or_new_state(tmp_path, monkeypatch, kind):
    k = 1
    outcomes = set()
    while True:
        path = tmp_path / f"{kind}-{k}"
        store = CheckpointStore(path, max_segments=1 if kind == "base" else 100,
                                max_segment_fraction=100.0)
        tables = _fresh()
        _step(tables, 0)
        _write(store, tables, 0)
        _step(tables, 1)
        _write(store, tables, 1)  # a segment (or, with max_segments=1, a second base)
        before = _digests(tables)
        _step(tables, 2)
        after = _digests(tables)
        assert store.plan(tables) == kind
        with monkeypatch.context() as m:
            seen = _fail_at(m, k)
            try:
                _write(store, tables, 2)
                failed = False
            except _Boom:
                failed = True
        snap = read_snapshot(path)
        got = _digests(snap.tables)
        assert got in (before, after), (kind, k, seen)
        assert snap.offsets == ({0: 1} if got == before else {0: 2}), (kind, k)
        outcomes.add(got == after)
        if failed:
            # the next write recovers (as a base) and stores exactly the live state
            _step(tables, 3)
            assert _write(store, tables, 3).kind == "base"
            assert _digests(read_snapshot(path).tables) == _digests(tables)
            assert _digests(CheckpointStore(path).load().tables) == _digests(tables)
        if not failed:
            break
        k += 1
    assert k > 4 and outcomes == {False, True}  # failures before and after the commit


_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from consumers.storage.checkpoint import CheckpointStore
    from consumers.serving.table import ServingTable
    from tests.consumers.storage.test_checkpoint import _step, _big

    store = CheckpointStore(sys.argv[1], max_segments=4)
    snap = store.load()
    if snap is None:
        tables, i = _big(), 0
        store.write(tables=tables, offsets={0: 0}, seqs={}, meta={})
    else:
        tables, i = snap.tables, snap.offsets[0]
    while True:
        i += 1
        _step(tables, i)
        r = store.write(tables=tables, offsets={0: i}, seqs={}, meta={})
        print(i, r.kind, flush=True)
""")


def _big() -> dict[str, ServingTable]:
    """Tables large enough that a base write takes a while (kills land inside it)."""
    rng = np.random.default_rng(12345)
    return {"a": ServingTable.from_arrays("a", np.arange(60000),
                                          rng.standard_normal((60000, 8)).astype(np.float32)),
            "b": ServingTable("b", 4, dtype="f16")}


def test_sigkill_at_random_instants_leaves_a_consistent_checkpoint(tmp_path):
    rng = random.Random(7)
    path = tmp_path / "ck"
    kinds: set = set()
    ref = _big()
    done = 0
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(REPO)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
        # wait for some commits, then kill at a random instant
        lines = []
        deadline = time.monotonic() + 30
        while len(lines) < rng.randint(2, 6) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, proc.stderr.read().decode()[-2000:]
            lines.append(line.decode().split())
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
        kinds.update(kind for _, kind in lines)
        snap = read_snapshot(path)
        n = snap.offsets[0]
        assert n >= int(lines[-1][0])  # every reported commit is durable
        for i in range(done + 1, n + 1):
            _step(ref, i)
        done = n
        assert _digests(snap.tables) == _digests(ref), n
    assert kinds == {"base", "segment"}
    # no stray files survive the next open
    CheckpointStore(path).load()
    body = json.loads((path / "manifest.json").read_text())
    listed = {body["base"]["dir"], "manifest.json", *(s["file"] for s in body["segments"])}
    assert {p.name for p in path.iterdir()} == listed


def test_read_checkpoint_and_store_validate(tmp_path):
    with pytest.raises(ValueError, match="max_segment_fraction"):
        CheckpointStore(tmp_path, max_segment_fraction=0)
    with pytest.raises(ValueError, match="max_segments"):
        CheckpointStore(tmp_path, max_segments=-1)
    with pytest.raises(SnapshotError, match="manifest missing"):
        read_checkpoint(tmp_path)
    assert CheckpointStore(tmp_path / "none").load() is None
    with pytest.raises(TypeError, match="tables"):
        CheckpointStore(tmp_path / "x").write(tables={"a": 1}, offsets={}, seqs={}, meta={})


# ----------------------------------------------------------------------------- dense state


def _dense_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("dense-"))


def test_dense_state_is_checkpointed_with_the_tables_and_written_only_when_changed(tmp_path):
    path = tmp_path / "ckpt"
    t = ServingTable("user", 4)
    t.upsert(np.arange(5), np.ones((5, 4), np.float32))
    store = CheckpointStore(path)
    store.write(tables={"user": t}, offsets={0: 5}, seqs={}, meta={}, dense=b"state-1")
    assert read_checkpoint(path).dense == b"state-1" and _dense_files(path) == ["dense-000001.bin"]
    t.upsert(np.arange(2), np.zeros((2, 4), np.float32))
    store.write(tables={"user": t}, offsets={0: 6}, seqs={}, meta={}, dense=b"state-1")
    assert _dense_files(path) == ["dense-000001.bin"]  # unchanged: not written again
    store.write(tables={"user": t}, offsets={0: 7}, seqs={}, meta={}, dense=b"state-2")
    assert _dense_files(path) == ["dense-000002.bin"]  # the old one went once unlisted
    again = CheckpointStore(path)
    snap = again.load()
    assert snap.dense == b"state-2" and snap.offsets == {0: 7}
    again.write(tables=snap.tables, offsets={0: 8}, seqs={}, meta={}, dense=b"state-2")
    assert _dense_files(path) == ["dense-000002.bin"]
    assert read_checkpoint(path).dense == b"state-2"


def test_a_damaged_dense_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "ckpt"
    CheckpointStore(path).write(tables={}, offsets={}, seqs={}, meta={}, dense=b"abcdef")
    f = path / "dense-000001.bin"
    f.write_bytes(b"abcdeX")
    with pytest.raises(SnapshotError, match="dense-000001.bin"):
        CheckpointStore(path).load()


def test_a_checkpoint_without_dense_state_loads_none(tmp_path):
    path = tmp_path / "ckpt"
    CheckpointStore(path).write(tables={}, offsets={0: 1}, seqs={}, meta={})
    assert read_checkpoint(path).dense is None and _dense_files(path) == []
