"""Shared dense files: one version per file, switched by rename, read zero-copy; the same
modes as shared tables and the same refusals for what another user planted."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest

from consumers.errors import ConsumerError
from consumers.serving.dense_shm import DenseReader, remove_dense, share_dense
from consumers.serving.dense_view import DenseView
from consumers.serving.shm import shm_root
from tests.other_user import NOBODY, need_root, open_dir


def _view(step: int, shard: int = 0) -> DenseView:
    t = {"w": np.full((3, 5), step, np.float32), "b": np.arange(7, dtype=np.float32) + step,
         "scalar": np.array(step, np.float32), "empty": np.zeros((0, 4), np.float32)}
    return DenseView(shard, 1, step, step * 10**9, MappingProxyType(t))


@pytest.fixture
def state(tmp_path):
    s = tmp_path / "state"
    s.mkdir(mode=0o750)
    yield s
    shutil.rmtree(shm_root(s), ignore_errors=True)


def test_a_reader_maps_the_version_whole_and_keeps_it_across_a_switch(state):
    share_dense(state, "m", _view(1))
    r = DenseReader.open(state)
    old = r.current()
    assert old.version == (1, 1) and old.ts == 10**9 and r.names() == ["b", "empty",
                                                                        "scalar", "w"]
    for k, a in _view(1).tensors.items():
        assert old[k].shape == a.shape and np.array_equal(old[k], a)
    with pytest.raises(ValueError):
        old["w"][0, 0] = 5  # read-only mapping
    assert not r.refresh()
    share_dense(state, "m", _view(2))
    assert r.current() is old  # nothing moves until refresh
    assert r.refresh() and r.version == (1, 2) and np.array_equal(r["w"], _view(2)["w"])
    assert np.array_equal(old["w"], _view(1)["w"])  # the old version stays whole


def test_files_get_the_state_dirs_modes_and_reset_removes_only_ours(state):
    path = share_dense(state, "m", _view(1))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o750
    foreign = path.parent / "shard-9.dense"
    foreign.write_bytes(b"not ours")
    assert remove_dense(state) == 1
    assert not path.exists() and foreign.exists()


def test_no_version_shared_is_a_clear_error(state):
    with pytest.raises(ConsumerError, match="no shared dense version of shard 3"):
        DenseReader.open(state, 3)


def test_a_group_writable_or_linked_file_is_refused(state):
    path = share_dense(state, "m", _view(1))
    os.chmod(path, 0o660)
    with pytest.raises(ConsumerError, match="refusing"):
        DenseReader.open(state)
    os.chmod(path, 0o640)
    real = path.with_name("elsewhere")
    os.rename(path, real)
    os.symlink(real, path)
    with pytest.raises((ConsumerError, OSError)):
        DenseReader.open(state)


def test_a_file_of_another_user_is_refused():
    need_root()
    parent = Path(open_dir())
    state = parent / "state"
    state.mkdir(mode=0o755)
    try:
        path = share_dense(state, "m", _view(1))
        os.chown(path, NOBODY, -1)  # as if another user had planted it there
        with pytest.raises(ConsumerError, match="refusing"):
            DenseReader.open(state)
    finally:
        shutil.rmtree(shm_root(state), ignore_errors=True)
        shutil.rmtree(parent)
