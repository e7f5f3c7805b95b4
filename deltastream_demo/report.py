"""The demo's report: a terminal table, ``report.json`` and PNG plots (torch-free).

:func:`write_report` writes ``report.json`` atomically; :func:`format_report` renders the
table printed at the end of ``deltastream demo``; :func:`check_report` lists broken
invariants (published ≤ tracked, serving rows equal to the trainer's after the final flush,
positive freshness, …) so the demo and its test judge a report the same way;
:func:`plot_freshness` and :func:`plot_published` (with their matplotlib helpers) live in
:mod:`deltastream_demo.plots` and are re-exported here. matplotlib is optional: without it
the plots are skipped with a warning and the report says so.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import numpy as np

# The plots and their matplotlib helpers live in .plots; re-exported here, where callers
# have imported them from.
from deltastream_demo.plots import (
    freshness_series,
    plot_freshness,
    plot_published,
    pyplot,
    save_png,
    time_bins,
)

__all__ = [
    "REPORT_VERSION",
    "write_report",
    "read_report",
    "format_report",
    "check_report",
    "plot_freshness",
    "plot_published",
    "freshness_series",
    "time_bins",
    "pyplot",
    "save_png",
    "PNG_MAGIC",
]

log = logging.getLogger(__name__)

REPORT_VERSION = 1
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _jsonable(x: Any) -> Any:
    """Plain JSON types; NaN/inf become None (JSON has neither)."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return [_jsonable(v) for v in x.tolist()]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        f = float(x)
        return f if math.isfinite(f) else None
    if isinstance(x, Path):
        return str(x)
    return x


