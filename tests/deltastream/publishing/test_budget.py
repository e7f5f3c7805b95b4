"""BudgetPublisher: a byte budget spent on the largest serving errors across tables.

Rows travel through the real wire codec into ``consumers.ServingTable`` s (f32 on the wire,
so "exact" means exact), and the tests compare what predictors hold with the trainer.
Every test runs in both modes: rounds inside ``tick`` and rounds on the worker threads
(there each tick is followed by ``drain``, so the assertions see the tick's round); and once
more in sync mode with ``read_decay=None`` (keys not weighted by reads): every guarantee
holds either way, and where rows are read alike the order is the same.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from consumers import ServingTable
from deltastream import DeltaTracker, HashTable, PublishError, TrackingMode, wire
from deltastream.publishing.budget import BudgetPolicy, BudgetPublisher
from deltastream.publishing.round_publisher import RoundPolicy, RoundPublisher
from deltastream.publishing.rounds import SelectionPolicy
from deltastream.publishing.token_bucket import TokenBucket
from deltastream.tracking import recorder
from tests.deltastream.publishing.budget_cases import (
    Loopback,
    move,
    served_error,
    setup,
    tick,
    train,
)


@pytest.fixture(autouse=True, params=["sync", "threaded", "unweighted"])
def mode(request):
    global _THREADED, _UNWEIGHTED
    _THREADED = request.param == "threaded"
    _UNWEIGHTED = request.param == "unweighted"
    yield request.param


_THREADED = _UNWEIGHTED = False


def _publisher(*args, **kwargs) -> BudgetPublisher:
    if _UNWEIGHTED:
        args = tuple(replace(a, read_decay=None) if isinstance(a, BudgetPolicy) else a
                     for a in args)
    return BudgetPublisher(*args, threaded=_THREADED, **kwargs)


def _tick(bp: BudgetPublisher, step: int):
    """``bp.tick(step)``'s round record in either mode (None: the tick only refilled)."""
    return tick(bp, step, _THREADED)


def _train(model, tracker, bp: BudgetPublisher, steps: int, seed: int) -> None:
    train(model, tracker, bp, steps, seed, _THREADED)


# ---------------------------------------------------------------------------- the policy


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one of bytes_per_s and bytes_per_step"),
    ({"bytes_per_s": 1, "bytes_per_step": 1}, "exactly one"),
    ({"bytes_per_step": 0}, "bytes_per_step must be a finite number"),
    ({"bytes_per_s": math.inf}, "bytes_per_s"),
    ({"bytes_per_step": 10, "scale": "row"}, "scale must be one of"),
    ({"bytes_per_step": 10, "weights": {"user": -1}}, r"weights\['user'\]"),
    ({"bytes_per_step": 10, "overdue_share": 0}, "overdue_share"),
    ({"bytes_per_step": 10, "max_age": -1}, "max_age"),
    ({"bytes_per_step": 10, "new_rows": "zero"}, "new_rows"),
    ({"bytes_per_step": 10, "window": 0}, "window"),
    ({"bytes_per_step": 10, "wide_dtype": "f64"}, "wide_dtype must be None or one of"),
    ({"bytes_per_s": 10, "max_worker_share": 0}, "max_worker_share must be a finite number"),
    ({"bytes_per_s": 10, "max_worker_share": 1.5}, "max_worker_share"),
    ({"bytes_per_s": 10, "max_worker_share": "half"}, "max_worker_share"),
    ({"bytes_per_s": 10, "read_decay": 1.0}, r"read_decay must be None or a number in \(0, 1\)"),
    ({"bytes_per_s": 10, "read_decay": 0}, "read_decay"),
    ({"bytes_per_s": 10, "read_decay": True}, "read_decay"),
])
def test_policy_names_the_bad_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BudgetPolicy(**kwargs)


def test_policy_defaults_and_burst():
    p = BudgetPolicy(bytes_per_step=1000)
    assert (p.per_step, p.rate, p.burst) == (True, 1000.0, 4000.0)
    q = BudgetPolicy(bytes_per_s=5e5, burst_bytes=123)
    assert (q.per_step, q.rate, q.burst) == (False, 5e5, 123.0)
    assert BudgetPolicy(bytes_per_s=5e5).burst == 5e5  # one second's budget
    assert p.describe()["scale"] == "table" and p.describe()["per_byte"] is True
    # the worker's share: capped for a wall-clock budget, off for a per-step one (its rounds
    # follow steps, the same in every threading mode)
    assert (p.max_worker_share, q.max_worker_share) == (None, 0.05)
    assert BudgetPolicy(bytes_per_s=1, max_worker_share=None).max_worker_share is None
    assert p.read_decay == 0.9 and p.describe()["read_decay"] == 0.9  # keys weighted by reads


