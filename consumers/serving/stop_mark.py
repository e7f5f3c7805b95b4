"""The clean-stop mark: how a reader opened after ``deltastream-sync`` stopped learns why no
table is shared.

A daemon that stops cleanly removes its shared tables (readers that mapped them keep
serving the last rows; /dev/shm is not left full) and leaves ``<state_dir>/daemon.stopped``
(when it shared tables): when it stopped, and its pid. :meth:`TableReader.open
<consumers.serving.reader.TableReader.open>` that finds no table and this mark fails after
at most :data:`STOP_GRACE_S` (its timeout when shorter), saying the daemon is stopped,
instead of waiting out a long timeout for a table that no one will share. The next daemon
of the state dir removes the mark first thing (under the state dir's lock): a daemon being
started within the grace clears it, and the reader then waits for its tables as asked.

The mark is trusted only when its owner may write the state dir's tables (the state dir's
owner, or root: :func:`consumers.serving.access.writers_of`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

__all__ = ["STOP_MARK", "STOP_GRACE_S", "mark_stopped", "leave_stop_mark", "clear_stopped", "stopped_at"]

log = logging.getLogger(__name__)

#: file name of the mark in the state dir
STOP_MARK = "daemon.stopped"
#: seconds a reader waits for a stopped daemon's restart to clear the mark
STOP_GRACE_S = 5.0


def mark_stopped(state_dir: os.PathLike | str) -> None:
    """Leave the mark (atomically: temp file + rename; mode 0644 so readers of any uid
    may read it). Raises ``OSError`` when the state dir cannot be written."""
    path = Path(state_dir) / STOP_MARK
    tmp = path.with_name(f".{STOP_MARK}.tmp-{os.getpid()}")
    body = json.dumps({"stopped_at": time.time(), "pid": os.getpid()})
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, body.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def leave_stop_mark(state_dir: os.PathLike | str) -> None:
    """:func:`mark_stopped`, a failure logged (a full or read-only disk must not fail a
    stop; readers then wait out their timeout as before)."""
    try:
        mark_stopped(state_dir)
    except OSError as e:
        log.warning("%s: cannot leave the clean-stop mark for readers (%s)", state_dir, e)


def clear_stopped(state_dir: os.PathLike | str) -> None:
    """Remove the mark (a daemon starts); nothing when there is none."""
    try:
        os.unlink(Path(state_dir) / STOP_MARK)
    except FileNotFoundError:
        pass


def stopped_at(state_dir: os.PathLike | str, writers: frozenset[int]) -> Optional[float]:
    """When the daemon of ``state_dir`` stopped cleanly (s since the epoch), from a mark
    owned by one of ``writers``; ``None`` when there is no trusted, readable mark."""
    try:
        fd = os.open(Path(state_dir) / STOP_MARK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid not in writers:
            return None
        body = json.loads(os.read(fd, 4096).decode())
        return float(body["stopped_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)
