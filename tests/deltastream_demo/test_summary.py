"""deltastream_demo.summary: the report dict from the trainers' final messages and the predictor's result."""

from __future__ import annotations

import pytest

from deltastream_demo.options import DemoOptions
from deltastream_demo.report import PNG_MAGIC, check_report
from deltastream_demo.summary import build_report, make_plots, merge_rounds


def _round(step: int, t: float, published: int, carried: int, final: bool = False) -> dict:
    return dict(step=step, t=t, final=final, tracked=published + carried, published=published,
                carried=carried, rejected=0, tombstones=0, messages=1, bytes=80 * published,
                seconds=0.01)


def _final(rank: int, rounds: list[dict]) -> dict:
    keys = ("tracked", "published", "carried", "rejected", "tombstones", "messages", "bytes")
    totals = {k: sum(r[k] for r in rounds) for k in keys}
    totals.update(rounds=len(rounds), final_flush=rounds[-1]["published"])
    return {"rank": rank, "steps": 20, "examples": 20 * 2 * 8, "train_seconds": 2.0 + rank,
            "flush_seconds": 0.1, "final_loss": 0.6, "losses": [[10, 0.65], [20, 0.6]],
            "rounds": rounds, "totals": totals, "left_after_flush": 0, "deferred_ticks": 0,
            "offsets": {rank: len(rounds)}, "dump": f"trainer-{rank}.npz",
            "heldout_start": 320, "rows_held": {"user": 10 + rank, "item": 5},
            "snapshots": {"count": 1, "last_step": 10, "seconds": 0.2 * (rank + 1)},
            "tracker": {}, "publisher": {}, "epoch": 100 + rank,
            # DensePublisher.stats(): rank 0 publishes the MLP, the other rank's is inactive
            "dense": {"active": rank == 0, "versions": 3 - 3 * rank, "full_versions": 1 - rank,
                      "messages": 3 - 3 * rank, "bytes": 900 - 900 * rank, "deferred": 0,
                      "copy_ms": {"p50": 0.01, "max": 0.02} if rank == 0 else None}}


def _result() -> dict:
    return {"drift": {"tables": {"user": {"ids_compared": 20, "missing_in_serving": 0},
                                 "item": {"ids_compared": 9, "missing_in_serving": 1}},
                      "ids_compared": 29, "missing_in_serving": 0, "missing_in_trainer": 0,
                      "max_abs": 1e-4, "tolerance": 2e-4, "rmse": 1e-5},
            "auc": {"serving": 0.7, "trainer": 0.7001, "dense_source": "stream",
                    "dense_version": [100, 20], "dense_age_s": 0.5, "dense_age_steps": 0},
            "freshness": {"p50": 0.01, "p95": 0.02, "p99": 0.03, "max": 0.05},
            "stats": {"gaps": 0, "quarantined": 0, "messages": 6, "dense_versions": 3,
                      "dense_incomplete": 0, "dense_unbased": 0}, "torch_imported": False,
            "bootstrap": {"ids": 15}, "apply_t": [0.5, 1.2, 1.4, 2.5],
            "apply_fresh": [0.01, 0.02, 0.03, 0.01]}


FINALS = {0: _final(0, [_round(10, 1.0, 5, 3), _round(20, 2.0, 4, 2), _round(20, 2.1, 6, 0,
                                                                             final=True)]),
          1: _final(1, [_round(10, 0.9, 7, 1), _round(20, 2.2, 2, 2), _round(20, 2.3, 3, 0,
                                                                             final=True)])}


def test_merge_rounds_sums_shards_per_step_final_flush_last():
    merged = merge_rounds(FINALS)
    assert [(r["step"], r["final"], r["t"], r["rows"], r["carried"]) for r in merged] == [
        (10, False, 0.9, 12, 4), (20, False, 2.0, 6, 4), (20, True, 2.1, 9, 0)]


def test_build_report_adds_up_the_ranks_and_passes_the_checks():
    opts = DemoOptions(workers=2, batch_size=8, steps=20)
    r = build_report(opts, FINALS, _result(), topic="deltas.demo", servers="h:1",
                     embedded=True, wall_s=5.0)
    assert r["rows"] == {"tracked": 35, "published": 27, "carried": 8, "rejected": 0,
                         "exact": 0, "tombstones": 0, "final_flush": 9, "rounds": 3,
                         "unique_published": 30, "left_after_flush": 0,
                         "deferred_ticks": 0}
    assert r["train"]["seconds"] == 3.0 and r["train"]["examples_per_s"] == pytest.approx(
        320 / 3.0)
    assert r["train"]["rows_held"] == {"user": 21, "item": 10}
    assert r["wire"]["bytes"] == 80 * 27 and r["wire"]["bytes_per_row"] == 80.0
    assert r["snapshot"]["seconds"] == pytest.approx(0.4)
    assert r["config"]["topic"] == "deltas.demo" and r["config"]["embedded_broker"] is True
    assert [t["rank"] for t in r["trainers"]] == [0, 1]
    assert r["timeline"]["publish"][-1] == [20, 2.1, 9, 720, 1]
    # the dense section: the publishing rank's figures, the predictor's versions served
    assert r["dense"] == {"every_steps": opts.dense_every, "versions": 3, "full_versions": 1,
                          "messages": 3, "bytes": 900, "deferred": 0,
                          "copy_ms": {"p50": 0.01, "max": 0.02}, "served": 3,
                          "incomplete": 0, "unbased": 0}
    assert check_report(r) == []


