"""The files predictor state is stored in: sealed manifests, verified reads, atomic swaps.

Every persistent format of the predictor (a table directory, a full snapshot, an
incremental checkpoint) is built from these pieces:

* **manifests** — ``manifest.json``: a JSON body plus ``"checksum"``, the sha256 of the
  body's canonical JSON (:func:`seal` / :func:`unseal`), so any edited byte is caught; file
  entries in a manifest carry the size and CRC-32C of each file (:func:`read_verified`;
  entries written by format version 1 carry a sha256 instead, still read: see
  :data:`CHECKSUM`);
* **durable writes** — every file written here is fsynced (:func:`write_file`,
  :func:`write_npy`, :func:`write_chunks`), and so is each directory after it changes
  (:func:`fsync_dir`);
* **atomic directories** — a directory is filled under a temporary name next to its place
  and swapped in by renames (:func:`write_dir_atomic`, :func:`replace_dir`); a reader
  finds the latest complete one with :func:`resolve_dir`;
* **ownership** — a write replaces only what deltastream wrote: an output path (or its
  ``<path>.old``) that exists and is neither an empty directory nor a deltastream snapshot
  (:func:`is_deltastream_dir`) is refused with :class:`SnapshotError` naming the path and
  what was expected (:func:`check_replaceable`); nothing there is deleted or moved.

The table directory (one table's ``ids.npy`` + ``rows.npy`` + manifest) is the serving
table's own format: :mod:`consumers.serving.table_files`. This module knows no table: it
sits below both ``consumers.serving`` and ``consumers.storage``.

Every problem found while reading raises :class:`~consumers.errors.SnapshotError` naming
the file and what was expected.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import crc32c
import numpy as np

from consumers.errors import SnapshotError

__all__ = [
    "PathLike",
    "no_follow",
    "MANIFEST",
    "OWN_FORMATS",
    "HashingWriter",
    "CHECKSUM",
    "WRITE_SLICE",
    "fsync_dir",
    "write_file",
    "write_npy",
    "write_npy_chunks",
    "write_chunks",
    "seal",
    "unseal",
    "write_manifest",
    "read_manifest",
    "read_verified",
    "parse_npy",
    "check_format",
    "old_path",
    "new_tmp",
    "is_tmp_name",
    "is_deltastream_dir",
    "foreign_entries",
    "check_replaceable",
    "replace_dir",
    "resolve_dir",
    "write_dir_atomic",
]

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
T = TypeVar("T")

MANIFEST = "manifest.json"
#: manifest formats deltastream writes (table dir, full snapshot, incremental checkpoint)
OWN_FORMATS = ("deltastream-table", "deltastream-snapshot", "deltastream-checkpoint")
#: names deltastream writes at the top of a table, snapshot or checkpoint directory
_OWN_NAME = re.compile(r"^(manifest\.json|ids\.npy|rows\.npy|tables|base-\d{6,}|"
                       r"seg-\d{6,}-\d{6,}\.bin|dense(-\d{6,})?\.bin)(\.tmp-\d+-[0-9a-f]+)?$")
#: a temp directory of :func:`new_tmp` next to ``<name>``
_TMP_SUFFIX = re.compile(r"\.tmp-\d+-[0-9a-f]+$")


# ----------------------------------------------------------------------------- writing


#: bytes per ``write()`` call. A kernel running ``preempt=none`` (the default of many server and
#: VM kernels) copies a whole ``write()`` into the page cache without a preemption point. A
#: checkpoint writing 16 MiB per call held a CPU for milliseconds, and a process woken on that
#: CPU (a model server's lookup) waited for it. Same-CPU latency probe, 1 GiB written:
#: p99 3.2 ms with 64 MiB calls, 0.11-0.13 ms with 256 KiB calls (and the file is written
#: faster too).
WRITE_SLICE = 256 << 10


#: checksum of the data files written (CRC-32C, hardware on x86-64 and arm64: ~16 GB/s here
#: against ~1.6 GB/s for the sha256 format version 1 used, which was the largest cost of
#: the daemon's checkpoint thread). It catches what a checksum of local files is for: torn,
#: truncated and bit-rotted files. The manifest's own checksum stays a sha256.
CHECKSUM = "crc32c"
_CHECKSUMS = {"crc32c": lambda b: f"{crc32c.crc32c(b):08x}",
              "sha256": lambda b: hashlib.sha256(b).hexdigest()}


class HashingWriter:
    """File wrapper that checksums (:data:`CHECKSUM`) and counts what is written, in
    ``write()`` calls of at most :data:`WRITE_SLICE` bytes."""

    def __init__(self, f: Any) -> None:
        self.f, self.h, self.n = f, crc32c.CRC32CHash(), 0

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.h.update(mv)  # the whole buffer in one call, without the GIL
        for i in range(0, len(mv), WRITE_SLICE):
            self.f.write(mv[i: i + WRITE_SLICE])
        self.n += len(mv)
        return len(mv)

    def entry(self) -> dict:
        """The manifest entry of what was written: {CHECKSUM: hex, "bytes": n}."""
        return {CHECKSUM: self.h.hexdigest(), "bytes": self.n}


def no_follow(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open` that never follows a symbolic link at ``path``
    (``OSError`` ELOOP instead): the daemon writes only through names it made."""
    return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)


