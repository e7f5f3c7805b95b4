"""The demo's over-the-run pictures (matplotlib Agg; torch-free; optional like the others).

Each takes the report's ``timeline`` (see :func:`deltastream_demo.summary.build_report`) and
draws one PNG whose axes fit the steady state: the final flush, which sends every retained
row at once, is marked with a dashed line and its size written on the picture instead of
stretching the axis.

* :func:`plot_learning` — training loss, and the AUC of the trainer's tables against the
  predictor's serving tables on the same examples at the same moments (progressive
  validation): the gap is what serving loses to staleness;
* :func:`plot_rates` — bytes/s and rows/s published per second, against the byte budget;
* :func:`plot_bound` — the serving-error bound after each budget tick.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from deltastream_demo.report import pyplot, save_png, time_bins

__all__ = ["plot_learning", "plot_rates", "plot_bound", "per_second", "steady_ylim"]

_FLUSH = {"color": "tab:purple", "ls": "--", "lw": 1.2}


def per_second(t: Sequence[float], values: Sequence[float], *, bin_s: float = 1.0
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(bin starts s [k], sum of values per bin ÷ bin_s [k])``, every bin from the first
    to the last sample (empty bins are 0: nothing sent is a rate of 0)."""
    b, v = time_bins(t, values, bin_s=bin_s)
    if b.size == 0:
        return np.empty(0), np.empty(0)
    lo = int(b.min())
    sums = np.bincount(b - lo, weights=v)
    return (lo + np.arange(sums.size)) * bin_s, sums / bin_s


def steady_ylim(values: Sequence[float], *, floor: float = 0.0) -> float:
    """Top of a y axis that fits the steady state: 1.25 × the 99th percentile of
    ``values`` (a single spike stays off the scale), at least ``floor``."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    top = float(np.quantile(v, 0.99)) * 1.25 if v.size else 0.0
    return max(top, floor, 1e-12)


def _flush_mark(ax: Any, x: Optional[float], text: str = "") -> None:
    """The final flush: a dashed vertical line at ``x``, labelled, ``text`` beside it."""
    if x is None:
        return
    ax.axvline(x, label="final flush", **_FLUSH)
    if text:
        ax.annotate(text, xy=(x, 0.97), xycoords=("data", "axes fraction"), ha="right",
                    va="top", fontsize=8, color=_FLUSH["color"])


def _legend(ax: Any, loc: str) -> None:
    """A legend of every labelled line (none on an empty panel)."""
    if ax.get_legend_handles_labels()[1]:
        ax.legend(loc=loc, fontsize=8)


def plot_learning(path: str | os.PathLike, timeline: dict, auc_final: dict, *,
                  final_step: Optional[int] = None) -> Optional[Path]:
    """PNG, two panels over trainer steps: the training loss (rank 0's batch loss), and
    AUC of the trainer vs serving (its tables under the dense version streamed to it) on
    the same next examples of the stream (``timeline["auc"]`` rows ``[step, t, trainer,
    serving, lag, dense step, dense age steps, dense age s]``), and the AUC lost to
    staleness, with the final
    held-out AUCs and the ceiling (the true model) from ``auc_final``."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(8, 8), dpi=100, sharex=True,
                                     gridspec_kw={"height_ratios": [3, 3, 2]})
    try:
        loss = np.asarray(timeline.get("loss") or [], np.float64).reshape(-1, 2)
        a1.plot(loss[:, 0], loss[:, 1], color="tab:blue", lw=1.0, label="training loss "
                "(batch, rank 0)")
        a1.set_ylabel("log loss")
        a1.set_title("learning: loss, and serving vs trainer AUC during the run")
        ev = [r for r in timeline.get("auc") or [] if r[2] is not None]
        if ev:
            x = [r[0] for r in ev]
            a2.plot(x, [r[2] for r in ev], color="tab:green", marker="o", ms=3,
                    label="trainer: its tables + MLP (next examples)")
            srv = [(r[0], r[3]) for r in ev if r[3] is not None]
            a2.plot([s for s, _ in srv], [v for _, v in srv], color="tab:orange", marker="x",
                    ms=4, label="serving: tables + streamed MLP, same examples, "
                                "same moment")
            gap = [(r[0], r[2] - r[3]) for r in ev if r[3] is not None]
            a3.bar([s for s, _ in gap], [g for _, g in gap], width=0.6 * (
                gap[1][0] - gap[0][0] if len(gap) > 1 else 1), color="tab:orange",
                label="trainer − serving AUC")
            a3.axhline(0, color="black", lw=0.8)
        for key, style, label in (("trainer", "o", "trainer, final held-out"),
                                  ("serving", "x", "serving, final held-out")):
            if auc_final.get(key) is not None and final_step is not None:
                a2.plot([final_step], [auc_final[key]], ls="none", marker=style, ms=8,
                        color="tab:red" if key == "serving" else "black", label=label)
        if auc_final.get("ceiling") is not None:
            a2.axhline(auc_final["ceiling"], color="grey", ls=":", label="ceiling (true model)")
        if not ev and auc_final.get("trainer") is None:
            a2.text(0.5, 0.5, "no AUC measured (--eval-every 0)", ha="center", va="center",
                    transform=a2.transAxes)
        a2.set_ylabel("AUC (higher is better)")
        a3.set_ylabel("AUC lost to\nstaleness\n(rows + MLP)")
        a3.set_xlabel("trainer step")
        for ax in (a1, a2, a3):
            _flush_mark(ax, final_step)
            ax.grid(True, alpha=0.3)
            # the AUC panel's middle (between the curves and the ceiling) is empty
            _legend(ax, "center right" if ax is a2 else "upper right")
        return save_png(fig, path)
    finally:
        plt.close(fig)