EVALS = [{"step": 10, "t": 1.0, "n": 100, "auc": 0.7, "serving_auc": 0.68, "lag": 3,
          "dense_step": 5, "dense_age_steps": 4, "dense_age_s": 0.25},
         {"step": 20, "t": 2.0, "n": 100, "auc": 0.72}]  # the predictor never answered


def test_make_plots_draws_the_four_pngs(tmp_path):
    opts = DemoOptions(workers=2, batch_size=8, steps=20)
    r = build_report(opts, FINALS, _result(), topic="t", servers="h:1", embedded=False,
                     wall_s=5.0, evals=EVALS)
    made = make_plots(tmp_path, r, _result())
    assert sorted(p.rsplit("/", 1)[1] for p in made) == [
        "bound.png", "freshness.png", "learning.png", "published.png"]
    for p in made:
        assert open(p, "rb").read(8) == PNG_MAGIC


def test_timeline_has_the_auc_over_the_run_and_the_worst_bound_per_tick():
    finals = {r: dict(f) for r, f in FINALS.items()}
    finals[0]["bounds"] = [[1, 0.1, 0.5, False], [2, 0.2, 0.4, False], [20, 2.1, 0.0, True]]
    finals[1]["bounds"] = [[1, 0.15, 0.7, False], [2, 0.25, 0.1, False]]
    opts = DemoOptions(workers=2, batch_size=8, steps=20)
    r = build_report(opts, finals, _result(), topic="t", servers="h:1", embedded=False,
                     wall_s=5.0, evals=EVALS)
    assert r["timeline"]["auc"] == [[10, 1.0, 0.7, 0.68, 3, 5, 4, 0.25],
                                    [20, 2.0, 0.72, None, None, None, None, None]]
    assert r["timeline"]["bound"] == [[1, 0.1, 0.7, 0], [2, 0.2, 0.4, 0], [20, 2.1, 0.0, 1]]
    from deltastream_demo.report import format_report

    text = format_report(r)  # only the answered evaluation counts in the gap
    assert "AUC gap trainer − serving mean / max" in text and "0.0200 / 0.0200" in text
    # the dense version scored with at step 10 was step 5's, 4 steps behind the rows, 0.25 s
    assert "dense version age mean / max" in text and "4 / 4 steps, 0.25 / 0.25 s" in text
    assert "not scored" not in text  # step 20 was not answered at all: not counted
    r["timeline"]["auc"].append([30, 3.0, 0.73, None, 2, None, None, None])  # no version
    assert "1 not scored: no dense version yet" in format_report(r)


def test_budget_section_reports_the_budget_bytes_per_s_and_the_error_bound():
    from deltastream_demo.report import format_report
    from deltastream_demo.summary import budget_summary

    def stats(sent, p99, tmax):
        return {"bytes": sent, "final_bytes": 10, "overdue_rows": 1,
                "bound": {"p50": 0.1, "p99": p99, "max": p99 * 2},
                "table_bounds": {"user": {"p50": 0.01, "p99": 0.02, "max": tmax}}}

    b = budget_summary(1000.0, [stats(4000, 0.3, 0.5), stats(2000, 0.4, 0.2)], 2.0)
    assert b["bytes_per_s"] == 1000.0 and b["sent_bytes_per_s"] == 1500.0  # per trainer
    assert b["bound"] == {"p50": 0.1, "p99": 0.4, "max": 0.8}  # the worst trainer
    assert b["table_bounds"]["user"]["max"] == 0.5 and b["final_bytes"] == 20
    assert budget_summary(0.0, [stats(1, 1, 1)], 1.0) is None  # fixed rounds
    opts = DemoOptions(workers=2, batch_size=8, steps=20)
    r = build_report(opts, FINALS, _result(), topic="deltas.demo", servers="h:1",
                     embedded=True, wall_s=5.0)
    r["budget"] = b
    text = format_report(r)
    assert "publish budget" in text and "1000 B/s per trainer" in text
    assert "error bound p50 / p99 / max" in text and "0.1 / 0.4 / 0.8" in text
    assert "user (L2) p50 / p99 / max" in text
    r["rows"]["exact"] = 2  # dropped by the budget publisher: accounted for
    r["rows"]["tracked"] += 2
    assert check_report(r) == []
