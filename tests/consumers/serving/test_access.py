"""Shared table files no more readable than the state dir, verified by readers, with a
lock no other user can hold (issue 27, items 6 and 7); a real second uid."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from consumers.errors import ConsumerError
from consumers.serving import TableReader
from consumers.serving.shm import derived_root, shm_root, table_dir
from consumers.serving.table import ServingTable
from tests.other_user import NOBODY, as_nobody, need_root, open_dir, shared_lock_attempt

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def state():
    """A state dir in a place every user can reach (its own mode decides the rest)."""
    need_root()
    parent = Path(open_dir())
    yield parent / "state"
    shutil.rmtree(shm_root(parent / "state"), ignore_errors=True)
    shutil.rmtree(derived_root(parent / "state"), ignore_errors=True)  # a plant's too
    shutil.rmtree(parent)


def _table(value: float = 1.0, name: str = "user") -> ServingTable:
    t = ServingTable(name, 4)
    t.upsert(np.arange(10), np.full((10, 4), value, np.float32))
    return t


def _lookup(state: Path):
    def attempt():
        return TableReader.open(state, "user").lookup([1, 2]).tolist()
    return attempt


@pytest.mark.parametrize("mode", [0o700, 0o750])
def test_shared_files_are_no_more_readable_than_the_state_dir(state, mode):
    state.mkdir()
    os.chmod(state, mode)
    os.chown(state, -1, NOBODY)  # the state dir's group: the shared files get it too
    t = _table()
    t.share(state)
    try:
        root = shm_root(state)
        for p in [root, *root.rglob("*")]:
            st = os.lstat(p)
            want = mode if stat.S_ISDIR(st.st_mode) else 0o600 if p.name == "lock" \
                else (mode & 0o644) | 0o600
            gid = NOBODY if p.name != "lock" else st.st_gid  # the lock is the owner's alone
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (want, gid), p
        with as_nobody(_lookup(state)) as got:
            if mode == 0o700:  # private state dir: another uid reads nothing
                assert isinstance(got, PermissionError), got
            else:  # group-readable: a model server in the state dir's group reads
                assert got == [[1.0] * 4] * 2, got
    finally:
        t.unshare()


def _plant(state: Path):
    def attempt():
        t = _table(666.0)
        t.share(state)
        return "planted"
    return attempt


def test_a_table_planted_by_another_user_is_refused(state):
    state.mkdir(mode=0o755)
    with as_nobody(_plant(state)) as got:
        assert got == "planted", got
        with pytest.raises(ConsumerError, match=rf"Refused {derived_root(state)}.*uid {NOBODY}"):
            TableReader.open(state, "user")


def test_a_planted_shm_dir_does_not_stop_sharing_and_is_never_served(state, caplog):
    """Another user creates the state dir's shm path first (with a table of 666.0): the
    writer shares in the state dir instead, with a WARNING naming the planted path; readers
    serve the writer's rows, and what was planted is left as it was."""
    state.mkdir(mode=0o755)
    planted = derived_root(state)
    with as_nobody(_plant(state)) as got:
        assert got == "planted", got
        before = sorted(p.relative_to(planted) for p in planted.rglob("*"))
        t = _table(2.0)
        with caplog.at_level("WARNING", logger="consumers.serving.shm"):
            t.share(state)
        try:
            assert str(planted) in caplog.text and f"uid {NOBODY}" in caplog.text, caplog.text
            assert shm_root(state) == state / "shm" and t.shared.is_relative_to(state)
            with TableReader.open(state, "user") as reader:
                assert (reader.lookup([1, 2]) == 2.0).all()
            assert sorted(p.relative_to(planted) for p in planted.rglob("*")) == before
        finally:
            t.unshare()


def test_another_user_cannot_hold_a_killed_writers_table_lock(state):
    state.mkdir(mode=0o755)  # readable by all: the lock is still the writer's alone
    code = ("import numpy as np, time; from consumers.serving.table import ServingTable; "
            "t = ServingTable('user', 4); t.upsert(np.arange(3), np.ones((3, 4), np.float32));"
            f" t.share({str(state)!r}); print('up', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with as_nobody(shared_lock_attempt(table_dir(state, "user") / "lock")) as got:
        assert isinstance(got, PermissionError), got
        t = _table(2.0)
        t.share(state)  # the restarted writer is not refused
        try:
            assert (TableReader.open(state, "user").lookup([1]) == 2.0).all()
        finally:
            t.unshare()


def test_lookup_out_must_be_an_array(state):
    state.mkdir()
    t = _table()
    t.share(state)
    try:
        with pytest.raises(TypeError, match="out"):
            TableReader.open(state, "user").lookup([1, 2], out=[[0.0] * 4] * 2)
    finally:
        t.unshare()