def test_token_bucket_caps_bursts_and_carries_debt():
    b = TokenBucket(100, 250)
    assert b.refill(1) == 100
    assert b.refill(10) == 250  # capped: idle time does not pile up
    assert b.spend(300) == -50  # debt
    assert b.refill(1) == 50
    assert b.added == 100 + 150 + 100 and b.spent == 300
    with pytest.raises(ValueError, match="units"):
        b.refill(-1)
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(0, 10)


# ---------------------------------------------------------------------------- ticks


def test_spends_the_budget_on_the_largest_errors_across_tables():
    model, tracker, serving, pub = setup({"a": 4, "b": 4})
    ids = torch.arange(10)
    # row i of a moves by (i + 1) / 10 per coordinate, row i of b by (i + 1.5) / 10
    move(model["a"], ids, ((ids + 1.0) / 10)[:, None].repeat(1, 4))
    move(model["b"], ids, ((ids + 1.5) / 10)[:, None].repeat(1, 4))
    tracker.step()
    row = wire.row_bytes(4, "f32")  # 24 bytes
    # room for 6 rows and two message headers (learnt overhead starts at a 256-byte guess)
    policy = BudgetPolicy(bytes_per_step=6 * row + 2 * 256, scale="none", per_byte=False)
    bp = _publisher(tracker, pub, "p", policy)
    tick = _tick(bp, 1)
    got = {t.table: t.ids.tolist() for t in tick.round.tables if t.published}
    assert got == {"a": [7, 8, 9], "b": [7, 8, 9]}  # the 6 largest errors, merged
    assert tick.bytes <= tick.tokens
    assert tick.carried == 14
    err = served_error(model, serving)
    # the bound is the largest error left: row 6 of b, moved by 0.75 per coordinate
    assert tick.table_bounds == pytest.approx({"a": 1.4, "b": 1.5})
    assert tick.bound == pytest.approx(1.5)
    for name in ("a", "b"):
        assert err[name].max() == pytest.approx(tick.table_bounds[name], rel=1e-6)
    # the carried rows come back with their FIRST state; the header estimate is learnt
    # now (~110 bytes, not 256), so the unspent tokens and the refill take all 14
    tick2 = _tick(bp, 2)
    got2 = {t.table: t.ids.tolist() for t in tick2.round.tables if t.published}
    assert got2 == {"a": list(range(7)), "b": list(range(7))}
    assert tick2.bound == 0.0
    assert all(e.max() == 0.0 for e in served_error(model, serving).values())


def test_bytes_stay_within_rate_times_ticks_plus_burst_and_track_the_rate():
    model, tracker, serving, pub = setup({"emb": 16, "bias": 1})
    rate, burst = 600.0, 1500.0
    bp = _publisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=rate,
                                                         burst_bytes=burst))
    g = torch.Generator().manual_seed(1)
    sent = 0
    for step in range(1, 201):
        ids = torch.randint(0, 100, (20,), generator=g).unique()
        move(model["emb"], ids, 0.1 * torch.randn(len(ids), 16, generator=g))
        move(model["bias"], ids, 0.01 * torch.randn(len(ids), 1, generator=g))
        tracker.step()
        sent += _tick(bp, step).bytes
        # a tick spends what its tokens allow; the learnt header estimate keeps any
        # overshoot within one header per table
        assert sent <= burst + rate * step + 2 * 256
    st = bp.stats()
    assert st["bytes"] == sent and st["steps"] == 200
    assert 0.9 * rate <= st["bytes_per_step"] <= rate + burst / 200
    assert st["bound"]["ticks"] == 200
    assert st["bound"]["p50"] <= st["bound"]["p99"] <= st["bound"]["max"]
    assert set(st["table_bounds"]) == {"emb", "bias"}


