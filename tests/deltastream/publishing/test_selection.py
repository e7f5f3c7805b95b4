"""select_changed: drift scores, budgets, new-first, non-finite rows, leftover, anti-starvation;
error thresholds (absolute, relative, read-weighted) and LookupRate.

The selection contract tests take the ``path`` fixture (tests/deltastream/publishing/
conftest.py) and run twice: on the torch reference path and on the Triton kernel path."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from deltastream.publishing.lookup_rate import LookupRate
from deltastream.publishing.selection import row_wire_bytes, select_changed
from deltastream.types import DeltaRows
from tests.deltastream.publishing.selection_cases import (
    DIM,
    TABLE_KINDS,
    partition_ok,
    scenario,
)


@pytest.mark.parametrize("kind", TABLE_KINDS)
def test_scores_are_drift_norms_and_rows_current(kind, path):
    ids, first, cur, table = path.scenario(kind)
    delta = DeltaRows(ids=ids, states=first.clone())
    sel = path(delta, table)
    assert torch.equal(sel.ids, ids)  # no budget: every finite row
    torch.testing.assert_close(sel.rows, cur)
    torch.testing.assert_close(sel.scores, torch.linalg.vector_norm(cur - first, dim=1))
    assert len(sel.leftover) == 0 and sel.n_rejected == 0
    partition_ok(delta, sel)


@pytest.mark.parametrize("kind", TABLE_KINDS)
def test_k_picks_largest_drift_and_leftover_keeps_first(kind, path):
    ids, first, cur, table = path.scenario(kind)
    n = ids.numel()
    new = torch.zeros(n, dtype=torch.bool)
    age = torch.zeros(n, dtype=torch.int64)
    delta = DeltaRows(ids=ids, states=first.clone(), new=new, age=age)
    sel = path(delta, table, k=10)
    scores = torch.linalg.vector_norm(cur - first, dim=1)
    expect = torch.sort(ids[torch.topk(scores, 10).indices]).values
    assert torch.equal(sel.ids, expect)
    torch.testing.assert_close(sel.rows, cur[torch.isin(ids, expect)])
    # leftover carries the ORIGINAL FIRST states, new flags and ages
    lmask = ~torch.isin(ids, expect)
    assert torch.equal(sel.leftover.ids, ids[lmask])
    assert torch.equal(sel.leftover.states, first[lmask])
    assert torch.equal(sel.leftover.new, new[lmask])
    assert torch.equal(sel.leftover.age, age[lmask])
    assert sel.scores.min() >= sel.leftover.states.new_tensor(
        scores[lmask].max().item())
    partition_ok(delta, sel)


def test_fraction_and_threshold(path):
    ids, first, cur, table = path.scenario("embedding", n=100)
    scores = torch.linalg.vector_norm(cur - first, dim=1)
    delta = DeltaRows(ids=ids, states=first)
    sel = path(delta, table, fraction=0.1)
    assert len(sel) == 10
    assert torch.equal(sel.ids, torch.sort(torch.topk(scores, 10).indices).values)
    assert len(path(delta, table, fraction=0.123)) == 13  # ceil
    assert len(path(delta, table, fraction=1.0)) == 100

    t = float(scores.median())
    sel = path(delta, table, threshold=t)
    assert torch.equal(sel.ids, ids[scores >= t])
    assert torch.equal(sel.leftover.ids, ids[scores < t])
    # new rows pass any threshold: predictors do not have them at all
    new = torch.zeros(100, dtype=torch.bool)
    new[scores.argmin()] = True
    sel = path(DeltaRows(ids=ids, states=first, new=new), table, threshold=t)
    assert torch.equal(sel.ids, ids[(scores >= t) | new])


@pytest.mark.parametrize("wire_dtype,per_row", [("f32", 8 + 4 * DIM), ("f16", 8 + 2 * DIM),
                                                ("bf16", 8 + 2 * DIM), ("i8", 8 + DIM + 4)])
def test_max_bytes_caps_the_count(wire_dtype, per_row, path):
    assert row_wire_bytes(DIM, wire_dtype) == per_row
    ids, first, cur, table = path.scenario("embedding", n=100)
    scores = torch.linalg.vector_norm(cur - first, dim=1)
    delta = DeltaRows(ids=ids, states=first)
    sel = path(delta, table, max_bytes=7 * per_row + per_row - 1, wire_dtype=wire_dtype)
    assert len(sel) == 7
    assert torch.equal(sel.ids, torch.sort(torch.topk(scores, 7).indices).values)
    # combined with k: the smaller bound wins
    assert len(path(delta, table, k=3, max_bytes=10 * per_row,
                              wire_dtype=wire_dtype)) == 3
    assert len(path(delta, table, k=30, max_bytes=10 * per_row,
                              wire_dtype=wire_dtype)) == 10
    assert len(path(delta, table, threshold=0.0, max_bytes=5 * per_row,
                              wire_dtype=wire_dtype)) == 5
    assert len(path(delta, table, max_bytes=per_row - 1, wire_dtype=wire_dtype)) == 0


def test_new_rows_come_first_then_by_score(path):
    ids, first, cur, table = path.scenario("embedding", n=50)
    scores = torch.linalg.vector_norm(cur - first, dim=1)
    order = torch.argsort(scores)
    new = torch.zeros(50, dtype=torch.bool)
    new[order[:5]] = True  # the five SMALLEST drifts are new rows
    delta = DeltaRows(ids=ids, states=first, new=new, age=torch.zeros(50, dtype=torch.int64))
    sel = path(delta, table, k=8)
    expect = torch.cat([order[:5], order[-3:]])  # all new rows, then the 3 largest drifts
    assert torch.equal(sel.ids, torch.sort(ids[expect]).values)
    # budget smaller than the new rows: only new rows, the largest-drift ones
    sel = path(delta, table, k=2)
    assert torch.equal(sel.ids, torch.sort(ids[order[3:5]]).values)
    assert bool(sel.leftover.new.sum() == 3)


def test_non_finite_rows_rejected_never_selected_or_retained(caplog, path):
    ids, first, cur, table = path.scenario("embedding", n=40)
    with torch.no_grad():
        table.weight[3, 1] = math.nan
        table.weight[7, 0] = math.inf
        table.weight[9, 5] = -math.inf
    first = first.clone()
    first[11, 2] = math.nan       # bad FIRST, good current: publish it first (score +inf)
    with torch.no_grad():
        table.weight[13] = 1e30   # finite but the norm overflows float32: +inf, not rejected
    new = torch.zeros(40, dtype=torch.bool)
    new[3] = True  # even a new row is rejected when its value is non-finite
    delta = DeltaRows(ids=ids, states=first, new=new, age=torch.zeros(40, dtype=torch.int64))
    with caplog.at_level(logging.WARNING, logger="deltastream.publishing.selection"):
        sel = path(delta, table, k=4)
    assert sel.rejected.tolist() == [3, 7, 9] and sel.n_rejected == 3
    assert "3 of 40" in caplog.text
    assert not torch.isin(sel.rejected, sel.ids).any()
    assert not torch.isin(sel.rejected, sel.leftover.ids).any()
    assert {11, 13} <= set(sel.ids.tolist())
    assert torch.isinf(sel.scores[sel.ids == 11]).all()
    assert torch.isfinite(sel.rows).all()
    partition_ok(delta, sel)
    # fraction counts finite candidates only: ceil(0.5 * 37) = 19
    assert len(path(delta, table, fraction=0.5)) == 19
    # ID_ONLY deltas are checked too
    sel = path(DeltaRows(ids=ids), table)
    assert sel.rejected.tolist() == [3, 7, 9]
    assert len(sel) == 37 and 13 in sel.ids.tolist()


def test_id_only_selects_every_row_with_nan_scores(path):
    ids, first, cur, table = path.scenario("embedding", n=30)
    sel = path(DeltaRows(ids=ids), table)
    assert torch.equal(sel.ids, ids)
    assert torch.isnan(sel.scores).all()
    torch.testing.assert_close(sel.rows, cur)
    assert sel.leftover.states is None and len(sel.leftover) == 0
    # threshold cannot be evaluated without FIRST: every row passes
    assert len(path(DeltaRows(ids=ids), table, threshold=100.0)) == 30
    # a count budget is still honoured: new rows, then the oldest
    new = torch.zeros(30, dtype=torch.bool)
    new[[4, 20]] = True
    age = torch.zeros(30, dtype=torch.int64)
    age[[1, 2, 25]] = torch.tensor([3, 9, 5])
    sel = path(DeltaRows(ids=ids, new=new, age=age), table, k=4)
    assert sel.ids.tolist() == [2, 4, 20, 25]
    assert sorted(sel.leftover.ids.tolist()) == sorted(set(range(30)) - {2, 4, 20, 25})


def test_empty_delta_and_zero_budget(path):
    ids, first, cur, table = path.scenario("embedding", n=10)
    sel = path(DeltaRows.empty(DIM), table, k=5)
    assert len(sel) == 0 and sel.rows.shape == (0, DIM) and len(sel.leftover) == 0
    assert sel.leftover.states.shape == (0, DIM)
    tomb = torch.tensor([100, 200])
    delta = DeltaRows(ids=ids, states=first, tombstones=tomb)
    sel = path(delta, table, k=0)
    assert len(sel) == 0 and torch.equal(sel.leftover.ids, ids)
    assert torch.equal(sel.leftover.states, first)
    assert torch.equal(sel.tombstones, tomb)  # passed through for the publisher


def test_half_precision_table_and_states(path):
    ids, first, cur, _ = path.scenario("embedding", n=20)
    table = path.table("embedding", ids, cur.half())
    sel = path(DeltaRows(ids=ids, states=first.half()), table, k=5)
    ref = torch.linalg.vector_norm(cur.half().float() - first.half().float(), dim=1)
    assert torch.equal(sel.ids, torch.sort(torch.topk(ref, 5).indices).values)
    assert sel.rows.dtype == torch.float16 and sel.scores.dtype == torch.float32
    torch.testing.assert_close(sel.scores, ref[sel.ids])


def test_chunking_gives_identical_results(path):
    ids, first, cur, table = path.scenario("embedding", n=257)
    delta = DeltaRows(ids=ids, states=first, age=torch.arange(257) % 5)
    a = path(delta, table, fraction=0.3)
    b = path(delta, table, fraction=0.3, chunk_rows=16)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.scores, b.scores)
    assert torch.equal(a.leftover.ids, b.leftover.ids)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(k=3, fraction=0.5), ValueError, "at most one of k, fraction, threshold"),
    (dict(k=1, threshold=0.1), ValueError, "at most one"),
    (dict(k=-1), ValueError, "k must be >= 0"),
    (dict(k=True), TypeError, "k must be an int"),
    (dict(k=2.5), TypeError, "k must be an int"),
    (dict(fraction=0.0), ValueError, r"fraction must be in \(0, 1\]"),
    (dict(fraction=1.5), ValueError, r"fraction must be in \(0, 1\]"),
    (dict(fraction="0.1"), TypeError, "fraction must be a float"),
    (dict(threshold=-0.1), ValueError, "threshold must be a finite number >= 0"),
    (dict(threshold=math.nan), ValueError, "threshold must be a finite number"),
    (dict(max_bytes=-1), ValueError, "max_bytes must be >= 0"),
    (dict(max_bytes=1.5), TypeError, "max_bytes must be an int"),
    (dict(wire_dtype="f64"), ValueError, "wire_dtype must be one of"),
    (dict(max_age=0), ValueError, "max_age must be None or an int >= 1"),
    (dict(chunk_rows=0), ValueError, "chunk_rows"),
])
def test_argument_validation(kwargs, exc, match, path):
    ids, first, cur, table = path.scenario("embedding", n=5)
    with pytest.raises(exc, match=match):
        path(DeltaRows(ids=ids, states=first), table, **kwargs)


def test_delta_validation(path):
    ids, first, cur, table = path.scenario("embedding", n=5)
    with pytest.raises(TypeError, match="delta must be a DeltaRows"):
        path({"ids": ids}, table)
    with pytest.raises(ValueError, match="unique and ascending"):
        path(DeltaRows(ids=torch.tensor([0, 2, 1])), table)
    with pytest.raises(ValueError, match="unique and ascending"):
        path(DeltaRows(ids=torch.tensor([0, 1, 1])), table)
    with pytest.raises(ValueError, match="1-D int64"):
        path(DeltaRows(ids=ids.int()), table)
    with pytest.raises(ValueError, match=r"states must be \[n=5, dim\]"):
        path(DeltaRows(ids=ids, states=first[:4]), table)
    with pytest.raises(ValueError, match="states has dim 3 but the table has dim 8"):
        path(DeltaRows(ids=ids, states=first[:, :3]), table)
    with pytest.raises(ValueError, match="states must be floating point"):
        path(DeltaRows(ids=ids, states=first.long()), table)
    with pytest.raises(ValueError, match="new must be a bool tensor"):
        path(DeltaRows(ids=ids, new=torch.zeros(5)), table)
    with pytest.raises(ValueError, match="age must be an integer tensor"):
        path(DeltaRows(ids=ids, age=torch.zeros(4, dtype=torch.int64)), table)
    with pytest.raises(ValueError, match="age must be >= 0"):
        path(DeltaRows(ids=ids, age=-torch.ones(5, dtype=torch.int64)), table)
    with pytest.raises(TypeError, match="table must be a HashTable"):
        path(DeltaRows(ids=ids), object())
    with pytest.raises(ValueError, match=r"row indices in \[0, 5\)"):
        path(DeltaRows(ids=torch.tensor([1, 9])), table)


def run_rounds(rounds: int, k: int, max_age, use_age: bool, R: int = 200, hot: int = 20,
               select=select_changed, device="cpu"):
    """Simulate publish rounds under a fixed budget; return max rounds any row waited.

    Hot rows drift by 1.0 every round, cold rows by 0.001: pure top-k by drift would
    publish only hot rows. The fake retain does what DeltaTracker.retain does: leftover rows
    keep their FIRST state (the value last published) and their age grows by one.
    ``select`` is select_changed or a ``path`` (the table then lives on ``device``).
    """
    g = torch.Generator().manual_seed(1)
    ids = torch.arange(R)
    table = torch.nn.Embedding(R, DIM)
    published = table.weight.detach().clone()  # FIRST: what predictors hold
    table = table.to(device)
    age = torch.zeros(R, dtype=torch.int64)
    new = torch.ones(R, dtype=torch.bool)
    last_pub = torch.zeros(R, dtype=torch.int64)
    speed = torch.full((R,), 0.001)
    speed[:hot] = 1.0
    worst = 0
    for rnd in range(1, rounds + 1):
        step = torch.randn(R, DIM, generator=g)
        step = step / step.norm(dim=1, keepdim=True) * speed[:, None]
        with torch.no_grad():
            table.weight += step.to(device)
        delta = DeltaRows(ids=ids, states=published.clone(), new=new.clone(),
                          age=age.clone() if use_age else None)
        sel = select(delta, table, k=k, max_age=max_age)
        assert len(sel) == k and sel.n_rejected == 0
        published[sel.ids] = sel.rows
        new[sel.ids] = False
        age[sel.ids] = 0
        age[sel.leftover.ids] += 1
        last_pub[sel.ids] = rnd
        worst = max(worst, int((rnd - last_pub).max()))
    return worst


def test_no_row_starves_under_fixed_budget():
    R, k = 200, 20
    for max_age in (4, 16):
        bound = max_age + math.ceil(R / k)
        worst = run_rounds(rounds=120, k=k, max_age=max_age, use_age=True, R=R)
        assert worst <= bound, f"max_age={max_age}: a row waited {worst} rounds, bound {bound}"
    # without ages (pure top-k by drift) cold rows starve: the test above is meaningful
    assert run_rounds(rounds=120, k=k, max_age=max_age, use_age=False, R=R) > 100


def test_no_row_starves_on_the_kernel_path(kernel_device):
    """The bound above, with the priority key built by the kernel (fewer rounds: the
    interpreter is slow)."""
    from tests.deltastream.publishing.selection_cases import SelectPath

    R, k, max_age = 200, 20, 4
    worst = run_rounds(rounds=40, k=k, max_age=max_age, use_age=True, R=R,
                       select=SelectPath("kernels", kernel_device), device=kernel_device)
    assert worst <= max_age + math.ceil(R / k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", TABLE_KINDS)
def test_cuda_matches_cpu(kind):
    ids, first, cur, table = scenario(kind, n=300)
    age = torch.arange(300) % 20
    new = torch.arange(300) % 17 == 0
    delta = DeltaRows(ids=ids, states=first, new=new, age=age)
    ref = select_changed(delta, table, fraction=0.2)
    ids_c, first_c, cur_c, table_c = scenario(kind, n=300, device="cuda")
    delta_c = DeltaRows(ids=ids_c, states=first_c, new=new.cuda(), age=age.cuda())
    got = select_changed(delta_c, table_c, fraction=0.2)
    assert got.ids.is_cuda and got.rows.is_cuda
    assert torch.equal(got.ids.cpu(), ref.ids)
    torch.testing.assert_close(got.rows.cpu(), ref.rows)
    torch.testing.assert_close(got.scores.cpu(), ref.scores)
    assert torch.equal(got.leftover.ids.cpu(), ref.leftover.ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("relative", [False, True])
def test_cuda_threshold_policies_match_cpu(relative):
    ids, first, cur, table = scenario("hashtable", n=300)
    new = torch.arange(300) % 7 == 0
    w = torch.rand(300, generator=torch.Generator().manual_seed(2)) * 3
    kw = dict(threshold=0.5 if relative else 2.0, relative=relative, new_rows="drift")
    ref = select_changed(DeltaRows(ids=ids, states=first, new=new), table, weights=w, **kw)
    ids_c, first_c, cur_c, table_c = scenario("hashtable", n=300, device="cuda")
    got = select_changed(DeltaRows(ids=ids_c, states=first_c, new=new.cuda()), table_c,
                         weights=w.cuda(), **kw)
    assert 0 < len(ref) < 300
    assert torch.equal(got.ids.cpu(), ref.ids)
    torch.testing.assert_close(got.scores.cpu(), ref.scores)
    rate = LookupRate(0.5)
    rate.observe(ids_c[:10].repeat(3))
    rate.end_round()
    assert rate.rate(ids_c[:12]).is_cuda
    assert rate.rate(ids_c[:12]).cpu().tolist() == [1.5] * 10 + [0.0] * 2


def test_no_row_starves_with_real_tracker_and_training():
    """End to end: HashTable + SparseSGD + DeltaTracker(EMBEDDING) + select_changed + retain."""
    from deltastream.embedding.hashtable import HashTable
    from deltastream.embedding.optim import SparseSGD
    from deltastream.tracking.tracker import DeltaTracker
    from deltastream.types import TrackingMode

    R, hot, k, max_age, rounds = 60, 6, 6, 5, 40
    model = torch.nn.ModuleDict({"emb": HashTable(DIM, name="emb")})
    table = model["emb"]
    opt = SparseSGD(model, lr=0.1)
    tracker = DeltaTracker(model, mode=TrackingMode.EMBEDDING)
    ids = torch.arange(R, dtype=torch.int64) * 1000 + 7
    weight = torch.full((R, 1), 1e-3)
    weight[:hot] = 1.0  # hot rows get ~1000x larger gradients
    g = torch.Generator().manual_seed(3)
    last_pub = torch.full((R,), -1, dtype=torch.int64)
    published_value = torch.zeros(R, DIM)
    worst = 0
    for rnd in range(rounds):
        out = table(ids)
        (out * weight * torch.randn(R, DIM, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
        tracker.step()
        delta = tracker.get_delta()["emb"]
        assert torch.equal(delta.ids, ids)  # every id was touched or carried
        if rnd > 0:  # FIRST = what was published last (retained rows keep theirs)
            torch.testing.assert_close(delta.states, published_value)
        sel = select_changed(delta, table, k=k, max_age=max_age)
        assert len(sel) == k
        tracker.retain("default", "emb", sel.leftover)
        pos = torch.searchsorted(ids, sel.ids)
        # rows that never had a value published read as FIRST = their pre-update value; keep
        # the published values so the next FIRST can be checked
        published_value[torch.searchsorted(ids, sel.leftover.ids)] = sel.leftover.states
        published_value[pos] = sel.rows
        last_pub[pos] = rnd
        if rnd >= R // k:  # after the initial wave of new rows
            worst = max(worst, int((rnd - last_pub).max()))
    bound = max_age + math.ceil(R / k)
    assert (last_pub >= 0).all()
    assert worst <= bound, f"a row waited {worst} rounds, bound {bound}"


# ------------------------------------------------------------------ error thresholds


def test_threshold_does_not_force_overdue_rows(path):
    """Under a threshold a row below it stays leftover however long it was carried."""
    ids, first, cur, table = path.scenario("embedding", n=60)
    scores = torch.linalg.vector_norm(cur - first, dim=1)
    age = torch.full((60,), 1000, dtype=torch.int64)  # far past max_age
    t = float(scores.median())
    sel = path(DeltaRows(ids=ids, states=first, age=age), table, threshold=t,
                         max_age=4)
    assert torch.equal(sel.ids, ids[scores >= t])
    assert torch.equal(sel.leftover.ids, ids[scores < t])
    assert torch.equal(sel.leftover.age, age[scores < t])  # the tracker adds 1 on retain
    # a count budget still forces them (the anti-starvation bound is kept there)
    sel = path(DeltaRows(ids=ids, states=first, age=age.clone()), table, k=60,
                         max_age=4)
    assert len(sel) == 60
    partition_ok(DeltaRows(ids=ids), sel)


@pytest.mark.parametrize("kind", TABLE_KINDS)
def test_new_rows_drift_policy(kind, path):
    """new_rows="drift": a never-published row's error is ‖current‖ (predictors serve zeros)."""
    ids, first, cur, table = path.scenario(kind, n=80)
    new = torch.zeros(80, dtype=torch.bool)
    new[::3] = True
    eff = torch.where(new, torch.linalg.vector_norm(cur, dim=1),
                      torch.linalg.vector_norm(cur - first, dim=1))
    t = float(eff.median())
    delta = DeltaRows(ids=ids, states=first.clone(), new=new.clone(),
                      age=torch.zeros(80, dtype=torch.int64))
    sel = path(delta, table, threshold=t, new_rows="drift")
    assert torch.equal(sel.ids, ids[eff >= t])
    torch.testing.assert_close(sel.scores, eff[eff >= t])
    # some new rows are held back; they keep their ORIGINAL FIRST state and new flag
    lmask = eff < t
    assert bool((new & lmask).any()) and bool((new & ~lmask).any())
    assert torch.equal(sel.leftover.ids, ids[lmask])
    assert torch.equal(sel.leftover.states, first[lmask])
    assert torch.equal(sel.leftover.new, new[lmask])
    partition_ok(delta, sel)
    # the default ("first") sends every new row whatever its drift
    sel = path(delta, table, threshold=t)
    assert torch.equal(sel.ids, ids[(eff >= t) | new])
    # under a count budget "drift" has no new-row tier: plain top-k of the effective drift
    sel = path(delta, table, k=10, new_rows="drift")
    assert torch.equal(sel.ids, torch.sort(ids[torch.topk(eff, 10).indices]).values)


