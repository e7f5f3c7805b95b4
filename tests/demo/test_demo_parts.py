"""The demo's building blocks: the synthetic stream, numpy scoring, the report helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from demo.data import ClickStream, StreamConfig, entity_ids
from demo.model import CTRModel, export_dense, local_tables
from demo.predictor import compare_rows, row_tolerance
from demo.report import (
    PNG_MAGIC,
    check_report,
    format_report,
    freshness_series,
    plot_freshness,
    plot_published,
    read_report,
    write_report,
)
from demo.scoring import RowTable, auc, logloss, mlp_logits, score

SMALL = StreamConfig(seed=3, n_users=2000, n_items=500)


# --------------------------------------------------------------------------- stream


def test_stream_is_reproducible_and_salted():
    a = ClickStream(SMALL).batch(1000, 256)
    b = ClickStream(SMALL).batch(1000, 256)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    c = ClickStream(SMALL).batch(1000, 256, salt=1)
    assert not np.array_equal(a.labels, c.labels) or not np.array_equal(a.item_ids, c.item_ids)
    # users are keyed by stream position: the same in every salt and every batch split
    np.testing.assert_array_equal(a.user_ids, c.user_ids)
    np.testing.assert_array_equal(ClickStream(SMALL).batch(1000, 128).user_ids,
                                  a.user_ids[:128])
    np.testing.assert_array_equal(a.positions, np.arange(1000, 1256))


def test_stream_shapes_ids_and_labels():
    b = ClickStream(SMALL).batch(0, 5000)
    assert b.user_ids.dtype == np.int64 and b.item_ids.dtype == np.int64
    assert (b.user_ids >= 0).all() and (b.item_ids >= 0).all()
    assert b.dense.shape == (5000, SMALL.n_dense) and b.dense.dtype == np.float32
    assert set(np.unique(b.labels)) <= {0.0, 1.0}
    assert 0.05 < b.labels.mean() < 0.95
    # the hidden model makes AUC meaningful: the true logits rank clicks well
    assert auc(b.labels, b.true_logits) > 0.8


def test_entity_ids_are_distinct():
    ids = entity_ids(np.arange(100_000), 12345)
    assert np.unique(ids).size == 100_000 and (ids >= 0).all()


def test_popularity_is_zipf_and_drifts():
    s = ClickStream(StreamConfig(seed=1, n_users=5000, n_items=2000, item_drift=0.0005,
                                 session_return=0.0))
    early = s.batch(0, 20_000)
    late = s.batch(400_000, 20_000)
    ids, counts = np.unique(early.item_ids, return_counts=True)
    top = ids[np.argsort(-counts)[:20]]
    # heavy head: the top 20 of 2000 items get a large share of the traffic
    assert counts[np.argsort(-counts)[:20]].sum() / counts.sum() > 0.3
    # the head moved: most early head items are no longer in the late head
    ids2, counts2 = np.unique(late.item_ids, return_counts=True)
    top2 = ids2[np.argsort(-counts2)[:20]]
    assert len(set(top) & set(top2)) < 10


def test_sessions_repeat_users():
    on = ClickStream(StreamConfig(seed=2, n_users=20_000, session_return=0.9,
                                  session_window=500)).batch(50_000, 5000)
    off = ClickStream(StreamConfig(seed=2, n_users=20_000, session_return=0.0)).batch(
        50_000, 5000)
    assert np.unique(on.user_ids).size < 0.6 * np.unique(off.user_ids).size


@pytest.mark.parametrize("bad", [dict(n_users=0), dict(user_zipf=0.0),
                                 dict(session_return=1.0), dict(concept_period=-1.0),
                                 dict(seed=-1)])
def test_stream_config_validation(bad):
    with pytest.raises(ValueError, match="StreamConfig"):
        StreamConfig(**bad)


def test_batch_argument_validation():
    s = ClickStream(SMALL)
    with pytest.raises(ValueError, match="count"):
        s.batch(0, 0)
    with pytest.raises(ValueError, match="start"):
        s.batch(-1, 10)


# --------------------------------------------------------------------------- scoring


def test_auc_matches_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    y = (rng.random(600) < 0.3).astype(np.float32)
    s = np.round(rng.random(600) + 0.4 * y, 1)  # many ties
    pos, neg = s[y > 0], s[y == 0]
    expect = ((pos[:, None] > neg[None, :]).sum()
              + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (pos.size * neg.size)
    assert auc(y, s) == pytest.approx(expect, abs=1e-12)
    assert np.isnan(auc(np.ones(5), np.arange(5.0)))


def test_logloss_is_stable():
    assert logloss(np.array([1.0, 0.0]), np.array([100.0, -100.0])) == pytest.approx(0, abs=1e-9)
    assert logloss(np.array([1.0]), np.array([0.0])) == pytest.approx(np.log(2))


def test_row_table_lookup_and_missing_ids():
    t = RowTable.concat([(np.array([5, 1]), np.array([[5.0, 5], [1, 1]])),
                         (np.array([9]), np.array([[9.0, 9]]))], 2)
    np.testing.assert_array_equal(t.lookup(np.array([9, 7, 1])), [[9, 9], [0, 0], [1, 1]])
    np.testing.assert_array_equal(t.ids(), [1, 5, 9])
    np.testing.assert_array_equal(t.contains(np.array([1, 2])), [True, False])
    with pytest.raises(ValueError, match="unique"):
        RowTable(np.array([1, 1]), np.zeros((2, 2)))


def test_numpy_scoring_matches_the_torch_model():
    torch.manual_seed(0)
    s = ClickStream(SMALL)
    m = CTRModel(8, SMALL.n_dense, hidden=(16, 8), seed=0)
    b = s.batch(0, 512)
    m(torch.from_numpy(b.user_ids), torch.from_numpy(b.item_ids), torch.from_numpy(b.dense))
    m.eval()
    ev = s.batch(512, 300)  # includes ids the tables never saw (read as zeros both ways)
    with torch.no_grad():
        want = m(torch.from_numpy(ev.user_ids), torch.from_numpy(ev.item_ids),
                 torch.from_numpy(ev.dense)).numpy()
    tabs = local_tables(m)
    rows = {n: RowTable(t.ids().numpy(), t.embeddings().numpy()) for n, t in tabs.items()}
    got = score(export_dense(m), rows["user"].lookup, rows["item"].lookup, ev.user_ids,
                ev.item_ids, ev.dense)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="w0"):
        mlp_logits({"b0": np.zeros(1)}, np.zeros((1, 1)))


def test_row_tolerance_and_compare_rows():
    from consumers.serving_table import ServingTable

    rng = np.random.default_rng(1)
    ids = np.arange(50, dtype=np.int64)
    rows = rng.normal(size=(50, 4)).astype(np.float32)
    trainer = RowTable(ids, rows)
    serving = ServingTable.from_arrays("t", ids[:40], rows[:40].astype(np.float16)
                                       .astype(np.float32))
    c = compare_rows(ids, serving, trainer, "f16")
    assert c["ids_compared"] == 40 and c["missing_in_serving"] == 10
    assert c["violations"] == 0 and 0 < c["max_abs"] <= c["tolerance"]
    assert row_tolerance(rows, "f32").max() == 0
    # a wrong row is caught
    serving.upsert(ids[:1], rows[:1] + 0.1)
    assert compare_rows(ids, serving, trainer, "f16")["violations"] > 0


# --------------------------------------------------------------------------- report


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
        "auc": {"serving": 0.70, "trainer": 0.7001},
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
