"""The trainer-cost benchmark runs small against the test broker and reports, for every
configuration, the ratio against the step alone in the same run and what explains it."""

from __future__ import annotations

import math
import statistics

import pytest

from bench import trainer_cost

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("tables", [0, 3])
def test_trainer_cost_runs_small_and_reports_every_configuration(broker, tables, tmp_path):
    """The README's two-table model (``--tables 0``) and a model of three feature tables."""
    out = trainer_cost.main(["--batches", "64", "--rounds", "2", "--chunk", "12",
                             "--chunk-s", "0", "--rate-s", "0.5", "--budgets", "50000",
                             "--no-sync", "--no-thread", "--users", "2000", "--items", "500",
                             "--tables", str(tables), "--servers", broker.bootstrap_servers,
                             "--out", str(tmp_path)])
    by = {r["config"]: r for r in out}
    assert set(by) == {"tracker", "tracker-idle", "budget-50000", "delta-10", "rounds-10"}
    tag = f".t{tables}" if tables else ""
    for r in out:
        assert r["name"] == f"trainer_cost.{r['config']}.b64{tag}" and r["pairs"] == 2
        assert r["tables"] == (tables or 2)
        # the ratio is the median pair's, against the step alone measured in the same run
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["step_alone_ms"] > 0
        lo, hi = r["ratio_ci95"]
        assert lo <= r["ratio"] <= hi
        # the pairs themselves, whose median the ratio is
        assert len(r["pair_ratios"]) == 2 and r["ratio"] == statistics.median(r["pair_ratios"])
        assert r["faults_per_step"] >= 0 and r["faults_alone_per_step"] >= 0
        # where the steps took longer: the phases of the step, and the rest (the tick)
        assert set(r["extra_us"]) == {"forward", "backward", "optimizer", "rest"}
        assert all(math.isfinite(v) for v in r["extra_us"].values())
    for name in ("budget-50000", "rounds-10"):  # published off the loop, by a worker
        r = by[name]
        assert r["worker"] in ("process", "thread") and r["bytes_per_s"] > 0
        assert 0 <= r["tick_p50_ms"] <= r["tick_p99_ms"]
    assert by["delta-10"]["tick_p99_ms"] > 0 and by["delta-10"]["bytes_per_s"] > 0
    assert by["tracker"]["tick_p99_ms"] is None and by["tracker"]["bytes_per_s"] == 0
    # the picture of it all (matplotlib is a test dependency)
    png = tmp_path / f"trainer_cost{'_t3' if tables else ''}.png"
    assert all(r["plot"] == str(png) for r in out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
