"""Who may read and write the files of shared tables, and what readers trust.

The files a daemon shares (``/dev/shm/deltastream-<h>/…``) are no more readable than its
state dir: directories get the state dir's permission bits without group/other write
(``0700`` state dir → ``0700`` dirs and ``0600`` files; ``0750`` → ``0750`` / ``0640``)
and the state dir's group, so a model server in another uid reads them exactly when it can
read the state dir (e.g. a state dir ``0750`` of group ``models``, the model server's
user in that group). Lock files are ``0600``: nobody else can open them, so nobody else
can hold them.

Readers (:class:`~consumers.serving.reader.TableReader`) map only what the state dir's
owner (or root) wrote: every directory and file on the way must be owned by one of
:func:`writers_of` the state dir, carry no group/other write bit and not be a link;
anything else is refused with :class:`~consumers.errors.ConsumerError` naming the path
(the shm path is computable by anyone: another local user could plant a table there).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from consumers.errors import ConsumerError

__all__ = ["Access", "access_of", "make_dir", "fix_file", "writers_of", "check_dir",
           "check_fd"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Access:
    """Modes and group of the shared files of one state dir."""

    dir_mode: int
    file_mode: int
    gid: int

    @property
    def lock_mode(self) -> int:
        """Mode of lock files: the owner's alone."""
        return 0o600


def access_of(state_dir: os.PathLike | str) -> Access:
    """The modes shared files of ``state_dir`` get (see the module docstring)."""
    st = os.stat(state_dir)
    dir_mode = (stat.S_IMODE(st.st_mode) & 0o755) | 0o700
    return Access(dir_mode=dir_mode, file_mode=(dir_mode & 0o644) | 0o600, gid=st.st_gid)


def _set(path: Path, fd: int, mode: int, gid: int) -> None:
    st = os.fstat(fd)
    if stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)  # the umask may have taken bits, an older version added some
    if st.st_gid != gid:
        try:
            os.fchown(fd, -1, gid)
        except OSError as e:  # not a member of the state dir's group
            log.warning("%s: cannot give it the state dir's group %d (%s); readers in that "
                        "group cannot read it", path, gid, e)


def make_dir(path: Path, access: Access) -> None:
    """Create directory ``path`` (its parent exists) with ``access``'s mode and group, or
    accept an existing one only when it is a real directory of this user (in a
    world-writable place like /dev/shm, never follow someone else's link); then give it
    that mode and group."""
    try:
        os.mkdir(path, access.dir_mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ConsumerError(f"{path}: expected a directory owned by uid {os.geteuid()} for "
                            f"shared tables, found something else (a link, a file, or uid "
                            f"{st.st_uid}); remove it or use another state dir")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _set(path, fd, access.dir_mode, access.gid)
    finally:
        os.close(fd)


def fix_file(path: Path, fd: int, mode: int, gid: int) -> None:
    """Give the file ``fd`` (just created at ``path``) ``mode`` and group ``gid``."""
    _set(path, fd, mode, gid)


def writers_of(state_dir: os.PathLike | str) -> frozenset[int]:
    """The uids whose shared files readers of ``state_dir`` trust: its owner, and root.
    ``FileNotFoundError`` when it does not exist (yet)."""
    try:
        return frozenset({os.stat(state_dir).st_uid, 0})
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ConsumerError(f"state dir {state_dir}: cannot stat it ({e}); readers need "
                            "to see who owns it to trust its shared tables") from e


def _check(path: Path, st: os.stat_result, writers: frozenset[int], kind: str) -> None:
    if st.st_uid not in writers or stat.S_IMODE(st.st_mode) & 0o022:
        raise ConsumerError(
            f"{path}: refusing a shared table {kind} of uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}: expected uid {' or '.join(map(str, sorted(writers)))} "
            "(the state dir's owner) and no group/other write bit; another user may have "
            "planted it")


def check_dir(path: Path, writers: frozenset[int]) -> None:
    """Refuse (``ConsumerError`` naming it) a directory readers must not trust; a missing
    one raises ``FileNotFoundError``."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConsumerError(f"{path}: refusing a shared table directory that is not a "
                            "directory (a link or a file); another user may have planted it")
    _check(path, st, writers, "directory")


def check_fd(path: Path, fd: int, writers: frozenset[int]) -> None:
    """Refuse (``ConsumerError`` naming ``path``) the open file ``fd`` unless a plain file
    one of ``writers`` owns without group/other write bits."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ConsumerError(f"{path}: refusing a shared table file that is not a plain file")
    _check(path, st, writers, "file")
