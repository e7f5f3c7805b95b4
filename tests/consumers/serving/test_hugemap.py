"""consumers.serving.hugemap: 2 MiB-aligned file mappings, and huge pages for shared tables on
a tmpfs mounted without them (MADV_COLLAPSE) — checked in the kernel's own accounting."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from consumers.serving import TableReader, hugemap
from consumers.serving.table import ServingTable

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
BLOCK = hugemap.BLOCK


@pytest.fixture
def shm_file():
    p = Path("/dev/shm") / f"ds-test-hugemap-{os.getpid()}"
    yield p
    p.unlink(missing_ok=True)


def _map(path: Path, size: int, writable: bool = True) -> np.ndarray:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        return hugemap.map_file(fd, size, writable)
    finally:
        os.close(fd)


def _pmd_mapped_kib() -> int:
    kib = hugemap.pmd_mapped_kib()
    if kib is None:
        pytest.skip("no ShmemPmdMapped in /proc/self/smaps_rollup")
    return kib


def test_mappings_are_aligned_shared_and_read_only_where_asked(shm_file):
    a = _map(shm_file, 3 * BLOCK + 4096)
    r = _map(shm_file, 3 * BLOCK + 4096, writable=False)
    assert a.ctypes.data % BLOCK == 0 and r.ctypes.data % BLOCK == 0
    assert a.nbytes == r.nbytes == 3 * BLOCK + 4096
    a[-1], a[BLOCK] = 7, 9
    assert (r[-1], r[BLOCK]) == (7, 9)  # one file, two mappings
    with pytest.raises(ValueError, match="read-only"):
        r[0] = 1
    small = _map(shm_file, 8192)  # under a block: a plain mapping
    assert small.nbytes == 8192 and small.flags.writeable


def test_collapse_takes_whole_blocks_only_and_maps_them_huge(shm_file):
    a = _map(shm_file, 5 * BLOCK)
    fd = os.open(shm_file, os.O_RDWR)
    os.posix_fallocate(fd, 0, 5 * BLOCK)
    os.close(fd)
    a[:] = 3
    before = _pmd_mapped_kib()
    assert hugemap.collapse(a, 10, BLOCK + 10) == 0  # no whole block inside
    got = hugemap.collapse(a, BLOCK - 1, 4 * BLOCK + 1)  # blocks 1..3
    if not hugemap.collapsing():
        pytest.skip("this kernel does not collapse shmem (Linux < 6.1 or shmem deny)")
    assert got == 3
    assert (a == 3).all()  # the contents moved with the pages
    r = _map(shm_file, 5 * BLOCK, writable=False)
    assert int(r[BLOCK: 4 * BLOCK].sum()) == 3 * 3 * BLOCK  # a reader faults them in
    assert _pmd_mapped_kib() - before >= 2 * 3 * BLOCK // 1024  # writer's and reader's


def _anonymous_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))


def test_the_warm_up_before_each_block_keeps_no_memory(shm_file):
    """Each block's warm-up faults in an anonymous huge page and frees it again: the blocks
    still collapse, and no anonymous memory stays behind."""
    a = _map(shm_file, 4 * BLOCK)
    fd = os.open(shm_file, os.O_RDWR)
    for b in range(4):
        os.posix_fallocate(fd, b * BLOCK, 4096)  # as the shared storage backs a block
    os.close(fd)
    hugemap.collapse(a, 0, BLOCK)  # the scratch mapping exists from here on
    before = _anonymous_kib()
    got = hugemap.collapse(a, BLOCK, 4 * BLOCK)
    assert _anonymous_kib() - before < BLOCK // 1024
    if not hugemap.collapsing():
        pytest.skip("this kernel does not collapse shmem (Linux < 6.1 or shmem deny)")
    assert got == 3
    assert hugemap.collapse(a, 0, 4 * BLOCK, warm=False) == 4  # collapsed blocks: no-ops
    assert not a.any()


def test_a_kernel_that_refuses_is_asked_once_and_said_once(shm_file, monkeypatch, caplog):
    class Refusing:  # stands for a libc on a kernel without MADV_COLLAPSE
        calls = 0

        def madvise(self, addr, length, advice):
            Refusing.calls += advice == 25  # MADV_COLLAPSE (the warm-up asks too)
            ctypes.set_errno(errno.EINVAL)
            return -1

    a = _map(shm_file, 4 * BLOCK)
    monkeypatch.setattr(hugemap, "_libc", Refusing())
    monkeypatch.setattr(hugemap, "_collapse", True)
    with caplog.at_level(logging.INFO, logger="consumers.serving.hugemap"):
        assert hugemap.collapse(a, 0, 4 * BLOCK) == 0
        assert hugemap.collapse(a, 0, 4 * BLOCK) == 0
    assert Refusing.calls == 1 and not hugemap.collapsing()
    assert sum("keep 4 KiB pages" in r.getMessage() for r in caplog.records) == 1


def test_collapsing_can_be_switched_off_from_the_environment():
    code = "from consumers.serving import hugemap; print(hugemap.collapsing())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, DELTASTREAM_SHM_COLLAPSE="0"), check=True)
    assert out.stdout.strip() == "False"


def test_a_growing_shared_table_is_collapsed_and_reads_the_same(tmp_path):
    """Rows beyond the first 16 MiB chunk and a big index migrate into huge pages as the
    table grows; a reader in 2 MiB-aligned mappings reads every row right."""
    t = ServingTable("emb", 64)
    t.share(tmp_path)
    try:
        r = TableReader.open(tmp_path, "emb")
        ids = np.arange(300_000, dtype=np.int64) * 7919
        rows = (ids[:, None] % 1000 + np.arange(64)).astype(np.float32)
        for a in range(0, ids.size, 50_000):
            t.upsert(ids[a: a + 50_000], rows[a: a + 50_000])
        if hugemap.collapsing():
            # ≈ 73 MiB of rows and a 16 MiB index: about 50 blocks (one here measured 54);
            # the kernel may refuse some when it has no free huge page (EAGAIN), so: some
            assert t._core.storage.huge_blocks > 0
            assert t.stats()["shared_huge_pages"] is True
        pick = np.random.default_rng(0).choice(ids.size, 5000)
        assert np.array_equal(r.lookup(ids[pick]), rows[pick])
        assert np.array_equal(t.lookup(ids[pick]), rows[pick])
    finally:
        t.unshare()
