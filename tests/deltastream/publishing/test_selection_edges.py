"""select_changed at the edges, on both paths (``path`` fixture: torch reference and Triton
kernels): nothing / everything changed, exact ties at the budget boundary, tables that do
not hold the ids, half precision, float64 FIRST states, strided states, duck-typed tables;
plus the kernels' own counts and the one-sync promise on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from deltastream.publishing.selection import row_wire_bytes, select_changed
from deltastream.types import DeltaRows
from tests.deltastream.publishing.selection_cases import DIM, global_ids, partition_ok


def integer_rows(n: int, seed: int = 0) -> torch.Tensor:
    """Small integer-valued rows: differences and norms are exact, so ties are exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, (n, DIM), generator=g).float()


@pytest.mark.parametrize("kind", ["embedding", "hashtable"])
def test_nothing_changed(kind, path):
    ids = global_ids(kind, 40)
    first = integer_rows(40)
    table = path.table(kind, ids, first)
    delta = DeltaRows(ids=ids, states=first, age=torch.zeros(40, dtype=torch.int64))
    sel = path(delta, table)  # no budget: every finite row, drift 0
    assert torch.equal(sel.ids, ids) and bool((sel.scores == 0).all())
    sel = path(delta, table, threshold=0.0)  # >= 0: everything
    assert len(sel) == 40
    sel = path(delta, table, threshold=1e-6)  # nothing drifted: everything stays
    assert len(sel) == 0 and torch.equal(sel.leftover.ids, ids)
    assert torch.equal(sel.leftover.states, first)
    sel = path(delta, table, k=5)  # all tied at 0: any 5
    assert len(sel) == 5 and len(sel.leftover) == 35
    partition_ok(delta, sel)


def test_everything_changed(path):
    ids = global_ids("hashtable", 50)
    first = integer_rows(50)
    step = torch.zeros(50, DIM)
    step[:, 0] = torch.arange(1, 51).float()  # row i drifts by i + 1
    table = path.table("hashtable", ids, first + step)
    delta = DeltaRows(ids=ids, states=first)
    sel = path(delta, table, threshold=0.5)
    assert torch.equal(sel.ids, ids) and len(sel.leftover) == 0
    torch.testing.assert_close(sel.scores, step[:, 0])
    sel = path(delta, table, fraction=0.5)
    assert torch.equal(sel.ids, ids[25:])  # the 25 largest drifts
    assert torch.equal(sel.leftover.ids, ids[:25])


@pytest.mark.parametrize("budget", [dict(k=8), dict(fraction=0.4),
                                    dict(max_bytes=8 * row_wire_bytes(DIM))])
def test_exact_ties_at_the_budget_boundary(budget, path):
    """5 rows drift 3, 10 rows drift exactly 2, 5 rows drift 1; a budget of 8 takes the five
    3s and any three of the tied 2s, never a 1."""
    ids = global_ids("hashtable", 20)
    first = integer_rows(20)
    drift = torch.tensor([3.0] * 5 + [2.0] * 10 + [1.0] * 5)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(3))
    drift = drift[perm]
    step = torch.zeros(20, DIM)
    step[:, 2] = drift
    table = path.table("hashtable", ids, first + step)
    delta = DeltaRows(ids=ids, states=first, age=torch.zeros(20, dtype=torch.int64))
    sel = path(delta, table, **budget)
    assert len(sel) == 8
    picked = drift[torch.isin(ids, sel.ids)]
    assert int((picked == 3).sum()) == 5 and int((picked == 2).sum()) == 3
    assert set(ids[drift == 3].tolist()) <= set(sel.ids.tolist())
    assert not set(ids[drift == 1].tolist()) & set(sel.ids.tolist())
    partition_ok(delta, sel)
    # ties among new rows (same tier, age and drift): still exactly the budget
    new = torch.ones(20, dtype=torch.bool)
    sel = path(DeltaRows(ids=ids, states=first, new=new), table, k=3)
    assert len(sel) == 3 and set(drift[torch.isin(ids, sel.ids)].tolist()) == {3.0}


