"""Backing a shared table's memory ahead of its writer, on a thread of its own.

A shared table's files are sparse. A page gets memory when it is allocated
(``posix_fallocate``, so a full tmpfs is an ``OSError`` rather than a ``SIGBUS`` on a
write), and each 2 MiB block is collapsed into a huge page before anything in it is
published (:mod:`consumers.serving.hugemap`). That costs the CPU that does it: on a VM
whose host backs guest memory on first touch and takes freed memory back within seconds,
about 40 ms per 256 MiB while the host's memory is warm and up to 250 ms while it is cold.
Done inside the apply, it took up to 83 % of the writer's CPU in the slowest seconds of a
10M-row table's growth, and most of what slowed them (BENCHMARKS.md).

A :class:`Backer` does that work on its own thread, ahead of the writer. Per file (a
*job*, by key) the writer says which bytes it needs now and how far to go on:

1. :meth:`Backer.add` registers a file (its path, its mapping, the bytes already backed);
2. :meth:`Backer.want` ``(key, need, target)`` raises the job's target and starts the
   thread if it is not running (it ends once every job reached its target);
3. the thread backs each job in order from where it stands, one 2 MiB block per step
   (allocate the block's first page, collapse the block, allocate the rest:
   :func:`back_range`), so bytes ``[0, done)`` of a job's file are always backed; a job the
   writer waits for goes first;
4. :meth:`Backer.want` returns at once when ``need <= done``; otherwise the writer waits for
   the thread. When the thread failed below ``need`` (a full tmpfs), the writer gets the
   ``OSError``, naming the file; the job stops where it failed and the next ``want``
   retries from there. A failure beyond ``need`` is not the writer's concern yet;
5. :meth:`Backer.drop` forgets a job whose file is going away, :meth:`Backer.close` every
   job. The thread holds a job's mapping and its own fd until it finishes the block it is
   on, so memory it works on is never unmapped under it.

The writer asks only for bytes beyond what it has published, so no reader reads a block
while it is being collapsed (hugemap's rule). The thread inherits the CPU affinity and
niceness of the thread that starts it: the writer's (``deltastream-sync --cpus``).

``DELTASTREAM_SHM_BACKER=0`` (read when a table's storage is made) backs inline instead:
:meth:`Backer.want` backs the blocks up to ``need`` in the writer's thread and nothing
ahead (the work an apply did before the backer existed) — for a host where the extra
thread is unwelcome, and for ``deltastream bench growth``, which compares the two ways.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Hashable
from typing import Optional

import numpy as np

from consumers.serving import hugemap
from consumers.serving.memory import PAGE

__all__ = ["Backer", "back_range", "allocate", "BACKER_ENV"]

log = logging.getLogger(__name__)

#: environment variable: ``0`` backs in the writer's thread (see the module docstring)
BACKER_ENV = "DELTASTREAM_SHM_BACKER"


def allocate(fd: int, offset: int, length: int) -> None:
    """Allocate the file's pages in ``[offset, offset + length)`` now, so a full tmpfs
    raises OSError here rather than SIGBUS on a later write (where the OS can)."""
    if length > 0 and hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, offset, length)


def back_range(fd: int, buf: np.ndarray, lo: int, hi: int) -> int:
    """Allocate bytes ``[lo, hi)`` of the file ``buf`` maps (:func:`allocate`), the 2 MiB
    blocks wholly inside in huge pages where the kernel collapses them
    (:mod:`consumers.serving.hugemap`); returns how many it collapsed. A block's first page
    is allocated, the block collapsed (its holes filled), then the rest allocated: a reader
    that maps pages as they are allocated (the warmer) never holds a block of 512 small
    pages in the way of the collapse."""
    done = 0
    if hugemap.collapsing():
        first = -(-lo // hugemap.BLOCK) * hugemap.BLOCK
        for b in range(first, hi - hugemap.BLOCK + 1, hugemap.BLOCK):
            allocate(fd, b, PAGE)
        done = hugemap.collapse(buf, lo, hi)
    allocate(fd, lo, hi - lo)  # no-op where collapsed; the rest (a full tmpfs: OSError)
    return done


class _Job:
    """One file being backed: bytes ``[0, done)`` are, up to ``target`` are wanted."""

    __slots__ = ("path", "fd", "buf", "done", "target", "error", "dropped", "busy")

    def __init__(self, path: str, fd: int, buf: np.ndarray, done: int) -> None:
        self.path, self.fd, self.buf = path, fd, buf
        self.done = self.target = done
        self.error: Optional[OSError] = None
        self.dropped = self.busy = False

    def pending(self) -> bool:
        return self.done < self.target and self.error is None


class Backer:
    """Backs the files of one writer's table ahead of it, on a thread started on demand
    (see the module docstring). Every method is called by the writer's thread.
    ``threaded``: False backs inline (default: unless ``$DELTASTREAM_SHM_BACKER`` is 0)."""

    def __init__(self, name: str = "", *, threaded: Optional[bool] = None) -> None:
        self._name = name
        self.threaded = os.environ.get(BACKER_ENV, "1") != "0" if threaded is None \
            else threaded
        self._cond = threading.Condition()
        self._jobs: dict[Hashable, _Job] = {}
        self._thread: Optional[threading.Thread] = None
        self._urgent: Optional[Hashable] = None
        self._blocks = 0

    @property
    def huge_blocks(self) -> int:
        """2 MiB blocks collapsed into huge pages so far."""
        with self._cond:
            return self._blocks

    def add(self, key: Hashable, path: os.PathLike | str, buf: np.ndarray, done: int) -> None:
        """Register file ``path``, mapped by ``buf`` (from :func:`hugemap.map_file`), whose
        bytes ``[0, done)`` are backed already. OSError when it cannot be opened."""
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        with self._cond:
            if key in self._jobs:
                os.close(fd)
                raise ValueError(f"backer {self._name}: {key!r} is registered already")
            self._jobs[key] = _Job(os.fspath(path), fd, buf, done)

    def want(self, key: Hashable, need: int, target: int) -> int:
        """Bytes ``[0, need)`` of job ``key`` backed when this returns (waiting for the
        thread while it is behind), and the thread going on to ``target`` (bytes, capped at
        the mapping). Returns the bytes backed so far. OSError (naming the file) when the
        thread failed below ``need``; KeyError for a job that was never added, ValueError
        for ``need`` beyond the mapping."""
        with self._cond:
            job = self._jobs[key]
            if need > job.buf.nbytes:
                raise ValueError(f"backer {self._name}: {need} bytes of {job.path} wanted, "
                                 f"beyond its mapping of {job.buf.nbytes}")
            job.target = max(job.target, need, min(target, job.buf.nbytes))
            job.error = None  # a new request: a failed job tries again from where it stopped
            if not self.threaded:  # whole blocks up to need, here, as the thread would
                stop = min(job.target, -(-need // hugemap.BLOCK) * hugemap.BLOCK)
                while job.done < stop and job.error is None:
                    self._record(job, *_step(job))
            elif job.pending() and self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"deltastream-backer-{self._name}")
                self._thread.start()
            if need > job.done:
                self._urgent = key
                try:
                    while job.done < need and job.error is None:
                        self._cond.wait()
                finally:
                    self._urgent = None
                if job.done < need:
                    assert job.error is not None
                    raise OSError(job.error.errno, job.error.strerror, job.path)
            return job.done

    def drop(self, key: Hashable) -> None:
        """Forget job ``key`` (its file is going away): the thread stops after the block it
        is on. No-op for an unknown key."""
        with self._cond:
            job = self._jobs.pop(key, None)
            if job is not None:
                job.dropped = True
                if not job.busy:
                    os.close(job.fd)

    def close(self) -> None:
        """Drop every job."""
        with self._cond:
            keys = list(self._jobs)
        for key in keys:
            self.drop(key)

    def _next(self) -> Optional[_Job]:
        urgent = self._jobs.get(self._urgent) if self._urgent is not None else None
        if urgent is not None and urgent.pending():
            return urgent
        return next((j for j in self._jobs.values() if j.pending()), None)

    def _record(self, job: _Job, hi: int, blocks: int, err: Optional[OSError]) -> None:
        """A step of ``job`` is over (lock held): bytes up to ``hi`` are backed, or ``err``."""
        job.busy = False
        if job.dropped:
            os.close(job.fd)
        elif err is not None:
            job.error = err
            log.debug("backer %s: %s at byte %d: %s", self._name, job.path, job.done, err)
        else:
            job.done, self._blocks = hi, self._blocks + blocks
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._next()
                if job is None:
                    self._thread = None
                    return
                job.busy = True
            step = _step(job)
            with self._cond:
                self._record(job, *step)


def _step(job: _Job) -> tuple[int, int, Optional[OSError]]:
    """Back the next block of ``job``: (its end, blocks collapsed, the error if it failed)."""
    hi = min(job.target, (job.done // hugemap.BLOCK + 1) * hugemap.BLOCK)
    try:
        return hi, back_range(job.fd, job.buf, job.done, hi), None
    except OSError as e:
        return hi, 0, e