def test_tombstones_go_whatever_the_budget_and_do_not_starve_the_rows():
    """Every step inserts 150 ids; every 10 steps those inserted 10-20 steps before are
    evicted: their tombstones (8 bytes an id) alone need twice what the budget refills, a
    round's more than the bucket holds. They go in the next round whatever the budget and
    are not charged to it, nor to the message overhead the budget learns, so the rows still
    get the whole budget, round after round. (Charged, the bucket sank into a debt no refill
    paid back; counted as overhead, no row fitted a round again.)"""
    model, tracker, serving, pub = setup({"emb": 8})
    emb, rate, churn, steps = model["emb"], 600.0, 150, 120
    bp = _publisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=rate))
    g = torch.Generator().manual_seed(2)
    moved_sent = []  # per step: rows of the moving ids 0..99 published
    for step in range(1, steps + 1):
        emb.insert(torch.arange(churn) + 1000 + step * churn, torch.zeros(churn, 8))
        if step % 10 == 0 and step >= 20:
            emb.evict(torch.arange(10 * churn) + 1000 + (step - 19) * churn)
        ids = torch.randint(0, 100, (20,), generator=g).unique()
        move(emb, ids, 0.1 * torch.randn(len(ids), 8, generator=g))
        tracker.step()
        rec = _tick(bp, step)
        moved_sent.append(sum(int((t.ids < 100).sum()) for t in rec.round.tables)
                          if rec is not None else 0)
    st = bp.stats()
    assert st["tombstones"] >= churn * (steps - 20)
    tombstone_bytes = 8 * st["tombstones"]
    assert tombstone_bytes > 1.5 * rate * steps  # more than the budget on their own
    charged = st["bytes"] - tombstone_bytes  # rows, ids, headers
    assert 0.8 * rate * steps <= charged <= rate * steps + bp.policy.burst + 256
    assert sum(moved_sent[steps // 2:]) >= 100  # the rows kept going out to the end
    assert bp.stats()["bound"]["max"] < math.inf


def test_wire_v3_rows_are_costed_at_their_varint_ids_so_the_budget_buys_more_rows():
    """v3 sends these dense ids in ~1-2 bytes instead of 8: the budget learns each table's
    id bytes per row, still spends its rate, and publishes more rows for it than v2."""
    rate, steps, got = 300.0, 120, {}
    for version in (2, 3):
        model, tracker, serving, pub = setup({"emb": 4, "bias": 1})
        pub.wire_version = version
        bp = _publisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=rate))
        _train(model, tracker, bp, steps, seed=1)
        got[version] = st = bp.stats()
        assert 0.9 * rate <= st["bytes_per_step"] <= rate + bp.policy.burst / steps
        for name, dim in (("emb", 4), ("bias", 1)):
            values = wire.row_bytes(dim, "f32") - 8
            if version == 2:
                assert st["row_bytes"][name] == wire.row_bytes(dim, "f32")
            else:  # at least one byte an id, fewer than 8
                assert values + 1 <= st["row_bytes"][name] < values + 8
    assert got[3]["rows"] > got[2]["rows"]


@pytest.mark.parametrize("wide", [None, "i8"])
def test_wide_dtype_sends_wide_tables_in_it_and_costs_them_so(wide):
    """``wide_dtype="i8"``: a dim-8 table's rows go as i8 (8 + 4 bytes instead of 32 in
    f32), a dim-1 table stays f32 (i8 would cost 5 bytes, not 4); the budget costs each at
    its own dtype, and after a flush predictors hold every row within i8's bound."""
    model, tracker, serving, pub = setup({"emb": 8, "bias": 1})
    bp = _publisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=300, wide_dtype=wide))
    _train(model, tracker, bp, 40, seed=3)
    bp.flush(41)
    want = {"emb": wide or "f32", "bias": "f32"}
    assert pub.dtypes == {name: {d} for name, d in want.items()}
    assert bp.stats()["row_bytes"] == {name: float(wire.row_bytes(dim, want[name]))
                                       for name, dim in (("emb", 8), ("bias", 1))}
    err = served_error(model, serving)
    assert err["bias"].max() == 0.0
    rows = model["emb"].lookup(model["emb"].ids()).numpy()
    bound = np.abs(rows).max(axis=1) / 254 * np.sqrt(8) * (1 + 1e-5)  # L2 of [8] elements
    assert np.all(err["emb"] <= bound) and (err["emb"].max() > 0) == (wide == "i8")