def test_ids_the_table_does_not_hold(path):
    """An empty table (and one holding only some ids) reads absent ids as its eval value,
    as HashTable.lookup does: their drift is measured from that value."""
    from deltastream.embedding.hashtable import HashTable
    from deltastream.embedding.initializers import constant_initializer

    ids = global_ids("hashtable", 12)
    first = integer_rows(12)
    table = HashTable(DIM, name="t", device=path.device,
                      initializer=constant_initializer(0.5))
    sel = path(DeltaRows.empty(DIM), table, k=3)
    assert len(sel) == 0 and sel.rows.shape == (0, DIM)
    sel = path(DeltaRows(ids=ids, states=first), table)
    assert torch.equal(sel.ids, ids)
    assert bool((sel.rows == 0.5).all())
    torch.testing.assert_close(sel.scores, torch.linalg.vector_norm(first - 0.5, dim=1))
    table.insert(ids[::2].to(path.device), (first[::2] + 1).to(path.device))
    sel = path(DeltaRows(ids=ids, states=first), table, k=12)
    expect = torch.full((12, DIM), 0.5)
    expect[::2] = first[::2] + 1
    torch.testing.assert_close(sel.rows, expect)
    torch.testing.assert_close(sel.scores, torch.linalg.vector_norm(first - expect, dim=1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("states_dtype", ["table", "float32"])
def test_half_precision_hashtable(dtype, states_dtype, path):
    ids = global_ids("hashtable", 60)
    g = torch.Generator().manual_seed(4)
    first = torch.randn(60, DIM, generator=g).to(dtype)
    cur = (first.float() + torch.randn(60, DIM, generator=g) * torch.rand(60, 1, generator=g)
           ).to(dtype)
    if states_dtype == "float32":
        first = first.float()
    table = path.table("hashtable", ids, cur)
    sel = path(DeltaRows(ids=ids, states=first), table, k=9)
    ref = torch.linalg.vector_norm(cur.float() - first.float(), dim=1)
    assert torch.equal(sel.ids, torch.sort(ids[torch.topk(ref, 9).indices]).values)
    assert sel.rows.dtype == dtype and sel.scores.dtype == torch.float32
    assert torch.equal(sel.rows, cur[torch.isin(ids, sel.ids)])
    torch.testing.assert_close(sel.scores, ref[torch.isin(ids, sel.ids)])


def test_float64_states_and_strided_states(path):
    ids = global_ids("embedding", 30)
    first = torch.randn(30, 2 * DIM, generator=torch.Generator().manual_seed(5))
    strided = first[:, ::2]  # FIRST states with a non-unit stride along dim
    cur = strided + 0.25 * torch.arange(30).float()[:, None]
    table = path.table("embedding", ids, cur)
    sel = path(DeltaRows(ids=ids, states=strided), table, k=4)
    assert torch.equal(sel.ids, ids[-4:])
    sel = path(DeltaRows(ids=ids, states=strided.double()), table, threshold=0.25 * 20)
    ref = torch.linalg.vector_norm(cur.double() - strided.double(), dim=1)
    assert torch.equal(sel.ids, ids[ref >= 5.0])
    torch.testing.assert_close(sel.scores, ref[ref >= 5.0].float())


def test_strided_ids_flags_ages_and_weights(path):
    """Every [n] input may be a strided view (the kernels index them densely)."""
    ids2 = global_ids("embedding", 80)
    g = torch.Generator().manual_seed(6)
    first2 = torch.randn(80, DIM, generator=g)
    cur2 = first2 + torch.randn(80, DIM, generator=g) * torch.rand(80, 1, generator=g)
    new2, age2 = torch.arange(80) % 9 == 0, torch.arange(80) % 6
    w2 = torch.rand(80, generator=g)
    table = path.table("embedding", ids2, cur2)
    view = DeltaRows(ids=ids2[::2], states=first2[::2], new=new2[::2], age=age2[::2])
    dense = DeltaRows(ids=ids2[::2].clone(), states=first2[::2].clone(),
                      new=new2[::2].clone(), age=age2[::2].clone())
    for kw in (dict(k=9), dict(threshold=0.3, new_rows="drift")):
        a = path(view, table, weights=w2[::2], max_age=3, **kw)
        b = path(dense, table, weights=w2[::2].clone(), max_age=3, **kw)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.leftover.ids, b.leftover.ids)
        torch.testing.assert_close(a.scores, b.scores)


class DictTable:
    """A duck-typed table: ``lookup`` and ``embedding_dim`` only (no storage to gather)."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.rows = dict(zip(ids.tolist(), rows, strict=True))
        self.embedding_dim = rows.shape[1]
        self.device = rows.device

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.rows[i] for i in ids.tolist()]).to(ids.device)


def test_duck_typed_table(path):
    ids = global_ids("hashtable", 20)
    first = integer_rows(20)
    cur = first.clone()
    cur[[3, 7, 11], 0] += torch.tensor([5.0, 1.0, 3.0])
    cur[15, 1] = math.nan
    sel = path(DeltaRows(ids=ids, states=first), DictTable(ids, cur.to(path.device)), k=2)
    assert sel.ids.tolist() == [ids[3].item(), ids[11].item()]
    assert sel.rejected.tolist() == [ids[15].item()]
    torch.testing.assert_close(sel.scores, torch.tensor([5.0, 3.0]))


def test_row_drift_kernel_counts(kernel_device):
    """The kernel itself: absent / out-of-range positions and non-finite rows are counted."""
    from deltastream.kernels.row_diff import COUNT_MISSING, COUNT_NONFINITE, row_drift

    dev = kernel_device
    storage = torch.randn(10, DIM, device=dev)
    storage[4, 3] = math.inf
    pos = torch.tensor([0, 4, -1, 9, 10, 2], device=dev)
    first = torch.randn(6, DIM, device=dev)
    out = row_drift(storage, pos, first, None, want_norm=True, compute_dtype=torch.float32)
    counts = out.counts.tolist()
    assert counts[COUNT_MISSING] == 2 and counts[COUNT_NONFINITE] == 1
    ok = torch.tensor([0, 3, 5])
    rows = storage[pos[ok]]
    torch.testing.assert_close(out.score[ok], torch.linalg.vector_norm(rows - first[ok], dim=1))
    torch.testing.assert_close(out.norm[ok], torch.linalg.vector_norm(rows, dim=1))
    assert out.finite[ok].all() and not out.finite[1] and torch.isnan(out.score[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_path_syncs_once():
    """On CUDA the kernel path reads back to the host once (the counts), whatever the
    budget; an nn.Embedding has no find of its own that could sync."""
    from deltastream.kernels.runtime import kernels_mode

    n = 4096
    emb = torch.nn.Embedding(n, 32, device="cuda")
    ids = torch.arange(n, device="cuda")
    first = emb.weight.detach() + torch.randn(n, 32, device="cuda")
    delta = DeltaRows(ids=ids, states=first, new=torch.rand(n, device="cuda") < 0.1,
                      age=torch.randint(0, 20, (n,), device="cuda"))
    with kernels_mode("on"):
        select_changed(delta, emb, fraction=0.1)  # compile outside the count
        for kw in (dict(fraction=0.1), dict(threshold=1.0), dict(k=100, max_bytes=10_000)):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with pytest.warns(UserWarning) as record:
                    select_changed(delta, emb, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            syncs = [r for r in record if "synchroniz" in str(r.message)]
            assert len(syncs) == 1, [str(r.message) for r in syncs]
