"""Where the shared tables of a state dir live: the place in the shm dir derived from the
state dir's path, or ``<state_dir>/shm`` when there is no shm dir or another local user
planted something at that place (anyone can compute it). Writer and readers decide alike.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from pathlib import Path
from typing import Optional

from consumers.serving.access import writers_of

__all__ = ["SHM_BASE", "SHM_ENV", "shm_base", "derived_root", "planted_root", "shm_root",
           "table_dir"]

log = logging.getLogger(__name__)

SHM_BASE = "/dev/shm"
#: environment variable naming another shm dir (for the writer and its readers alike)
SHM_ENV = "DELTASTREAM_SHM_DIR"
_warned: set[Path] = set()  # planted shm paths the fallback warning was logged for


def shm_base(shm_dir: Optional[os.PathLike | str] = None) -> Optional[Path]:
    """The shm dir shared tables live under: ``shm_dir`` when given, else
    ``$DELTASTREAM_SHM_DIR`` when set, else ``/dev/shm`` when it exists, else None (then
    tables live in the state dir). A dir that is given must be an existing directory
    (``ValueError`` naming where it came from otherwise)."""
    what = "shm_dir"
    if shm_dir is None and os.environ.get(SHM_ENV):
        shm_dir, what = os.environ[SHM_ENV], SHM_ENV
    if shm_dir is None:
        return Path(SHM_BASE) if os.path.isdir(SHM_BASE) else None
    if not isinstance(shm_dir, (str, os.PathLike)) or not os.path.isdir(shm_dir):
        raise ValueError(f"{what}: expected an existing directory (a tmpfs such as /dev/shm), "
                         f"got {shm_dir!r}")
    return Path(os.path.realpath(os.fspath(shm_dir)))


def derived_root(state_dir: os.PathLike | str,
                 shm_dir: Optional[os.PathLike | str] = None) -> Optional[Path]:
    """``<shm dir>/deltastream-<h>``, the place in the shm dir derived from the state
    dir's real path (anyone can compute it), or None when there is no shm dir."""
    base = shm_base(shm_dir)
    if base is None:
        return None
    real = os.path.realpath(os.fspath(state_dir))
    return base / f"deltastream-{hashlib.sha256(real.encode()).hexdigest()[:16]}"


def planted_root(state_dir: os.PathLike | str,
                 shm_dir: Optional[os.PathLike | str] = None) -> Optional[str]:
    """Why the shm dir's place for ``state_dir``'s tables cannot be trusted — something
    there that is not a directory of the state dir's owner (or root) without group/other
    write bits: another local user may have planted it, since anyone can compute the path —
    or None (nothing there, or a trusted directory)."""
    real = os.path.realpath(os.fspath(state_dir))
    path = derived_root(real, shm_dir)
    if path is None:
        return None
    try:
        st = os.lstat(path)
        writers = writers_of(real)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode) and st.st_uid in writers and \
            not stat.S_IMODE(st.st_mode) & 0o022:
        return None
    what = "directory" if stat.S_ISDIR(st.st_mode) else "link or file"
    return (f"{path}: a {what} of uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}, "
            f"not of the state dir's owner (uid {' or '.join(map(str, sorted(writers)))}); "
            "another user may have planted it")


def shm_root(state_dir: os.PathLike | str,
             shm_dir: Optional[os.PathLike | str] = None) -> Path:
    """Directory of the shared tables of ``state_dir`` (``shm_dir``: see :func:`shm_base`).

    ``<shm dir>/deltastream-<h>``, unless another user holds that path
    (:func:`planted_root`): then ``<state_dir>/shm``, where only the state dir's owner can
    create anything, with a WARNING naming the planted path (writer and readers decide
    alike, so readers never map what was planted there). The same when nothing is at that
    path and ``<state_dir>/shm`` exists (a table shared there, the plant since removed)."""
    real = os.path.realpath(os.fspath(state_dir))
    private = Path(real) / "shm"
    path = derived_root(real, shm_dir)
    if path is None:
        return private
    planted = planted_root(real, shm_dir)
    if planted is not None:
        if path not in _warned:
            _warned.add(path)
            log.warning("%s; shared tables of %s live in %s instead (slower when that is "
                        "not a tmpfs): stop the daemon, remove the planted path, restart",
                        planted, real, private)
        return private
    if not os.path.lexists(path) and os.path.isdir(private) and not os.path.islink(private):
        return private
    return path


def table_dir(state_dir: os.PathLike | str, name: str,
              shm_dir: Optional[os.PathLike | str] = None) -> Path:
    """Directory of the files of shared table ``name`` of ``state_dir``."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:48]
    return shm_root(state_dir, shm_dir) / \
        f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
