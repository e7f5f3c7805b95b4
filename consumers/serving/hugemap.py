"""Huge pages for shared tables on any tmpfs: 2 MiB-aligned mappings and ``MADV_COLLAPSE``.

A lookup of random ids reads rows spread over gigabytes; in 4 KiB pages every row costs a
TLB miss and a page walk. ``/dev/shm`` is mounted without huge pages on most hosts
(``huge=never``), so shmem pages are faulted in 4 KiB. Linux 6.1+ still turns a 2 MiB
block of a shmem file into one huge page on request — ``madvise(MADV_COLLAPSE)``, which only
``shmem_enabled=deny`` forbids — and a process whose mapping of the file is 2 MiB-aligned
then maps the block with a single page-table entry. So:

1. every table file is mapped at a 2 MiB-aligned address (:func:`map_file`: readers and
   the writer alike);
2. the writer collapses each block it backs *before* anything is published in it
   (:func:`collapse`): the kernel locks a block's pages while it collapses it (about a
   millisecond), and no reader reads a block that holds no published row or bucket yet;
3. before each collapse the writer faults in, then frees, one anonymous huge page
   (:func:`_warm_page`). The collapse zeroes its new huge page in one stretch of kernel code
   that cannot be preempted where the kernel runs ``preempt=none`` (the default of many
   server kernels). On a VM whose host backs guest memory on first touch and takes freed
   memory back within seconds (free-page reporting: Firecracker, many cloud sandboxes),
   that stretch took about 3 ms per block here. A reader woken on that CPU waited for it:
   a same-CPU latency probe measured p99 4 ms and max 10 ms. An anonymous huge page is
   zeroed at fault time with a preemption point after every 4 KiB. Freed, it is the page the
   collapse then takes from the allocator (the CPU's free list of huge pages), and the
   collapse zeroes memory that is already backed: about 0.25 ms per block. The probe then
   measured p99 0.3 ms and max 4.5 ms. On bare metal the warm-up costs one extra 2 MiB
   clear (about 0.1 ms).

Measured on a 2-core EPYC VM, 10M × 64 f32 rows on ``/dev/shm``: a 256-id gather 17–20 µs
collapsed against 24–37 µs in 4 KiB pages; collapsing costs the writer about 0.2–0.3 ms per
2 MiB block, once, plus the first touch of fresh memory on a VM (BENCHMARKS.md). Where the kernel refuses (older than 6.1, not Linux,
``shmem_enabled=deny``, a process with THP disabled by ``prctl``), tables keep 4 KiB pages;
it is logged once. A block the kernel cannot collapse now (no free huge page, a memory
cgroup at its limit) stays small. On a host whose memory is fragmented the kernel may
compact memory during a collapse, in the writer's apply; ``DELTASTREAM_SHM_COLLAPSE=0``
turns collapsing off.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from typing import Optional

import numpy as np

__all__ = ["BLOCK", "map_file", "collapse", "collapsing", "pmd_mapped_kib"]

log = logging.getLogger(__name__)

#: bytes of one huge page (x86-64 and arm64 with 4 KiB base pages)
BLOCK = 2 << 20
_MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_POPULATE_WRITE, _MADV_COLLAPSE = 4, 14, 23, 25
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc: Optional[ctypes.CDLL] = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.madvise.restype = ctypes.c_int
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):  # no usable libc: plain mappings, no collapse
        _libc = None

_collapse = _libc is not None and os.environ.get("DELTASTREAM_SHM_COLLAPSE", "1") != "0"
_said = threading.Lock()
_scratch: Optional[tuple[mmap.mmap, int]] = None  # (anonymous mapping, its aligned block)


def collapsing() -> bool:
    """Whether :func:`collapse` asks the kernel for huge pages (False once it refused)."""
    return _collapse


def pmd_mapped_kib() -> Optional[int]:
    """KiB of shared memory this process maps in huge pages (the kernel's
    ``ShmemPmdMapped``); None where unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("ShmemPmdMapped:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def map_file(fd: int, size: int, writable: bool) -> np.ndarray:
    """``uint8 [size]`` over a ``MAP_SHARED`` mapping of the first ``size`` bytes of open
    file ``fd``, at a 2 MiB-aligned address when ``size`` spans a huge page (so that huge
    pages of the file can be mapped whole). Read-only array for ``writable=False``. The
    mapping lasts until the array and its views are freed."""
    if _libc is None or size < BLOCK:
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return np.frombuffer(mmap.mmap(fd, size, access=access), np.uint8)
    # reserve size + one block of address space (never touched: no memory), then map the
    # file over its aligned part; the reservation's owner (a Python mmap object) unmaps
    # all of it when the last array over it is freed
    res = mmap.mmap(-1, size + BLOCK, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
    whole = np.frombuffer(res, np.uint8)
    off = (-whole.ctypes.data) % BLOCK
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    at = _libc.mmap(whole.ctypes.data + off, size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if at == _MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"mmap of {size} bytes: {os.strerror(e)}")
    _libc.madvise(at, size, _MADV_HUGEPAGE)  # a tmpfs mounted huge=advise honours it
    out = whole[off: off + size]
    out.flags.writeable = writable
    return out


def collapse(buf: np.ndarray, start: int, stop: int, *, warm: bool = True) -> int:
    """Ask the kernel to back the 2 MiB blocks of ``buf`` (from :func:`map_file`) that lie
    wholly inside bytes ``[start, stop)`` with huge pages; the caller guarantees no reader
    reads them meanwhile. Returns how many blocks were collapsed (0 when collapsing is off
    or refused). Releases the GIL meanwhile (ctypes).

    One block per call, so a refusal costs one block. A block refused for now
    (``EAGAIN``: a page of it was being mapped by another process, say a reader's warmer)
    is tried once more after the others; ``ENOMEM`` (no free huge page) leaves it small.
    ``warm``: fault in and free an anonymous huge page before each block (step 3 of the
    module docstring; off only to measure what it saves, ``deltastream bench stalls``).
    """
    base = buf.ctypes.data
    lo = start + (-(base + start)) % BLOCK
    hi = min(stop, buf.nbytes)
    hi -= (base + hi) % BLOCK
    done, again = 0, []
    for tries, blocks in ((0, range(lo, hi, BLOCK)), (1, again)):
        for b in blocks:
            if not _collapse:
                return done
            if warm:
                _warm_page()
            e = _collapse_block(base + b)
            if e == 0:
                done += 1
            elif e == errno.EAGAIN and not tries:
                again.append(b)
            else:
                log.debug("collapse of the block at byte %d refused: %s", b, os.strerror(e))
    return done


def _warm_page() -> None:
    """Fault in one anonymous huge page and free it again, right before a collapse takes a
    huge page from the allocator (see the module docstring, step 3). Through ctypes: the
    GIL is released while the host backs the memory. Best effort: where anonymous huge
    pages are off, this touches and frees one small page."""
    global _scratch
    assert _libc is not None
    with _said:
        if _scratch is None:
            m = mmap.mmap(-1, 2 * BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            addr += (-addr) % BLOCK
            _libc.madvise(addr, BLOCK, _MADV_HUGEPAGE)
            _scratch = (m, addr)
        addr = _scratch[1]
    _libc.madvise(addr, BLOCK, _MADV_POPULATE_WRITE)  # Linux 5.14+; may fail part-way
    _libc.madvise(addr, BLOCK, _MADV_DONTNEED)  # whatever it got goes back


def _collapse_block(addr: int) -> int:
    """``madvise(MADV_COLLAPSE)`` of the 2 MiB block at ``addr``: 0, or the errno."""
    global _collapse
    assert _libc is not None
    if _libc.madvise(addr, BLOCK, _MADV_COLLAPSE) == 0:
        return 0
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.EPERM, errno.ENOSYS):  # this kernel won't: stop asking
        with _said:
            if _collapse:
                _collapse = False
                log.info("the kernel does not collapse shared memory into huge pages (%s): "
                         "shared tables keep 4 KiB pages", os.strerror(e))
    return e
