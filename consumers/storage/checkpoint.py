"""Incremental checkpoints: a full base plus a chain of delta segments, one manifest.

Why: rewriting every table in full at each checkpoint costs O(resident rows) — 256 MB
written, hashed and fsynced per checkpoint for 1M × 64 f32 rows. A checkpoint here writes
only the rows changed since the previous one (:meth:`ServingTable.take_changes`), and
rewrites the base only when the segments grow large next to it.

Layout of a checkpoint directory ``<path>``::

    manifest.json            format "deltastream-checkpoint": base (dir + size/checksum of
                             its manifest + bytes), segments in apply order (file, size, CRC),
                             offsets, seqs, meta; sealed with a checksum of itself
    base-GGGGGG/             a full snapshot (``write_snapshot`` layout, readable on its own)
    seg-GGGGGG-KKKKKK.bin    rows changed after base G: per table upserted ids + rows
                             (storage dtype) and deleted ids
    dense-NNNNNN.bin         the dense versions' state (optional; the bytes of
                             ``DenseAssembler.state()``), written only when it changed

Segment files are :mod:`consumers.storage.segments`' format.

Commit protocol (one writer per directory): new files are written under names no committed
manifest uses and fsynced, with the directory; then ``manifest.json`` is replaced atomically
(temp file + fsync + rename + directory fsync). Files a manifest no longer lists (old base
and segments after a compaction, leftovers of a crashed write) are removed only after the
new manifest is durable, and again when a store is opened. So a crash at any instant
leaves ``manifest.json`` naming either the previous or the new state, whose files are all
present; every file is checked against its checksum at load.

Loading = base, then each segment in order (deletes, then upserts). A directory holding a
full snapshot (the older checkpoint format, ``deltastream-replay rebuild`` output) is read
as is; the first checkpoint written by a :class:`CheckpointStore` then writes a base there
and removes the old files after its manifest is durable.

Damage is refused, never papered over: the very first checkpoint is built in a temp
directory next to ``<path>`` and renamed into place, so a checkpoint directory exists only
with a committed manifest. :meth:`CheckpointStore.load` therefore raises
:class:`SnapshotError` naming the path for a ``<path>`` that is a file, a directory that
holds checkpoint files but no ``manifest.json``, or one holding files deltastream does not
write; an absent or empty directory is a fresh start. :meth:`CheckpointStore.reset`
removes a (damaged) checkpoint so the next write starts over — only when everything there
is something deltastream writes; it never deletes or moves anything else.
"""

from __future__ import annotations

import copy
import glob
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from consumers.files import (
    MANIFEST,
    PathLike,
    fsync_dir,
    is_deltastream_dir,
    is_tmp_name,
    new_tmp,
    no_follow,
    old_path,
    read_manifest,
    seal,
    write_chunks,
)
from consumers.serving.table import ServingTable
from consumers.serving.views import FrozenChanges
from consumers.storage.checkpoint_dir import check_checkpoint_dir, remove_checkpoint_dir
from consumers.storage.checkpoint_read import (
    BASE_RE,
    CHECKPOINT_FORMAT,
    CHECKPOINT_FORMAT_VERSION,
    DENSE_RE,
    SEG_RE,
    read_chain,
    read_checkpoint,
)
from consumers.storage.full_format import (
    Snapshot,
    check_contents,
    read_saved,
    write_full,
)
from consumers.storage.segments import encode_segment

# read_checkpoint and the format constants live in .checkpoint_read; re-exported here, where
# callers have imported them from.
__all__ = ["CheckpointStore", "CheckpointResult", "PreparedCheckpoint", "read_checkpoint",
           "CHECKPOINT_FORMAT", "CHECKPOINT_FORMAT_VERSION"]

log = logging.getLogger(__name__)


