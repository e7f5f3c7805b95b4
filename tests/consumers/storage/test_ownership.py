"""Writers replace only what deltastream wrote (issue 13, point 1) and damaged checkpoint
state is refused, never silently replaced (point 2): real files, real directories."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from consumers.errors import SnapshotError
from consumers.files import check_replaceable, is_deltastream_dir
from consumers.serving.table import ServingTable
from consumers.storage.checkpoint import CheckpointStore
from consumers.storage.snapshot import read_snapshot, write_snapshot

THESIS = "four years of my life\n"


def _table(n: int = 10) -> ServingTable:
    t = ServingTable("user", 4)
    t.upsert(np.arange(n), np.full((n, 4), 1.5))
    return t


def _state(version: int = 1) -> dict:
    return dict(tables={"user": _table(version * 5)}, offsets={0: version}, seqs={},
                meta={"v": version})


def _user_dir(path):
    path.mkdir()
    (path / "thesis.txt").write_text(THESIS)
    return path


def _listing(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("writer", ["save", "write_snapshot"])
def test_a_directory_of_user_files_is_refused_and_left_as_is(tmp_path, writer):
    out = _user_dir(tmp_path / "out")
    before = _listing(tmp_path)
    with pytest.raises(SnapshotError) as e:
        if writer == "save":
            _table().save(out)
        else:
            write_snapshot(out, **_state())
    msg = str(e.value)
    assert str(out) in msg and "thesis.txt" in msg and "expected a deltastream snapshot" in msg
    assert "\n" not in msg
    assert (out / "thesis.txt").read_text() == THESIS
    assert _listing(tmp_path) == before  # nothing written, moved or removed


@pytest.mark.parametrize("writer", ["save", "write_snapshot"])
def test_a_regular_file_is_refused_not_moved_to_old(tmp_path, writer):
    out = tmp_path / "out"
    out.write_text(THESIS)
    with pytest.raises(SnapshotError, match="is a file, not a directory"):
        if writer == "save":
            _table().save(out)
        else:
            write_snapshot(out, **_state())
    assert out.read_text() == THESIS
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no out.old, no temp dir


def test_a_foreign_dot_old_next_to_the_path_is_refused(tmp_path):
    old = _user_dir(tmp_path / "out.old")
    with pytest.raises(SnapshotError, match="out.old"):
        write_snapshot(tmp_path / "out", **_state())
    assert (old / "thesis.txt").read_text() == THESIS
    assert sorted(os.listdir(tmp_path)) == ["out.old"]


def test_a_user_file_inside_a_snapshot_makes_it_foreign(tmp_path):
    out = tmp_path / "out"
    write_snapshot(out, **_state(1))
    (out / "notes.md").write_text("mine")
    assert not is_deltastream_dir(out)
    with pytest.raises(SnapshotError, match="notes.md"):
        write_snapshot(out, **_state(2))
    assert (out / "notes.md").read_text() == "mine"
    assert read_snapshot(out).meta == {"v": 1}


def test_absent_empty_and_own_snapshots_are_replaced(tmp_path):
    for name in ("absent", "empty"):
        out = tmp_path / name
        if name == "empty":
            out.mkdir()
        check_replaceable(out)
        write_snapshot(out, **_state(1))
        write_snapshot(out, **_state(2))  # its own snapshot: replaced
        assert read_snapshot(out).meta == {"v": 2}
    t = _table()
    t.save(tmp_path / "table")
    t.save(tmp_path / "table")
    # a damaged snapshot of ours (bad checksum) is still ours to replace
    man = tmp_path / "absent" / "manifest.json"
    man.write_text(man.read_text().replace('"v": 2', '"v": 9'))
    with pytest.raises(SnapshotError, match="checksum"):
        read_snapshot(tmp_path / "absent")
    write_snapshot(tmp_path / "absent", **_state(3))
    assert read_snapshot(tmp_path / "absent").meta == {"v": 3}
    assert sorted(os.listdir(tmp_path)) == ["absent", "empty", "table"]


def test_stale_temp_names_of_others_are_not_removed(tmp_path):
    (tmp_path / "out.tmp-notes.txt").write_text("mine")  # not a name deltastream writes
    write_snapshot(tmp_path / "out", **_state())
    assert (tmp_path / "out.tmp-notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- checkpoints


def _checkpointed(path, writes: int = 3) -> CheckpointStore:
    store = CheckpointStore(path)
    assert store.load() is None
    t = _table()
    for i in range(writes):
        t.upsert([100 + i], [[float(i)] * 4])
        store.write(tables={"user": t}, offsets={0: i + 1}, seqs={}, meta={})
    return store


def test_fresh_paths_start_empty(tmp_path):
    assert CheckpointStore(tmp_path / "none").load() is None
    (tmp_path / "empty").mkdir()
    assert CheckpointStore(tmp_path / "empty").load() is None


def test_first_checkpoint_appears_whole(tmp_path, monkeypatch):
    """The first checkpoint is renamed into place with its manifest, so a crash while it is
    written never leaves a checkpoint directory without one."""
    path = tmp_path / "ck"
    store = CheckpointStore(path)
    real_replace = os.replace

    def fail_commit(src, dst):
        if str(dst).endswith("manifest.json"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_commit)
    with pytest.raises(OSError):
        store.write(tables={"user": _table()}, offsets={0: 1}, seqs={}, meta={})
    assert os.listdir(tmp_path) == []  # neither ck nor a temp directory
    monkeypatch.setattr(os, "replace", real_replace)
    store.write(tables={"user": _table()}, offsets={0: 1}, seqs={}, meta={})
    assert CheckpointStore(path).load().offsets == {0: 1}


@pytest.mark.parametrize("damage", ["manifest-deleted", "regular-file", "foreign-files"])
def test_damaged_checkpoint_is_refused_naming_the_path_and_reset_starts_over(tmp_path,
                                                                            damage):
    path = tmp_path / "ck"
    _checkpointed(path)
    if damage == "manifest-deleted":
        (path / "manifest.json").unlink()
        match = "manifest.json is missing"
    elif damage == "regular-file":
        shutil.rmtree(path)
        path.write_text(THESIS)
        match = "is a file, not a checkpoint directory"
    else:
        shutil.rmtree(path)
        _user_dir(path)
        match = "thesis.txt"
    with pytest.raises(SnapshotError, match=match) as e:
        CheckpointStore(path).load()
    assert str(path) in str(e.value)
    store = CheckpointStore(path)
    if damage == "manifest-deleted":  # everything there is ours: reset removes it
        removed = store.reset()
        assert any(n.startswith("base-") for n in removed)
        assert not path.exists() and store.load() is None
        store.write(tables={"user": _table()}, offsets={0: 7}, seqs={}, meta={})
        assert CheckpointStore(path).load().offsets == {0: 7}
    else:  # not ours: even a reset refuses and leaves it alone
        with pytest.raises(SnapshotError, match="move"):
            store.reset()
        text = path.read_text() if path.is_file() else (path / "thesis.txt").read_text()
        assert text == THESIS


def test_damaged_segment_is_refused_and_reset_removes_only_our_files(tmp_path):
    path = tmp_path / "ck"
    _checkpointed(path)
    seg = next(p for p in path.iterdir() if p.name.startswith("seg-"))
    seg.write_bytes(seg.read_bytes()[:-3])
    with pytest.raises(SnapshotError, match="seg-"):
        CheckpointStore(path).load()
    assert CheckpointStore(path).reset()
    assert not path.exists()


def test_foreign_file_next_to_a_manifest_is_left_alone(tmp_path, caplog):
    path = tmp_path / "ck"
    store = _checkpointed(path)
    (path / "README").write_text("ops notes")
    assert CheckpointStore(path).load().offsets == {0: 3}
    assert "README" in caplog.text
    t = _table()
    store2 = CheckpointStore(path)
    store2.load()
    for i in range(3):
        store2.write(tables={"user": t}, offsets={0: 10 + i}, seqs={}, meta={})
    assert (path / "README").read_text() == "ops notes"
    del store
    body = json.loads((path / "manifest.json").read_text())
    assert body["offsets"] == {"0": 12}
