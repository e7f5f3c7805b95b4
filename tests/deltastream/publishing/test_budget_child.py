"""The budget worker process keeps its temporaries in glibc's heap: after ``_hold_heap`` a
block of megabytes comes from the heap (``[heap]`` in ``/proc/self/maps``), not from a new
mapping as glibc's thresholds give it. Run in a new interpreter: the setting is
process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = r"""
import ctypes
from deltastream.publishing.budget_child import HEAP_BYTES, _hold_heap

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def in_heap(size):
    p = libc.malloc(size)
    try:
        for line in open("/proc/self/maps"):
            if line.rstrip().endswith("[heap]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                return lo <= p < hi
        return False
    finally:
        libc.free(p)

# glibc raises its threshold to the size of a mapped block once it is freed: the second
# block is larger than the first, so only _hold_heap's threshold puts it in the heap
assert 8 << 20 < HEAP_BYTES
before = in_heap(4 << 20)
_hold_heap()
print(before, in_heap(8 << 20))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not __import__("platform")
                    .libc_ver()[0] == "glibc", reason="glibc's malloc on Linux only")
def test_the_worker_takes_blocks_of_megabytes_from_the_heap():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split()
    assert before == "False"  # glibc's default: a new mapping (what the worker paid per round)
    assert after == "True"
