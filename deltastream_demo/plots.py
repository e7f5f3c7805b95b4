"""The demo's over-the-run pictures (matplotlib Agg; torch-free; optional like the others).

The first three take the report's ``timeline`` (see
:func:`deltastream_demo.summary.build_report`) and each draws one PNG whose axes fit the steady state: the final flush, which sends every retained
row at once, is marked with a dashed line and its size written on the picture instead of
stretching the axis.

* :func:`plot_learning` — training loss, and the AUC of the trainer's tables against the
  predictor's serving tables on the same examples at the same moments (progressive
  validation): the gap is what serving loses to staleness;
* :func:`plot_rates` — bytes/s and rows/s published per second, against the byte budget;
* :func:`plot_bound` — the serving-error bound after each budget tick;
* :func:`plot_freshness` — predictor freshness over time (from per-record samples, binned by
  :func:`freshness_series`), and :func:`plot_published` — rows published per step.

:func:`pyplot` gives matplotlib's Agg backend (no display needed), or ``None`` with a
warning when matplotlib is not installed: plots are optional, the report says they were
skipped; :func:`save_png` writes a figure.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

__all__ = ["plot_learning", "plot_rates", "plot_bound", "per_second", "steady_ylim",
           "plot_freshness", "plot_published", "freshness_series", "time_bins", "pyplot",
           "save_png"]

log = logging.getLogger(__name__)

def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed), or ``None`` with a
    warning when matplotlib is not installed (plots are optional)."""
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: plots are skipped "
                    "(pip install 'deltastream[plots]')")
        return None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def time_bins(t: Sequence[float], values: Sequence[float], *, bin_s: float,
              name: str = "values") -> tuple[np.ndarray, np.ndarray]:
    """``(bin index [m] int64, values [m] float64)`` of samples at times ``t`` (s) in bins
    of ``bin_s`` s. ``ValueError`` when the shapes differ or ``bin_s`` is not positive."""
    t = np.asarray(t, np.float64)
    v = np.asarray(values, np.float64)
    if t.shape != v.shape:
        raise ValueError(f"t and {name} must have the same shape, got {t.shape} vs {v.shape}")
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    return np.floor(t / bin_s).astype(np.int64), v


def freshness_series(t: np.ndarray, fresh: np.ndarray, *, bin_s: float = 1.0
                     ) -> list[tuple[float, int, float, float, float]]:
    """Per time bin: ``(bin start s, samples, p50, p99, max)`` of freshness samples.

    ``t`` are apply times (s since the run started), ``fresh`` the freshness (s) of each
    applied message. Empty bins are left out.
    """
    b, f = time_bins(t, fresh, bin_s=bin_s, name="fresh")
    if b.size == 0:
        return []
    order = np.argsort(b, kind="stable")
    b, f = b[order], f[order]
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    ends = np.r_[starts[1:], b.size]
    out = []
    for s, e in zip(starts, ends, strict=True):  # one iteration per time bin, not per sample
        chunk = f[s:e]
        p50, p99 = np.quantile(chunk, [0.5, 0.99])
        out.append((float(b[s] * bin_s), int(e - s), float(p50), float(p99),
                    float(chunk.max())))
    return out


def save_png(fig, path: str | os.PathLike) -> Path:
    """Lay out ``fig`` and write it to ``path`` as PNG (parent directories made)."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def plot_freshness(path: str | os.PathLike, t: Sequence[float], fresh: Sequence[float], *,
                   bin_s: float = 1.0, title: str = "freshness (trainer read → applied)",
                   flush_t: Optional[float] = None) -> Optional[Path]:
    """PNG: each applied message's freshness over time, with per-bin p50/p99 lines.

    ``t``: apply time of each message (s since the run started); ``fresh``: its freshness
    (s); ``flush_t``: when the final flush started (s), marked with a dashed line. Returns
    the path, or None when matplotlib is missing.
    """
    plt = pyplot()
    if plt is None:
        return None
    t = np.asarray(t, np.float64)
    f = np.asarray(fresh, np.float64) * 1e3
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    try:
        if t.size:
            ax.scatter(t, f, s=6, alpha=0.4, color="tab:blue", label="message", lw=0)
            series = freshness_series(t, f / 1e3, bin_s=bin_s)
            if series:
                xs = [s[0] + bin_s / 2 for s in series]
                ax.plot(xs, [s[2] * 1e3 for s in series], color="tab:green", lw=1.5,
                        label=f"p50 per {bin_s:g} s")
                ax.plot(xs, [s[3] * 1e3 for s in series], color="tab:red", lw=1.5,
                        label=f"p99 per {bin_s:g} s")
            if (f > 0).all():
                from matplotlib.ticker import FuncFormatter

                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                # minor ticks 20, 50, 200, …: readable without crowding
                ax.yaxis.set_minor_formatter(FuncFormatter(
                    lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else ""))
            if flush_t is not None:
                ax.axvline(flush_t, color="tab:purple", ls="--", lw=1.2, label="final flush")
            ax.legend(loc="upper right", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no messages applied", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel("freshness (ms)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        return save_png(fig, path)
    finally:
        plt.close(fig)


def plot_published(path: str | os.PathLike, steps: Sequence[int], rows: Sequence[int],
                   nbytes: Sequence[int], *, title: str = "published per interval",
                   final_step: Optional[int] = None) -> Optional[Path]:
    """PNG: rows (bars) and bytes (line, right axis) published per publish interval.

    ``steps[i]`` is the trainer step of interval ``i``; ``rows``/``nbytes`` are summed over
    shards. When the last entry is the final flush, pass its step as ``final_step``: it is
    drawn apart. Returns the path, or None without matplotlib.
    """
    plt = pyplot()
    if plt is None:
        return None
    x = np.asarray(steps, np.float64)
    r = np.asarray(rows, np.float64)
    b = np.asarray(nbytes, np.float64)
    if not (x.shape == r.shape == b.shape):
        raise ValueError(f"steps, rows, nbytes must have equal lengths, got "
                         f"{x.shape}, {r.shape}, {b.shape}")
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    try:
        if x.size:
            last = np.zeros(x.shape, bool)
            if final_step is not None and x.size and x[-1] == final_step:
                last[-1] = True  # the final flush: drawn apart, after the last round
            gaps = np.diff(np.unique(x))
            width = float(np.median(gaps)) if gaps.size else 1.0
            xs = np.where(last, x + width, x)
            ax.bar(xs[~last], r[~last], width=width * 0.8, color="tab:blue", alpha=0.6,
                   label="rows")
            if last.any():
                # wide enough to see next to hundreds of regular rounds
                span = float(xs.max() - xs.min()) if xs.size > 1 else width
                wide = max(width * 0.8, span / 80.0)
                ax.bar(xs[last] + wide / 2, r[last], width=wide, color="tab:purple",
                       alpha=0.8, label="rows (final flush)")
            ax2 = ax.twinx()
            ax2.plot(xs, b / 1024.0, color="tab:orange", marker=".", lw=1.2, label="KiB")
            ax2.set_ylabel("KiB published", color="tab:orange")
            ax2.set_ylim(bottom=0)
            ax.legend(loc="upper left", fontsize=8)
        else:
            ax.text(0.5, 0.5, "nothing published", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_xlabel("trainer step")
        ax.set_ylabel("rows published", color="tab:blue")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        return save_png(fig, path)
    finally:
        plt.close(fig)


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
