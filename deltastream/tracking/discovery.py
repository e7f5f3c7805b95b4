"""Which modules of a model a :class:`~deltastream.DeltaTracker` tracks, and how.

:func:`discover` unwraps the model (``DistributedDataParallel``, ``DataParallel`` and
``torch.compile``'s wrapper, nested in any order: the FQNs are those of the innermost model,
the one the user built) and returns every :class:`~deltastream.HashTable` (or duck-typed
dynamic table), ``torch.nn.Embedding`` and ``torch.nn.EmbeddingBag`` by FQN, minus
``fqns_to_skip``; modules inside a tracked module are not tracked again. A
:class:`TrackedTable` says what kind of table it is and how its changes are found:

* ``"lookups"``: every row change follows a recorded lookup (a HashTable with deltastream's
  sparse optimizers; an ``nn.Embedding``/``EmbeddingBag`` declared ``sparse_updates_only``);
* ``"scan"``: rows may move without a lookup (a dense optimizer's momentum or weight decay,
  ``load_state_dict``, a manual write), so changed rows are found by comparing the weight
  with a shadow copy (:mod:`.scan`). The default for ``nn.Embedding``/``EmbeddingBag``.

Any other module that looks like an embedding table (its class name says ``Embedding`` or
it has ``num_embeddings``/``embedding_dim``) and holds no tracked table is named in a
``UserWarning``: its rows would never be reported. ``fqns_to_skip`` silences it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from deltastream.embedding.hashtable import HashTable
from deltastream.tracking.torchrec_tables import (
    TORCHREC_KIND,
    TorchRecTable,
    torchrec_tables,
    unwrap_dmp,
)

__all__ = ["TrackedTable", "Discovered", "discover", "unwrap", "is_dynamic", "is_positional",
           "skip_patterns", "is_skipped", "LOOKUPS", "SCAN"]

log = logging.getLogger(__name__)

#: path names (``DeltaTracker.stats()["paths"]``)
LOOKUPS = "lookups"
SCAN = "scan"

_DENSE_KINDS = {torch.nn.Embedding: "embedding", torch.nn.EmbeddingBag: "embedding_bag"}


@dataclass
class TrackedTable:
    """A tracked table: its module, row width, dtype, device and how it is tracked.

    ``kind``: ``"hashtable"``, ``"embedding"``, ``"embedding_bag"`` or ``"torchrec"`` (a
    :class:`~deltastream.tracking.torchrec_tables.TorchRecTable` view: the lookups path for
    a shard a fused kernel updates, else the scan; ``row_offset`` is added to its local
    rows to make them global ids). ``dynamic``: it has
    insert/evict hooks (a HashTable), so ids can be new or evicted. ``positional``: its
    lookups are recorded as row positions (see :func:`is_positional`). ``path``:
    :data:`LOOKUPS` or :data:`SCAN`. ``shared_with``: other parameter names of the model
    bound to the same weight (tied weights), ``()`` for none.
    """

    module: torch.nn.Module
    dim: int
    dtype: torch.dtype
    device: torch.device
    dynamic: bool
    positional: bool = False
    kind: str = "hashtable"
    path: str = LOOKUPS
    shared_with: tuple[str, ...] = field(default=())
    row_offset: int = 0

    @property
    def weight(self) -> Optional[torch.Tensor]:
        """The ``[rows, dim]`` weight of an ``nn.Embedding``/``EmbeddingBag`` (else None)."""
        return getattr(self.module, "weight", None) if self.kind != "hashtable" else None


@dataclass
class Discovered:
    """What :func:`discover` found: the tables, the unwrapped root module, the wrappers
    peeled off it (class names, outermost first) and whether one of them is
    ``DistributedDataParallel`` (replicas then also move through other ranks' lookups)."""

    tables: dict[str, TrackedTable]
    root: torch.nn.Module
    wrappers: tuple[str, ...]
    distributed: bool


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
    positions to ids (``ids_at``) and tells when rows are freed (``register_row_listener``);
    one that writes rows outside lookups reports them too (``register_write_hook``)."""
    return all(callable(getattr(mod, a, None)) for a in
               ("register_lookup_hook", "ids_at", "register_row_listener")) \
        and isinstance(getattr(mod, "capacity", None), int)


def _looks_like_embedding(mod: torch.nn.Module) -> bool:
    return "embedding" in type(mod).__name__.lower() \
        or hasattr(mod, "num_embeddings") or hasattr(mod, "embedding_dim")


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


def unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, tuple[str, ...], bool]:
    """Peel ``DistributedDataParallel``, ``DataParallel``, ``torch.compile`` and TorchRec's
    ``DistributedModelParallel`` wrappers.

    Returns ``(inner model, wrapper class names outermost first, any DDP among them)``.
    """
    names: list[str] = []
    ddp = False
    while True:
        if isinstance(model, (DataParallel, DistributedDataParallel)):
            ddp = ddp or isinstance(model, DistributedDataParallel)
            names.append(type(model).__name__)
            model = model.module
            continue
        dmp_inner = unwrap_dmp(model)
        if dmp_inner is not None:
            names.append("DistributedModelParallel")
            model = dmp_inner
            continue
        # torch.compile's OptimizedModule keeps the compiled module as ``_orig_mod`` (its
        # documented way back to the original; there is no public accessor)
        inner = getattr(model, "_orig_mod", None)
        if type(model).__name__ == "OptimizedModule" and isinstance(inner, torch.nn.Module):
            names.append("OptimizedModule")
            model = inner
            continue
        return model, tuple(names), ddp


def _under(name: str, prefixes: list[str]) -> bool:
    """``name`` is one of ``prefixes`` or inside one of them ("" is the root: everything)."""
    return any(p == "" or name == p or name.startswith(p + ".") for p in prefixes)


def _describe(mod: torch.nn.Module, kind: str,
              owners: dict[int, list[str]], name: str) -> TrackedTable:
    if kind == "hashtable":
        return TrackedTable(mod, int(mod.embedding_dim), getattr(mod, "dtype", torch.float32),
                            torch.device(getattr(mod, "device", "cpu")), True,
                            is_positional(mod), kind, LOOKUPS)
    w = mod.weight
    prefix = f"{name}." if name else ""
    others = tuple(n for n in owners.get(id(w), ()) if n != f"{prefix}weight")
    return TrackedTable(mod, int(mod.embedding_dim), w.dtype, w.device, False, False, kind,
                        SCAN, others)


def _torchrec_tracked(found: dict[str, TorchRecTable]) -> dict[str, TrackedTable]:
    return {fqn: TrackedTable(t, t.embedding_dim, t.weight.dtype, t.weight.device, False,
                              False, TORCHREC_KIND, LOOKUPS if t.fused else SCAN, (),
                              t.row_offset)
            for fqn, t in found.items()}


def discover(model: torch.nn.Module, fqns_to_skip: Iterable[str] = ()) -> Discovered:
    """Find the tables to track in ``model`` (see the module docstring), in module order.

    Every table starts on its default path (HashTable: lookups; nn.Embedding/EmbeddingBag:
    scan); the tracker applies ``sparse_updates_only``. Warns (``UserWarning``) for each
    embedding-like module it cannot track. Raises ``ValueError`` when there is no table
    (after ``fqns_to_skip``).
    """
    skip = skip_patterns(fqns_to_skip)
    root, wrappers, ddp = unwrap(model)
    owners: dict[int, list[str]] = {}
    for pname, p in root.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(pname)
    tables: dict[str, TrackedTable] = {}
    taken: list[str] = []  # names of tracked modules: their children are not tracked
    skipped: list[str] = []
    unknown: list[tuple[str, torch.nn.Module]] = []
    torchrec_modules = 0  # a rank may hold no shard of a sharded collection: not an error
    for name, mod in root.named_modules():
        if _under(name, taken) or _under(name, skipped):
            continue
        torchrec_found = torchrec_tables(name, mod) \
            if not is_skipped(name, skip) else None
        kind = TORCHREC_KIND if torchrec_found is not None else \
            "hashtable" if is_dynamic(mod) else _DENSE_KINDS.get(type(mod)) or next(
            (k for t, k in _DENSE_KINDS.items() if isinstance(mod, t)), None)
        if kind is None:
            if _looks_like_embedding(mod) and name and is_skipped(name, skip):
                skipped.append(name)
            elif _looks_like_embedding(mod):
                unknown.append((name, mod))
            continue
        if is_skipped(name, skip):
            log.info("DeltaTracker: skipping %s (fqns_to_skip)", name)
            skipped.append(name)
            continue
        if torchrec_found is not None:
            taken.append(name)
            tables.update(_torchrec_tracked({
                k: t for k, t in torchrec_found.items()
                if not is_skipped(k.split("#")[0], skip)}))
            torchrec_modules += 1
            continue
        taken.append(name)
        tables[name or str(getattr(mod, "name", "") or "embedding")] = _describe(
            mod, kind, owners, name)
    for name, mod in unknown:
        # a container of tracked tables (e.g. ShardedEmbedding holds a HashTable) is covered
        if any(t == name or t.startswith(name + ".") or name == "" for t in taken + skipped):
            continue
        warnings.warn(
            f"DeltaTracker cannot track {name or '<root>'} ({type(mod).__name__}): it looks "
            f"like an embedding table but is not a HashTable, torch.nn.Embedding or "
            f"torch.nn.EmbeddingBag, so its row changes would never be reported; add "
            f"{name or type(mod).__name__!r} to fqns_to_skip to silence this warning",
            UserWarning, stacklevel=3)
    if not tables and not torchrec_modules:
        raise ValueError("DeltaTracker found no HashTable, torch.nn.Embedding, "
                         "torch.nn.EmbeddingBag or TorchRec EmbeddingBagCollection/"
                         "EmbeddingCollection in the model (after fqns_to_skip); nothing "
                         "to track")
    return Discovered(tables, root, wrappers, ddp)
