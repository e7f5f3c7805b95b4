"""BudgetPolicy(residuals=True): ranked rows go as 1-bit residuals (wire ``r1``, or ``r1e``
with a publisher writing v5) added to what predictors hold, and the trainer's mirror of
what they hold stays exact.

Rows travel through the real wire codec (v4, and v5: every test runs with both) into ``consumers.ServingTable`` s; whole rows
are f32, so a row predictors got whole is exact, and a row still pending differs from the
trainer by exactly the error the publisher reports for it (its mirror is bit-exact).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastream import PublishError
from deltastream.publishing.budget import BudgetPolicy, BudgetPublisher
from tests.deltastream.publishing.budget_cases import (
    Loopback,
    move,
    served_error,
    setup,
    tick,
    train,
)


@pytest.fixture(params=["sync", "threaded"])
def threaded(request) -> bool:
    return request.param == "threaded"


#: wire version -> the residual dtype a budget publisher writing it sends
RESIDUAL = {4: "r1", 5: "r1e"}


@pytest.fixture(params=sorted(RESIDUAL))
def version(request) -> int:
    return request.param


def _residual_setup(version: int, n: int = 100):
    return setup({"u": 32, "b": 1}, n=n, wire_version=version)


def _check_mirror(model, serving, bp: BudgetPublisher) -> None:
    """What predictors hold differs from the trainer by exactly what the publisher believes:
    its largest pending error per table is the largest real error (0 when none pending)."""
    got = served_error(model, serving)
    bounds = bp.last.table_bounds if bp.last is not None else {}
    for name, err in got.items():
        assert err.max() == pytest.approx(bounds.get(name, 0.0), rel=1e-6, abs=1e-7), name


def test_policy_fields_and_publisher_needs_wire_v4():
    with pytest.raises(ValueError, match="whole_every must be an int >= 1"):
        BudgetPolicy(bytes_per_step=100, residuals=True, whole_every=0)
    with pytest.raises(TypeError, match="residuals must be a bool"):
        BudgetPolicy(bytes_per_step=100, residuals=1)
    model, tracker, serving, pub = setup({"u": 32})  # a v2 publisher
    with pytest.raises(ValueError, match="wire v4"):
        BudgetPublisher(tracker, pub, "p", BudgetPolicy(bytes_per_step=100, residuals=True))


def test_ranked_rows_go_as_residuals_and_the_mirror_stays_exact(threaded, version):
    model, tracker, serving, pub = _residual_setup(version)
    policy = BudgetPolicy(bytes_per_step=600, residuals=True, max_age=1000)
    bp = BudgetPublisher(tracker, pub, "p", policy, threaded=threaded)
    for seed in range(4):
        train(model, tracker, bp, 10, seed, threaded)
        _check_mirror(model, serving, bp)
    assert pub.dtypes["u"] == {RESIDUAL[version]} and pub.dtypes["b"] == {RESIDUAL[version]}
    assert bp.stats()["pending"] > 0  # residuals leave errors, ranked again
    bp.close()


def test_error_feedback_then_whole_rows_make_predictors_exact(threaded, version):
    """Rows that stop changing: residuals shrink their error, and when they are overdue
    they go whole, so predictors end exact without a flush."""
    model, tracker, serving, pub = _residual_setup(version)
    policy = BudgetPolicy(bytes_per_step=3000, residuals=True, max_age=20)
    bp = BudgetPublisher(tracker, pub, "p", policy, threaded=threaded)
    train(model, tracker, bp, 5, 0, threaded)
    first = served_error(model, serving)["u"].max()
    step = 5
    for _ in range(8):
        step += 1
        tracker.step()
        tick(bp, step, threaded)
        _check_mirror(model, serving, bp)
    assert 0 < served_error(model, serving)["u"].max() < first
    for _ in range(30):
        step += 1
        tracker.step()
        tick(bp, step, threaded)
    assert bp.stats()["pending"] == 0
    assert all(err.max() == 0 for err in served_error(model, serving).values())
    assert "f32" in pub.dtypes["u"]  # the overdue rows went whole
    bp.close()


def test_a_row_evicted_and_inserted_again_starts_from_zeros(version):
    """The tracker folds an eviction into the re-insert (no tombstone): the residual carries
    ``fresh``, so predictors drop the old row they hold instead of adding to it."""
    model, tracker, serving, pub = _residual_setup(version)
    policy = BudgetPolicy(bytes_per_step=10_000, residuals=True, max_age=1000)
    bp = BudgetPublisher(tracker, pub, "p", policy, threaded=False)
    ids = torch.tensor([3, 7])
    for t in model.values():
        t.evict(ids)
        move(t, ids, 0.25)  # looked up again: a new row (zeros here) moved by 0.25
    tracker.step()
    assert serving["u"].contains(ids.numpy()).all()  # predictors still hold the old rows
    bp.tick(1)
    _check_mirror(model, serving, bp)
    got = serving["u"].lookup(ids.numpy())
    # from zeros: ±mean|0.25| = 0.25 exactly (2^-2 is on r1e's grid too), nothing of the
    # old rows left
    assert np.array_equal(got, np.full((2, 32), 0.25, np.float32))
    bp.close()


@pytest.mark.parametrize("delivered", [False, True])
def test_a_failed_residual_send_goes_whole_next(delivered, version):
    """A residual send that failed — or whose acknowledgement was lost after predictors
    applied it — leaves their copy unknown; the rows go whole at the next round."""
    model, tracker, serving, pub = _residual_setup(version)
    policy = BudgetPolicy(bytes_per_step=10_000, residuals=True, max_age=1000)
    bp = BudgetPublisher(tracker, pub, "p", policy, threaded=False)
    train(model, tracker, bp, 3, 0)
    move(model["u"], torch.arange(10), 0.5)
    tracker.step()
    pub.fail_next = (RESIDUAL[version], delivered)
    with pytest.raises(PublishError):
        bp.tick(4)
    pub.log.clear()
    tracker.step()
    bp.tick(5)
    whole = {i for table, dtype, ids in pub.log if table == "u" and dtype == "f32"
             for i in ids}
    assert set(range(10)) <= whole
    _check_mirror(model, serving, bp)
    for i in range(10):  # exact again
        assert np.array_equal(serving["u"].lookup(np.array([i])),
                              model["u"].lookup(torch.tensor([i])).numpy())
    bp.close()


def test_flush_sends_whole_rows(version):
    model, tracker, serving, pub = _residual_setup(version)
    policy = BudgetPolicy(bytes_per_step=300, residuals=True, max_age=1000)
    bp = BudgetPublisher(tracker, pub, "p", policy, threaded=False)
    train(model, tracker, bp, 10, 0)
    assert bp.stats()["pending"] > 0
    bp.flush(11)
    assert bp.stats()["pending"] == 0
    assert all(err.max() == 0 for err in served_error(model, serving).values())
    bp.close()


def test_residuals_cost_fewer_bytes_for_the_same_rows(version):
    """At one budget a residual publisher reaches more rows than whole i8 rows would."""
    rows = {}
    for residuals in (False, True):
        model, tracker, serving, pub = _residual_setup(version, n=400)
        policy = BudgetPolicy(bytes_per_step=800, residuals=residuals, max_age=1000,
                              wide_dtype="i8")
        bp = BudgetPublisher(tracker, pub, "p", policy, threaded=False)
        train(model, tracker, bp, 20, 0)
        rows[residuals] = bp.stats()["rows"]
        assert isinstance(pub, Loopback)
        bp.close()
    assert rows[True] > 2 * rows[False]


def test_a_row_is_overdue_only_while_a_change_of_it_is_unsent(version):
    """max_age bounds how long a change waits for a send (whole or residual); what a
    residual left is not a change, so it never makes the row overdue (its next change
    does: ``test_pending``)."""
    model, tracker, serving, pub = _residual_setup(version)
    policy = BudgetPolicy(bytes_per_step=120, burst_bytes=2000, residuals=True, max_age=2,
                          whole_every=1000)
    bp = BudgetPublisher(tracker, pub, "p", policy, threaded=False)
    step = 0

    def ticks(k: int) -> list[int]:
        nonlocal step
        out = []
        for _ in range(k):
            step += 1
            tracker.step()
            rec = bp.tick(step)
            out.append(0 if rec is None else rec.overdue)
        return out

    ticks(20)  # a full bucket
    move(model["u"], torch.arange(60), 0.3)
    assert ticks(1) == [0] and pub.dtypes["u"] == {RESIDUAL[version]}
    assert sorted(pub.log[-1][2]) == list(range(60))  # every change went out
    assert bp.stats()["pending"] >= 60  # what the residuals left
    assert ticks(10) == [0] * 10  # ranked again, never overdue
    bp.close()


def test_a_residual_past_the_f16_scale_goes_whole_in_r1_only(version):
    """r1's scale is an f16: a row whose mean |residual| is past it goes whole; r1e's
    one-byte code spans every float32 scale of the message, so it goes as a residual."""
    model, tracker, serving, pub = _residual_setup(version)
    policy = BudgetPolicy(bytes_per_step=10_000, residuals=True)
    bp = BudgetPublisher(tracker, pub, "p", policy, threaded=False)
    move(model["u"], torch.tensor([3]), 1e5)  # a mean |residual| of 1e5: no f16 scale
    move(model["u"], torch.tensor([4]), 0.5)
    tracker.step()
    bp.tick(1)
    sent = {(dtype, i) for table, dtype, ids in pub.log if table == "u" for i in ids}
    r = RESIDUAL[version]
    assert ((r if version == 5 else "f32", 3) in sent) and (r, 4) in sent
    _check_mirror(model, serving, bp)
    bp.close()
