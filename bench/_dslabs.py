"""A second real interaction log for benchmarks: MovieLens "latest-small" (2016 cut) as the
Debian package ``r-cran-dslabs`` ships it.

``r-cran-dslabs`` (the R package dslabs, Artistic-2.0; the ratings are GroupLens's, under
their usage licence: not redistributed here, read from the package) holds ``movielens``: the
100,004 ratings (0.5–5 stars in half steps) of ``ml-latest-small`` as GroupLens published it
in October 2016 — 671 users, 9,066 movies, January 1995 to October 2016. Same service as
MovieLens-100K, but another era (twenty years instead of seven months), half-star ratings
and five times the items: the log the publishing defaults were *not* chosen on.

The ``.deb`` is fetched with ``apt-get download r-cran-dslabs`` into the cache directory
(:func:`fetch_deb`) — no install, no R — and the data frame is read from the package's
lazy-load database (``data/Rdata.rdb``) with :mod:`bench._rdata`.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Optional

import numpy as np

from bench._rdata import NA_INTEGER, data_frame_columns, lazyload_object

__all__ = ["DEB_PACKAGE", "DATA_DIR", "HOW_TO_GET", "find_deb", "fetch_deb", "read_deb",
           "ratings_from_deb"]

log = logging.getLogger(__name__)

DEB_PACKAGE = "r-cran-dslabs"
#: where the package keeps its data sets
DATA_DIR = "usr/lib/R/site-library/dslabs/data"
HOW_TO_GET = (f"this log is MovieLens latest-small as the Debian package {DEB_PACKAGE} ships "
              f"it; fetch it with\n  (cd bench-out/cache && apt-get download {DEB_PACKAGE})"
              "   # one 4 MB .deb, nothing installed\n"
              "(found there by default; elsewhere pass --cache DIR)")


def find_deb(cache_dir: str | os.PathLike) -> Optional[Path]:
    """The newest ``r-cran-dslabs_*.deb`` in ``cache_dir`` (by name), or ``None``."""
    found = sorted(Path(cache_dir).glob(f"{DEB_PACKAGE}_*.deb")) \
        if Path(cache_dir).is_dir() else []
    return found[-1] if found else None


def fetch_deb(cache_dir: str | os.PathLike, *, timeout: float = 300.0) -> Path:
    """Download the package's ``.deb`` into ``cache_dir`` with ``apt-get download`` (the
    machine's configured Debian mirror); return its path.

    Raises:
        RuntimeError: apt-get failed or wrote no ``.deb`` (its last line and
            :data:`HOW_TO_GET` in the text).
    """
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    log.info("fetching %s into %s", DEB_PACKAGE, cache_dir)
    try:
        proc = subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=cache_dir,
                              capture_output=True, text=True, timeout=timeout)
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1] \
            if proc.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    deb = find_deb(cache_dir)
    if why or deb is None:
        raise RuntimeError(f"fetching {DEB_PACKAGE} failed ({why or 'no .deb written'}): "
                           f"{HOW_TO_GET}")
    return deb


def _ar_members(data: bytes) -> dict[str, bytes]:
    """Members of an ``ar`` archive (a ``.deb`` is one), by name."""
    if data[:8] != b"!<arch>\n":
        raise ValueError("not a .deb (no ar archive header)")
    out, p = {}, 8
    while p + 60 <= len(data):
        header = data[p:p + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        out[name] = data[p + 60:p + 60 + size]
        p += 60 + size + (size & 1)  # members are 2-byte aligned
    return out


def read_deb(path: str | os.PathLike, names: list[str]) -> dict[str, bytes]:
    """The files ``names`` (paths inside the package, no leading ``./``) of a ``.deb``.
    Raises ``ValueError`` naming what is missing or when the data tarball is compressed
    with something Python cannot read."""
    members = _ar_members(Path(path).read_bytes())
    tar_name = next((n for n in members if n.startswith("data.tar")), None)
    if tar_name is None:
        raise ValueError(f"{path}: no data.tar.* member (has {sorted(members)})")
    try:
        tar = tarfile.open(fileobj=io.BytesIO(members[tar_name]))
    except tarfile.ReadError as e:
        raise ValueError(f"{path}: cannot read {tar_name} ({e})") from None
    out = {}
    with tar:
        for m in tar.getmembers():
            name = m.name.removeprefix("./")
            if name in names and m.isfile():
                out[name] = tar.extractfile(m).read()
    missing = sorted(set(names) - set(out))
    if missing:
        raise ValueError(f"{path}: has no {missing}; is it the {DEB_PACKAGE} package?")
    return out


def ratings_from_deb(path: str | os.PathLike) -> tuple[np.ndarray, ...]:
    """``(users, items, ratings, timestamps)`` of the ``movielens`` data frame of an
    ``r-cran-dslabs`` ``.deb``, in the package's order: int64, int64, float32 (stars),
    int64 (Unix seconds), each ``[n]``. Raises ``ValueError`` on a missing column or NA."""
    rdx, rdb = (f"{DATA_DIR}/Rdata.rdx", f"{DATA_DIR}/Rdata.rdb")
    files = read_deb(path, [rdx, rdb])
    cols = data_frame_columns(lazyload_object(files[rdx], files[rdb], "movielens"))
    need = ("userId", "movieId", "rating", "timestamp")
    if any(c not in cols for c in need):
        raise ValueError(f"{path}: movielens has columns {sorted(cols)}, expected {need}")
    users, items, ts = (np.asarray(cols[c], dtype=np.int64)
                        for c in ("userId", "movieId", "timestamp"))
    ratings = np.asarray(cols["rating"], dtype=np.float64)
    bad = (users == NA_INTEGER) | (items == NA_INTEGER) | (ts == NA_INTEGER) \
        | ~np.isfinite(ratings)
    if bad.any():
        raise ValueError(f"{path}: {int(bad.sum())} ratings have a missing user, movie, "
                         f"rating or timestamp (first at row {int(np.argmax(bad)) + 1})")
    return users, items, ratings.astype(np.float32), ts
