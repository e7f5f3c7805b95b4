"""bench._policy_sim: its byte counts are the wire's, its budgets hold, residuals converge."""

import numpy as np
import pytest

from bench._policy_sim import KINDS, SimBudget, message_overhead
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


def _sim(kind, framing="per-table", rate=400.0):
    dims, sizes = {"item": 16, "item_bias": 1}, {"item": 50, "item_bias": 50}
    return SimBudget(kind, framing, rate, dims, sizes)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("framing", ["per-table", "one"])
def test_bytes_stay_within_the_bucket(kind, framing):
    sim, rng = _sim(kind, framing), np.random.default_rng(1)
    seen = {"item": np.ones(50, bool), "item_bias": np.ones(50, bool)}
    for step in range(1, 41):
        cur = {"item": rng.normal(size=(50, 16)).astype(np.float32),
               "item_bias": rng.normal(size=(50, 1)).astype(np.float32)}
        sim.tick(cur, seen)
        assert sim.sent["bytes"] <= 400.0 * step
    assert sim.sent["bytes"] > 0.8 * 400.0 * 40  # and the budget is spent


def test_residuals_converge_to_a_row_that_stops_changing():
    sim, rng = _sim("res1", rate=10_000.0), np.random.default_rng(2)
    cur = {"item": rng.normal(size=(50, 16)).astype(np.float32),
           "item_bias": rng.normal(size=(50, 1)).astype(np.float32)}
    seen = {"item": np.ones(50, bool), "item_bias": np.ones(50, bool)}
    errors = []
    for _ in range(30):
        sim.tick(cur, seen)
        errors.append(float(np.abs(sim.held["item"] - cur["item"]).max()))
    assert errors[-1] < 0.05 * errors[0]
    assert (np.diff(errors) <= 1e-6).all()  # the largest error never grows


def test_i8_rows_are_within_the_dtype_error_bound():
    sim, rng = _sim("i8", rate=10_000.0), np.random.default_rng(3)
    cur = {"item": rng.normal(size=(50, 16)).astype(np.float32),
           "item_bias": rng.normal(size=(50, 1)).astype(np.float32)}
    sim.tick(cur, {"item": np.ones(50, bool), "item_bias": np.ones(50, bool)})
    bound = np.abs(cur["item"]).max(1, keepdims=True) / 254 + 1e-7
    assert (np.abs(sim.held["item"] - cur["item"]) <= bound).all()
    assert np.array_equal(sim.held["item_bias"], cur["item_bias"].astype(np.float16)
                          .astype(np.float32))
