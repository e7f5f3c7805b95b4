"""The demo's report dict (``report.json``) and plots, from what the processes sent back.

:func:`build_report` combines the trainers' ``final`` messages (one per rank: counters,
publish rounds, snapshots) with the predictor's ``result`` (freshness, drift, AUC) into the
report that :mod:`deltastream_demo.report` writes, prints and checks; :func:`make_plots` draws its PNGs.
Torch-free: it runs in the demo's parent process.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from deltastream_demo import plots
from deltastream_demo import report as rpt
from deltastream_demo.options import DemoOptions

__all__ = ["build_report", "merge_rounds", "merge_bounds", "make_plots", "budget_summary",
           "dense_summary"]


def merge_rounds(finals: dict[int, dict]) -> list[dict]:
    """Publish rounds summed over shards, keyed by (step, final)."""
    by: dict[tuple[int, bool], dict] = {}
    for f in finals.values():
        for r in f["rounds"]:
            key = (int(r["step"]), bool(r["final"]))
            cur = by.setdefault(key, {"step": key[0], "final": key[1], "t": r["t"], "rows": 0,
                                      "bytes": 0, "messages": 0, "tracked": 0, "carried": 0})
            cur["t"] = min(cur["t"], r["t"])
            cur["rows"] += int(r["published"])
            cur["bytes"] += int(r["bytes"])
            cur["messages"] += int(r["messages"])
            cur["tracked"] += int(r["tracked"])
            cur["carried"] += int(r["carried"])
    return [by[k] for k in sorted(by, key=lambda k: (k[1], k[0]))]


def budget_summary(budget: float, stats: list, train_s: float) -> dict | None:
    """The byte budget's report section from each trainer's ``BudgetPublisher.stats()``:
    budget and bytes/s per trainer, and the serving-error bound (normalized, and per table
    in embedding units) — p50 / p99 of the worst trainer, max over all. ``None`` when the
    demo ran fixed rounds."""
    stats = [s for s in stats if s]
    if not budget or not stats:
        return None

    def worst(get, key):
        vals = [get(s).get(key) for s in stats if get(s) and get(s).get(key) is not None]
        return max(vals) if vals else None

    tables = sorted({t for s in stats for t in s.get("table_bounds", {})})
    sent = sum(int(s["bytes"]) for s in stats)
    return {
        "bytes_per_s": float(budget), "trainers": len(stats),
        "sent_bytes": sent, "final_bytes": sum(int(s["final_bytes"]) for s in stats),
        "sent_bytes_per_s": sent / len(stats) / train_s if train_s > 0 else None,
        "overdue_rows": sum(int(s["overdue_rows"]) for s in stats),
        "bound": {q: worst(lambda s: s.get("bound"), q) for q in ("p50", "p99", "max")},
        "table_bounds": {t: {q: worst(lambda s, t=t: s.get("table_bounds", {}).get(t), q)
                             for q in ("p50", "p99", "max")} for t in tables},
    }


def dense_summary(every_steps: int, finals: dict[int, dict], stats: dict) -> dict:
    """The report's ``dense`` section: the cadence (steps), what the publishing rank sent
    (its ``DensePublisher.stats()``: versions, full ones, messages, bytes, deferred, the
    training thread's copy time in ms) and what the predictor's daemon assembled
    (``stats``: versions served, never complete, without their base)."""
    pub = next((f["dense"] for f in finals.values() if (f.get("dense") or {}).get("active")),
               {})
    return {"every_steps": int(every_steps),
            **{k: pub.get(k) for k in ("versions", "full_versions", "messages", "bytes",
                                       "deferred", "copy_ms")},
            "served": stats.get("dense_versions"), "incomplete": stats.get("dense_incomplete"),
            "unbased": stats.get("dense_unbased")}


def _sharding(opts: DemoOptions, f0: dict) -> dict:
    """The report's ``sharding`` key, the plan one line per table: ``--sharding
    table|column``, or DMP's plan with ``--model-kind torchrec``; none for HashTables
    sharded by row (the tables are unchanged)."""
    if f0.get("plan"):
        return {"sharding": {"kind": opts.sharding, "plan": list(f0["plan"])}}
    if f0.get("model_plan"):
        return {"sharding": {"kind": f"torchrec {opts.sharding}",
                             "plan": list(f0["model_plan"])}}
    return {}


def merge_bounds(finals: dict[int, dict]) -> list[list]:
    """The serving-error bound per budget tick, ``[step, t s, bound, final]``, the worst
    trainer per (step, final); empty when no trainer ran a budget."""
    by: dict[tuple[int, bool], list] = {}
    for f in finals.values():
        for step, t, bound, final in f.get("bounds") or []:
            cur = by.get((int(step), bool(final)))
            if cur is None:
                by[(int(step), bool(final))] = [int(step), float(t), float(bound), int(final)]
            else:
                cur[1], cur[2] = min(cur[1], float(t)), max(cur[2], float(bound))
    return [by[k] for k in sorted(by, key=lambda k: (k[1], k[0]))]


def _timeline(finals: dict[int, dict], rounds: list[dict], result: dict,
              evals: Optional[list[dict]]) -> dict:
    """The report's ``timeline``: publish rounds, freshness per second, rank 0's loss,
    the progressive evaluations ``[step, t, trainer AUC, serving AUC, lag, dense step,
    dense age steps, dense age s]`` (the dense version the predictor scored with) and the
    error bound per budget tick."""
    f0 = finals[sorted(finals)[0]]
    return {
        "publish": [[r["step"], r["t"], r["rows"], r["bytes"], int(r["final"])]
                    for r in rounds],
        "freshness": [list(s) for s in plots.freshness_series(
            result["apply_t"], result["apply_fresh"], bin_s=1.0)],
        "loss": f0.get("losses", []),
        "auc": [[e.get("step"), e.get("t"), e.get("auc"), e.get("serving_auc"),
                 e.get("lag"), e.get("dense_step"), e.get("dense_age_steps"),
                 e.get("dense_age_s")]
                for e in evals or []],
        "bound": merge_bounds(finals),
    }


def build_report(opts: DemoOptions, finals: dict[int, dict], result: dict, *, topic: str,
                 servers: str, embedded: bool, wall_s: float,
                 evals: Optional[list[dict]] = None) -> dict:
    """The report dict (``report.json``) from the trainers' final messages, the
    predictor's result and the progressive evaluations ``evals`` (per step: the trainer's
    ``auc``, the predictor's ``serving_auc`` and ``lag``)."""
    from deltastream.wire import row_bytes

    ranks = sorted(finals)
    f0 = finals[ranks[0]]
    totals = {k: sum(int(finals[r]["totals"].get(k, 0)) for r in ranks)
              for k in f0["totals"]}
    train_s = max(float(finals[r]["train_seconds"]) for r in ranks)
    examples = int(f0["examples"])
    published = totals["published"]
    uniq = sum(int(v.get("ids_compared", 0)) + int(v.get("missing_in_serving", 0))
               for v in result["drift"]["tables"].values())
    rounds = merge_rounds(finals)
    auc = dict(result["auc"])
    cfg = asdict(opts)
    cfg.update(topic=topic, bootstrap_servers=servers, embedded_broker=embedded,
               steps=opts.resolved_steps, batch_size=opts.resolved_batch_size)
    boot = result.get("bootstrap") or {}
    if f0.get("plan"):  # a column shard holds part of every row: no per-rank base snapshots
        boot = {"skipped": f"base snapshots need --sharding row (this run: {opts.sharding})"}
    # a column shard's message carries its columns: the narrowest shard bounds bytes per row
    payload_dim = opts.dim // opts.workers if opts.sharding == "column" else opts.dim
    return {
        "version": rpt.REPORT_VERSION,
        "kind": "deltastream-demo",
        "created_at": time.time(),
        "config": cfg,
        "stream": opts.stream_config().to_dict(),
        "train": {
            "steps": int(f0["steps"]), "examples": examples, "seconds": train_s,
            "device": f0.get("device"), "kernels": f0.get("kernels"),
            "examples_per_s": examples / train_s if train_s > 0 else None,
            "final_loss": f0["final_loss"], "flush_seconds": max(
                float(finals[r]["flush_seconds"]) for r in ranks),
            "wall_seconds": wall_s,
            "loop_split": f0.get("loop_split"),
            "rows_held": {name: sum(int(finals[r]["rows_held"][name]) for r in ranks)
                          for name in f0["rows_held"]},
        },
        "rows": {
            "tracked": totals["tracked"], "published": published,
            "carried": totals["carried"], "rejected": totals["rejected"],
            "exact": totals.get("exact", 0),
            "tombstones": totals["tombstones"], "final_flush": totals["final_flush"],
            "rounds": int(f0["totals"]["rounds"]), "unique_published": uniq,
            "left_after_flush": sum(int(finals[r]["left_after_flush"]) for r in ranks),
            "deferred_ticks": sum(int(finals[r]["deferred_ticks"]) for r in ranks),
        },
        "wire": {
            "dtype": opts.wire_dtype, "messages": totals["messages"], "bytes": totals["bytes"],
            "bytes_per_row": totals["bytes"] / published if published else None,
            "row_payload_bytes": row_bytes(payload_dim, opts.wire_dtype),
            "rows_per_s": published / train_s if train_s > 0 else None,
            "full_rows_bytes": row_bytes(opts.dim, "f32") * published,
        },
        "budget": budget_summary(opts.publish_budget, [finals[r].get("budget") for r in ranks],
                                 train_s),
        "freshness_s": result["freshness"],
        "drift": {k: v for k, v in result["drift"].items()},
        "auc": auc,
        "dense": dense_summary(opts.dense_every, finals, result["stats"]),
        "predictor": dict(result["stats"], torch_imported=result["torch_imported"]),
        **_sharding(opts, f0),
        "snapshot": {"count": int(f0["snapshots"]["count"]),
                     "last_step": f0["snapshots"]["last_step"],
                     "seconds": max(float(finals[r]["snapshots"]["seconds"]) for r in ranks),
                     "bootstrap": boot},
        "trainers": [{"rank": r, "epoch": finals[r]["epoch"], "offsets": finals[r]["offsets"],
                      "tracker": finals[r].get("tracker"),
                      "publisher": finals[r].get("publisher")} for r in ranks],
        "timeline": _timeline(finals, rounds, result, evals),
    }


def make_plots(out: Path, report: dict, result: dict) -> list[str]:
    """Draw into ``out``: ``learning.png`` (loss; serving vs trainer AUC over the run),
    ``published.png`` (bytes/s and rows/s against the budget), ``freshness.png`` and
    ``bound.png`` (the serving-error bound over time); the paths drawn (none without
    matplotlib)."""
    tl = report["timeline"]
    flush = [r for r in tl["publish"] if r[4]]
    budget = report.get("budget") or {}
    made = [
        plots.plot_learning(out / "learning.png", tl, report.get("auc") or {},
                            final_step=report["train"]["steps"]),
        plots.plot_rates(out / "published.png", tl["publish"],
                         budget_bytes_per_s=float(budget.get("bytes_per_s") or 0.0),
                         trainers=int(report["config"]["workers"])),
        plots.plot_freshness(out / "freshness.png", result["apply_t"], result["apply_fresh"],
                           bin_s=1.0, flush_t=min(r[1] for r in flush) if flush else None),
        plots.plot_bound(out / "bound.png", tl.get("bound") or []),
    ]
    return [str(p) for p in made if p is not None]
