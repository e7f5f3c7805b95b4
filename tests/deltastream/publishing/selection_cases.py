"""Shared pieces of the select_changed suites: real tables, scenarios, and :class:`SelectPath`
(one path of select_changed — the torch reference or the Triton kernels — on its device,
with results brought back to CPU so one set of assertions checks both)."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from deltastream.publishing.selection import Selection, select_changed
from deltastream.types import DeltaRows

DIM = 8
TABLE_KINDS = ["embedding", "hashtable"]


def make_table(kind: str, ids: torch.Tensor, rows: torch.Tensor, device="cpu"):
    """A real table holding ``rows`` at ``ids`` (nn.Embedding: ids must be 0..n-1)."""
    if kind == "embedding":
        emb = torch.nn.Embedding(int(ids.max()) + 1, rows.shape[1], device=device,
                                 dtype=rows.dtype)
        with torch.no_grad():
            emb.weight[ids.to(device)] = rows.to(device)
        return emb
    hashtable = pytest.importorskip("deltastream.embedding.hashtable")
    table = hashtable.HashTable(rows.shape[1], name="t", device=device, dtype=rows.dtype,
                                capacity=max(16, 2 * ids.numel()))
    table.insert(ids.to(device), rows.to(device))
    return table


def global_ids(kind: str, n: int) -> torch.Tensor:
    # HashTable ids are arbitrary (sparse, some negative); nn.Embedding ids are row indices.
    if kind == "embedding":
        return torch.arange(n, dtype=torch.int64)
    return torch.arange(n, dtype=torch.int64) * 7919 - 50_000


def scenario(kind: str, n: int = 64, seed: int = 0, device="cpu", table_device=None):
    """``ids, first, cur`` on ``device`` and a table holding ``cur`` on ``table_device``
    (default: ``device``)."""
    g = torch.Generator().manual_seed(seed)
    ids = global_ids(kind, n)
    first = torch.randn(n, DIM, generator=g)
    # drift of row i grows with a random per-row scale: distinct scores
    scale = torch.rand(n, generator=g) * 3
    cur = first + torch.randn(n, DIM, generator=g) * scale[:, None]
    table = make_table(kind, ids, cur, device if table_device is None else table_device)
    return ids.to(device), first.to(device), cur.to(device), table


def partition_ok(delta: DeltaRows, sel: Selection) -> None:
    """Every candidate ends in exactly one of selected / leftover / rejected."""
    all_ids = torch.cat([sel.ids.cpu(), sel.leftover.ids.cpu(), sel.rejected.cpu()])
    assert all_ids.numel() == delta.ids.numel()
    assert torch.equal(torch.sort(all_ids).values, delta.ids.cpu())
    for t in (sel.ids, sel.leftover.ids, sel.rejected):
        assert torch.all(t[1:] > t[:-1]), "ids must be ascending"


def _moved(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (DeltaRows, Selection)):
        return type(obj)(**{f.name: _moved(getattr(obj, f.name), device) for f in fields(obj)})
    return obj


class SelectPath:
    """``path(delta, table, **kw)``: select_changed on this path's device (the delta and
    ``weights`` are moved there; the table must already be there), result on CPU."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device

    def __repr__(self) -> str:
        return f"SelectPath({self.name}, {self.device})"

    def table(self, kind: str, ids: torch.Tensor, rows: torch.Tensor):
        return make_table(kind, ids, rows, self.device)

    def scenario(self, kind: str, n: int = 64, seed: int = 0):
        """``scenario`` with CPU tensors and the table on this path's device."""
        return scenario(kind, n, seed, table_device=self.device)

    def __call__(self, delta, table, **kw) -> Selection:
        if "weights" in kw:
            kw["weights"] = _moved(kw["weights"], self.device)
        sel = select_changed(_moved(delta, self.device), table, **kw)
        if self.device.type != "cpu":
            assert sel.ids.device.type == self.device.type
        return _moved(sel, "cpu")
