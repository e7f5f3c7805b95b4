"""Reading an incremental checkpoint (the format of :mod:`consumers.storage.checkpoint`):
the manifest checked, the base read, then every segment applied in order, each file
verified against its checksum. A reader racing a writer's compaction reads the newer
manifest instead (:func:`read_checkpoint`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Optional

from consumers.errors import SnapshotError
from consumers.files import MANIFEST, PathLike, check_format, read_manifest, read_verified
from consumers.storage.full_format import SNAPSHOT_FORMAT, Snapshot, read_full
from consumers.storage.segments import apply_segment, parse_segment

__all__ = ["read_checkpoint", "read_chain", "CHECKPOINT_FORMAT",
           "CHECKPOINT_FORMAT_VERSION", "BASE_RE", "SEG_RE", "DENSE_RE"]

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "deltastream-checkpoint"
CHECKPOINT_FORMAT_VERSION = 2  # 2: file entries carry a CRC-32C (1: a sha256, still read)
#: names of a base directory, a segment file, a dense-state file
BASE_RE = re.compile(r"^base-(\d{6,})$")
SEG_RE = re.compile(r"^seg-(\d{6,})-(\d{6,})\.bin$")
DENSE_RE = re.compile(r"^dense-(\d{6,})\.bin$")


def _check_body(root: Path, body: dict) -> tuple[dict, list, dict[int, int], dict, dict]:
    """(base entry, segment entries, offsets, seqs, meta) of a manifest ``body``."""
    where = root / MANIFEST
    check_format(where, body, CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION)
    base, segs = body.get("base"), body.get("segments")
    offs, seqs, meta = body.get("offsets"), body.get("seqs"), body.get("meta")
    if not isinstance(base, dict) or not isinstance(segs, list) or not isinstance(offs, dict) \
            or not isinstance(seqs, dict) or not isinstance(meta, dict):
        raise SnapshotError(f"{where}: malformed manifest (base/segments/offsets/seqs/meta)")
    m = BASE_RE.match(str(base.get("dir")))
    if m is None or int(m.group(1)) != base.get("gen"):
        raise SnapshotError(f"{where}: malformed base entry {base!r}")
    for i, s in enumerate(segs, 1):
        sm = SEG_RE.match(str(s.get("file"))) if isinstance(s, dict) else None
        if sm is None or int(sm.group(1)) != base["gen"]:
            raise SnapshotError(f"{where}: segment {i} entry {s!r} is not a segment of base "
                                f"{base['gen']}")
    try:
        offsets = {int(p): int(o) for p, o in offs.items()}
    except (TypeError, ValueError):
        raise SnapshotError(f"{where}: malformed offsets {offs!r}") from None
    return base, segs, offsets, seqs, meta


def read_chain(root: Path, body: dict) -> Snapshot:
    """The state manifest ``body`` of checkpoint directory ``root`` names: its base, then
    its segments in order (files verified). Raises :class:`SnapshotError`."""
    base, segs, offsets, seqs, meta = _check_body(root, body)
    bdir = root / base["dir"]
    bbody = read_manifest(bdir, base.get("manifest"))
    if bbody.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotError(f"{bdir / MANIFEST}: base format is {bbody.get('format')!r}, "
                            f"expected {SNAPSHOT_FORMAT!r}")
    tables = read_full(bdir, bbody).tables
    for s in segs:
        path = root / s["file"]
        index = int(SEG_RE.match(s["file"]).group(2))  # type: ignore[union-attr]
        parts = parse_segment(read_verified(path, s), path, base["gen"], index)
        apply_segment(tables, parts, path)
    return Snapshot(tables=tables, offsets=offsets, seqs=seqs, meta=meta, path=root,
                    dense=_read_dense(root, body.get("dense")))


def _read_dense(root: Path, entry: Any) -> Optional[bytes]:
    """The dense state a manifest's ``dense`` entry names (verified), or None."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or not DENSE_RE.match(str(entry.get("file"))):
        raise SnapshotError(f"{root / MANIFEST}: malformed dense entry {entry!r:.200}")
    return bytes(read_verified(root / entry["file"], entry))


def read_checkpoint(path: PathLike, body: Optional[dict] = None) -> Snapshot:
    """Read and verify the incremental checkpoint in directory ``path``: its base, then
    every segment in order (each file checked against its checksum).

    ``body``: the already verified ``manifest.json`` content (read when None). When a
    listed file vanished because a writer committed a newer manifest meanwhile (a
    compaction removes the old files), the newer manifest is read instead.

    Raises :class:`SnapshotError` naming the file and the problem.
    """
    root = Path(path)
    if body is None:
        body = read_manifest(root)
    for attempt in range(3):
        try:
            return read_chain(root, body)
        except SnapshotError:
            newer = read_manifest(root)
            if newer == body or attempt == 2:
                raise
            log.debug("checkpoint %s changed while reading; reading the new one", root)
            body = newer
    raise AssertionError("unreachable")