def fsync_dir(path: Path) -> None:
    """fsync directory ``path`` (makes the names created or renamed in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> dict:
    """Write ``data`` to ``path`` with fsync; returns the file's manifest entry."""
    return write_chunks(path, [data])


def write_npy(path: Path, arr: np.ndarray) -> dict:
    """``arr`` as the ``.npy`` file ``path`` (what np.save writes) with fsync; returns
    the file's manifest entry."""
    return write_npy_chunks(path, arr.dtype, arr.shape, [arr])


def write_npy_chunks(path: Path, dtype: np.dtype, shape: tuple, chunks: Iterable[Any]
                     ) -> dict:
    """A ``.npy`` file of ``dtype`` and ``shape`` (the bytes np.save writes) from ``chunks``
    of rows along the first axis, with fsync; returns the file's manifest entry.

    Chunks are written from their own memory: np.save into a file object that is not a
    real file (the hashing writer) copies each 16 MiB piece with ``tobytes`` first, which
    holds the GIL for milliseconds (fresh pages), and every thread of the daemon's
    process waits.
    """
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": tuple(shape)}
    n = 0
    with open(path, "wb", opener=no_follow) as f:
        w = HashingWriter(f)
        np.lib.format.write_array_header_1_0(w, header)  # what np.save writes here
        for c in chunks:
            c = np.ascontiguousarray(c, dtype=dtype)
            n += c.shape[0]
            if c.size:
                w.write(c.reshape(-1))
        f.flush()
        os.fsync(f.fileno())
    if n != shape[0]:
        raise RuntimeError(f"{path}: wrote {n} rows, expected {shape[0]}")
    return w.entry()


def write_chunks(path: Path, chunks: Iterable[Any]) -> dict:
    """Write ``chunks`` (bytes or contiguous arrays) to the new file ``path`` with fsync;
    returns the file's manifest entry ({:data:`CHECKSUM`: hex, "bytes": size})."""
    with open(path, "wb", opener=no_follow) as f:
        w = HashingWriter(f)
        for c in chunks:
            w.write(c)
        f.flush()
        os.fsync(f.fileno())
    return w.entry()


# ----------------------------------------------------------------------------- manifests


def seal(body: dict) -> dict:
    """``body`` plus "checksum": sha256 of its canonical JSON (catches any edited byte)."""
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return {**body, "checksum": hashlib.sha256(canon).hexdigest()}