def test_relative_threshold(path):
    ids, first, cur, table = path.scenario("embedding", n=40)
    first, cur = first.clone(), cur.clone()
    first[5] = 0.0   # unchanged all-zero row: relative drift 0
    cur[5] = 0.0
    cur[6] = 0.0     # moved to zero: relative drift +inf
    with torch.no_grad():
        table.weight[5] = 0.0
        table.weight[6] = 0.0
    drift = torch.linalg.vector_norm(cur - first, dim=1)
    rel = drift / torch.linalg.vector_norm(cur, dim=1)
    rel[5], rel[6] = 0.0, math.inf
    rho = float(rel[torch.isfinite(rel)].median())
    sel = path(DeltaRows(ids=ids, states=first), table, threshold=rho, relative=True)
    assert torch.equal(sel.ids, ids[rel >= rho])
    assert 6 in sel.ids.tolist() and 5 in sel.leftover.ids.tolist()
    torch.testing.assert_close(sel.scores, drift[rel >= rho])  # scores stay absolute
    # relative=0 publishes everything (>= 0), including the unchanged zero row
    assert len(path(DeltaRows(ids=ids, states=first), table, threshold=0.0,
                              relative=True)) == 40


def test_weights_scale_the_drift(path):
    ids, first, cur, table = path.scenario("embedding", n=100)
    g = torch.Generator().manual_seed(5)
    w = torch.rand(100, generator=g) * 2
    w[:10] = 0.0
    first = first.clone()
    first[3, 0] = math.nan  # recovered row (score +inf) with weight 0: still published
    drift = torch.linalg.vector_norm(cur - first, dim=1)
    drift[3] = math.inf
    weighted = torch.where(torch.isinf(drift), math.inf, drift * w)
    t = float(weighted[torch.isfinite(weighted)].median())
    delta = DeltaRows(ids=ids, states=first)
    sel = path(delta, table, threshold=t, weights=w)
    assert torch.equal(sel.ids, ids[weighted >= t])
    assert 3 in sel.ids.tolist()
    assert set(range(10)) - {3} <= set(sel.leftover.ids.tolist())
    torch.testing.assert_close(sel.scores, drift[weighted >= t])  # unweighted drift
    # a count budget ranks by the weighted drift too
    sel = path(delta, table, k=7, weights=w.double())
    assert torch.equal(sel.ids, torch.sort(ids[torch.topk(weighted, 7).indices]).values)
    # ID_ONLY: nothing to weight, every row (weights still validated)
    assert len(path(DeltaRows(ids=ids), table, threshold=t, weights=w)) == 100


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(new_rows="sometimes"), ValueError, "new_rows must be one of"),
    (dict(threshold=0.1, relative=1), TypeError, "relative must be a bool"),
    (dict(relative=True), ValueError, "relative=True needs a threshold"),
    (dict(weights=torch.ones(4)), ValueError, r"weights must be a float tensor \[n=5\]"),
    (dict(weights=torch.ones(5, dtype=torch.int64)), ValueError, "weights must be a float"),
    (dict(weights=-torch.ones(5)), ValueError, "finite and >= 0"),
    (dict(weights=torch.full((5,), math.nan)), ValueError, "finite and >= 0"),
    (dict(weights=[1.0] * 5), ValueError, "weights must be a float tensor"),
])
def test_policy_argument_validation(kwargs, exc, match, path):
    ids, first, cur, table = path.scenario("embedding", n=5)
    with pytest.raises(exc, match=match):
        path(DeltaRows(ids=ids, states=first), table, **kwargs)


