"""How often each id of a table is read: the weight of its serving error.

:class:`LookupRate` counts the trainer's own training lookups per publish round (an
exponentially decayed count per id). ``rate(delta.ids).sqrt()`` is the ``weights`` argument
that makes :func:`deltastream.publishing.selection.select_changed`'s ``threshold`` a budget
of read-weighted serving error (see that module's docstring for why the square root).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

__all__ = ["LookupRate"]


class LookupRate:
    """How often each id of one table is read: an exponentially decayed count per round.

    The importance of a row's serving error is how many requests read the row before the
    next publish. The requests predictors serve are the traffic the trainer learns from, so
    the trainer's own lookups estimate it: :meth:`observe` the ids of every batch (or use
    :meth:`watch`), call :meth:`end_round` once per publish round, then
    ``rate(ids)`` gives lookups per round (an id looked up ``λ`` times every round reads
    ``λ``; the weight of the past halves every ``log(0.5) / log(decay)`` rounds). Pass
    ``weights=rate(delta.ids).sqrt()`` to :func:`select_changed` with a ``threshold`` to publish
    by read-weighted drift (see its docstring for why the square root).

    Ids whose decayed count falls below ``min_count`` are forgotten (they read as 0), so the
    memory is bounded by the ids read in the last few dozen rounds. Vectorized: lookups are
    buffered and merged once per round (one sort of the live ids).

    Args:
        decay: factor in ``(0, 1)`` applied to every count at each :meth:`end_round`.
        min_count: decayed counts below this are dropped (``>= 0``).
        device: where the counts live (default: the device of the first observed ids).
    """

    def __init__(self, decay: float = 0.8, *, min_count: float = 1e-3,
                 device: Optional[torch.device | str] = None) -> None:
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) \
                or not 0.0 < float(decay) < 1.0:
            raise ValueError(f"decay must be a number in (0, 1), got {decay!r}")
        if isinstance(min_count, bool) or not isinstance(min_count, numbers.Real) \
                or not (math.isfinite(float(min_count)) and float(min_count) >= 0.0):
            raise ValueError(f"min_count must be a finite number >= 0, got {min_count!r}")
        self.decay = float(decay)
        self.min_count = float(min_count)
        self._device = None if device is None else torch.device(device)
        self._ids: Optional[torch.Tensor] = None  # int64 [m], ascending
        self._count: Optional[torch.Tensor] = None  # float64 [m], decayed lookups
        self._pending: list[torch.Tensor] = []
        self.rounds = 0

    def _init(self, dev: torch.device) -> None:
        if self._ids is None:
            self._device = self._device or dev
            self._ids = torch.empty(0, dtype=torch.int64, device=self._device)
            self._count = torch.empty(0, dtype=torch.float64, device=self._device)

    def observe(self, ids: torch.Tensor) -> None:
        """Count one lookup per element of ``ids`` (int64, any shape; repeats count)."""
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
            raise ValueError(f"ids must be an int64 tensor, got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)}")
        self._init(ids.device)
        if ids.numel():
            # a copy: the caller may reuse its batch buffer before end_round
            self._pending.append(ids.detach().reshape(-1).to(self._device, copy=True))

    def watch(self, module: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
        """Observe every training-mode lookup of ``module`` (its first argument: the ids).

        Returns the hook handle (``handle.remove()`` stops observing). Eval-mode lookups
        (scoring, validation) are not counted: they do not reflect the served traffic.
        """
        def hook(mod: torch.nn.Module, args: tuple) -> None:
            if mod.training and args and isinstance(args[0], torch.Tensor):
                self.observe(args[0])

        return module.register_forward_pre_hook(hook)

    @torch.no_grad()
    def end_round(self) -> None:
        """Close a round: decay every count, add the lookups observed since, drop tiny counts."""
        self.rounds += 1
        if self._ids is None:
            return
        count = self._count * self.decay
        ids = self._ids
        if self._pending:
            fresh, n = torch.unique(torch.cat(self._pending), return_counts=True)
            self._pending = []
            both = torch.cat([ids, fresh])
            uniq, inv = torch.unique(both, return_inverse=True)  # sorted
            merged = torch.zeros(uniq.numel(), dtype=torch.float64, device=uniq.device)
            merged.index_add_(0, inv, torch.cat([count, n.to(torch.float64)]))
            ids, count = uniq, merged
        keep = count >= self.min_count
        if not bool(keep.all()):
            ids, count = ids[keep], count[keep]
        self._ids, self._count = ids, count

    @torch.no_grad()
    def rate(self, ids: torch.Tensor) -> torch.Tensor:
        """Estimated lookups per round of ``ids`` (float32, same shape; 0 for unknown ids).

        Counts lookups up to the last :meth:`end_round`.
        """
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
            raise ValueError(f"ids must be an int64 tensor, got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)}")
        flat = ids.reshape(-1)
        if self._ids is None or self._ids.numel() == 0 or flat.numel() == 0:
            return torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        q = flat.to(self._ids.device)
        pos = torch.searchsorted(self._ids, q).clamp_(max=self._ids.numel() - 1)
        hit = self._ids[pos] == q
        out = torch.where(hit, self._count[pos] * (1.0 - self.decay), 0.0)
        return out.to(device=ids.device, dtype=torch.float32).reshape(ids.shape)

    def __len__(self) -> int:
        """Ids with a live (not yet forgotten) count."""
        return 0 if self._ids is None else int(self._ids.numel())