@dataclass
class CheckpointResult:
    """What one :meth:`CheckpointStore.write` did.

    Attributes:
        kind: ``"base"`` (full rewrite) or ``"segment"`` (changed rows only; a segment
            with no changed rows writes only the manifest).
        bytes: bytes of new files written (base or segment, plus the manifest).
        upserts: rows written (all rows for a base). deletes: deleted ids recorded.
        seconds: wall time of the write.
    """

    kind: str
    bytes: int
    upserts: int
    deletes: int
    seconds: float


@dataclass
class PreparedCheckpoint:
    """A checkpoint frozen by :meth:`CheckpointStore.prepare`, to be written by
    :meth:`CheckpointStore.finish`: the plan, the tables, their frozen views (base: every
    row; segment: the changes) and the offsets/seqs/meta of the same instant."""

    kind: str
    tables: dict[str, ServingTable]
    views: dict[str, Any]
    offsets: dict[str, int]
    seqs: dict
    meta: dict
    prepared_at: float = field(default_factory=time.perf_counter)
    dense: Optional[bytes] = None

    def release(self) -> None:
        """Let the tables reuse the rows the views pinned (idempotent)."""
        for v in self.views.values():
            if v is not None:
                v.release()


# ----------------------------------------------------------------------------- writing


class CheckpointStore:
    """The one writer of an incremental checkpoint directory.

    Args:
        path: the checkpoint directory (created on first write).
        max_segment_fraction: write a new base when the segments' total bytes exceed this
            fraction of the base's bytes.
        max_segments: write a new base when this many segments are chained.

    Usage: :meth:`load` once (recovers and removes leftovers of a crashed write; returns
    the stored state, or None), then :meth:`write` per checkpoint with the same table
    objects. Tables are tracked from :meth:`load` or the last base on; a table that is
    new, replaced or not tracked makes the next write a base.
    """

    def __init__(self, path: PathLike, *, max_segment_fraction: float = 0.5,
                 max_segments: int = 128) -> None:
        if isinstance(max_segment_fraction, bool) \
                or not isinstance(max_segment_fraction, (int, float)) \
                or not max_segment_fraction > 0:
            raise ValueError(f"max_segment_fraction: expected a positive number, got "
                             f"{max_segment_fraction!r}")
        if isinstance(max_segments, bool) or not isinstance(max_segments, int) \
                or max_segments < 0:
            raise ValueError(f"max_segments: expected an int ≥ 0, got {max_segments!r}")
        self.path = Path(path)
        self.max_segment_fraction = float(max_segment_fraction)
        self.max_segments = max_segments
        self._base: Optional[dict] = None  # committed base entry
        self._segs: list[dict] = []  # committed segment entries
        self._dense: Optional[dict] = None  # committed dense entry
        self._dense_data: Optional[bytes] = None  # ... and the bytes it holds
        self._tracked: dict[str, ServingTable] = {}
        self._need_base = True
        self._next_gen = 1
        self._next_seg = 1
        self._recovered = False

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        """Finish or undo what a crashed writer left next to / inside ``path``."""
        if self._recovered:
            return
        self._recovered = True
        path, old = self.path, old_path(self.path)
        # an interrupted write_snapshot swap (full format written at this path); a
        # ``<path>.old`` deltastream did not write is left alone
        if old.exists() and not is_deltastream_dir(old):
            log.warning("checkpoint %s: %s is not a deltastream snapshot; leaving it alone",
                        path, old)
        elif path.exists() and old.exists():
            shutil.rmtree(old, ignore_errors=True)
        elif old.exists() and not os.path.lexists(path):
            os.rename(old, path)
            fsync_dir(path.parent)
        if path.parent.exists():
            for stale in path.parent.glob(glob.escape(path.name) + ".tmp-*"):
                if is_tmp_name(stale.name) and stale.is_dir() and not stale.is_symlink():
                    shutil.rmtree(stale, ignore_errors=True)  # only our own temp dirs
        if not path.is_dir():
            return
        gens = [int(m.group(1)) for p in path.iterdir()
                for m in [BASE_RE.match(p.name.split(".tmp-")[0])] if m]
        self._next_gen = max(gens, default=0) + 1

    def _referenced(self) -> set[str]:
        names = {MANIFEST}
        if self._base is not None:
            names.add(self._base["dir"])
        names.update(s["file"] for s in self._segs)
        if self._dense is not None:
            names.add(self._dense["file"])
        return names

    def _clean(self, *, legacy: bool) -> None:
        """Remove files no committed manifest lists (call only after a durable commit)."""
        keep = self._referenced()
        for p in self.path.iterdir():
            if p.name in keep:
                continue
            ours = p.name.startswith(("base-", "seg-", "dense-", MANIFEST + ".tmp-"))
            if ours or (legacy and p.name == "tables"):
                try:
                    if p.is_dir():
                        shutil.rmtree(p)
                    else:
                        p.unlink()
                except OSError as e:  # retried at the next commit / open
                    log.warning("checkpoint %s: cannot remove stale %s: %s", self.path, p, e)

    # ------------------------------------------------------------------ public

    def reset(self) -> list[str]:
        """Remove the checkpoint at ``path`` (damaged or not) so the next :meth:`write`
        starts over; returns the names removed. Refuses (:class:`SnapshotError`) when
        ``path`` holds anything deltastream does not write
        (:func:`~consumers.storage.checkpoint_dir.remove_checkpoint_dir`)."""
        removed = remove_checkpoint_dir(self.path)
        self._base, self._segs, self._tracked = None, [], {}
        self._dense = self._dense_data = None
        self._need_base, self._next_gen, self._next_seg = True, 1, 1
        return removed

    def exists(self) -> bool:
        """True when ``path`` holds a manifest (checksums are verified by :meth:`load`)."""
        self._recover()
        return (self.path / MANIFEST).is_file()

    def load(self) -> Optional[Snapshot]:
        """Recover from a crashed write, read and verify the stored state, and start
        tracking changes of its tables. None when there is no checkpoint yet.

        Raises :class:`SnapshotError` on a damaged checkpoint: unreadable or failing a
        check, ``path`` a file, or checkpoint files without a manifest (see the module
        docstring; :meth:`reset` starts over).
        """
        self._recover()
        check_checkpoint_dir(self.path)
        if not (self.path / MANIFEST).is_file():
            return None
        body = read_manifest(self.path)
        fmt = body.get("format")
        if fmt == CHECKPOINT_FORMAT:
            snap = read_chain(self.path, body)
            self._base, self._segs = dict(body["base"]), [dict(s) for s in body["segments"]]
            self._next_gen = max(self._next_gen, self._base["gen"] + 1)
            self._next_seg = 1 + max((int(SEG_RE.match(s["file"]).group(2))  # type: ignore
                                      for s in self._segs), default=0)
            self._need_base = False
            self._dense, self._dense_data = body.get("dense"), snap.dense
            self._clean(legacy=True)
        else:
            snap = read_saved(self.path, body)  # full format: rewritten as a base next time
            self._need_base = True
        for t in snap.tables.values():
            t.start_tracking()
        self._tracked = dict(snap.tables)
        return snap

    def plan(self, tables: dict[str, ServingTable]) -> str:
        """``"base"`` or ``"segment"``: what :meth:`write` of ``tables`` would do now."""
        if self._need_base or self._base is None or set(tables) != set(self._tracked) \
                or any(t is not self._tracked[n] or not t.tracking for n, t in tables.items()):
            return "base"
        if len(self._segs) >= self.max_segments:
            return "base"
        seg_bytes = sum(s["bytes"] for s in self._segs)
        if seg_bytes > self.max_segment_fraction * max(1, int(self._base.get("bytes", 0))):
            return "base"
        return "segment"

    def write(self, *, tables: dict[str, ServingTable], offsets: dict[int, int], seqs: dict,
              meta: dict, dense: Optional[bytes] = None) -> CheckpointResult:
        """Checkpoint ``tables`` + next offset per partition + seq state + meta atomically.

        Writes the rows changed since the previous write as a segment, or a new base (see
        :meth:`plan`). After a crash at any instant, :meth:`load` / ``read_snapshot``
        return either the previous or this checkpoint, complete. On an exception nothing
        was committed (or the commit is not known durable): the next write is a base.
        Call from the one thread that applies to ``tables``. Lookups of the tables never
        wait for it (it reads frozen views); = :meth:`finish` of :meth:`prepare`.
        ``dense``: the dense versions' state of the same instant (None: none kept; bytes
        equal to the committed ones are not written again).
        """
        return self.finish(self.prepare(tables=tables, offsets=offsets, seqs=seqs, meta=meta,
                                        dense=dense))

    def prepare(self, *, tables: dict[str, ServingTable], offsets: dict[int, int],
                seqs: dict, meta: dict, dense: Optional[bytes] = None) -> PreparedCheckpoint:
        """Freeze what :meth:`write` would write, now: decide base or segment and take
        frozen views of the tables (O(changes), no row copied) — in the thread that
        applies, between two applies. :meth:`finish` then writes it from any thread while
        the tables keep applying and serving. Prepare the next one only after that finish.
        """
        offs = check_contents(tables, offsets, seqs, meta)
        self._recover()
        kind = self.plan(tables)
        views: dict[str, Any] = {}
        try:
            for n in sorted(tables):
                if kind == "base":  # restart tracking at exactly the frozen state
                    views[n] = tables[n].frozen(track=True)
                else:
                    views[n] = tables[n].frozen_changes()
                    if views[n] is None:  # plan() said segment: tracking stopped, a bug
                        raise RuntimeError(f"table {n!r} does not track changes")
        except BaseException:
            for v in views.values():
                if v is not None:
                    v.release()
            self._need_base = True  # changes may have been taken: rewrite all
            raise
        return PreparedCheckpoint(kind, dict(tables), views, offs, copy.deepcopy(seqs),
                                  copy.deepcopy(meta), dense=dense)

    def finish(self, prep: PreparedCheckpoint) -> CheckpointResult:
        """Write and commit the prepared checkpoint ``prep`` (see :meth:`write`), then
        release its views. One at a time, in the order prepared."""
        try:
            if prep.kind == "base":  # the very first one at path is built aside, renamed in
                write = self._write_base if os.path.lexists(self.path) else self._write_first
                res = write(prep)
            else:
                res = self._write_segment(prep)
        except BaseException:
            self._need_base = True  # changes taken from the tables may be lost: rewrite all
            raise
        finally:
            prep.release()
        res.seconds = time.perf_counter() - prep.prepared_at
        return res

    def _write_dense(self, data: Optional[bytes]) -> Optional[dict]:
        """The dense entry the next manifest lists: the committed one when ``data`` is
        what it holds, else a new file written (and its name made durable) now."""
        if data is None or data is self._dense_data or data == self._dense_data:
            return None if data is None else self._dense
        taken = {int(m.group(1)) for p in self.path.iterdir()
                 for m in [DENSE_RE.match(p.name.split(".tmp-")[0])] if m}
        fname = f"dense-{max(taken, default=0) + 1:06d}.bin"
        try:
            entry = write_chunks(self.path / fname, [data])
        except BaseException:
            (self.path / fname).unlink(missing_ok=True)
            raise
        fsync_dir(self.path)
        return {"file": fname, **entry}

    def _commit(self, base: dict, segs: list[dict], offs: dict, seqs: dict, meta: dict,
                dense: Optional[bytes] = None) -> int:
        entry = self._write_dense(dense)
        body = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_FORMAT_VERSION,
                "base": base, "segments": segs, "offsets": offs, "seqs": seqs, "meta": meta}
        if entry is not None:
            body["dense"] = entry
        data = json.dumps(seal(body), indent=1, sort_keys=True).encode()
        tmp = self.path / f"{MANIFEST}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb", opener=no_follow) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path / MANIFEST)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.path)  # the rename is durable: the commit point
        old, self._dense, self._dense_data = self._dense, entry, dense
        if old is not None and old != entry:  # no longer listed: only now that it is durable
            (self.path / old["file"]).unlink(missing_ok=True)
        return len(data)

    def _write_first(self, prep: PreparedCheckpoint) -> CheckpointResult:
        """The first checkpoint at ``path``: a base written into a temp directory next to
        it, renamed into place once committed — so a checkpoint directory without a
        manifest is never left by a crash of ours (:meth:`load` refuses one as damaged)."""
        final = self.path
        tmp = new_tmp(final)
        self.path = tmp
        try:
            res = self._write_base(prep)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            self.path = final
        try:
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(final.parent)
        return res

    def _drop_uncommitted(self, name: str) -> None:
        """Remove the new base ``name`` after its commit failed, unless the manifest on
        disk lists it (the rename landed, only a later step failed)."""
        try:
            listed = json.loads((self.path / MANIFEST).read_bytes()).get("base", {}).get("dir")
        except (OSError, ValueError, AttributeError):
            listed = None
        if listed != name:
            shutil.rmtree(self.path / name, ignore_errors=True)

    def _write_base(self, prep: PreparedCheckpoint) -> CheckpointResult:
        tables, offs, seqs, meta = prep.tables, prep.offsets, prep.seqs, prep.meta
        self.path.mkdir(parents=True, exist_ok=True)
        legacy = (self.path / MANIFEST).is_file() and self._base is None
        gen = self._next_gen
        self._next_gen += 1
        name = f"base-{gen:06d}"
        tmp = self.path / f"{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # views frozen by prepare() with tracking restarted: later changes go in segments
        try:
            info = write_full(tmp, tables, offs, seqs, meta, prep.views)
            os.rename(tmp, self.path / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(self.path)
        base = {"dir": name, "gen": gen, "manifest": info["manifest"], "bytes": info["bytes"]}
        try:
            mbytes = self._commit(base, [], offs, seqs, meta, prep.dense)
        except BaseException:
            self._drop_uncommitted(name)  # a full disk must not fill up with orphan bases
            raise
        self._base, self._segs = base, []
        self._tracked = dict(tables)
        self._need_base = False
        self._next_seg = 1
        self._clean(legacy=legacy)  # old base and segments: only now that this is durable
        rows = sum(v.n for v in prep.views.values())
        log.debug("checkpoint %s: base %s written (%d rows, %d bytes)", self.path, name, rows,
                  info["bytes"])
        return CheckpointResult("base", info["bytes"] + mbytes, rows, 0, 0.0)

    def _write_segment(self, prep: PreparedCheckpoint) -> CheckpointResult:
        assert self._base is not None
        changes: dict[str, FrozenChanges] = {
            n: v for n, v in prep.views.items() if v.n or v.deleted.size}
        segs = list(self._segs)
        nbytes = 0
        if changes:
            gen, index = self._base["gen"], self._next_seg
            self._next_seg += 1
            fname = f"seg-{gen:06d}-{index:06d}.bin"
            path = self.path / fname
            try:
                entry = write_chunks(path, encode_segment(gen, index, changes))
            except BaseException:
                path.unlink(missing_ok=True)
                raise
            fsync_dir(self.path)  # the new name is durable before a manifest lists it
            segs.append({"file": fname, **entry})
            nbytes = entry["bytes"]
        nbytes += self._commit(self._base, segs, prep.offsets, prep.seqs, prep.meta,
                               prep.dense)
        self._segs = segs
        ups = sum(v.n for v in changes.values())
        dels = sum(int(v.deleted.shape[0]) for v in changes.values())
        return CheckpointResult("segment", nbytes, ups, dels, 0.0)
