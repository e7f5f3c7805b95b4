"""The dense-cost benchmark runs small against the test broker and reports what it says:
the copy per version against the step, and the worker's share."""

from __future__ import annotations

import pytest

from bench import dense_cost

pytestmark = pytest.mark.integration


def test_dense_cost_runs_small_and_reports_the_copy_against_the_step(broker):
    out = dense_cost.main(["--models", "demo", "--versions", "3", "--chunk", "2", "--rounds",
                           "1", "--every", "1", "--batch", "32",
                           "--servers", broker.bootstrap_servers])
    copy, worker = out
    assert copy["name"] == "dense_cost.demo.copy" and copy["unit"] == "ms/version"
    assert copy["params"] > 0 and copy["copy_p50_ms"] <= copy["copy_max_ms"]
    assert copy["ratio"] == pytest.approx(copy["value"] / copy["baseline"])
    assert copy["versions"] >= 1 and copy["worker_ms_per_version"] > 0
    assert worker["name"] == "dense_cost.demo.with_worker" and worker["pass"] is None