def unseal(raw: bytes, where: Path) -> dict:
    """The body of the sealed manifest ``raw`` (read from ``where``) after checking it."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotError(f"{where}: manifest is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or "checksum" not in doc:
        raise SnapshotError(f"{where}: manifest has no checksum (not a deltastream snapshot?)")
    body = {k: v for k, v in doc.items() if k != "checksum"}
    if seal(body)["checksum"] != doc["checksum"]:
        raise SnapshotError(f"{where}: manifest checksum mismatch (the manifest was altered "
                            "or damaged)")
    return body


def write_manifest(dir: Path, body: dict) -> dict:
    """Write ``body`` sealed as ``dir/manifest.json`` with fsync; returns its file entry."""
    data = json.dumps(seal(body), indent=1, sort_keys=True).encode()
    return write_file(dir / MANIFEST, data)


def read_verified(path: Path, entry: Any) -> bytearray:
    """Bytes of ``path`` after checking size and checksum against the manifest ``entry``
    (a CRC-32C, or the sha256 of format version 1)."""
    algo = next((a for a in _CHECKSUMS if isinstance(entry, dict)
                 and isinstance(entry.get(a), str)), None)
    if algo is None or not isinstance(entry.get("bytes"), int):
        raise SnapshotError(f"{path}: manifest entry is malformed: {entry!r} (expected "
                            "bytes and a crc32c or sha256)")
    try:
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise SnapshotError(f"{path}: {size} bytes, manifest says {entry['bytes']} "
                                "(truncated or half-written)")
        data = bytearray(size)
        with open(path, "rb") as f:
            got = f.readinto(data)
    except FileNotFoundError:
        raise SnapshotError(f"{path}: file missing") from None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read ({e})") from None
    if got != size:
        raise SnapshotError(f"{path}: short read ({got} of {size} bytes)")
    if _CHECKSUMS[algo](data) != entry[algo]:
        raise SnapshotError(f"{path}: {algo} checksum mismatch (file damaged)")
    return data


def read_manifest(dir: Path, entry: Any = None) -> dict:
    """The verified body of ``dir/manifest.json`` (``entry``: its expected size and
    checksum)."""
    path = dir / MANIFEST
    if entry is not None:
        raw = bytes(read_verified(path, entry))
    else:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise SnapshotError(f"{path}: manifest missing (half-written or not a "
                                "snapshot)") from None
        except OSError as e:
            raise SnapshotError(f"{path}: cannot read ({e})") from None
    return unseal(raw, path)


def check_format(where: Path, body: dict, fmt: str, version: int) -> None:
    """Refuse a manifest ``body`` (read from ``where``) of another format, or of a version
    newer than ``version`` (this reader reads every version from 1 to it)."""
    if body.get("format") != fmt:
        raise SnapshotError(f"{where}: format is {body.get('format')!r}, expected {fmt!r}")
    v = body.get("version")
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= version:
        raise SnapshotError(f"{where}: format version {v!r} is not supported (this reader "
                            f"knows 1 to {version})")


def parse_npy(data: bytearray, path: Path, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """Array from verified .npy bytes (no copy); refuses object dtypes and wrong shapes."""
    try:
        head = io.BytesIO(bytes(data[: min(len(data), 1 << 16)]))
        version = np.lib.format.read_magic(head)
        reader = {(1, 0): np.lib.format.read_array_header_1_0,
                  (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if reader is None:
            raise ValueError(f"unsupported .npy version {version}")
        fshape, fortran, fdtype = reader(head)
    except ValueError as e:
        raise SnapshotError(f"{path}: not a valid .npy file ({e})") from None
    if fdtype != dtype or fortran or tuple(fshape) != tuple(shape):
        raise SnapshotError(f"{path}: holds {fdtype} {tuple(fshape)} (fortran={fortran}), "
                            f"expected {dtype} {tuple(shape)}")
    offset = head.tell()
    count = int(np.prod(shape, dtype=np.int64))
    if len(data) - offset != count * dtype.itemsize:
        raise SnapshotError(f"{path}: {len(data) - offset} data bytes, expected "
                            f"{count * dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


# ----------------------------------------------------------------------------- atomic dirs


def old_path(path: Path) -> Path:
    """Where :func:`replace_dir` keeps the previous ``path`` during a swap."""
    return path.with_name(path.name + ".old")


def new_tmp(path: Path) -> Path:
    """A fresh temp dir name next to ``path`` (same filesystem, so renames are atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(glob.escape(path.name) + ".tmp-*"):
        # left by a writer that crashed (single writer per path is a documented rule);
        # only directories named exactly as this function names them are ours to remove
        if _TMP_SUFFIX.fullmatch(stale.name[len(path.name):]) and stale.is_dir() \
                and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_tmp_name(name: str) -> bool:
    """True when ``name`` ends like the temp names deltastream writes under
    (``<name>.tmp-<pid>-<hex>``): a write that is not committed."""
    return _TMP_SUFFIX.search(name) is not None


def foreign_entries(dir: Path) -> list[str]:
    """Names at the top of directory ``dir`` that deltastream never writes there (sorted)."""
    return sorted(p.name for p in dir.iterdir() if not _OWN_NAME.match(p.name))


def is_deltastream_dir(path: Path) -> bool:
    """True when ``path`` is a directory deltastream wrote: its ``manifest.json`` is JSON
    naming one of deltastream's formats (checksums are not verified: a damaged snapshot of
    ours is still ours to replace) and it holds only names deltastream writes."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        doc = json.loads((path / MANIFEST).read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("format") in OWN_FORMATS \
        and not foreign_entries(path)


def _refusal(path: Path) -> Optional[str]:
    """Why ``path`` must not be replaced, or None when it may be (absent, an empty
    directory, or a deltastream snapshot)."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        return "is a symbolic link"
    if not path.is_dir():
        return "is a file, not a directory"
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError as e:
        return f"cannot be listed ({e})"
    if not names or is_deltastream_dir(path):
        return None
    foreign = foreign_entries(path)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f", … ({len(foreign)} in all)"
                                          if len(foreign) > 5 else "")
        return f"holds files deltastream did not write ({shown})"
    return f"holds no valid {MANIFEST} (not a complete deltastream snapshot)"


