"""bench._policy_sim: its byte counts are the wire's, its budgets hold, residuals converge."""

import numpy as np
import pytest

from bench._policy_sim import KINDS, READS, SimBudget, message_overhead
from deltastream import wire


@pytest.mark.parametrize("ids", [[0], [7, 8, 9], [3, 200, 70_000, 2**40], list(range(0, 5000, 3))])
@pytest.mark.parametrize("dim,dtype", [(32, "i8"), (1, "f16")])
@pytest.mark.parametrize("version", [3, 4])
def test_priced_bytes_are_the_wire_message_bytes(ids, dim, dtype, version):
    ids = np.asarray(ids, np.int64)
    rows = np.random.default_rng(0).normal(size=(ids.size, dim)).astype(np.float32)
    batch = wire.DeltaBatch(model="mf", table="item", shard=0, epoch=1_700_000_000_000,
                            seq=1000, step=1000,
                            ts=1_700_000_000_000_000_000, ids=ids, rows=rows, dtype=dtype)
    (msg,) = wire.encode(batch, version=version, max_message_bytes=1 << 24)
    value = dim + 4 if dtype == "i8" else 2 * dim
    assert message_overhead("item", dim, dtype, ids, version) \
        + wire.id_bytes(ids, version) + ids.size * value == len(msg)


ALL = {"item": np.arange(50), "item_bias": np.arange(50)}  # every row touched


def _sim(kind, framing="per-table", rate=400.0, reads="none"):
    dims, sizes = {"item": 16, "item_bias": 1}, {"item": 50, "item_bias": 50}
    return SimBudget(kind, framing, rate, dims, sizes, reads=reads)


@pytest.mark.parametrize("kind,reads", [(k, "none") for k in KINDS]
                         + [("res1", r) for r in READS[1:]])
@pytest.mark.parametrize("framing", ["per-table", "one"])
def test_bytes_stay_within_the_bucket(kind, framing, reads):
    sim, rng = _sim(kind, framing, reads=reads), np.random.default_rng(1)
    seen = {"item": np.ones(50, bool), "item_bias": np.ones(50, bool)}
    for step in range(1, 41):
        cur = {"item": rng.normal(size=(50, 16)).astype(np.float32),
               "item_bias": rng.normal(size=(50, 1)).astype(np.float32)}
        sim.tick(cur, seen, ALL)
        assert sim.sent["bytes"] <= 400.0 * step
    assert sim.sent["bytes"] > 0.8 * 400.0 * 40  # and the budget is spent


def test_residuals_converge_to_a_row_that_stops_changing():
    sim, rng = _sim("res1", rate=10_000.0), np.random.default_rng(2)
    cur = {"item": rng.normal(size=(50, 16)).astype(np.float32),
           "item_bias": rng.normal(size=(50, 1)).astype(np.float32)}
    seen = {"item": np.ones(50, bool), "item_bias": np.ones(50, bool)}
    errors = []
    for _ in range(30):
        sim.tick(cur, seen, ALL)
        errors.append(float(np.abs(sim.held["item"] - cur["item"]).max()))
    assert errors[-1] < 0.05 * errors[0]
    assert (np.diff(errors) <= 1e-6).all()  # the largest error never grows


def test_i8_rows_are_within_the_dtype_error_bound():
    sim, rng = _sim("i8", rate=10_000.0), np.random.default_rng(3)
    cur = {"item": rng.normal(size=(50, 16)).astype(np.float32),
           "item_bias": rng.normal(size=(50, 1)).astype(np.float32)}
    sim.tick(cur, {"item": np.ones(50, bool), "item_bias": np.ones(50, bool)}, ALL)
    bound = np.abs(cur["item"]).max(1, keepdims=True) / 254 + 1e-7
    assert (np.abs(sim.held["item"] - cur["item"]) <= bound).all()
    assert np.array_equal(sim.held["item_bias"], cur["item_bias"].astype(np.float16)
                          .astype(np.float32))


@pytest.mark.parametrize("reads", READS[1:])
def test_read_weights_send_the_row_read_more_often_first(reads):
    # row 0 of "item" was touched every step, row 1 once; row 1 ends with a slightly larger
    # error. The bucket pays for one row: unweighted, row 1 goes; weighted by reads, row 0.
    dims, sizes = {"item": 16}, {"item": 2}
    for weighted in (False, True):
        sim = SimBudget("res1", "per-table", 0.0, dims, sizes,
                        reads=reads if weighted else "none")
        seen, cur = {"item": np.ones(2, bool)}, {"item": np.zeros((2, 16), np.float32)}
        for step in range(10):
            sim.tick(cur, seen, {"item": np.array([0, 1] if step == 0 else [0])})
        cur["item"][0], cur["item"][1] = 1.0, 1.01
        sim.rate = sim.overhead["item"] + sim.value_bytes("item") + 2  # one row's bytes
        sim.tick(cur, seen, {"item": np.array([], np.int64)})
        assert np.flatnonzero(sim.held["item"].any(1)).tolist() == ([0] if weighted else [1])
