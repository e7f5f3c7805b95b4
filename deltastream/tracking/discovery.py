"""Which modules of a model a :class:`~deltastream.DeltaTracker` tracks, and how.

:func:`find_tables` walks the model (a ``DistributedDataParallel``/``DataParallel`` wrapper
is unwrapped) and returns every :class:`~deltastream.HashTable` (or duck-typed dynamic
table) and ``torch.nn.Embedding`` by FQN, minus ``fqns_to_skip``; modules inside a tracked
module are not tracked again. A :class:`TrackedTable` says how its lookups are recorded:
by row position (:func:`is_positional`) or through a forward hook.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from deltastream.embedding.hashtable import HashTable

__all__ = ["TrackedTable", "find_tables", "is_dynamic", "is_positional", "skip_patterns",
           "is_skipped"]

log = logging.getLogger(__name__)


@dataclass
class TrackedTable:
    """A tracked table: its module, row width, dtype and device.

    ``dynamic``: it has insert/evict hooks (a HashTable), so ids can be new or evicted.
    ``positional``: its lookups are recorded as row positions (see :func:`is_positional`).
    """

    module: torch.nn.Module
    dim: int
    dtype: torch.dtype
    device: torch.device
    dynamic: bool
    positional: bool = False


def is_dynamic(mod: torch.nn.Module) -> bool:
    """A HashTable, or any dynamic table with its hook surface (insert/evict hooks and an
    int ``embedding_dim``)."""
    if isinstance(mod, HashTable):
        return True
    return (callable(getattr(mod, "register_insert_hook", None))
            and callable(getattr(mod, "register_evict_hook", None))
            and isinstance(getattr(mod, "embedding_dim", None), int))


def is_positional(mod: torch.nn.Module) -> bool:
    """A table whose lookups report row positions (``register_lookup_hook``), which maps
    positions to ids (``ids_at``) and tells when rows are freed (``register_row_listener``)."""
    return all(callable(getattr(mod, a, None)) for a in
               ("register_lookup_hook", "ids_at", "register_row_listener")) \
        and isinstance(getattr(mod, "capacity", None), int)


def skip_patterns(fqns_to_skip: Iterable[str]) -> list[tuple[str, ...]]:
    """``fqns_to_skip`` (a str or an iterable of them) as tuples of dotted segments.

    Raises ``ValueError`` for an empty name or an empty segment.
    """
    if isinstance(fqns_to_skip, str):
        fqns_to_skip = (fqns_to_skip,)
    out = []
    for s in fqns_to_skip:
        if not isinstance(s, str) or not s or any(not seg for seg in s.split(".")):
            raise ValueError(f"fqns_to_skip entries must be non-empty dotted names, got {s!r}")
        out.append(tuple(s.split(".")))
    return out


def is_skipped(fqn: str, patterns: list[tuple[str, ...]]) -> bool:
    """True when some pattern occurs in ``fqn`` as a run of whole dotted segments."""
    segs = tuple(fqn.split(".")) if fqn else ()
    for pat in patterns:
        k = len(pat)
        if any(segs[i:i + k] == pat for i in range(len(segs) - k + 1)):
            return True
    return False


def _describe(mod: torch.nn.Module, dynamic: bool) -> TrackedTable:
    if dynamic:
        dim = int(mod.embedding_dim)
        dtype = getattr(mod, "dtype", torch.float32)
        device = torch.device(getattr(mod, "device", "cpu"))
    else:
        dim, dtype, device = int(mod.embedding_dim), mod.weight.dtype, mod.weight.device
    return TrackedTable(mod, dim, dtype, device, dynamic, dynamic and is_positional(mod))


def find_tables(model: torch.nn.Module,
                fqns_to_skip: Iterable[str] = ()) -> dict[str, TrackedTable]:
    """``{fqn: TrackedTable}`` of the tables to track in ``model``, in module order.

    Raises ``ValueError`` when there is none (after ``fqns_to_skip``).
    """
    skip = skip_patterns(fqns_to_skip)
    root = model.module if isinstance(model, (DataParallel, DistributedDataParallel)) \
        else model
    tables: dict[str, TrackedTable] = {}
    taken: list[str] = []  # names of tracked modules: their children are not tracked
    for name, mod in root.named_modules():
        if any(name == p or name.startswith(p + ".") or p == "" for p in taken):
            continue
        dynamic = is_dynamic(mod)
        if not dynamic and not isinstance(mod, torch.nn.Embedding):
            continue
        if is_skipped(name, skip):
            log.info("DeltaTracker: skipping %s (fqns_to_skip)", name)
            continue
        taken.append(name)
        tables[name or str(getattr(mod, "name", "") or "embedding")] = _describe(mod, dynamic)
    if not tables:
        raise ValueError("DeltaTracker found no HashTable or torch.nn.Embedding in the "
                         "model (after fqns_to_skip); nothing to track")
    return tables