def plot_rates(path: str | os.PathLike, publish: Sequence[Sequence[float]], *,
               budget_bytes_per_s: float = 0.0, trainers: int = 1) -> Optional[Path]:
    """PNG, two panels over time: bytes/s (KiB/s) and rows/s published, summed over the
    trainers, per second, with the byte budget (× ``trainers``) as a line. ``publish``: the
    timeline's rows ``[step, t s, rows, bytes, final]``; the final flush is marked apart."""
    plt = pyplot()
    if plt is None:
        return None
    rows = np.asarray(publish, np.float64).reshape(-1, 5)
    steady, flush = rows[rows[:, 4] == 0], rows[rows[:, 4] != 0]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), dpi=100, sharex=True)
    try:
        ft = float(flush[:, 1].min()) if flush.size else None
        x, kib = per_second(steady[:, 1], steady[:, 3] / 1024.0)
        _, rps = per_second(steady[:, 1], steady[:, 2])
        a1.step(x, kib, where="post", color="tab:blue", lw=1.0, label="rows sent, per second")
        top = steady_ylim(kib)
        if budget_bytes_per_s > 0:
            b = budget_bytes_per_s * trainers / 1024.0
            a1.axhline(b, color="tab:red", ls="-.", label=f"budget ({trainers} × "
                       f"{budget_bytes_per_s / 1024:.3g} KiB/s)")
            top = max(top, b * 1.25)
        a1.set_ylim(0, top)
        a2.step(x, rps, where="post", color="tab:green", lw=1.0, label="rows, per second")
        a2.set_ylim(0, steady_ylim(rps))
        if ft is not None:
            _flush_mark(a1, ft, f"final flush: {flush[:, 3].sum() / 1024:,.0f} KiB "
                                "(off scale) ")
            _flush_mark(a2, ft, f"final flush: {int(flush[:, 2].sum()):,} rows (off scale) ")
        a1.set_ylabel("KiB/s published")
        a1.set_title("rows published per second (all trainers), against the budget\n"
                      "(dense versions apart: the report's [dense weights])")
        a2.set_ylabel("rows/s published")
        a2.set_xlabel("time since start (s)")
        for ax in (a1, a2):
            ax.grid(True, alpha=0.3)
            _legend(ax, "lower right")
        return save_png(fig, path)
    finally:
        plt.close(fig)


def plot_bound(path: str | os.PathLike, bounds: Sequence[Sequence[float]]
               ) -> Optional[Path]:
    """PNG: the serving-error bound after each budget tick (``bounds`` rows ``[step,
    t s, bound, final]``, the worst trainer per step), with its running median. The bound
    is the largest error a served row still has ÷ the table's RMS row norm: 0 = serving is
    exact, 1 = some row is off by a whole typical row."""
    plt = pyplot()
    if plt is None:
        return None
    b = np.asarray(bounds, np.float64).reshape(-1, 4)
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    try:
        if b.size:
            steady = b[b[:, 3] == 0]
            ax.plot(steady[:, 0], steady[:, 2], color="tab:blue", lw=0.6, alpha=0.6,
                    label="bound after each tick")
            k = max(1, steady.shape[0] // 50)
            med = [float(np.median(steady[max(0, i - k):i + 1, 2]))
                   for i in range(steady.shape[0])]
            ax.plot(steady[:, 0], med, color="tab:red", lw=1.5,
                    label=f"running median ({k} ticks)")
            ax.set_ylim(0, steady_ylim(steady[:, 2]))
            fl = b[b[:, 3] != 0]
            _flush_mark(ax, float(fl[0, 0]) if fl.size else None,
                        f"after the final flush: {fl[:, 2].max():.3g} " if fl.size else "")
            _legend(ax, "upper right")
        else:
            ax.text(0.5, 0.5, "no byte budget (--publish-budget 0): no bound", ha="center",
                    va="center", transform=ax.transAxes)
        ax.set_xlabel("trainer step")
        ax.set_ylabel("error bound (÷ RMS row norm, lower is better)")
        ax.set_title("serving-error bound over the run")
        ax.grid(True, alpha=0.3)
        return save_png(fig, path)
    finally:
        plt.close(fig)