def test_read_weighted_threshold_bounds_every_served_row():
    """End to end: HashTable + RowWiseAdagrad + DeltaTracker + LookupRate + threshold.

    The promise of ``threshold=ε, weights=√rate, new_rows="drift"``: right after every
    publish round, every row the predictor serves (zeros for rows never published) is
    within ε / √(1 − decay) of the trainer's row, and within ε / √((1 − decay)·c) for a
    row read c times in that round (its rate is at least (1 − decay)·c); rows under it are
    held back (tracked, not lost) and a final flush makes the predictor equal to the
    trainer.
    """
    from deltastream.embedding.hashtable import HashTable, normal_initializer
    from deltastream.embedding.optim import RowWiseAdagrad
    from deltastream.tracking.tracker import DeltaTracker
    from deltastream.types import TrackingMode

    R, steps_per_round, rounds, batch, eps, decay = 400, 4, 30, 128, 0.2, 0.8
    g = torch.Generator().manual_seed(11)
    universe = torch.arange(R, dtype=torch.int64) * 7919 + 3
    zipf = 1.0 / torch.arange(1, R + 1, dtype=torch.float64) ** 1.1
    target = torch.randn(R, DIM, generator=g)
    model = torch.nn.ModuleDict({"emb": HashTable(DIM, name="emb",
                                                  initializer=normal_initializer(0.1, seed=1))})
    table = model["emb"]
    opt = RowWiseAdagrad(model, lr=0.1)
    tracker = DeltaTracker(model, mode=TrackingMode.EMBEDDING)
    rate = LookupRate(decay)
    rate.watch(table)
    served = torch.zeros(R, DIM)  # the predictor: zeros until a row is published
    bound = eps / math.sqrt(1 - decay)
    published = touched = held_max = 0
    worst_unweighted = 0.0
    for rnd in range(rounds):
        reads = torch.zeros(R)
        for _ in range(steps_per_round):
            pos = torch.multinomial(zipf, batch, replacement=True, generator=g)
            reads += torch.bincount(pos, minlength=R)
            loss = ((table(universe[pos]) - target[pos]) ** 2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            tracker.step()
        target += 0.05 * torch.randn(R, DIM, generator=g)  # concept drift
        rate.end_round()
        delta = tracker.get_delta()["emb"]
        sel = select_changed(delta, table, threshold=eps, new_rows="drift",
                             weights=rate.rate(delta.ids).sqrt())
        tracker.retain("default", "emb", sel.leftover)
        served[torch.searchsorted(universe, sel.ids)] = sel.rows
        touched += int((reads > 0).sum())
        published += len(sel)
        held_max = max(held_max, len(sel.leftover))
        live = torch.searchsorted(universe, table.ids())
        err = torch.linalg.vector_norm(table.lookup(universe[live]) - served[live], dim=1)
        assert float(err.max()) <= bound + 1e-5, f"round {rnd}: error {float(err.max())}"
        hot = reads[live] > 0
        assert bool((err[hot] <= eps / reads[live][hot].sqrt() / math.sqrt(1 - decay)
                     + 1e-5).all())
        worst_unweighted = max(worst_unweighted, float(err.max()))
    # the policy did something: rows held back, fewer rows sent than touched, and rarely
    # read rows were allowed past the unweighted ε (hot ones were not)
    assert held_max > 0 and published < 0.5 * touched
    assert worst_unweighted > eps
    # nothing was lost: a final flush (no budget) sends every held row
    final = select_changed(tracker.get_delta()["emb"], table)
    served[torch.searchsorted(universe, final.ids)] = final.rows
    live = torch.searchsorted(universe, table.ids())
    assert torch.equal(served[live], table.lookup(universe[live]))
