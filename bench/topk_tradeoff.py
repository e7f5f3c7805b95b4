"""Top-k trade-off: bytes on the wire vs serving AUC at several top-k fractions.

One training run of the demo's CTR model (:mod:`deltastream.demo_model`, one process, on the
demo's drifting Zipf click stream) feeds **one DeltaTracker with one consumer per fraction**
(``f1``, ``f0.5``, …), so every fraction sees exactly the same model trajectory. Every
``--publish-every`` steps each consumer runs a publish round: ``select_changed`` with its
fraction (new rows first, then top drift; the leftover is ``retain``-ed), the selected rows are
encoded in wire format v1 (``--dtype``; the encoded bytes are what is counted) and decoded and
applied to that fraction's own :class:`~consumers.ServingTable` s — exactly what a predictor
would hold. (In-process, without a broker: the broker does not change which bytes arrive,
and one process keeps the run short and deterministic.)

Serving quality is measured the way an online system is judged — on traffic it has not seen
yet: every ``--eval-every`` steps, right after the publish round, the next
``--eval-examples`` examples of the stream (a held-out draw, ``salt=1``) are scored with the
trainer's current MLP and (a) the trainer's tables, (b) each fraction's serving tables. The
AUC per fraction is over all such evaluation points. There is no final flush: this is the
steady state.

Figure ``topk_bytes_reduction``: bytes sent at fraction 1.0 (every touched row, the baseline)
divided by the bytes sent at the smallest fraction whose serving AUC is within ``--tolerance``
(0.002) of the fraction-1.0 serving AUC. Goal ≥ 5×. Per-fraction records give bytes and the
serving AUC against the trainer AUC. The curve is written to ``--out``/topk_tradeoff.png.

Reading the figure: ``select_changed`` never drops a changed row — what it does not pick is
carried (``retain``) and published later, new rows first and no row starving — so fewer
bytes can only come from rows that change again while carried (one publish instead of
several). How much that saves depends on how often ids recur within a few publish rounds;
how much AUC it costs depends on how much the predictor needs the newest value of the
carried rows. On the demo stream users come in sessions, so the rows of users active right
now are both the ones that matter for the next requests and the ones a small budget defers.
``--session-return 0`` (independent draws) shows the same model on a stream without
sessions.

Run: ``deltastream bench topk-tradeoff [--fractions 1,0.5,0.2,0.1,0.05] [--steps N]``.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from pathlib import Path

import numpy as np

from bench._common import result

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _fractions(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") \
            from None
    if not vals or any(not 0 < v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"fractions must be in (0, 1], got {text!r}")
    if 1.0 not in vals:
        vals.append(1.0)  # the baseline
    return sorted(set(vals), reverse=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deltastream bench topk-tradeoff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fractions", type=_fractions, default=_fractions("1,0.5,0.2,0.1,0.05"),
                   help="top-k fractions, comma-separated (1.0 is always included)")
    p.add_argument("--steps", type=int, default=1200, help="training steps (default 1200)")
    p.add_argument("--batch-size", type=int, default=1024, help="examples per step")
    p.add_argument("--publish-every", type=int, default=10, help="steps between publishes")
    p.add_argument("--eval-every", type=int, default=20,
                   help="steps between evaluations on upcoming traffic (multiple of "
                        "--publish-every)")
    p.add_argument("--eval-examples", type=int, default=2048,
                   help="upcoming examples scored per evaluation")
    p.add_argument("--warmup-steps", type=int, default=200,
                   help="evaluations before this step are left out (default 200)")
    p.add_argument("--dim", type=int, default=32, help="embedding width")
    p.add_argument("--dtype", choices=["f32", "f16", "bf16", "i8"], default="f16",
                   help="wire dtype")
    p.add_argument("--users", type=int, default=50_000, help="distinct users in the stream")
    p.add_argument("--items", type=int, default=10_000, help="distinct items in the stream")
    p.add_argument("--session-return", type=float, default=None,
                   help="stream: probability an example continues a user session (default: "
                        "the demo stream's; 0 = independent draws)")
    p.add_argument("--session-window", type=int, default=None,
                   help="stream: how far back (examples) a session continues (default: the "
                        "demo stream's)")
    p.add_argument("--max-age", type=int, default=16,
                   help="select_changed max_age: rows carried this many rounds go first")
    p.add_argument("--tolerance", type=float, default=0.002,
                   help="largest AUC loss vs fraction 1.0 that counts as 'the same'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out", help="directory of the PNG (default bench-out)")
    args = p.parse_args(argv)
    if min(args.steps, args.batch_size, args.publish_every, args.eval_every,
           args.eval_examples, args.dim) <= 0:
        p.error("--steps, --batch-size, --publish-every, --eval-every, --eval-examples and "
                "--dim must be positive")
    if args.eval_every % args.publish_every:
        p.error("--eval-every must be a multiple of --publish-every")
    if not 0 <= args.warmup_steps < args.steps:
        p.error("--warmup-steps must be in [0, --steps)")
    return args


def _label(f: float) -> str:
    return f"f{f:g}"


def run(args: argparse.Namespace) -> dict:
    """The training run; returns per-fraction bytes/rows/AUC and the trainer AUC."""
    import torch

    from consumers.serving_table import ServingTable
    from deltastream import wire
    from deltastream.demo_data import ClickStream, StreamConfig
    from deltastream.demo_model import CTRModel, export_dense
    from deltastream.demo_scoring import auc, score
    from deltastream.optim import RowWiseAdagrad
    from deltastream.selection import select_changed
    from deltastream.tracker import DeltaTracker
    from deltastream.types import TrackingMode

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    extra = {k: v for k, v in (("session_return", args.session_return),
                               ("session_window", args.session_window)) if v is not None}
    stream = ClickStream(StreamConfig(seed=args.seed, n_users=args.users, n_items=args.items,
                                      **extra))
    model = CTRModel(args.dim, stream.config.n_dense, seed=args.seed)
    sparse = RowWiseAdagrad(model, lr=0.05)
    dense = torch.optim.Adam(model.dense_parameters(), lr=2e-3)
    names = [_label(f) for f in args.fractions]
    tracker = DeltaTracker(model, consumers=names, mode=TrackingMode.EMBEDDING)
    tables = {fqn: m for fqn, m in model.named_modules()
              if m.__class__.__name__ == "HashTable"}
    serving = {n: {t.name: ServingTable(t.name, args.dim) for t in tables.values()}
               for n in names}
    sent = {n: {"bytes": 0, "rows": 0, "messages": 0, "select_s": 0.0} for n in names}
    labels: list[np.ndarray] = []
    logits: dict[str, list[np.ndarray]] = {n: [] for n in names + ["trainer"]}
    seq = {n: 0 for n in names}
    t0 = time.monotonic()
    bs = args.batch_size
    for step in range(1, args.steps + 1):
        b = stream.batch((step - 1) * bs, bs)
        out = model(torch.from_numpy(b.user_ids), torch.from_numpy(b.item_ids),
                    torch.from_numpy(b.dense))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            out, torch.from_numpy(b.labels))
        loss.backward()
        sparse.step()
        dense.step()
        sparse.zero_grad()
        dense.zero_grad()
        tracker.step()
        if step % args.publish_every:
            continue
        for f, n in zip(args.fractions, names, strict=True):
            ts0 = time.monotonic()
            for fqn, d in tracker.get_delta(n).items():
                if len(d) == 0:
                    continue
                tbl = tables[fqn]
                sel = select_changed(d, tbl, fraction=None if f >= 1.0 else f,
                                     wire_dtype=args.dtype, max_age=args.max_age)
                if len(sel.leftover):
                    tracker.retain(n, fqn, sel.leftover)
                if len(sel) == 0:
                    continue
                batch = wire.DeltaBatch(model="topk", table=tbl.name, shard=0, epoch=1,
                                        seq=seq[n], step=step, ts=time.time_ns(),
                                        ids=sel.ids.numpy(), rows=sel.rows.numpy(),
                                        dtype=args.dtype)
                counted = step > args.warmup_steps  # bytes over the same window as the AUC
                for msg in wire.encode(batch):
                    if counted:
                        sent[n]["bytes"] += len(msg)
                        sent[n]["messages"] += 1
                    seq[n] += 1
                    serving[n][tbl.name].apply(wire.decode(msg))
                if counted:
                    sent[n]["rows"] += len(sel)
            sent[n]["select_s"] += time.monotonic() - ts0
        if step % args.eval_every or step < args.warmup_steps:
            continue
        # ---- score the upcoming traffic (not trained on yet)
        ev = stream.batch(step * bs, args.eval_examples, salt=1)
        weights = export_dense(model)
        labels.append(ev.labels)

        def trainer_lookup(name: str):
            t = next(t for t in tables.values() if t.name == name)
            return lambda ids: t.lookup(torch.from_numpy(ids)).numpy()

        logits["trainer"].append(score(weights, trainer_lookup("user"), trainer_lookup("item"),
                                       ev.user_ids, ev.item_ids, ev.dense))
        for n in names:
            st = serving[n]
            logits[n].append(score(weights, st["user"].lookup, st["item"].lookup,
                                   ev.user_ids, ev.item_ids, ev.dense))
    seconds = time.monotonic() - t0
    y = np.concatenate(labels)
    aucs = {n: auc(y, np.concatenate(v)) for n, v in logits.items()}
    return {"sent": sent, "auc": aucs, "seconds": seconds, "eval_examples": int(y.size),
            "names": names, "stream": stream.config.to_dict()}


def _plot(path: Path, args: argparse.Namespace, r: dict, chosen: str | None) -> Path | None:
    from deltastream.report import _pyplot

    plt = _pyplot()
    if plt is None:
        return None
    names = r["names"]
    mib = [r["sent"][n]["bytes"] / 2**20 for n in names]
    aucs = [r["auc"][n] for n in names]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    try:
        ax.plot(mib, aucs, marker="o", color="tab:blue", label="serving AUC")
        for f, x, a in zip(args.fractions, mib, aucs, strict=True):
            ax.annotate(f"{f:g}", (x, a), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        ax.axhline(r["auc"]["trainer"], color="tab:green", ls="--", lw=1,
                   label="trainer AUC")
        base = r["auc"][_label(1.0)]
        ax.axhline(base - args.tolerance, color="tab:red", ls=":", lw=1,
                   label=f"AUC(1.0) − {args.tolerance:g}")
        if chosen is not None:
            i = names.index(chosen)
            ax.scatter([mib[i]], [aucs[i]], s=120, facecolors="none", edgecolors="tab:red",
                       label="smallest fraction within tolerance")
        ax.set_xscale("log")
        from matplotlib.ticker import FuncFormatter

        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_xlabel("MiB sent (log scale); labels = top-k fraction")
        ax.set_ylabel("AUC on upcoming traffic")
        ax.set_title("top-k fraction: bytes on the wire vs serving AUC")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the trade-off benchmark; return the result records."""
    args = _parse(argv)
    r = run(args)
    names = r["names"]
    full = _label(1.0)
    base_bytes = r["sent"][full]["bytes"]
    base_auc = r["auc"][full]
    ok = [(f, n) for f, n in zip(args.fractions, names, strict=True)
          if r["auc"][n] >= base_auc - args.tolerance]
    f_best, chosen = min(ok) if ok else (1.0, full)
    png = _plot(Path(args.out) / "topk_tradeoff.png", args, r, chosen)
    chosen_bytes = r["sent"][chosen]["bytes"]
    common = dict(steps=args.steps, batch_size=args.batch_size, dim=args.dim,
                  session_return=r["stream"]["session_return"],
                  session_window=r["stream"]["session_window"],
                  dtype=args.dtype, publish_every=args.publish_every,
                  eval_examples=r["eval_examples"], seconds=r["seconds"],
                  trainer_auc=r["auc"]["trainer"], plot=str(png) if png else None)
    out = [result(
        "topk_bytes_reduction", float(chosen_bytes), float(base_bytes), 5.0, "bytes",
        ratio=base_bytes / chosen_bytes if chosen_bytes else math.nan,
        baseline_desc="bytes sent publishing every touched row (fraction 1.0), same run",
        note=f"smallest fraction with serving AUC within {args.tolerance:g} of fraction 1.0: "
             f"{f_best:g} (AUC {r['auc'][chosen]:.4f} vs {base_auc:.4f}; trainer "
             f"{r['auc']['trainer']:.4f}); ratio = bytes(1.0) / bytes({f_best:g})",
        fraction=f_best, serving_auc=r["auc"][chosen], serving_auc_full=base_auc, **common)]
    for f, n in zip(args.fractions, names, strict=True):
        s = r["sent"][n]
        out.append(result(
            f"topk_serving_auc@{f:g}", r["auc"][n], r["auc"]["trainer"], None, "AUC",
            baseline_desc="AUC with the trainer's own tables on the same traffic",
            note=f"{s['bytes'] / 2**20:.2f} MiB, {s['rows']:,} rows in {s['messages']} "
                 f"messages ({base_bytes / s['bytes'] if s['bytes'] else math.nan:.1f}× "
                 "fewer bytes than fraction 1.0)",
            fraction=f, bytes=s["bytes"], rows=s["rows"], messages=s["messages"],
            auc_loss_vs_full=base_auc - r["auc"][n], **common))
    return out
