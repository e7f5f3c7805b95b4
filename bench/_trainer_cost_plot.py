"""``bench trainer-cost`` as a picture: what the training loop pays, per configuration.

Top row, one panel per batch size: every pair's ratio (a chunk with deltastream ÷ the
step alone in the chunks around it, one dot per pair), the median the figure reports and
its bootstrap 95 % interval, against the ratio goal. The dots show what a single number
hides on a shared VM: how far one pair lies from the next. Bottom row: the time the
training thread spends inside ``tick`` (p50 and p99, a log scale above 0.01 ms) against
the tick goal; configurations without a tick (the tracker alone) are left out there.
Third row: where the extra time goes (``extra_us``): the µs a step that each phase of the
step (forward, backward, optimizer) and the rest (``tick``) took more than alone, one bar
each per configuration — a bar below zero is a phase that ran faster (noise: no
deltastream code runs in the backward or the optimizer on the CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from deltastream_demo.plots import pyplot, save_png

__all__ = ["plot"]


def plot(path: Path, results: list[dict], *, ratio_goal: float, tick_goal_ms: float
         ) -> Optional[Path]:
    """Write the picture of ``results`` (``trainer_cost.main``'s records, with
    ``pair_ratios``) to ``path`` as a PNG; None without matplotlib or results."""
    plt = pyplot()
    if plt is None or not results:
        return None
    batches = sorted({r["batch"] for r in results})
    fig, axes = plt.subplots(3, len(batches), figsize=(1.5 + 5.5 * len(batches), 11),
                             dpi=100, squeeze=False)
    try:
        for col, batch in enumerate(batches):
            rs = [r for r in results if r["batch"] == batch]
            _ratios(axes[0][col], rs, ratio_goal)
            _ticks(axes[1][col], rs, tick_goal_ms)
            _extra(axes[2][col], rs)
        save_png(fig, path)
    finally:
        plt.close(fig)
    return path


def _ratios(ax, rs: list[dict], goal: float) -> None:
    """Pair ratios, median and interval per configuration."""
    for i, r in enumerate(rs):
        pairs = np.asarray(r["pair_ratios"], dtype=np.float64)
        # spread the dots sideways, in pair order (no randomness: the same run, the same PNG)
        x = i + np.linspace(-0.18, 0.18, pairs.size) if pairs.size > 1 else np.full(1, i)
        ax.scatter(x, pairs, s=14, alpha=0.45, color="tab:blue",
                   label="one pair" if i == 0 else None)
        lo, hi = r["ratio_ci95"]
        ax.errorbar(i, r["ratio"], yerr=[[r["ratio"] - lo], [hi - r["ratio"]]], fmt="_",
                    color="black", markersize=18, capsize=5, lw=1.2,
                    label="median, 95 % interval" if i == 0 else None)
        ax.annotate(f"{r['ratio']:.3f}", (i + 0.22, r["ratio"]), fontsize=8, va="center")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.axhline(goal, color="tab:green", ls="--", lw=1, label=f"goal: ≤ {goal:g}")
    ax.set_xticks(range(len(rs)), [r["config"] for r in rs], rotation=25, ha="right",
                  fontsize=8)
    ax.set_xlim(-0.6, len(rs) - 0.4)
    ax.set_ylabel("step with deltastream ÷ step alone")
    alone = float(np.median([r["step_alone_ms"] for r in rs]))
    ax.set_title(f"batch {rs[0]['batch']}, {rs[0]['tables']} tables: the step alone "
                 f"{alone:.1f} ms", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def _ticks(ax, rs: list[dict], goal_ms: float) -> None:
    """The training thread's time inside ``tick``: p50 and p99 per configuration."""
    ticked = [r for r in rs if r.get("tick_p99_ms") is not None]
    for i, r in enumerate(ticked):
        ax.vlines(i, r["tick_p50_ms"], r["tick_p99_ms"], color="tab:gray", lw=1)
        ax.scatter([i], [r["tick_p50_ms"]], marker="o", color="tab:blue",
                   label="p50" if i == 0 else None)
        ax.scatter([i], [r["tick_p99_ms"]], marker="^", color="tab:red",
                   label="p99" if i == 0 else None)
        ax.annotate(f"{r['tick_p99_ms']:.2g} ms", (i + 0.12, r["tick_p99_ms"]), fontsize=8,
                    va="center")
    ax.axhline(goal_ms, color="tab:green", ls="--", lw=1, label=f"goal: p99 ≤ {goal_ms:g} ms")
    # symlog: a tick that is 0 at the median (a round every 10 steps) still has a place
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_ylim(0, 3 * max([goal_ms] + [r["tick_p99_ms"] for r in ticked]))
    ax.set_xticks(range(len(ticked)), [r["config"] for r in ticked], rotation=25,
                  ha="right", fontsize=8)
    ax.set_xlim(-0.6, max(len(ticked), 1) - 0.4)
    ax.set_ylabel("time in tick on the training thread (ms, symlog)")
    ax.grid(True, axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")


#: ``extra_us``'s parts, in the order of a step, and their colours
_PARTS = (("forward", "tab:blue"), ("backward", "tab:orange"), ("optimizer", "tab:purple"),
          ("rest", "tab:gray"))


def _extra(ax, rs: list[dict]) -> None:
    """``extra_us`` per configuration: one bar per part of the step."""
    width = 0.8 / len(_PARTS)
    for j, (part, colour) in enumerate(_PARTS):
        x = np.arange(len(rs)) + (j - (len(_PARTS) - 1) / 2) * width
        ax.bar(x, [r["extra_us"][part] for r in rs], width, color=colour, label=part)
    ax.axhline(0.0, color="black", lw=0.6)
    ax.set_xticks(range(len(rs)), [r["config"] for r in rs], rotation=25, ha="right",
                  fontsize=8)
    ax.set_xlim(-0.6, len(rs) - 0.4)
    ax.set_ylabel("µs a step more than the step alone")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", ncols=len(_PARTS))
