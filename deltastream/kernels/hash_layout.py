"""The slot layout of :class:`~deltastream.embedding.hash_index.HashIndex`, shared by its
torch path and its Triton kernels (:mod:`deltastream.kernels.hash_probe`).

Two flat int64 tensors over a power-of-two slot count: ``keys[slot]`` holds an id,
``vals[slot]`` its row position (>= 0) or one of the markers below. The home slot of an
id is the top log2(slots) bits of ``id * GOLDEN`` (mod 2^64); probes go on linearly.
"""

from __future__ import annotations

__all__ = ["EMPTY", "DELETED", "GOLDEN"]

EMPTY = -1  # vals[] marker: slot never used (ends a probe chain)
DELETED = -2  # vals[] marker: slot held an evicted id (probe chains pass over it)
# Golden-ratio multiplier 0x9E3779B97F4A7C15 as a signed int64 (torch multiplies with wrap).
GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
