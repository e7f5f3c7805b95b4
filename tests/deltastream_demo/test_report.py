"""deltastream_demo.report: report.json, the printed table, the invariants and the plots."""

from __future__ import annotations

import numpy as np
import pytest

from deltastream_demo.report import (
    PNG_MAGIC,
    check_report,
    format_report,
    freshness_series,
    plot_freshness,
    plot_published,
    read_report,
    write_report,
)


def _good_report() -> dict:
    return {
        "config": {"workers": 2, "batch_size": 8, "topk_fraction": 0.5},
        "train": {"steps": 10, "examples": 160, "seconds": 1.0, "examples_per_s": 160.0},
        "rows": {"tracked": 100, "published": 60, "carried": 39, "rejected": 1,
                 "left_after_flush": 0},
        "wire": {"bytes_per_row": 80.0, "row_payload_bytes": 72, "dtype": "f16"},
        "freshness_s": {"p50": 0.01, "p95": 0.02, "p99": 0.03},
        "drift": {"ids_compared": 60, "missing_in_serving": 0, "missing_in_trainer": 0,
                  "max_abs": 1e-4, "tolerance": 2e-4, "rmse": 1e-5},
        "auc": {"serving": 0.70, "trainer": 0.7001, "dense_source": "stream"},
        "predictor": {"gaps": 0, "quarantined": 0, "torch_imported": False},
    }


def test_check_report_accepts_a_consistent_report_and_names_each_violation():
    r = _good_report()
    assert check_report(r) == []
    assert "rows tracked" in format_report(dict(r, invariants={"problems": []}))
    cases = [
        (("rows", "published"), 101, "published"),
        (("rows", "carried"), 10, "published + carried"),
        (("freshness_s", "p95"), 0.001, "ordered"),
        (("freshness_s", "p50"), None, "missing"),
        (("drift", "max_abs"), 1.0, "differ"),
        (("drift", "missing_in_serving"), 3, "missing in the serving"),
        (("auc", "serving"), 0.69, "AUC"),
        (("auc", "dense_source"), "none", "no streamed dense version"),
        (("predictor", "torch_imported"), True, "torch"),
        (("wire", "bytes_per_row"), 10.0, "bytes per row"),
    ]
    for (sec, key), value, words in cases:
        bad = _good_report()
        bad[sec][key] = value
        problems = check_report(bad)
        assert problems and any(words in p for p in problems), (sec, key, problems)
    assert check_report({}) != []


def test_write_and_read_report_turn_nan_into_null(tmp_path):
    r = _good_report()
    r["auc"]["ceiling"] = float("nan")
    r["timeline"] = {"x": np.arange(3)}
    path = write_report(r, tmp_path)
    back = read_report(tmp_path)
    assert path.name == "report.json" and back["auc"]["ceiling"] is None
    assert back["timeline"]["x"] == [0, 1, 2]


def test_plots_are_png(tmp_path):
    t = np.linspace(0, 10, 200)
    f = 0.01 + 0.001 * np.arange(200) % 0.05
    p1 = plot_freshness(tmp_path / "f.png", t, f)
    p2 = plot_published(tmp_path / "p.png", [10, 20, 30, 30], [5, 6, 7, 40],
                        [500, 600, 700, 4000], final_step=30)
    p3 = plot_freshness(tmp_path / "empty.png", [], [])
    for p in (p1, p2, p3):
        assert p is not None and p.read_bytes()[:8] == PNG_MAGIC


def test_freshness_series_bins():
    s = freshness_series(np.array([0.1, 0.2, 1.5, 3.9]), np.array([1.0, 3.0, 2.0, 4.0]))
    assert [(b, n) for b, n, *_ in s] == [(0.0, 2), (1.0, 1), (3.0, 1)]
    assert s[0][4] == 3.0 and s[0][2] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        freshness_series(np.zeros(2), np.zeros(3))


def test_report_shows_the_plan_only_for_table_and_column_sharding():
    r = _good_report()
    assert "sharding" not in format_report(r) and "plan" not in format_report(r)
    r["sharding"] = {"kind": "column", "plan": [
        "user (dim 16, column): s0 r0 cols 0-8 | s1 r1 cols 8-16"]}
    text = format_report(r)
    assert "sharding" in text and "column" in text
    assert "user (dim 16, column): s0 r0 cols 0-8 | s1 r1 cols 8-16" in text
