"""The report of ``bench freshness-per-byte`` beyond its records: the plot, and what Kafka's
compression and cheaper ids would save on a policy's messages (``--transport``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from bench._common import result
from deltastream_demo.plots import pyplot, save_png

__all__ = ["plot", "transport_record"]


def transport_record(p, base: int, common: dict) -> dict:
    """``transport@LABEL``: what compression and cheaper ids would save on ``p``'s
    messages (bytes after the best per-message codec vs the bytes sent)."""
    from bench._transport import summarize

    t = summarize(p.messages or [])
    sent = max(1, t["bytes"])
    codec, packed = min(t["per_message"].items(), key=lambda kv: kv[1])
    note = (f"{p.label}: {t['bytes']:,} B in {t['messages']:,} messages; compressed per "
            "message " + ", ".join(f"{k} {v / sent:.3f}" for k, v in t["per_message"].items())
            + "; per step " + ", ".join(f"{k} {v / sent:.3f}" for k, v in t["per_step"].items())
            + "; per message, ids hashed " + ", ".join(
                f"{k} {v / sent:.3f}" for k, v in t["per_message_hashed"].items())
            + f" (× bytes sent); ids {t['ids'] / sent:.1%} of the bytes, sorted delta varint "
            f"{t['ids_delta_varint'] / max(1, t['ids_raw']):.3f} × their 8 bytes (hashed ids "
            f"{t['ids_hashed_delta_varint'] / max(1, t['ids_raw']):.3f}); rows "
            f"{t['rows_bytes'] / sent:.1%}, "
            f"other {t['other'] / sent:.1%}")
    return result(f"transport@{p.label}", float(packed), float(t["bytes"]), None, "bytes",
                  ratio=packed / sent, higher_is_better=False, note=note, policy=p.label,
                  codec=codec, bytes_ratio_sent=t["bytes"] / base if base else math.nan,
                  transport=t, **common)


_STYLE = {"full": ("tab:gray", "x", "send everything every N"),
          "touched": ("tab:blue", "o", "touched rows every N (Monolith)"),
          "fraction": ("tab:cyan", "v", "top fraction F, every step"),
          "threshold": ("tab:orange", "s", "threshold ε, every step"),
          "budget": ("tab:red", "D", "byte budget B/step (default: scaled, per byte)"),
          "budget-raw": ("tab:purple", "P", "byte budget, raw L2 (not scaled)"),
          "budget-by-error": ("tab:brown", "X", "byte budget, by error (not per byte)")}


def plot(path: Path, policies: list, baseline: str, trainer_auc: float, dataset: str, *,
         tolerance: float, goal: float) -> Path | None:
    """AUC gap against bytes (÷ the bytes of policy ``baseline``), one curve per family
    of ``policies``, with the goal's lines, as a PNG at ``path``; None without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    base = next(p for p in policies if p.label == baseline).sent["bytes"]
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    try:
        for fam, (color, marker, legend) in _STYLE.items():
            pts = [p for p in policies if p.family == fam]
            if not pts:
                continue
            xs = np.array([p.sent["bytes"] / base for p in pts])
            ys = np.array([trainer_auc - p.sent["auc"] for p in pts])
            o = np.argsort(xs)
            ax.plot(xs[o], ys[o], marker=marker, color=color, label=legend)
            for p, x, yv in zip(pts, xs, ys, strict=True):
                ax.annotate(f"{p.value:g}", (x, yv), textcoords="offset points", xytext=(4, 3),
                            fontsize=7, color=color)
        ax.axhline(tolerance, color="tab:green", ls=":", lw=1,
                   label=f"goal: AUC gap ≤ {tolerance:g}")
        ax.axvline(goal, color="tab:green", ls="--", lw=1,
                   label=f"goal: ≤ {goal:g} × bytes of {baseline}")
        ax.axhline(0.0, color="black", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xlabel("bytes sent / bytes of touched rows every step (log)")
        ax.set_ylabel("AUC gap: trainer − serving (symlog)")
        ax.set_title(f"freshness per byte, prequential MF on {dataset}")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        save_png(fig, path)
    finally:
        plt.close(fig)
    return path
