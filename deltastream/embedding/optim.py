"""Sparse optimizers for :class:`~deltastream.embedding.hashtable.HashTable` rows.

Each optimizer updates only the rows that received a gradient since the last
:meth:`zero_grad` (the table's :meth:`~deltastream.embedding.hashtable.HashTable.sparse_grad`), keeps
its per-row state in tensors indexed by the table's row positions, grows that state with the
table's storage, and resets the state of rows the table evicts (a reused position never
inherits an old row's state). Math is done in float32 whatever the table dtype.

Where the update runs (:func:`~deltastream.kernels.runtime.use_kernels`): on CUDA, one fused
Triton kernel per table per step over the touched rows
(:mod:`deltastream.kernels.sparse_optim`: 1 launch, no host sync); on CPU, the torch
reference below (``_update``), which the kernels match to float32 rounding. The step reads
the table's coalesced gradient first (:meth:`~deltastream.HashTable.sparse_grad`: on CUDA
one device->host read per table, the number of touched rows, which sizes the update).

Dense parameters (MLP weights, ``torch.nn.Embedding``) are not handled here: give them to a
normal ``torch.optim`` optimizer. ``HashTable`` storage is not a ``Parameter``, so
``model.parameters()`` already lists only the dense part::

    >>> import torch
    >>> from deltastream import HashTable, SparseAdam
    >>> model = torch.nn.ModuleDict({"user": HashTable(8, name="user"),
    ...                              "mlp": torch.nn.Linear(8, 1)})
    >>> sparse = SparseAdam(model, lr=1e-2)             # finds every HashTable in model
    >>> dense = torch.optim.Adam(model.parameters(), lr=1e-3)
    >>> loss = model["mlp"](model["user"](torch.tensor([1, 2, 1]))).sum()
    >>> loss.backward()
    >>> sparse.step(); dense.step(); sparse.zero_grad(); dense.zero_grad()

Like ``torch.optim``, gradients accumulate across backward passes until ``zero_grad``.
Hyperparameters live in ``param_groups[0]`` (one group), so they can be changed between
steps. ``state_dict()`` stores the state keyed by table name and **id** (not position), so it
survives a table ``state_dict`` round trip: load the tables first, then the optimizer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Optional, Union

import torch

from deltastream.embedding.hashtable import HashTable
from deltastream.kernels.runtime import use_kernels

__all__ = ["SparseOptimizer", "SparseSGD", "RowWiseAdagrad", "SparseAdam"]

log = logging.getLogger(__name__)

TablesLike = Union[torch.nn.Module, Iterable[torch.nn.Module]]


def _collect_tables(tables: TablesLike) -> list[HashTable]:
    """Every distinct HashTable in ``tables`` (a module, or an iterable of modules)."""
    items = [tables] if isinstance(tables, torch.nn.Module) else tables
    try:
        items = list(items)
    except TypeError:
        raise TypeError("expected a HashTable, a model containing HashTables, or an iterable "
                        f"of them, got {type(tables).__name__}") from None
    found: list[HashTable] = []
    seen: set[int] = set()
    for item in items:
        if isinstance(item, torch.Tensor):
            raise TypeError("sparse optimizers take HashTable modules, not tensors; give dense "
                            "parameters to a torch.optim optimizer")
        if not isinstance(item, torch.nn.Module):
            raise TypeError(f"expected HashTable modules, got {type(item).__name__}")
        for mod in item.modules():
            if isinstance(mod, HashTable) and id(mod) not in seen:
                seen.add(id(mod))
                found.append(mod)
    if not found:
        raise ValueError("no HashTable found in the given modules")
    names = [t.name for t in found]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"HashTable names must be unique within one optimizer, repeated: {dup}")
    return found


def _check_nonneg(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


class SparseOptimizer:
    """Base class: per-table row state, growth, eviction reset, step, state_dict.

    Subclasses set ``_row_state`` (state name -> ``"row"`` for ``[capacity]`` or ``"vec"`` for
    ``[capacity, dim]``) and implement :meth:`_update`.
    """

    _row_state: dict[str, str] = {}

    def __init__(self, tables: TablesLike, defaults: dict) -> None:
        self.tables: list[HashTable] = _collect_tables(tables)
        self.defaults = dict(defaults)
        self.param_groups: list[dict] = [dict(defaults)]
        # table name -> state name -> tensor indexed by row position (float32 / int64)
        self.state: dict[str, dict[str, torch.Tensor]] = {t.name: {} for t in self.tables}
        for t in self.tables:
            t.register_row_listener(self._on_rows_freed)

    # ------------------------------------------------------------------ state handling

    @property
    def lr(self) -> float:
        """Learning rate of the (single) parameter group."""
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self.param_groups[0]["lr"] = _check_nonneg("lr", value)

    def _alloc(self, kind: str, name: str, rows: int, table: HashTable) -> torch.Tensor:
        dtype = torch.int64 if name == "step" else torch.float32
        shape = (rows,) if kind == "row" else (rows, table.embedding_dim)
        return torch.zeros(shape, dtype=dtype, device=table.device)

    def _ensure_state(self, table: HashTable) -> dict[str, torch.Tensor]:
        """State tensors of ``table``, grown to its capacity and on its device."""
        st = self.state[table.name]
        cap = table.capacity
        for name, kind in self._row_state.items():
            cur = st.get(name)
            if cur is not None and cur.device != table.device:
                cur = cur.to(table.device)
                st[name] = cur
            if cur is None or cur.shape[0] < cap:
                new = self._alloc(kind, name, cap, table)
                if cur is not None:
                    new[: cur.shape[0]] = cur
                st[name] = new
        return st

    def _on_rows_freed(self, table: HashTable, positions: Optional[torch.Tensor]) -> None:
        st = self.state.get(table.name)
        if not st or self._find(table.name) is not table:
            return
        if positions is not None:
            # grown to the table's capacity first, so every freed position is in range: no
            # filtering by a data-dependent mask (a device sync on CUDA)
            st = self._ensure_state(table)
        for tensor in st.values():
            if positions is None:
                tensor.zero_()
            else:
                tensor.index_fill_(0, positions.to(tensor.device), 0)

    def _find(self, name: str) -> Optional[HashTable]:
        for t in self.tables:
            if t.name == name:
                return t
        return None

    # ------------------------------------------------------------------ public API

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated sparse gradients of every table."""
        for t in self.tables:
            t.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):
        """Update the rows touched since the last ``zero_grad``; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        for t in self.tables:
            g = t.sparse_grad()
            if g is None or g.positions.numel() == 0:
                continue
            st = self._ensure_state(t)
            pos = g.positions
            if use_kernels(t.storage):
                from deltastream.kernels import sparse_optim  # imports triton: only here

                if sparse_optim.supports(t.storage):
                    self._fused(sparse_optim, st, pos, t.storage, g.values, group)
                    continue
            w = t.storage.index_select(0, pos).float()
            new_w = self._update(st, pos, w, g.values.float(), group)
            t.storage.index_copy_(0, pos, new_w.to(t.dtype))
        return loss

    def _update(self, st: dict[str, torch.Tensor], pos: torch.Tensor, w: torch.Tensor,
                g: torch.Tensor, group: dict) -> torch.Tensor:
        """New float32 rows ``[u, dim]`` for unique positions ``pos``; updates ``st`` rows."""
        raise NotImplementedError

    def _fused(self, kernels, st: dict[str, torch.Tensor], pos: torch.Tensor,
               storage: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        """:meth:`_update` fused: ``storage`` rows at ``pos`` and ``st`` updated in place by
        one kernel of ``kernels`` (:mod:`deltastream.kernels.sparse_optim`)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Hyperparameters and per-row state keyed by table name and id (not position)."""
        out: dict = {"param_groups": [dict(g) for g in self.param_groups], "state": {}}
        for t in self.tables:
            st = self.state[t.name]
            if not st:
                continue
            st = self._ensure_state(t)
            live = t.live_positions()
            entry = {"ids": t.ids_at(live)}
            for name, tensor in st.items():
                entry[name] = tensor.index_select(0, live)
            out["state"][t.name] = entry
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore hyperparameters and per-row state (load the tables' state first).

        Ids in the state that the table does not hold are skipped (and counted in a log
        line); rows of the table absent from the state start from zero state.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict \
                or "param_groups" not in state_dict:
            raise ValueError("expected a dict with 'param_groups' and 'state' from "
                             f"{type(self).__name__}.state_dict()")
        groups = state_dict["param_groups"]
        if len(groups) != 1 or set(groups[0]) != set(self.defaults):
            raise ValueError(f"param_groups do not match {type(self).__name__}: expected one "
                             f"group with keys {sorted(self.defaults)}, got "
                             f"{[sorted(g) for g in groups]}")
        unknown = sorted(set(state_dict["state"]) - {t.name for t in self.tables})
        if unknown:
            raise ValueError(f"state for tables this optimizer does not hold: {unknown}")
        for name, entry in state_dict["state"].items():
            missing = sorted(set(self._row_state) - set(entry))
            if "ids" not in entry or missing:
                raise ValueError(f"state of table {name!r} lacks {missing or ['ids']}")
        self.param_groups = [dict(groups[0])]
        for t in self.tables:
            st = self._ensure_state(t)
            for tensor in st.values():
                tensor.zero_()
            entry = state_dict["state"].get(t.name)
            if entry is None:
                continue
            pos = t.positions(entry["ids"])
            found = (pos >= 0).nonzero().squeeze(1)
            skipped = pos.numel() - found.numel()
            if skipped:
                log.warning("%s: %d ids of table %r in the optimizer state are not in the "
                               "table; their state is skipped", type(self).__name__, skipped,
                               t.name)
            where = pos.index_select(0, found)
            for name, tensor in st.items():
                src = entry[name].to(tensor.device)
                tensor.index_copy_(0, where, src.index_select(0, found.to(src.device))
                                   .to(tensor.dtype))

    def __repr__(self) -> str:
        names = ", ".join(t.name for t in self.tables)
        hp = ", ".join(f"{k}={v}" for k, v in self.param_groups[0].items())
        return f"{type(self).__name__}([{names}], {hp})"


class SparseSGD(SparseOptimizer):
    """Plain SGD on touched rows: ``w -= lr * (g + weight_decay * w)``."""

    def __init__(self, tables: TablesLike, lr: float = 0.01, *,
                 weight_decay: float = 0.0) -> None:
        super().__init__(tables, {"lr": _check_nonneg("lr", lr),
                                  "weight_decay": _check_nonneg("weight_decay", weight_decay)})

    def _update(self, st, pos, w, g, group):
        if group["weight_decay"]:
            g = g + group["weight_decay"] * w
        return w - group["lr"] * g

    def _fused(self, kernels, st, pos, storage, g, group):
        kernels.sgd_update(storage, pos, g, lr=group["lr"], weight_decay=group["weight_decay"])


class RowWiseAdagrad(SparseOptimizer):
    """Row-wise Adagrad (one accumulator per row, as FBGEMM's ``EXACT_ROWWISE_ADAGRAD``).

    ``g += weight_decay * w; sum += mean(g², over dim); w -= lr * g / (sqrt(sum) + eps)``.
    State: ``sum`` float32 ``[rows]`` (4 bytes per row instead of ``4 * dim``).
    """

    _row_state = {"sum": "row"}

    def __init__(self, tables: TablesLike, lr: float = 0.01, *, eps: float = 1e-8,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0) -> None:
        super().__init__(tables, {
            "lr": _check_nonneg("lr", lr), "eps": _check_nonneg("eps", eps),
            "weight_decay": _check_nonneg("weight_decay", weight_decay),
            "initial_accumulator_value": _check_nonneg("initial_accumulator_value",
                                                       initial_accumulator_value)})

    def _update(self, st, pos, w, g, group):
        if group["weight_decay"]:
            g = g + group["weight_decay"] * w
        acc = st["sum"].index_select(0, pos)
        if group["initial_accumulator_value"]:
            # zero state means "fresh row" (also after eviction): start it at the initial value
            acc = torch.where(acc == 0, acc.new_tensor(group["initial_accumulator_value"]), acc)
        acc = acc + g.square().mean(dim=1)
        st["sum"].index_copy_(0, pos, acc)
        return w - group["lr"] * g / (acc.sqrt() + group["eps"]).unsqueeze(1)

    def _fused(self, kernels, st, pos, storage, g, group):
        kernels.rowwise_adagrad_update(
            storage, st["sum"], pos, g, lr=group["lr"], eps=group["eps"],
            weight_decay=group["weight_decay"],
            initial_accumulator_value=group["initial_accumulator_value"])


class SparseAdam(SparseOptimizer):
    """Adam on touched rows with a per-row step count (lazy Adam).

    Each row's moments and bias correction advance only when the row gets a gradient, so a
    new or reused row starts exactly like a fresh Adam parameter. On rows touched every step
    this equals ``torch.optim.Adam`` (``torch.optim.AdamW`` with ``weight_decay``, which is
    decoupled: ``w *= 1 - lr * weight_decay`` before the update).
    State: ``exp_avg``, ``exp_avg_sq`` float32 ``[rows, dim]``, ``step`` int64 ``[rows]``.
    """

    _row_state = {"exp_avg": "vec", "exp_avg_sq": "vec", "step": "row"}

    def __init__(self, tables: TablesLike, lr: float = 1e-3, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        super().__init__(tables, {
            "lr": _check_nonneg("lr", lr), "betas": (float(betas[0]), float(betas[1])),
            "eps": _check_nonneg("eps", eps),
            "weight_decay": _check_nonneg("weight_decay", weight_decay)})

    def _update(self, st, pos, w, g, group):
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        step = st["step"].index_select(0, pos) + 1
        st["step"].index_copy_(0, pos, step)
        m = st["exp_avg"].index_select(0, pos).mul_(b1).add_(g, alpha=1 - b1)
        v = st["exp_avg_sq"].index_select(0, pos).mul_(b2).addcmul_(g, g, value=1 - b2)
        st["exp_avg"].index_copy_(0, pos, m)
        st["exp_avg_sq"].index_copy_(0, pos, v)
        t = step.to(torch.float64)
        bc1 = (1 - torch.pow(b1, t)).to(torch.float32).unsqueeze(1)
        bc2 = (1 - torch.pow(b2, t)).to(torch.float32).unsqueeze(1)
        if wd:
            w = w * (1 - lr * wd)
        denom = v.sqrt() / bc2.sqrt() + eps
        return w - (lr / bc1) * m / denom

    def _fused(self, kernels, st, pos, storage, g, group):
        kernels.adam_update(storage, st["exp_avg"], st["exp_avg_sq"], st["step"], pos, g,
                            lr=group["lr"], betas=group["betas"], eps=group["eps"],
                            weight_decay=group["weight_decay"])
