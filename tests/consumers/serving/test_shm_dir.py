"""Where shared tables live (consumers.serving.shm: shm_dir, DELTASTREAM_SHM_DIR) and whether
that filesystem gives them huge pages (consumers.serving.mounts)."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

import numpy as np
import pytest

from consumers.errors import ConsumerError
from consumers.serving import TableReader, hugemap
from consumers.serving.mounts import huge_pages, mount_of
from consumers.serving.shm import SHM_ENV, shm_base, shm_root, table_dir
from consumers.serving.table import ServingTable

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


@pytest.fixture
def shm_dir():
    """A directory of our own under /dev/shm, standing in for another tmpfs; removed after
    (it must be empty of table files by then: every test unshares)."""
    d = Path("/dev/shm") / f"ds-test-shm-{secrets.token_hex(4)}"
    d.mkdir()
    yield d
    left = [p for p in d.rglob("*") if p.is_file() and p.name != "lock"]
    shutil.rmtree(d)
    assert not left, f"a test left table files: {left}"


def _table(n: int = 50, dim: int = 4) -> ServingTable:
    t = ServingTable("emb", dim)
    t.upsert(np.arange(n), np.arange(n * dim, dtype=np.float32).reshape(n, dim))
    return t


def test_a_table_shared_under_an_shm_dir_is_read_there_and_only_there(tmp_path, shm_dir):
    t = _table()
    loc = t.share(tmp_path, shm_dir=shm_dir)
    try:
        assert loc == table_dir(tmp_path, "emb", shm_dir) and loc.is_relative_to(shm_dir)
        assert t.share(tmp_path, shm_dir=shm_dir) == loc  # idempotent for the same place
        r = TableReader.open(tmp_path, "emb", shm_dir=shm_dir)
        assert r.lookup([3]).tolist() == [[12, 13, 14, 15]]
        with pytest.raises(ConsumerError, match=r"looked in /dev/shm/deltastream-.*--shm-dir"):
            TableReader.open(tmp_path, "emb")  # the default place: not there
        with pytest.raises(ValueError, match="shared at .* not for state dir"):
            t.share(tmp_path)  # already shared elsewhere
        assert t.stats()["shared"] == str(loc)
        assert t.stats()["shared_huge_pages"] is (hugemap.collapsing() or huge_pages(shm_dir))
    finally:
        t.unshare()
    assert not any(p.suffix == ".rows" for p in shm_dir.rglob("*"))


def test_the_environment_names_the_shm_dir_for_writer_and_reader(tmp_path, shm_dir,
                                                                  monkeypatch):
    monkeypatch.setenv(SHM_ENV, str(shm_dir))
    assert shm_base() == shm_dir.resolve()
    assert shm_root(tmp_path).parent == shm_dir.resolve()
    t = _table()
    try:
        assert t.share(tmp_path).is_relative_to(shm_dir)
        assert TableReader.open(tmp_path, "emb").lookup([1]).tolist() == [[4, 5, 6, 7]]
        assert shm_base("/dev/shm") == Path("/dev/shm").resolve()  # an argument wins
    finally:
        t.unshare()


def test_an_shm_dir_that_is_not_a_directory_is_refused_naming_its_source(tmp_path,
                                                                         monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="shm_dir: expected an existing directory"):
        _table().share(tmp_path, shm_dir=missing)
    with pytest.raises(ValueError, match="shm_dir: expected an existing directory"):
        TableReader.open(tmp_path, "emb", shm_dir=missing)
    monkeypatch.setenv(SHM_ENV, str(missing))
    with pytest.raises(ValueError, match=f"{SHM_ENV}: expected an existing directory"):
        shm_base()
    assert not missing.exists()  # nothing was created in its place


def test_rows_that_outgrow_their_reservation_move_within_the_shm_dir(tmp_path, shm_dir,
                                                                     monkeypatch):
    import consumers.serving.memory as memory

    monkeypatch.setattr(memory, "RESERVE_BYTES", 64 * 4 * 4)  # 64 rows of dim 4
    t = ServingTable("emb", 4, capacity=8)
    t.share(tmp_path, shm_dir=shm_dir)
    try:
        r = TableReader.open(tmp_path, "emb", shm_dir=shm_dir)
        ids = np.arange(500, dtype=np.int64)
        t.upsert(ids, np.repeat(ids[:, None], 4, axis=1).astype(np.float32))
        assert t.shared is not None and t.shared.is_relative_to(shm_dir)
        assert np.array_equal(r.lookup(ids)[:, 1], ids.astype(np.float32))  # reopened
    finally:
        t.unshare()


@pytest.mark.parametrize("collapse", [False, True])
def test_the_writer_says_once_when_its_tables_will_be_in_small_pages(tmp_path, shm_dir,
                                                                     caplog, monkeypatch,
                                                                     collapse):
    """A hint, once per shm dir, when neither the mount nor MADV_COLLAPSE gives huge pages."""
    import logging

    import consumers.serving.shm as shm

    shm._hinted.discard(shm_dir.resolve())
    monkeypatch.setattr(hugemap, "_collapse", collapse)
    with caplog.at_level(logging.INFO, logger="consumers.serving.shm"):
        for name in ("a", "b"):
            t = ServingTable(name, 2)
            t.share(tmp_path, shm_dir=shm_dir)
            t.unshare()
    hints = [r for r in caplog.records if "huge=within_size" in r.getMessage()]
    assert len(hints) == (1 if huge_pages(shm_dir) is False and not collapse else 0)


# ------------------------------------------------------------------ mounts (pure parsing)

_MOUNTINFO = """\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
30 22 0:25 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,size=8G
31 22 0:26 / /mnt/huge rw,relatime - tmpfs tmpfs rw,size=16G,huge=within_size
32 31 0:27 / /mnt/huge/inner rw,relatime - tmpfs tmpfs rw,huge=never
33 22 0:28 / /mnt/with\\040space rw master:7 - tmpfs tmpfs rw,huge=always
34 22 0:29 / /mnt/adv rw - tmpfs tmpfs rw,huge=advise
35 30 0:30 / /dev/shm rw - tmpfs tmpfs rw,huge=always
broken line
"""


@pytest.mark.parametrize("path, point, huge", [
    ("/mnt/huge/x/y", "/mnt/huge", True),
    ("/mnt/huge/inner/t", "/mnt/huge/inner", False),   # the deeper mount decides
    ("/mnt/hugely", "/", None),                         # a prefix of the name is no parent
    ("/mnt/with space/t", "/mnt/with space", True),     # octal escapes in mount points
    ("/mnt/adv", "/mnt/adv", True),                     # advise: our madvise asks for them
    ("/dev/shm/deltastream-1", "/dev/shm", True),       # mounted over: the later one counts
    ("/srv/state", "/", None),                          # not a tmpfs: unknown
])
def test_mount_of_and_huge_pages_read_the_mount_table(path, point, huge):
    assert mount_of(path, _MOUNTINFO).point == point
    assert huge_pages(path, _MOUNTINFO) is huge


def test_a_tmpfs_without_the_huge_option_has_none():
    text = "30 22 0:25 / /dev/shm rw - tmpfs tmpfs rw,size=8G\n"
    assert mount_of("/dev/shm", text).options == {"rw": "", "size": "8G"}
    assert huge_pages("/dev/shm/x", text) is False
    assert mount_of("/x", "") is None and huge_pages("/x", "") is None


def test_this_hosts_dev_shm_is_found_in_the_real_mount_table():
    m = mount_of("/dev/shm")
    assert m is not None and m.point == "/dev/shm"  # whatever its options
