"""Which path finds a dense table's changes: when the lookups path can be exact.

:func:`declared_tables` reads ``DeltaTracker(sparse_updates_only=...)``,
:func:`lookups_refusal` says why the lookups path cannot be exact for a table (DDP,
``max_norm``, a tied weight), and :func:`sparse_only_reason` which ``torch.optim``
optimizers move only the rows that were looked up.

A table's changes can be found from its lookups alone (the tracker's ``"lookups"`` path) only
when nothing moves a row that had no gradient in the step. For an ``nn.Embedding`` or
``nn.EmbeddingBag`` that holds for an optimizer that leaves a parameter entry untouched when
its gradient is zero (or absent from a sparse gradient):

* ``torch.optim.SGD`` without momentum and without weight decay (``w -= lr * 0`` is ``w``,
  bit for bit);
* ``torch.optim.Adagrad`` without weight decay (its accumulator grows by ``0``, the step is
  ``lr * 0 / ...``);
* ``torch.optim.SparseAdam`` (updates only the entries of the sparse gradient).

Every other optimizer keeps moving rows after their last gradient: momentum (SGD with
``momentum``), moments (Adam, AdamW, RMSprop, ...) or weight decay. Subclasses count as
"other": their ``step`` may differ. :func:`sparse_only_reason` says which case applies.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional, Union

import torch

from deltastream.tracking.discovery import TrackedTable

__all__ = ["sparse_only_reason", "owned_weights", "lookups_refusal", "declared_tables"]


def _groups_with(optimizer: Any, keys: tuple[str, ...]) -> list[str]:
    """The hyperparameters among ``keys`` that are non-zero in some param group."""
    bad = []
    for key in keys:
        if any(group.get(key) for group in optimizer.param_groups):
            bad.append(key)
    return bad


def sparse_only_reason(optimizer: Any) -> Optional[str]:
    """``None`` when ``optimizer`` moves only rows with a gradient; else why it does not.

    Checked against the optimizer's current ``param_groups`` (hyperparameters can change
    between steps, so callers check again before every step).
    """
    kind = type(optimizer)
    if kind is torch.optim.SparseAdam:
        return None
    if kind is torch.optim.SGD:
        bad = _groups_with(optimizer, ("momentum", "weight_decay"))
        return None if not bad else f"SGD with {' and '.join(bad)} moves rows after their " \
            "last gradient"
    if kind is torch.optim.Adagrad:
        bad = _groups_with(optimizer, ("weight_decay",))
        return None if not bad else "Adagrad with weight_decay moves every row each step"
    return (f"{kind.__name__} keeps per-row state (momentum, moments) or decays weights, so "
            "it moves rows that were not looked up")


def owned_weights(optimizer: Any, weights: dict[str, torch.Tensor]) -> list[str]:
    """The keys of ``weights`` whose tensor is one of ``optimizer``'s parameters."""
    params = {id(p) for group in optimizer.param_groups for p in group.get("params", ())}
    return [key for key, w in weights.items() if id(w) in params]


def declared_tables(tables: dict[str, TrackedTable],
                    sparse_updates_only: Union[bool, Iterable[str]]) -> list[str]:
    """The dense tables ``sparse_updates_only`` (True = all, or FQNs) declares. A HashTable
    named there is accepted and left out (it always uses its lookups). Raises
    ``ValueError`` for a name that is not tracked."""
    dense = [f for f, i in tables.items() if not i.dynamic]
    if isinstance(sparse_updates_only, bool):  # True: the nn.Embedding/EmbeddingBag tables
        return [f for f in dense if tables[f].kind != "torchrec"] \
            if sparse_updates_only else []
    names = [sparse_updates_only] if isinstance(sparse_updates_only, str) \
        else list(sparse_updates_only)
    unknown = sorted(n for n in names if n not in tables)
    if unknown:
        raise ValueError(f"sparse_updates_only names tables the tracker does not track: "
                         f"{unknown}; tracked: {sorted(tables)}")
    return [n for n in names if n in dense]


def lookups_refusal(info: TrackedTable, distributed: bool) -> Optional[str]:
    """Why the lookups path cannot be exact for dense table ``info`` (None: it can be)."""
    if info.kind == "torchrec":
        return ("TorchRec tables are tracked by the scan: their fused optimizers update rows "
                "inside the backward pass, where no lookup hook sees them")
    if distributed:
        return ("the model is wrapped in DistributedDataParallel: its rows also move "
                "through the other ranks' lookups (gradients are all-reduced), which "
                "this rank never sees")
    if getattr(info.module, "max_norm", None) is not None:
        return "max_norm renormalizes looked-up rows inside forward, before any hook"
    if info.shared_with:
        return (f"its weight is shared with {', '.join(info.shared_with)}, which moves "
                "its rows without a lookup")
    return None