def test_the_reported_bound_is_the_largest_served_error_after_every_tick():
    model, tracker, serving, pub = setup({"emb": 8, "bias": 1}, scale={"bias": 0.1})
    bp = _publisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=400))
    g = torch.Generator().manual_seed(2)
    for step in range(1, 60):
        ids = torch.randint(0, 100, (12,), generator=g).unique()
        move(model["emb"], ids, 0.05 * torch.randn(len(ids), 8, generator=g))
        move(model["bias"], ids, 0.005 * torch.randn(len(ids), 1, generator=g))
        tracker.step()
        tick = _tick(bp, step)
        err = served_error(model, serving)
        for name in ("emb", "bias"):
            # every served row is within the bound of its table; the bound is attained
            assert err[name].max() == pytest.approx(tick.table_bounds.get(name, 0.0),
                                                    rel=1e-5, abs=1e-7)
    final = bp.flush(60)
    assert final.round.final and final.carried == 0 and final.bound == 0.0
    assert all(e.max() == 0.0 for e in served_error(model, serving).values())
    assert sum(len(d) for d in tracker.get_delta("p").values()) == 0
    assert bp.stats()["final_rows"] == final.published > 0


def test_rows_predictors_already_hold_are_dropped_not_carried():
    model, tracker, serving, pub = setup({"a": 4})
    move(model["a"], [1, 2, 3], 0.0)  # looked up, unchanged
    tracker.step()
    tick = _tick(_publisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=10_000)), 1)
    assert (tick.published, tick.carried, tick.exact) == (0, 0, 3)
    assert tracker.get_delta("p") == {} or all(len(d) == 0
                                              for d in tracker.get_delta("p").values())


def test_new_rows_are_scored_against_the_zeros_predictors_serve():
    model, tracker, serving, pub = setup({"a": 4})
    with torch.no_grad():
        model["a"](torch.tensor([500]))  # inserted by a training-mode lookup
        model["a"].insert(torch.tensor([500]), torch.full((1, 4), 3.0))
    tracker.step()
    tick = _tick(_publisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=10_000,
                                                           scale="none")), 1)
    assert tick.published == 1
    assert serving["a"].lookup(np.array([500])).tolist() == [[3.0] * 4]


def test_a_cleared_table_is_cleared_at_the_predictors_too():
    """``HashTable.clear`` drops every row: predictors drop them as well (tombstones), and
    serve only what the trainer holds afterwards (before, they kept every cleared row)."""
    model, tracker, serving, pub = setup({"a": 4})
    bp = _publisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=10_000))
    move(model["a"], [1, 2], 0.5)  # pending or sent: either way gone after the clear
    tracker.step()
    _tick(bp, 1)
    model["a"].clear()
    move(model["a"], [7, 300], 0.25)  # back, fresh rows
    tracker.step()
    _tick(bp, 2)
    bp.flush(3)
    bp.close()
    assert sorted(serving["a"].ids().tolist()) == [7, 300]
    assert np.array_equal(serving["a"].lookup(np.array([7, 300])),
                          model["a"].lookup(torch.tensor([7, 300])).numpy())


def test_a_bias_table_does_not_starve_next_to_a_wide_table_with_scaled_errors():
    """dim-1 bias rows move 0.01 (their scale is 0.01), dim-64 rows move 0.1 per coordinate
    (scale 1): in raw L2 the wide rows always win and the bias rows starve; scaled, both
    tables' rows are equally far off and both get out."""
    def run(scale: str) -> dict[str, int]:
        model, tracker, serving, pub = setup({"wide": 64, "bias": 1},
                                              scale={"bias": 0.01})
        policy = BudgetPolicy(bytes_per_step=2000, scale=scale, per_byte=False, max_age=None)
        bp = _publisher(tracker, pub, "p", policy)
        sent = {"wide": 0, "bias": 0}
        g = torch.Generator().manual_seed(3)
        for step in range(1, 41):
            ids = torch.randperm(100, generator=g)[:20]
            move(model["wide"], ids, 0.1 * torch.randn(20, 64, generator=g))
            move(model["bias"], ids, 0.01 * torch.randn(20, 1, generator=g))
            tracker.step()
            for t in _tick(bp, step).round.tables:
                sent[t.table] += t.published
        return sent

    raw = run("none")
    assert raw["bias"] == 0 and raw["wide"] > 0  # starved
    scaled = run("table")
    assert scaled["bias"] > 0.3 * scaled["wide"] > 0


