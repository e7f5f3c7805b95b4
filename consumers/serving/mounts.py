"""Whether the filesystem holding shared tables gives them huge pages when they are faulted.

A lookup of random ids reads rows spread over gigabytes. In 4 KiB pages each row costs a
TLB miss and a page walk besides its cache misses; in 2 MiB pages the walks mostly hit
the cache. ``MAP_SHARED`` memory on tmpfs is faulted in huge pages only where the *mount*
allows it: the ``huge=`` option of that tmpfs (``never`` unless given; ``/dev/shm`` is
mounted without it on most distributions). Elsewhere the writer collapses blocks into huge
pages itself (:mod:`consumers.serving.hugemap`), or a tmpfs mounted for tables gives them::

    mount -t tmpfs -o huge=within_size,size=32G,mode=1777 tmpfs /dev/hugeshm

given to the daemon and its readers alike (``--shm-dir``, ``shm_dir=``, or
``DELTASTREAM_SHM_DIR``; see :mod:`consumers.serving.shm`). :func:`huge_pages` says which
kind a directory has.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["Mount", "mount_of", "huge_pages", "HUGE_MODES"]

#: tmpfs ``huge=`` values under which our mappings (``madvise(MADV_HUGEPAGE)``) get huge pages
HUGE_MODES = frozenset({"always", "within_size", "advise"})
_MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/self/mountinfo``: where, what filesystem, its options."""

    point: str
    fstype: str
    options: dict[str, str] = field(default_factory=dict)  # super options; flags map to ""


def _unescape(point: str) -> str:
    """mountinfo writes space, tab, newline and backslash as ``\\ooo`` (octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)


def _parse(line: str) -> Optional[Mount]:
    parts = line.split()
    try:
        sep = parts.index("-", 6)  # optional fields end at a lone "-"
        point, fstype, sopts = parts[4], parts[sep + 1], parts[sep + 3]
    except (ValueError, IndexError):
        return None
    options = dict((o.split("=", 1) + [""])[:2] for o in sopts.split(",") if o)
    return Mount(_unescape(point), fstype, options)


def mount_of(path: os.PathLike | str, mountinfo: Optional[str] = None) -> Optional[Mount]:
    """The mount holding ``path`` (resolved): the last-mounted one with the longest mount
    point that is a prefix of it. ``mountinfo``: the text of ``/proc/self/mountinfo``
    (read when None); None when unknown (not Linux, unreadable)."""
    if mountinfo is None:
        try:
            with open(_MOUNTINFO) as f:
                mountinfo = f.read()
        except OSError:
            return None
    real = os.path.realpath(os.fspath(path))
    best: Optional[Mount] = None
    for line in mountinfo.splitlines():
        m = _parse(line)
        if m is None:
            continue
        inside = real == m.point or real.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m  # equal length: a later mount over the same point hides the earlier
    return best


def huge_pages(path: os.PathLike | str, mountinfo: Optional[str] = None) -> Optional[bool]:
    """Whether shared tables under ``path`` get huge pages: True on a tmpfs mounted with
    ``huge=always|within_size|advise``, False on a tmpfs without (``never``, the default),
    None when unknown (another filesystem, or no mount table)."""
    m = mount_of(path, mountinfo)
    if m is None or m.fstype != "tmpfs":
        return None
    return m.options.get("huge", "never") in HUGE_MODES
