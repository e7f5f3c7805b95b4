"""End-to-end freshness at a fixed offered load: tracker → selection → publisher → broker → daemon.

A synthetic producer (this process, torch) changes ``--rows-per-s`` distinct rows per second
of a :class:`~deltastream.HashTable` (``--resident`` rows, ``--dim`` wide): every tick
(``--tick`` s) it looks a batch of ids up through the table (recorded by a
:class:`~deltastream.DeltaTracker` in EMBEDDING mode), writes changed rows back, and runs one
publish round (:func:`deltastream.publish_delta`: ``get_delta`` → ``select_changed`` (every
changed row) → ``DeltaPublisher.publish``, ``--dtype``, ``ts`` = when the rows were read). A
:class:`~consumers.SyncDaemon` in a separate, torch-free process (the predictor) applies the
messages from the embedded broker and logs each message's freshness (apply time − ``ts``).
Everything runs on this machine (2 cores shared by producer, broker and daemon).

Figures (``--warmup`` seconds excluded):

* ``e2e_rows_per_s``: rows applied by the daemon per second vs the offered load (baseline);
  goal ratio ≥ 0.95 (the pipeline keeps up).
* ``e2e_freshness_p99_s``: p99 freshness vs the issue's budget of 0.5 s (baseline);
  ratio = p99 / 0.5, goal ≤ 1.
* ``e2e_freshness_p50_s``: p50 freshness vs the same-run transport floor — the p50 freshness
  of 1-row messages sent at 50 msg/s through the same publisher, broker and daemon before the
  load starts (report only).

The daemon checkpoints every ``--checkpoint-interval`` seconds (its default, 5 s) in its
apply thread; those pauses are part of the measured tail, as they are in production.

Run: ``deltastream bench e2e [--rows-per-s N] [--duration S] [--dim D] [--dtype f16]``.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import queue
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import result

__all__ = ["main"]

log = logging.getLogger(__name__)

_BUDGET_S = 0.5  # the goal: p99 freshness ≤ 0.5 s at 100K rows/s


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deltastream bench e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows-per-s", type=float, default=100_000.0,
                   help="offered load: distinct rows changed per second (default 100K)")
    p.add_argument("--duration", type=float, default=20.0, help="load seconds (default 20)")
    p.add_argument("--warmup", type=float, default=3.0,
                   help="first seconds of the load left out of the figures (default 3)")
    p.add_argument("--tick", type=float, default=0.02,
                   help="seconds between change + publish rounds (default 0.02)")
    p.add_argument("--dim", type=int, default=64, help="row width (default 64)")
    p.add_argument("--dtype", choices=["f32", "f16", "bf16", "i8"], default="f16",
                   help="wire dtype (default f16)")
    p.add_argument("--resident", type=int, default=200_000,
                   help="rows held by the producer's table (default 200K)")
    p.add_argument("--floor-seconds", type=float, default=2.0,
                   help="seconds of 1-row messages measuring the transport floor (default 2)")
    p.add_argument("--checkpoint-interval", type=float, default=5.0,
                   help="the daemon's checkpoint interval in seconds (default 5, its default); "
                        "each checkpoint writes every table and pauses applying meanwhile")
    p.add_argument("--bootstrap-servers", default=None,
                   help="use this Kafka instead of starting the embedded broker")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.rows_per_s > 0 or not args.duration > 0 or not args.tick > 0 \
            or not args.checkpoint_interval > 0:
        p.error("--rows-per-s, --duration, --tick and --checkpoint-interval must be positive")
    if not 0 <= args.warmup < args.duration:
        p.error("--warmup must be in [0, --duration)")
    if args.dim <= 0 or args.resident <= 0:
        p.error("--dim and --resident must be positive")
    per_tick = args.rows_per_s * args.tick
    if per_tick > args.resident:
        p.error(f"--rows-per-s × --tick = {per_tick:.0f} rows per tick exceeds --resident "
                f"{args.resident}")
    return args


class _ApplyLog:
    """``SyncDaemon(on_apply=...)`` hook: wall time, freshness (s), rows and table of every
    applied message. Thread-safe (the daemon calls it from its apply thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.t: list[float] = []
        self.fresh: list[float] = []
        self.rows: list[int] = []
        self.tables: list[str] = []

    def __call__(self, outcome: Any, partition: int = -1, offset: int = -1) -> None:
        if outcome.kind != "applied" or outcome.ts is None:
            return
        now = time.time()
        with self._lock:
            self.t.append(now)
            self.fresh.append(now - outcome.ts / 1e9)
            self.rows.append(int(outcome.rows or 0))
            self.tables.append(str(outcome.table))

    def samples(self) -> dict:
        with self._lock:
            return {"t": list(self.t), "fresh": list(self.fresh), "rows": list(self.rows),
                    "tables": list(self.tables)}


def _sync_main(cfg: dict, events: Any, control: Any) -> None:
    """The predictor process (torch-free): a SyncDaemon with an :class:`_ApplyLog`.

    Starts at the topic's current end offsets (an empty base snapshot), sends ``ready``,
    applies until a ``stop`` control message (after draining up to its ``offsets``) or
    ``cfg["max_seconds"]``, then sends ``{"kind": "samples", "t", "fresh", "rows",
    "tables", "stats", "torch_imported"}`` (wall times in s).
    """
    import signal
    import sys

    from consumers import SyncDaemon, TopicReader, write_snapshot

    # Ctrl-C is the parent's to handle (it stops this process): no traceback from here
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    logging.basicConfig(level="WARNING",
                        format="%(asctime)s %(levelname)s sync %(name)s: %(message)s")
    try:
        state = Path(cfg["state_dir"])
        base = state.parent / (state.name + "-base")
        with TopicReader(cfg["bootstrap_servers"], cfg["topic"], timeout=15.0) as reader:
            ends = reader.end_offsets()
        write_snapshot(base, tables={}, offsets=ends, seqs={},
                       meta={"kind": "deltastream-bench-e2e-start", "topic": cfg["topic"]})
        alog = _ApplyLog()
        daemon = SyncDaemon(cfg["bootstrap_servers"], cfg["topic"], model=cfg["model_name"],
                            state_dir=state, base=base, on_apply=alog,
                            checkpoint_interval=float(cfg["checkpoint_interval"]),
                            summary_interval=0, poll_timeout_ms=50, max_poll_records=1000)
        runner = threading.Thread(target=daemon.run, name="sync-daemon", daemon=True)
        runner.start()
        events.put({"kind": "ready", "who": "sync"})
        deadline = time.monotonic() + float(cfg["max_seconds"])
        while time.monotonic() < deadline:
            try:
                msg = control.get(timeout=0.5)
            except queue.Empty:
                msg = None
            if msg is not None and msg.get("kind") == "stop":
                target = {int(p): int(o) for p, o in (msg.get("offsets") or {}).items()}
                drain_until = time.monotonic() + float(msg.get("timeout", 30.0))
                while target and time.monotonic() < drain_until:
                    pos = daemon.stats()["positions"]
                    if all(pos.get(p, 0) >= o for p, o in target.items()):
                        break
                    time.sleep(0.02)
                break
            if not runner.is_alive():
                raise RuntimeError("the sync daemon thread stopped unexpectedly")
        daemon.stop()
        runner.join(timeout=30)
        st = daemon.stats()
        events.put(dict(alog.samples(), kind="samples",
                        stats={k: st[k] for k in ("messages", "applied", "rows", "bytes",
                                                  "duplicates", "gaps", "quarantined")},
                        torch_imported="torch" in sys.modules))
    except BaseException as e:
        log.exception("sync process failed")
        events.put({"kind": "error", "who": "sync", "error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from None


def _wait(events: Any, kind: str, proc: Any, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ev = events.get(timeout=0.5)
        except queue.Empty:
            if proc.exitcode is not None:
                raise RuntimeError(f"the sync process exited with code {proc.exitcode}") \
                    from None
            continue
        if ev.get("kind") == "error":
            raise RuntimeError(f"sync process: {ev.get('error')}")
        if ev.get("kind") == kind:
            return ev
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {kind!r} from the sync "
                       "process")


def _run(args: argparse.Namespace, servers: str, tmp: Path) -> dict:
    import torch

    from deltastream import (
        DeltaPublisher,
        DeltaTracker,
        HashTable,
        TrackingMode,
        ensure_topic,
        publish_delta,
    )

    torch.set_num_threads(1)
    topic = f"deltas.e2e-{uuid.uuid4().hex[:8]}"
    model = "e2e"
    ensure_topic(servers, topic, partitions=1)
    ctx = mp.get_context("spawn")
    events, control = ctx.Queue(), ctx.Queue()
    total = args.floor_seconds + args.duration
    proc = ctx.Process(target=_sync_main, name="deltastream-e2e-sync", args=(
        {"bootstrap_servers": servers, "topic": topic, "model_name": model,
         "state_dir": str(tmp / "sync"), "max_seconds": total + 300.0,
         "checkpoint_interval": args.checkpoint_interval}, events, control))
    proc.start()
    try:
        _wait(events, "ready", proc, 60.0)
        g = torch.Generator().manual_seed(args.seed)
        table = HashTable(args.dim, name="e2e", capacity=int(args.resident * 1.3) + 1024)
        table.insert(torch.arange(args.resident, dtype=torch.int64),
                     torch.randn(args.resident, args.dim, generator=g) * 0.1)
        holder = torch.nn.ModuleDict({"e2e": table})
        tracker = DeltaTracker(holder, consumers=["publish"], mode=TrackingMode.EMBEDDING)
        pub = DeltaPublisher(servers, topic, model=model, shard=0, dtype=args.dtype)
        results = []

        # ---- transport floor: 1-row messages at 50 msg/s
        floor_row = torch.zeros(1, args.dim)
        n_floor = max(1, int(args.floor_seconds / 0.02))
        for i in range(n_floor):
            results.append(pub.publish("floor", torch.tensor([i]), floor_row, step=i))
            time.sleep(0.02)
        pub.flush()

        # ---- the load
        per_tick = args.rows_per_s * args.tick
        carry = 0.0
        changed = 0
        published = 0
        lag_ticks = 0
        t_start = time.time()
        t_next = time.monotonic()
        end = t_next + args.duration
        step = 0
        while True:
            now = time.monotonic()
            if now >= end:
                break
            if now < t_next:
                time.sleep(t_next - now)
            else:
                lag_ticks += now - t_next > args.tick  # the producer fell behind a full tick
            t_next += args.tick
            carry += per_tick
            n = int(carry)
            carry -= n
            ids = torch.randperm(args.resident, generator=g)[:n]
            with torch.no_grad():
                rows = table(ids)  # recorded by the tracker (FIRST = value before the change)
                table.insert(ids, rows + 0.01 * torch.randn(n, args.dim, generator=g))
            tracker.step()
            changed += n
            rnd = publish_delta(tracker, pub, "publish", step=step)  # every changed row
            published += rnd.published
            results += [t.result for t in rnd.tables if t.result is not None]
            step += 1
        t_end = time.time()
        pub.flush()
        last = max(o for r in results for o in (r.offsets or [-1]))
        pub.close()
        control.put({"kind": "stop", "offsets": {0: last + 1}, "timeout": 60.0})
        samples = _wait(events, "samples", proc, 120.0)
    except BaseException:  # Ctrl-C or a failure: the predictor stops now, not at its deadline
        proc.terminate()
        raise
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    return {"samples": samples, "t_start": t_start, "t_end": t_end, "changed": changed,
            "published": published, "lag_ticks": lag_ticks, "ticks": step}


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the end-to-end benchmark; return the result records."""
    args = _parse(argv)
    with tempfile.TemporaryDirectory(prefix="deltastream-e2e-") as tmp:
        if args.bootstrap_servers:
            run = _run(args, args.bootstrap_servers, Path(tmp))
        else:
            from deltastream import EmbeddedBroker

            with EmbeddedBroker() as broker:
                run = _run(args, broker.bootstrap_servers, Path(tmp))
    s = run["samples"]
    t = np.asarray(s["t"], np.float64)
    fresh = np.asarray(s["fresh"], np.float64)
    rows = np.asarray(s["rows"], np.int64)
    tables = np.asarray(s["tables"])
    load = tables == "e2e"
    floor = fresh[tables == "floor"]
    warm = run["t_start"] + args.warmup
    ts = t - fresh  # when the trainer read the rows
    measured = load & (ts >= warm)
    window = run["t_end"] - warm
    in_window = load & (t >= warm) & (t <= run["t_end"])
    achieved = float(rows[in_window].sum()) / window if window > 0 else float("nan")
    f = fresh[measured]
    p50, p99 = (np.quantile(f, [0.5, 0.99]) if f.size else (float("nan"), float("nan")))
    f50 = float(np.quantile(floor, 0.5)) if floor.size else float("nan")
    f99 = float(np.quantile(floor, 0.99)) if floor.size else float("nan")
    generated = run["changed"] / args.duration
    common = dict(dim=args.dim, dtype=args.dtype, duration_s=args.duration,
                  warmup_s=args.warmup, tick_s=args.tick, messages=int(f.size),
                  generated_rows_per_s=generated, producer_late_ticks=int(run["lag_ticks"]),
                  ticks=int(run["ticks"]), daemon_stats=s["stats"],
                  daemon_torch_imported=bool(s["torch_imported"]))
    return [
        result("e2e_rows_per_s", achieved, args.rows_per_s, 0.95, "rows/s",
               baseline_desc="offered load (rows changed per second by the producer)",
               note=f"rows applied by the predictor per second over {window:.1f} s after "
                    f"{args.warmup:g} s warm-up; producer generated {generated:,.0f} rows/s",
               **common),
        result("e2e_freshness_p99_s", float(p99), _BUDGET_S, 1.0, "s",
               ratio=float(p99) / _BUDGET_S, higher_is_better=False,
               baseline_desc="the issue's budget (0.5 s) at this load",
               note=f"p99 of (apply time − trainer read ts) over {f.size} messages at "
                    f"{args.rows_per_s:,.0f} rows/s offered; p50 {p50 * 1e3:.0f} ms; "
                    f"1-row floor p99 {f99 * 1e3:.0f} ms",
               p50_s=float(p50), floor_p99_s=f99, **common),
        result("e2e_freshness_p50_s", float(p50), f50, None, "s",
               ratio=float(p50) / f50 if f50 > 0 else float("nan"), higher_is_better=False,
               baseline_desc="same-run transport floor: p50 freshness of 1-row messages",
               note="p50 freshness under load vs the 1-row transport floor (report only)",
               floor_p50_s=f50, **common),
    ]