def test_overdue_rows_bound_the_wait_of_a_wide_table_ranked_per_byte():
    """Cheap bias rows that keep moving always win per byte; 20 dim-64 rows moved once
    would wait forever without ageing. With ``max_age`` every one of them is published
    within the docstring's bound ``max_age + (q + 1)·(⌈c / R⌉ + 1)``."""
    def run(max_age):
        model, tracker, serving, pub = setup({"wide": 64, "bias": 1})
        rate = 400.0
        bp = _publisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=rate,
                                                             max_age=max_age))
        move(model["wide"], torch.arange(20), 0.5)
        g = torch.Generator().manual_seed(4)
        out = {}
        for step in range(1, 81):
            move(model["bias"], torch.arange(50), 0.2 * torch.randn(50, 1, generator=g))
            tracker.step()
            for t in _tick(bp, step).round.tables:
                if t.table == "wide":
                    out.update(dict.fromkeys(t.ids.tolist(), step))
        return out, rate

    starved, _ = run(None)
    assert starved == {}  # the wide rows never win against the bias rows
    published, rate = run(5)
    assert sorted(published) == list(range(20))
    c = wire.row_bytes(64, "f32") + 256  # largest row + a message header (the first guess)
    q = 19  # all 20 rows were first carried at tick 1: 19 may be ahead of the last one
    bound = 1 + 5 + (q + 1) * (math.ceil(c / rate) + 1)
    assert max(published.values()) <= bound


def test_per_second_budget_uses_the_clock_and_min_interval_only_refills():
    model, tracker, serving, pub = setup({"a": 4})
    now = [0.0]
    bp = _publisher(tracker, pub, "p",
                         BudgetPolicy(bytes_per_s=1000, burst_bytes=5000, min_interval_s=0.5,
                                      max_worker_share=None),
                         clock=lambda: now[0])
    move(model["a"], torch.arange(50), 1.0)
    tracker.step()
    now[0] = 1.0
    first = _tick(bp, 1)
    assert first is not None and first.tokens == pytest.approx(1000)
    assert first.bytes <= 1000
    now[0] = 1.2
    assert _tick(bp, 2) is None  # too soon: refilled, nothing read
    now[0] = 1.6
    third = _tick(bp, 3)
    assert third is not None
    assert third.tokens == pytest.approx(1000 - first.bytes + 600)
    assert bp.stats()["ticks"] == 3


def test_a_failed_publish_keeps_every_undelivered_row_pending():
    model, tracker, serving, pub = setup({"a": 4, "b": 4}, fail_on="b")
    move(model["a"], torch.arange(5), 1.0)
    move(model["b"], torch.arange(5), 1.0)
    tracker.step()
    bp = _publisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=100_000))
    with pytest.raises(PublishError, match="broker down") as info:
        _tick(bp, 1)
    assert "5 rows not delivered are pending again" in "".join(info.value.__notes__)
    assert bp.stats()["pending"] == 5  # b's rows: not sent, pending in the publisher
    assert serving["a"].lookup(np.arange(5)).tolist() == model["a"].lookup(
        torch.arange(5)).tolist()  # sent before the failure
    pub.fail_on = None  # the broker is back: the next round delivers them
    final = bp.flush(2)
    assert final.published == 5 and bp.stats()["pending"] == 0
    assert all(e.max() == 0.0 for e in served_error(model, serving).values())


def test_id_only_tracking_is_refused_with_the_reason():
    model = torch.nn.ModuleDict({"a": HashTable(4, name="a")})
    tracker = DeltaTracker(model, consumers=["p"], mode=TrackingMode.ID_ONLY)
    move(model["a"], [1], 1.0)
    tracker.step()
    bp = _publisher(tracker, Loopback({"a": ServingTable("a", 4)}), "p",
                         BudgetPolicy(bytes_per_step=1000))
    with pytest.raises(ValueError, match="EMBEDDING"):
        _tick(bp, 1)
    assert tracker.get_delta("p")["a"].ids.tolist() == [1]  # handed back, not lost