def check_replaceable(path: Path) -> None:
    """Refuse to write at ``path`` unless it is absent, an empty directory, or a deltastream
    snapshot (likewise ``<path>.old``, which a swap removes): :class:`SnapshotError` naming
    the path and what was expected. Never deletes or moves anything."""
    for p in (path, old_path(path)):
        why = _refusal(p)
        if why is not None:
            raise SnapshotError(
                f"{p}: {why}; expected a deltastream snapshot to replace, an empty directory "
                f"or a path that does not exist — nothing was changed (move it away or "
                f"choose another path)")


def replace_dir(tmp: Path, path: Path) -> None:
    """Make the complete, fsynced directory ``tmp`` become ``path``.

    Steps (each a rename or removal; the parent is fsynced after each rename):
      1. ``path`` and ``path.old`` both exist (an earlier crash after step 3): ``path`` is
         the newer complete one, remove ``path.old``.
      2. rename ``path`` -> ``path.old`` (skipped when there is no ``path``).
      3. rename ``tmp`` -> ``path``.
      4. remove ``path.old``.
    At every instant either ``path`` is complete, or it is absent and ``path.old`` is the
    previous complete one; :func:`resolve_dir` reads whichever applies.
    """
    check_replaceable(path)  # again right before the swap: nothing foreign is ever removed
    parent = path.parent
    old = old_path(path)
    if path.exists() and old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.rename(path, old)
        fsync_dir(parent)
    os.rename(tmp, path)
    fsync_dir(parent)
    if old.exists():
        shutil.rmtree(old)


def resolve_dir(path: Path) -> Path:
    """The directory holding the latest complete snapshot written at ``path``."""
    if path.exists():
        return path
    old = old_path(path)
    if old.exists():
        log.warning("snapshot %s missing but %s exists (a write was interrupted); "
                    "reading the previous snapshot", path, old)
        return old
    raise SnapshotError(f"{path}: no snapshot there")


def write_dir_atomic(path: Path, fill: Callable[[Path], T]) -> T:
    """Call ``fill(tmp)`` to write a new directory ``tmp`` (fsynced), then swap it in at
    ``path`` with :func:`replace_dir`; returns what ``fill`` returned. On an exception
    from ``fill`` the temp directory is removed and ``path`` is untouched. A ``path`` (or
    ``<path>.old``) holding anything but a deltastream snapshot or an empty directory is
    refused first, before anything is written (:func:`check_replaceable`)."""
    check_replaceable(path)
    tmp = new_tmp(path)
    try:
        out = fill(tmp)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, path)
    return out
