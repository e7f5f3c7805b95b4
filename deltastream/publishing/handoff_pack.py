"""A hand-off's host tensors packed into one buffer, and back: the bytes a budget
publisher's worker process gets (:mod:`~.budget_process`).

:func:`layout` places every tensor of a :class:`~.handoff.Handoff` at a 64-byte aligned
offset; the parent copies them (:func:`pack`) into a :class:`Segment` (a file in the
shared-memory directory, its room reserved up front) or, when that has no room, into a
buffer it sends through the socket; the child maps or receives the bytes and :func:`unpack`
makes a new hand-off of views into them (the worker merges it where it lies).

:func:`pack` copies every tensor in one call of the C extension, without the GIL: the
parent packs on a thread beside the training thread, and a torch view and copy per tensor
(fourteen for two tables) held the GIL about 250 µs per hand-off in pieces, each one a
wait for the training thread's next op.
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
from typing import Any, Optional

import torch

from deltastream.native_ext import NativeExtension
from deltastream.publishing.handoff import Handoff, TableHandoff

__all__ = ["ALIGN", "FIELDS", "Segment", "describe", "layout", "pack", "shm_dir", "unpack",
           "use_native", "view"]

_NATIVE = NativeExtension("deltastream.publishing.native", "native hand-off packing",
                          "torch copies")
#: switch :func:`pack` to the C code (``RuntimeError`` when it is not built) or torch
use_native = _NATIVE.use

#: the tensor fields of a table's hand-off, in packing order
FIELDS = ("ids", "first", "current", "new", "tombstones", "inserted", "first_at")
#: bytes every packed tensor is aligned to
ALIGN = 64


def shm_dir() -> str:
    """Where segments are made: ``/dev/shm``, or the temporary directory without it."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class Segment:
    """The parent's shared-memory file: grown (a new file) when a hand-off does not fit."""

    def __init__(self) -> None:
        self.path: Optional[str] = None
        self.map: Optional[mmap.mmap] = None
        self.size = 0

    def fit(self, nbytes: int) -> bool:
        """Make room for ``nbytes``; True when that took a new file. ``OSError`` (e.g.
        ENOSPC: the tmpfs is full) when the room cannot be reserved, nothing kept."""
        if nbytes <= self.size:
            return False
        self.close()
        size = max(1 << 20, 1 << (nbytes - 1).bit_length())
        fd, self.path = tempfile.mkstemp(prefix="deltastream-handoff-", dir=shm_dir())
        try:
            # reserved, not sparse: a page written beyond a full tmpfs's room is a SIGBUS
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
            self.size = size
        except OSError:
            self.close()
            raise
        finally:
            os.close(fd)
        return True

    def unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    def close(self) -> None:
        self.unlink()
        if self.map is not None:
            self.map.close()
            self.map = None
        self.size = 0


def layout(h: Handoff) -> tuple[list[tuple], int]:
    """``[(table, field, offset, shape, dtype name)]`` of ``h``'s host tensors, and bytes."""
    out, off = [], 0
    for k, th in enumerate(h.tables):
        for f in FIELDS:
            t = getattr(th, f)
            if t is None:
                continue
            out.append((k, f, off, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
            off += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return out, off


def pack(h: Handoff, places: list[tuple], buf: Any) -> None:
    """Copy ``h``'s tensors into ``buf`` (a writable buffer of at least the bytes
    :func:`layout` gave with ``places``) at their places: host tensors, ``h.wait()`` done."""
    pieces = []
    for k, f, off, shape, dtype in places:
        t = getattr(h.tables[k], f)
        if not t.numel():
            continue
        if _NATIVE.enabled() and t.device.type == "cpu" and t.is_contiguous():
            pieces.append((off, t.data_ptr(), t.numel() * t.element_size()))
        else:
            view(buf, off, shape, dtype).copy_(t)
    if pieces:  # the tensors stay alive (h holds them) until the call returns
        _NATIVE.module.pack(buf, pieces)


def view(buf: Any, off: int, shape: tuple, dtype: str) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` (its name) at byte ``off`` of ``buf`` (no copy)."""
    dt = getattr(torch, dtype)
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(buf, dtype=dt, count=n, offset=off).view(shape)


def describe(h: Handoff, places: list[tuple]) -> dict:
    """What :func:`unpack` needs of ``h`` besides the bytes :func:`pack` wrote at
    ``places``: its own fields, its tables' names and forms (plain values, to send)."""
    return dict(tick=h.tick, step=h.step, ts=h.ts, units=h.units, read_units=h.read_units,
                final=h.final, charged=h.charged, fqns=[th.fqn for th in h.tables],
                ordered=[th.ordered for th in h.tables], layout=places)


def unpack(buf: Any, meta: dict) -> Handoff:
    """The hand-off ``meta`` describes, its tensors views of ``buf`` (no copy: valid until
    ``buf`` is written again)."""
    fields: list[dict] = [dict.fromkeys(FIELDS) for _ in meta["fqns"]]
    for k, f, off, shape, dtype in meta["layout"]:
        fields[k][f] = view(buf, off, tuple(shape), dtype)
    tables = [TableHandoff(fqn=fqn, ordered=o, **fl) for fqn, o, fl in zip(
        meta["fqns"], meta["ordered"], fields, strict=True)]
    return Handoff(tick=meta["tick"], step=meta["step"], ts=meta["ts"], units=meta["units"],
                   read_units=meta["read_units"], tables=tables, final=meta["final"],
                   charged=meta["charged"])