@pytest.mark.gpu
def test_cuda_tables_publish_within_the_budget_and_flush_exactly():
    dev = torch.device("cuda")
    model = torch.nn.ModuleDict({"emb": HashTable(16, name="emb", device=dev),
                                 "bias": HashTable(1, name="bias", device=dev)})
    tracker = DeltaTracker(model, consumers=["p"], mode=TrackingMode.EMBEDDING)
    serving = {"emb": ServingTable("emb", 16), "bias": ServingTable("bias", 1)}
    bp = _publisher(tracker, Loopback(serving), "p", BudgetPolicy(bytes_per_step=800))
    g = torch.Generator(device=dev).manual_seed(0)
    for step in range(1, 30):
        ids = torch.randint(0, 200, (32,), device=dev, generator=g).unique()
        move(model["emb"], ids, 0.1 * torch.randn(len(ids), 16, device=dev, generator=g))
        move(model["bias"], ids, 0.01 * torch.randn(len(ids), 1, device=dev, generator=g))
        tracker.step()
        tick = _tick(bp, step)
        assert tick.bytes <= tick.tokens
    bp.flush(30)
    for name, t in model.items():
        ids = t.ids()
        assert np.array_equal(serving[name].lookup(ids.cpu().numpy()), t.lookup(ids).cpu().numpy())


@pytest.mark.parametrize("device", [
    pytest.param("cpu", id="cpu-as-recorded"),  # the accelerators' path on CPU tensors
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("consumers", [["p"], ["p", "snapshot"]])
@pytest.mark.parametrize("table", ["embedding", "hashtable"])
@pytest.mark.parametrize("kind", ["budget", "rounds"])
def test_an_accelerators_training_loop_never_syncs_in_its_ticks(mode, table, consumers, device,
                                                          kind, monkeypatch):
    """Train on CUDA, tick every step: under ``set_sync_debug_mode("error")`` any host
    sync raises. An ``nn.Embedding`` (lookups declared sparse) with SGD: the whole step,
    hooks and tick included; a ``HashTable`` (which reads back its own inserts) with
    deltastream's SparseAdam: the tracker's step and the tick. Then every touched row
    reaches the serving table exactly, and a second consumer reads every touched id. On
    the CPU the tables record every lookup as CUDA's do (no sync mode there). ``kind``: a
    BudgetPublisher, or a RoundPublisher (publish_delta's rounds every 3 steps)."""
    if mode != "threaded":
        pytest.skip("the hand-off only: a synchronous tick runs its round on this thread")
    monkeypatch.setattr(recorder, "records_as_is", lambda d: True)
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    batches = [torch.randint(0, 300, (256,), device=dev, generator=g) for _ in range(40)]
    if table == "embedding":
        emb = torch.nn.Embedding(300, 16, device=dev)
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        tracker = DeltaTracker(torch.nn.ModuleDict({"emb": emb}), consumers=consumers,
                               mode=TrackingMode.EMBEDDING, sparse_updates_only=["emb"])
    else:
        from deltastream.embedding.optim import SparseAdam
        emb = HashTable(16, name="emb", device=dev)
        model = torch.nn.ModuleDict({"emb": emb})
        batches = [b * 7919 + 11 for b in batches]  # ids that are not their positions
        emb(torch.arange(300, device=dev) * 7919 + 11)  # every id inserted before the loop
        opt = SparseAdam(model, lr=0.05)
        tracker = DeltaTracker(model, consumers=consumers, mode=TrackingMode.EMBEDDING)
    serving = {"emb": ServingTable("emb", 16)}
    bp = _publisher(tracker, Loopback(serving), "p", BudgetPolicy(bytes_per_step=4000)) \
        if kind == "budget" else RoundPublisher(
            tracker, Loopback(serving), "p", RoundPolicy(SelectionPolicy(k=60), every=3))
    whole_step = table == "embedding"

    def no_sync(on: bool):
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("error" if on else "default")

    try:
        for step, ids in enumerate(batches, start=1):
            no_sync(whole_step)
            loss = (emb(ids) - 1.0).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            no_sync(True)
            tracker.step()
            assert bp.tick(step) is None
            no_sync(False)
    finally:
        no_sync(False)
    bp.flush(len(batches) + 1, timeout=60)
    stats = bp.stats()
    bp.close()
    ids = torch.cat(batches).unique()
    want = emb.weight.detach()[ids] if table == "embedding" else emb.lookup(ids)
    assert stats["ticks"] == len(batches) and stats["deferred_ticks"] < len(batches)
    assert np.array_equal(serving["emb"].lookup(ids.cpu().numpy()), want.cpu().numpy())
    if "snapshot" in consumers:
        seen = tracker.get_delta("snapshot")["emb"].ids
        assert set(ids.tolist()) <= set(seen.tolist())
