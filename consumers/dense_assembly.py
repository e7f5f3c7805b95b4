"""Dense versions from dense chunks: assembled whole, served only complete, switched atomically.

A trainer publishes its dense parameters (MLP weights, biases, buffers) as *versions*
(epoch, step), each cut into ``chunks`` messages (:mod:`deltastream.dense_wire`). Chunks
of one (model, shard, epoch) stream carry ``seq`` 0, 1, 2 … like row messages, and the
chunks of one version are consecutive seqs. :class:`DenseAssembler` keeps, per shard, the
version being built and the newest complete one, and classifies every chunk
(:meth:`DenseAssembler.offer`):

============  =========================================================  =================
verdict       when                                                       assembler does
============  =========================================================  =================
``taken``     a chunk of the version being built (or its first chunk)    copy it in
``served``    the version's last chunk: the version is complete (a       switch the served
              partial one laid over its base)                            version, at once
``duplicate`` seq already applied (producer retry, replay)               skip, count
``stale``     an older trainer epoch than the one applied                skip, count
``lost``      a chunk of a version that lost one before it (a seq gap,   skip, count the
              a damaged chunk, a start mid-version)                      version once
``unbased``   the last chunk of a partial version whose base version     drop it, count
              is not the one served here
``refused``   the chunk contradicts its version (tensor count, shape,    quarantine; the
              offset, element range)                                     version is lost
============  =========================================================  =================

A version missing any chunk is therefore never served: the served version stays the
previous complete one, and the gap is counted (``gaps``, ``missing_chunks``,
``incomplete``). A chunk 0 always starts a version: a version still being built is then
abandoned (``incomplete``), also one of the same (epoch, step). Seqs of ``refused``
chunks are not committed (like a quarantined row message), so the next chunk reports the
gap.

Serving: :meth:`DenseAssembler.view` returns a :class:`DenseView` — an immutable snapshot
(read-only arrays). A new version replaces the reference in one assignment, so a reader
holds either the old or the new version, never a mix. Tensors a partial version does not
carry are shared with its base (they did not change; nothing is copied).

State (:meth:`DenseAssembler.state` / :meth:`DenseAssembler.from_state`): seqs, the served
version and the version being built, as bytes, checkpointed with the tables so a restart
in the middle of a multi-chunk version resumes it exactly. :func:`merge_states` joins the
states of disjoint trainer shards (per-shard base snapshots given to one daemon).

numpy + msgpack only (no torch).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Optional

import msgpack
import numpy as np

from consumers.sequencing import SeqTracker
from consumers.serving.dense_view import DenseView

__all__ = ["DenseAssembler", "DenseView", "DENSE_VERDICTS", "MAX_TENSOR_ELEMENTS",
           "merge_states"]

log = logging.getLogger(__name__)

DENSE_VERDICTS = ("taken", "served", "duplicate", "stale", "lost", "unbased", "refused")
_COUNTERS = ("chunks", "versions", "duplicates", "stale", "lost_chunks", "incomplete",
             "unbased", "refused", "gaps", "missing_chunks", "new_epochs")
_STATE_VERSION = 1
_STREAM = ""  # the one dense stream of a shard, in the SeqTracker's (table, shard) keys
#: most elements of one tensor a predictor assembles (16 GiB of float32): the wire allows
#: 2⁴⁸, and a buffer that can never be allocated would stall the partition at its chunk
MAX_TENSOR_ELEMENTS = 1 << 32


@dataclass
class _Building:
    """The version being assembled on one shard (loop thread only)."""

    epoch: int
    step: int
    ts: int
    full: bool
    base_step: int
    tensors: int
    chunks: int
    next_index: int = 0
    lost: bool = False  # a chunk is missing: the rest is skipped, never served
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # name -> flat f32
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    filled: dict[str, int] = field(default_factory=dict)  # name -> elements written

    @property
    def key(self) -> tuple[int, int]:
        return (self.epoch, self.step)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class DenseAssembler:
    """Assemble dense chunks into versions and serve the newest complete one per shard.

    One thread calls :meth:`offer` (the daemon's loop); any thread may call :meth:`view`.
    """

    def __init__(self) -> None:
        self.seqs = SeqTracker()
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._served: dict[int, DenseView] = {}
        self._building: dict[int, _Building] = {}
        self._lock = threading.Lock()
        self.generation = 0  #: bumped by every accepted chunk (the state changed)

    # ------------------------------------------------------------------ serving

    def view(self, shard: Optional[int] = None) -> Optional[DenseView]:
        """The newest complete version of ``shard`` (None: the one shard that published
        one; ``ValueError`` naming them when several did), or None before the first."""
        with self._lock:
            served = dict(self._served)
        if shard is not None:
            return served.get(shard)
        if len(served) > 1:
            raise ValueError(f"dense versions of shards {sorted(served)} are served: "
                             "name one (dense(shard=...))")
        return next(iter(served.values()), None)

    def views(self) -> dict[int, DenseView]:
        """shard -> newest complete version."""
        with self._lock:
            return dict(self._served)

    # ------------------------------------------------------------------ chunks

    def offer(self, c: Any) -> tuple[str, str]:
        """Classify and take chunk ``c`` (a ``DenseChunk``). Returns (verdict, reason);
        see the module docstring. Never raises on bad data."""
        verdict = self.seqs.check(_STREAM, c.shard, c.epoch, c.seq)
        if verdict.kind == "duplicate":
            self.counters["duplicates"] += 1
            return "duplicate", f"seq {c.seq} already applied"
        if verdict.kind == "stale_epoch":
            self.counters["stale"] += 1
            return "stale", f"epoch {c.epoch} is older than the current one"
        b = self._building.get(c.shard)
        # chunk 0 (not a duplicate: the seq said so) starts a version, even one of the same
        # (epoch, step): a publisher's flush sends a full version of the step its tick's
        # partial one had, and that partial one's lost tail must not take the full one along
        if b is not None and (b.key != (c.epoch, c.step) or c.index == 0):
            self._abandon(c.shard, b, f"chunk {c.index} of version ({c.epoch}, {c.step}) "
                                      "came first")
            b = None
        if verdict.missing is not None:
            lo, hi = verdict.missing
            self.counters["gaps"] += 1
            self.counters["missing_chunks"] += hi - lo + 1
            log.warning("dense shard %d epoch %d: seq gap, chunks %d..%d missing", c.shard,
                        c.epoch, lo, hi)
            if b is not None:  # the missing chunks were this version's
                b.lost = True
        if verdict.kind == "new_epoch":
            self.counters["new_epochs"] += 1
        if b is None:
            b = _Building(c.epoch, c.step, c.ts, bool(c.full), c.base_step, c.tensors,
                          c.chunks, lost=c.index != 0)
            self._building[c.shard] = b
        why = None if b.lost else self._refusal(b, c)
        if why is not None:
            b.lost = True
            self.counters["refused"] += 1
            return "refused", why
        self.seqs.commit(_STREAM, c.shard, c.epoch, c.seq, c.step)
        self.counters["chunks"] += 1
        self.generation += 1
        if b.lost:
            self.counters["lost_chunks"] += 1
            if c.index == c.chunks - 1:
                self._abandon(c.shard, b, "chunks are missing")
            return "lost", f"version ({c.epoch}, {c.step}) lost a chunk before index {c.index}"
        self._copy(b, c)
        if b.next_index < b.chunks:
            return "taken", ""
        del self._building[c.shard]
        return self._complete(c.shard, b)

    def _refusal(self, b: _Building, c: Any) -> Optional[str]:
        """Why chunk ``c`` cannot belong to version ``b`` (None when it can)."""
        head = (bool(c.full), c.base_step, c.tensors, c.chunks)
        if head != (b.full, b.base_step, b.tensors, b.chunks):
            return (f"chunk (full, base_step, tensors, chunks) = {head} disagrees with its "
                    f"version's {(b.full, b.base_step, b.tensors, b.chunks)}")
        if c.index != b.next_index:
            return f"chunk index {c.index}, expected {b.next_index}"
        shape = tuple(int(d) for d in c.shape)
        size = int(np.prod(shape, dtype=np.int64))
        if c.name in b.shapes and b.shapes[c.name] != shape:
            return f"tensor {c.name!r}: shape {shape}, earlier chunks said {b.shapes[c.name]}"
        if size > MAX_TENSOR_ELEMENTS:
            return (f"tensor {c.name!r}: {size} elements, more than this predictor "
                    f"assembles ({MAX_TENSOR_ELEMENTS})")
        if c.name not in b.shapes and len(b.shapes) >= b.tensors:
            return f"tensor {c.name!r} is one more than the version's {b.tensors} tensors"
        n = int(np.asarray(c.values).size)
        if c.offset != b.filled.get(c.name, 0) or c.offset + n > size:
            return (f"tensor {c.name!r}: elements [{c.offset}, {c.offset + n}) do not follow "
                    f"the {b.filled.get(c.name, 0)} received of {size}")
        if c.index == c.chunks - 1:  # the last chunk must close every tensor
            done = dict(b.filled, **{c.name: c.offset + n})
            sizes = dict(b.shapes, **{c.name: shape})
            short = [k for k, s in sizes.items() if done.get(k, 0) != int(np.prod(s))]
            if len(sizes) != b.tensors or short:
                return (f"last chunk, but tensors {short or sorted(sizes)} are incomplete "
                        f"({len(sizes)} of {b.tensors} tensors seen)")
        return None

    @staticmethod
    def _copy(b: _Building, c: Any) -> None:
        if c.name not in b.arrays:
            shape = tuple(int(d) for d in c.shape)
            b.shapes[c.name] = shape
            b.arrays[c.name] = np.empty(int(np.prod(shape, dtype=np.int64)), np.float32)
            b.filled[c.name] = 0
        vals = c.values_f32()
        b.arrays[c.name][c.offset:c.offset + vals.size] = vals
        b.filled[c.name] += int(vals.size)
        b.next_index += 1

    def _complete(self, shard: int, b: _Building) -> tuple[str, str]:
        """Serve the complete version ``b`` (a partial one over its base)."""
        tensors = {k: _readonly(a.reshape(b.shapes[k])) for k, a in b.arrays.items()}
        if not b.full:
            base = self._served.get(shard)
            if base is None or base.version != (b.epoch, b.base_step):
                self.counters["unbased"] += 1
                held = None if base is None else base.version
                log.warning("dense shard %d: partial version (%d, %d) builds on (%d, %d), "
                            "but %s is held; not served", shard, b.epoch, b.step, b.epoch,
                            b.base_step, held)
                return "unbased", f"base ({b.epoch}, {b.base_step}) not held (held: {held})"
            tensors = {**base.tensors, **tensors}
        view = DenseView(shard, b.epoch, b.step, b.ts, MappingProxyType(tensors))
        with self._lock:
            self._served[shard] = view  # the switch: one assignment
        self.counters["versions"] += 1
        return "served", ""

    def _abandon(self, shard: int, b: _Building, why: str) -> None:
        self._building.pop(shard, None)
        self.counters["incomplete"] += 1
        log.warning("dense shard %d: version (%d, %d) never served: %s", shard, b.epoch,
                    b.step, why)

    # ------------------------------------------------------------------ state

    def shards(self) -> set[int]:
        """Trainer shards this assembler holds anything of (seqs, a served version, a
        version being built)."""
        with self._lock:
            served = set(self._served)
        return served | set(self._building) | {int(st["shard"])
                                               for st in self.seqs.state()["streams"]}

    def absorb(self, other: DenseAssembler) -> None:
        """Take over ``other``'s shards whole (seqs, served and building versions; not its
        counters). ``ValueError`` when a shard is held by both: the states would overlap."""
        both = self.shards() & other.shards()
        if both:
            raise ValueError(f"dense shard(s) {sorted(both)} held by both")
        for st in other.seqs.state()["streams"]:
            self.seqs.commit(st["table"], st["shard"], st["epoch"], st["seq"], st.get("step"))
        self._building.update(other._building)
        with self._lock:
            self._served.update(other.views())
        self.generation += 1

    def state(self) -> bytes:
        """The assembler's state as bytes (msgpack; arrays as raw little-endian f32)."""
        def arrays(d: Mapping[str, np.ndarray]) -> dict:
            return {k: [list(a.shape), np.ascontiguousarray(a, "<f4").tobytes()]
                    for k, a in d.items()}
        served = [[v.shard, v.epoch, v.step, v.ts, arrays(v.tensors)]
                  for v in self.views().values()]
        building = [[s, b.epoch, b.step, b.ts, b.full, b.base_step, b.tensors, b.chunks,
                     b.next_index, b.lost, arrays(b.arrays),
                     {k: list(v) for k, v in b.shapes.items()}, b.filled]
                    for s, b in sorted(self._building.items())]
        return msgpack.packb({"version": _STATE_VERSION, "seqs": self.seqs.state(),
                              "served": served, "building": building}, use_bin_type=True)

    @classmethod
    def from_state(cls, data: Optional[bytes]) -> DenseAssembler:
        """Rebuild from :meth:`state` (None: an empty assembler). ``ValueError`` on
        anything else."""
        out = cls()
        if data is None:
            return out
        try:
            d = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
            if d.get("version") != _STATE_VERSION:
                raise ValueError(f"version {d.get('version')!r}")
            out.seqs = SeqTracker.from_state(d["seqs"])
            for shard, epoch, step, ts, arr in d["served"]:
                out._served[shard] = DenseView(shard, epoch, step, ts,
                                               MappingProxyType(_arrays(arr, readonly=True)))
            for (s, epoch, step, ts, full, base_step, tensors, chunks, nxt, lost, arr,
                 shapes, filled) in d["building"]:
                out._building[s] = _Building(
                    epoch, step, ts, full, base_step, tensors, chunks, nxt, lost,
                    {k: a.reshape(-1) for k, a in _arrays(arr, readonly=False).items()},
                    {k: tuple(v) for k, v in shapes.items()}, dict(filled))
        except (ValueError, TypeError, KeyError, AttributeError,
                msgpack.UnpackException) as e:
            raise ValueError(f"dense state: malformed ({type(e).__name__}: {e})") from None
        return out


def merge_states(states: list[tuple[str, bytes]]) -> bytes:
    """One state (:meth:`DenseAssembler.state` bytes) holding the shards of every
    ``(label, state)`` given: the dense part of per-shard base snapshots merged into one
    base. ``ValueError`` naming both labels when two hold the same shard, or naming the
    label of a malformed state."""
    out = DenseAssembler()
    owner: dict[int, str] = {}
    for label, data in states:
        try:
            part = DenseAssembler.from_state(data)
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None
        for shard in sorted(part.shards()):
            if shard in owner:
                raise ValueError(f"dense shard {shard} has state in both {owner[shard]} and "
                                 f"{label}")
            owner[shard] = label
        out.absorb(part)
    return out.state()


def _arrays(d: dict, *, readonly: bool) -> dict[str, np.ndarray]:
    out = {}
    for k, (shape, raw) in d.items():
        a = np.frombuffer(raw, "<f4").astype(np.float32).reshape(shape)
        out[k] = _readonly(a) if readonly else a
    return out