def write_report(report: Mapping[str, Any], out_dir: str | os.PathLike) -> Path:
    """Write ``report`` to ``<out_dir>/report.json`` atomically (temp + fsync + rename)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    text = json.dumps(_jsonable(report), indent=2, sort_keys=False, allow_nan=False)
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".json", dir=out)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a report is an ordinary file
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def read_report(out_dir: str | os.PathLike) -> dict:
    """Read ``<out_dir>/report.json`` (or the file itself when a file path is given)."""
    p = Path(out_dir)
    if p.is_dir():
        p = p / "report.json"
    with open(p) as f:
        return json.load(f)


# --------------------------------------------------------------------------- table


def _num(v: Any, fmt: str = ".4g", unit: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}{unit}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "n/a"
        return f"{v:{fmt}}{unit}"
    return f"{v}{unit}"


def _ms(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v * 1e3:.1f} ms"


def _bytes(v: Optional[float]) -> str:
    if v is None:
        return "n/a"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= div:
            return f"{v / div:.2f} {unit}"
    return f"{int(v)} B"


def format_report(r: Mapping[str, Any]) -> str:
    """The human-readable report table (a few sections of ``label  value`` lines)."""
    g = lambda *keys: _get(r, *keys)  # noqa: E731 - short accessor for the table below
    rows: list[tuple[str, str]] = []
    for add in (_training_rows, _delta_rows, _wire_rows, _dense_rows, _run_auc_rows,
                _serving_rows, _extra_rows):
        add(r, g, rows)
    width = max(len(a) for a, _ in rows) + 2
    return "\n".join(a if not b and a.startswith("[") else f"  {a:<{width}}{b}"
                     for a, b in rows)


def _section(rows: list[tuple[str, str]], title: str) -> None:
    """Start a ``[title]`` section of the report table."""
    rows.append((f"[{title}]", ""))


def _training_rows(r: Mapping[str, Any], g: Any, rows: list[tuple[str, str]]) -> None:
    """Report rows of training: workers, device, steps, throughput, loss, sharding plan."""

    _section(rows, "training")
    rows += [
        ("workers × batch", f"{g('config', 'workers')} × {g('config', 'batch_size')}"),
        ("device", f"{g('train', 'device') or g('config', 'device') or 'n/a'}"
                   f" (Triton kernels: {_num(g('train', 'kernels'))})"),
        ("steps", _num(g("train", "steps"))),
        ("examples", _num(g("train", "examples"))),
        ("wall time", _num(g("train", "seconds"), ".1f", " s")),
        ("examples/s", _num(g("train", "examples_per_s"), ",.0f")),
        ("final loss", _num(g("train", "final_loss"), ".4f")),
    ]
    split, steps = g("train", "loop_split"), g("train", "steps")
    if split and steps:  # rank 0's loop, ms per step: where a slow run's time went
        rows.append(("loop, ms per step (rank 0)",
                     ", ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in split.items())))
    plan = g("sharding", "plan")
    if plan:  # --sharding table|column (row sharding: the table is unchanged)
        rows.append(("sharding", str(g("sharding", "kind"))))
        rows += [("  plan", str(line)) for line in plan]


def _delta_rows(r: Mapping[str, Any], g: Any, rows: list[tuple[str, str]]) -> None:
    """Report rows of deltas: rows tracked, published, carried, rejected; the budget or top-k."""

    _section(rows, "deltas")
    rows += [
        ("rows tracked (candidates, Σ rounds)", _num(g("rows", "tracked"))
         + "  (a row counts once per round it waits: not distinct rows)"),
        ("rows published", _num(g("rows", "published"))),
        ("  of which in the final flush", _num(g("rows", "final_flush"))),
        ("rows carried (retained, Σ rounds)", _num(g("rows", "carried"))),
        ("rows rejected (non-finite)", _num(g("rows", "rejected"))),
        ("distinct ids published", _num(g("rows", "unique_published"))),
        ("publish rounds", _num(g("rows", "rounds"))),
        ("ticks deferred (worker or last hand-off busy: rows wait in the tracker)",
         _num(g("rows", "deferred_ticks"))),
    ]
    if isinstance(g("budget"), Mapping):
        rows += [
            ("publish budget", f"{_bytes(g('budget', 'bytes_per_s'))}/s per trainer "
                               f"(byte-budgeted, every step)"),
            ("sent (excl. final flush)", f"{_bytes(g('budget', 'sent_bytes_per_s'))}/s per "
                                         f"trainer  (≈ the budget: it is all used)"),
            ("error bound p50 / p99 / max",
             " / ".join(_num(g("budget", "bound", q), ".3g") for q in ("p50", "p99", "max"))
             + "  (largest error a served row still has ÷ the table's RMS row norm: "
               "0 = serving exact, 1 = off by a typical row; lower is better, a larger "
               "budget lowers it)"),
        ]
        for name, b in sorted((g("budget", "table_bounds") or {}).items()):
            rows.append((f"  {name} (L2) p50 / p99 / max",
                         " / ".join(_num(b.get(q), ".3g") for q in ("p50", "p99", "max"))))
    else:
        rows.append(("top-k fraction", _num(g("config", "topk_fraction"))))


def _wire_rows(r: Mapping[str, Any], g: Any, rows: list[tuple[str, str]]) -> None:
    """Report rows of wire and predictor: messages, bytes, freshness, applied, quarantined."""

    _section(rows, "wire")
    rows += [
        ("messages", _num(g("wire", "messages"))),
        ("bytes", _bytes(g("wire", "bytes"))),
        ("bytes per row", _num(g("wire", "bytes_per_row"), ".1f")
         + f"  (row payload {_num(g('wire', 'row_payload_bytes'))} B, dtype "
           f"{g('wire', 'dtype')})"),
        ("rows published/s", _num(g("wire", "rows_per_s"), ",.0f")),
    ]
    _section(rows, "predictor")
    rows += [
        ("freshness p50 / p95 / p99",
         " / ".join(_ms(g("freshness_s", q)) for q in ("p50", "p95", "p99"))
         + "  (trainer read → served; lower is better)"),
        ("freshness max", _ms(g("freshness_s", "max"))),
        ("messages / rows applied", f"{_num(g('predictor', 'messages'))} / "
                                    f"{_num(g('predictor', 'rows'))}"),
        ("duplicates / gaps / quarantined",
         " / ".join(_num(g("predictor", k)) for k in ("duplicates", "gaps", "quarantined"))),
        ("torch imported by the daemon", _num(g("predictor", "torch_imported"))),
    ]


def _dense_rows(r: Mapping[str, Any], g: Any, rows: list[tuple[str, str]]) -> None:
    """Report rows of the dense (MLP) versions: published by one trainer, assembled by the
    predictor."""
    if not isinstance(g("dense"), Mapping):
        return
    copy = g("dense", "copy_ms") or {}
    _section(rows, "dense weights (the MLP, streamed)")
    rows += [
        ("versions published (full)", f"{_num(g('dense', 'versions'))} "
         f"({_num(g('dense', 'full_versions'))}), one every "
         f"{_num(g('dense', 'every_steps'))} steps; {_num(g('dense', 'deferred'))} deferred"),
        ("dense bytes / messages", f"{_bytes(g('dense', 'bytes'))} / "
                                   f"{_num(g('dense', 'messages'))}"),
        ("copy on the training thread p50 / max", f"{_num(copy.get('p50'), '.3f')} / "
                                                  f"{_num(copy.get('max'), '.3f')} ms"),
        ("versions served by the predictor", _num(g("dense", "served"))
         + f"  (never complete {_num(g('dense', 'incomplete'))}, without their base "
           f"{_num(g('dense', 'unbased'))})"),
    ]


def _run_auc_rows(r: Mapping[str, Any], g: Any, rows: list[tuple[str, str]]) -> None:
    """Report rows of the progressive evaluations: serving vs trainer AUC during training
    (the staleness the budget leaves), when the run measured any."""
    ev = [e for e in g("timeline", "auc") or [] if e[2] is not None and e[3] is not None]
    if not ev:
        return
    gap = np.array([e[2] - e[3] for e in ev], np.float64)
    # [step, t, trainer, serving, lag, dense step, dense age steps, dense age s]: the
    # version scored with (its age in steps: None before the first rows)
    age = np.array([[np.nan if e[6] is None else e[6], e[7]] for e in ev
                    if len(e) > 7 and e[5] is not None], np.float64).reshape(-1, 2)
    # answered (a lag) but not scored: the predictor had no dense version yet
    unscored = sum(1 for e in g("timeline", "auc") if e[3] is None and e[4] is not None)
    _section(rows, "serving vs trainer (during training)")
    rows += [
        ("evaluations", f"{len(ev)} (steps {ev[0][0]}…{ev[-1][0]}, each on the next "
                        f"{_num(g('config', 'eval_examples'))} examples of the stream)"
         + (f"; {unscored} not scored: no dense version yet" if unscored else "")),
        ("dense version age mean / max", f"{_num(_nan_mean(age[:, 0]), '.0f')} / "
         f"{_num(_nan_max(age[:, 0]), '.0f')} steps, {age[:, 1].mean():.2f} / "
         f"{age[:, 1].max():.2f} s  (the streamed MLP the predictor scored with: steps "
         "behind the newest rows it served with it, seconds since the trainer took it)"
         if age.size else "n/a"),
        ("AUC trainer / serving, last", f"{ev[-1][2]:.4f} / {ev[-1][3]:.4f}"),
        ("AUC gap trainer − serving mean / max", f"{gap.mean():.4f} / {gap.max():.4f}"
         "  (what staleness costs: 0 = serving as good as the trainer; a larger budget "
         "narrows it)"),
    ]


def _nan_mean(x: np.ndarray) -> Optional[float]:
    """Mean of the finite values (None without one)."""
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else None


def _nan_max(x: np.ndarray) -> Optional[float]:
    """Largest finite value (None without one)."""
    x = x[np.isfinite(x)]
    return float(x.max()) if x.size else None


def _serving_rows(r: Mapping[str, Any], g: Any, rows: list[tuple[str, str]]) -> None:
    """Report rows of serving vs trainer: drift and AUCs."""

    _section(rows, "serving vs trainer (after the final flush)")
    rows += [
        ("ids compared", _num(g("drift", "ids_compared"))),
        ("ids missing in serving", _num(g("drift", "missing_in_serving"))),
        ("row drift RMSE / max", f"{_num(g('drift', 'rmse'), '.3g')} / "
                                 f"{_num(g('drift', 'max_abs'), '.3g')}"
                                 f"  (tolerance {_num(g('drift', 'tolerance'), '.3g')}: "
                                 f"wire rounding only)"),
        ("dense weights served", "streamed, version of step "
         f"{(g('auc', 'dense_version') or [None, None])[1]}, age "
         f"{_num(g('auc', 'dense_age_s'), '.2f')} s / "
         f"{_num(g('auc', 'dense_age_steps'))} steps" if g("auc", "dense_source") == "stream"
         else "none: no dense version reached the predictor (not scored)"),
        ("AUC serving (tables + streamed MLP)", _num(g("auc", "serving"), ".4f")),
        ("AUC trainer (its tables + its MLP)", _num(g("auc", "trainer"), ".4f")),
        ("AUC trainer (torch model)", _num(g("auc", "trainer_torch"), ".4f")),
        ("AUC ceiling (true model)", _num(g("auc", "ceiling"), ".4f")
         + "  (the best any model can do on this stream)"),
        ("held-out examples", _num(g("auc", "examples"))),
    ]


def _extra_rows(r: Mapping[str, Any], g: Any, rows: list[tuple[str, str]]) -> None:
    """Report rows of snapshots, invariants and plots, when the report has them."""

    snap = g("snapshot")
    if isinstance(snap, Mapping):
        _section(rows, "snapshots")
        rows += [
            ("snapshots written", _num(snap.get("count"))),
            ("last at step", _num(snap.get("last_step"))),
        ]
        boot = snap.get("bootstrap")
        if isinstance(boot, Mapping) and boot.get("skipped"):
            rows.append(("new predictor from snapshot", f"skipped: {boot['skipped']}"))
        elif isinstance(boot, Mapping):
            rows.append(("new predictor from snapshot",
                         f"{_num(boot.get('ids'))} ids, max |Δ| vs trainer "
                         f"{_num(boot.get('max_abs'), '.3g')}; dense version of step "
                         f"{_num(boot.get('dense_step'))}"
                         + (" (the main predictor's)" if boot.get("dense_same_as_main")
                            else " (NOT the main predictor's)")))
    problems = r.get("invariants", {}).get("problems") if isinstance(r.get("invariants"),
                                                                     Mapping) else None
    if problems is not None:
        _section(rows, "invariants")
        rows.append(("status", "ok" if not problems else f"{len(problems)} problem(s)"))
        rows += [("  !", p) for p in problems]
    plots = r.get("plots") or []
    if plots:
        _section(rows, "plots")
        rows += [("", str(p)) for p in plots]


def _get(r: Mapping[str, Any], *keys: str) -> Any:
    cur: Any = r
    for k in keys:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(k)
    return cur


# --------------------------------------------------------------------------- invariants


def check_report(r: Mapping[str, Any], *, auc_tolerance: float = 0.002) -> list[str]:
    """Broken invariants of a demo report, as sentences (empty list = all hold).

    Checks: required sections present; published ≤ tracked and published + carried +
    rejected = tracked (every candidate accounted for); nothing carried after the final flush;
    bytes per row at least the row payload; freshness quantiles present, positive and
    ordered; every published id present in serving with drift within the wire dtype's
    tolerance; the predictor saw no gaps or quarantined messages; it scored with a dense
    version streamed to it; AUC with serving tables within ``auc_tolerance`` of AUC with
    the trainer's tables.
    """
    p: list[str] = []
    for sec in ("config", "train", "rows", "wire", "freshness_s", "drift", "auc", "predictor"):
        if not isinstance(r.get(sec), Mapping):
            p.append(f"section {sec!r} missing")
    if p:
        return p
    rows, wire, fr, dr, auc, pr = (r["rows"], r["wire"], r["freshness_s"], r["drift"],
                                   r["auc"], r["predictor"])
    tracked, published = rows.get("tracked"), rows.get("published")
    carried, rejected = rows.get("carried"), rows.get("rejected")
    if not all(isinstance(v, int) for v in (tracked, published, carried, rejected)):
        p.append(f"rows counts must be ints, got {dict(rows)}")
    else:
        if published > tracked:
            p.append(f"published ({published}) > tracked ({tracked})")
        # exact: candidates a budget publisher dropped because predictors held them already
        exact = rows.get("exact") or 0
        if published + carried + rejected + exact != tracked:
            p.append(f"published + carried + rejected + exact = "
                     f"{published + carried + rejected + exact} != tracked ({tracked})")
        if published <= 0:
            p.append("no rows were published")
    if rows.get("left_after_flush", 0):
        p.append(f"{rows.get('left_after_flush')} rows still retained after the final flush")
    bpr, payload = wire.get("bytes_per_row"), wire.get("row_payload_bytes")
    if bpr is None or payload is None or bpr < payload:
        p.append(f"bytes per row ({bpr}) below the row payload ({payload})")
    qs = [fr.get(q) for q in ("p50", "p95", "p99")]
    if any(q is None for q in qs):
        p.append(f"freshness quantiles missing: {dict(fr)}")
    elif not (0 < qs[0] <= qs[1] <= qs[2]):
        p.append(f"freshness quantiles must be positive and ordered, got p50/p95/p99 = {qs}")
    if not dr.get("ids_compared"):
        p.append("no published ids were compared with the trainer")
    if dr.get("missing_in_serving"):
        p.append(f"{dr['missing_in_serving']} published ids missing in the serving tables")
    if dr.get("missing_in_trainer"):
        p.append(f"{dr['missing_in_trainer']} serving ids unknown to the trainer")
    tol, mx = dr.get("tolerance"), dr.get("max_abs")
    if tol is None or mx is None or mx > tol:
        p.append(f"serving rows differ from the trainer's by up to {mx} (tolerance {tol})")
    for k in ("gaps", "quarantined"):
        if pr.get(k):
            p.append(f"predictor counted {pr[k]} {k}")
    if pr.get("torch_imported"):
        p.append("the predictor's daemon process imported torch")
    if auc.get("dense_source") != "stream":
        p.append(f"the predictor scored with no streamed dense version (dense_source "
                 f"{auc.get('dense_source')!r})")
    a_s, a_t = auc.get("serving"), auc.get("trainer")
    if a_s is None or a_t is None:
        p.append(f"AUC missing: serving {a_s}, trainer {a_t}")
    elif abs(a_s - a_t) > auc_tolerance:
        p.append(f"AUC serving {a_s:.5f} vs trainer {a_t:.5f} differ by more than "
                 f"{auc_tolerance}")
    return p
