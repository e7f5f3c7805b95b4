"""The demo's --out holds what a demo wrote, or nothing else: a user's file is never deleted."""

from __future__ import annotations

import json

import pytest

from deltastream_demo import outdir
from deltastream_demo.outdir import MANIFEST, OutDirError


def _a_run(out):
    """What a run does to ``out``: prepare, write files in its sub-directories, record."""
    paths = outdir.prepare(out)
    (paths["work"] / "shard-0.bin").write_bytes(b"x")
    (paths["state"] / "base-000001").mkdir()
    (paths["state"] / "base-000001" / "manifest.json").write_text("{}")
    (out / "report.json").write_text("{}")
    (paths["work"] / "base" / "tables").mkdir(parents=True)  # a snapshot of no tables
    outdir.record(out)
    return paths


def test_a_new_or_empty_directory_is_used_and_its_files_listed(tmp_path):
    out = tmp_path / "new" / "out"
    _a_run(out)
    listed = set(json.loads((out / MANIFEST).read_text())["files"])
    assert listed == {"work/shard-0.bin", "predictor-state/base-000001/manifest.json",
                      "report.json"}


def test_a_second_run_removes_exactly_what_the_first_wrote(tmp_path):
    out = tmp_path / "out"
    _a_run(out)
    paths = outdir.prepare(out)
    assert not (out / "report.json").exists() and not (paths["state"] / "base-000001").exists()
    # the directories it made go too, empty ones included (a snapshot path left holding an
    # empty tables/ is not a snapshot: the next run's writer refused to replace it)
    assert all(p.is_dir() and not any(p.iterdir()) for p in paths.values())


def test_an_empty_directory_the_demo_did_not_make_stays(tmp_path):
    out = tmp_path / "out"
    _a_run(out)
    (out / "work" / "mine").mkdir()
    outdir.prepare(out)
    assert (out / "work" / "mine").is_dir()


@pytest.mark.parametrize("where", ["work/mine.txt", "snapshots/mine.txt", "mine.txt",
                                   "predictor-state/base-000001/mine.txt"])
def test_a_file_the_demo_did_not_write_is_refused_and_nothing_is_deleted(tmp_path, where):
    out = tmp_path / "out"
    for first_run in (False, True):  # a foreign directory, then a demo's own with a stray file
        if first_run:
            _a_run(out)
        mine = out / where
        mine.parent.mkdir(parents=True, exist_ok=True)
        mine.write_text("keep me")
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        with pytest.raises(OutDirError, match="did not write") as e:
            outdir.prepare(out)
        assert str(mine) in str(e.value)
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
        mine.unlink()
        if not first_run:
            for p in sorted(out.rglob("*"), reverse=True):  # leave nothing for the next round
                p.rmdir() if p.is_dir() else p.unlink()


def test_a_link_is_a_foreign_file_and_is_not_followed(tmp_path):
    out = tmp_path / "out"
    target = tmp_path / "precious"
    target.mkdir()
    (target / "data").write_text("keep me")
    out.mkdir()
    (out / "work").symlink_to(target)
    with pytest.raises(OutDirError, match="did not write"):
        outdir.prepare(out)
    assert (target / "data").read_text() == "keep me"


def test_a_file_given_as_out_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("keep me")
    with pytest.raises(OutDirError, match="not a directory"):
        outdir.prepare(f)
    assert f.read_text() == "keep me"
