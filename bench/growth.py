"""Benchmark: a shared table's growth with its memory backed ahead by the backer's thread,
against backing inline in the apply (:mod:`consumers.serving.backer`).

One process grows a shared table (``ServingTable.share``, under ``--shm-dir``) from 0 to
``--rows`` × ``--dim`` f32 rows by applying ``--batch``-row wire batches of new ids back to
back, as the sync daemon applies one message after another; nothing reads and nothing is
checkpointed. Each run makes a table of its own, alternating the two ways ``--rounds``
times (``DELTASTREAM_SHM_BACKER=0`` is the inline way), after ``--rest`` seconds of rest
so that a VM's host has taken the freed memory back (free-page reporting) and every run
starts on fresh memory, as a growing table does.

Figures (medians over the rounds; ratio = backer / inline):

* ``growth.rows_per_s`` — rows applied per second over the whole growth (higher is better);
* ``growth.apply_max_ms`` — the slowest single apply (lower is better: how long a message
  waits behind one);
* ``growth.min_window`` — the slowest 1-second window of apply throughput against the
  median window, each way (issue 12's goal ≥ 0.5), for information.

Run: ``deltastream bench growth [--rows 10000000] [--rounds 2] [--rest 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench._common import result, row_ids
from consumers.serving.backer import BACKER_ENV
from consumers.serving.table import ServingTable
from deltastream.wire import DeltaBatch

__all__ = ["main"]


def _grow(args: argparse.Namespace, inline: bool) -> tuple[float, float, float]:
    """One growth: (rows/s, slowest apply in s, slowest 1-s window / median window)."""
    time.sleep(args.rest)
    old = os.environ.get(BACKER_ENV)
    os.environ[BACKER_ENV] = "0" if inline else "1"
    try:
        with tempfile.TemporaryDirectory(prefix="ds-bench-growth-") as state:
            table = ServingTable("emb", args.dim, capacity=args.batch)
            table.share(state, shm_dir=args.shm_dir)
            try:
                return _apply_all(args, table)
            finally:
                table.unshare()
    finally:
        if old is None:
            del os.environ[BACKER_ENV]
        else:
            os.environ[BACKER_ENV] = old


def _apply_all(args: argparse.Namespace, table: ServingTable) -> tuple[float, float, float]:
    pool = np.random.default_rng(0).standard_normal((args.batch, args.dim)).astype(np.float32)
    done, seq, slowest, windows, win_rows = 0, 0, 0.0, [], 0
    t0 = win_start = time.monotonic()
    while done < args.rows:
        n = min(args.batch, args.rows - done)
        ids = np.sort(row_ids(np.arange(done, done + n)))
        a = time.perf_counter()
        table.apply(DeltaBatch("bench", "emb", 0, 0, seq, seq, 0, ids=ids, rows=pool[:n],
                               dtype="f32"))
        slowest = max(slowest, time.perf_counter() - a)
        done, seq, win_rows = done + n, seq + 1, win_rows + n
        now = time.monotonic()
        if now - win_start >= 1.0:
            windows.append(win_rows / (now - win_start))
            win_start, win_rows = now, 0
    took = time.monotonic() - t0
    low = min(windows) / statistics.median(windows) if len(windows) >= 2 else float("nan")
    return args.rows / took, slowest, low


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns its figures as :func:`bench._common.result` dicts."""
    ap = argparse.ArgumentParser(prog="deltastream bench growth", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000, help="rows grown per run (10M)")
    ap.add_argument("--dim", type=int, default=64, help="row width, f32 (64)")
    ap.add_argument("--batch", type=int, default=4096, help="rows per applied batch (4096)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each way, alternating (2)")
    ap.add_argument("--rest", type=float, default=5.0,
                    help="seconds of rest before each run (5; 0 on bare metal)")
    ap.add_argument("--shm-dir", default=None, metavar="DIR",
                    help="where the table lives (default: $DELTASTREAM_SHM_DIR, else /dev/shm)")
    args = ap.parse_args(argv)
    for flag in ("rows", "dim", "batch", "rounds"):
        if getattr(args, flag) <= 0:
            ap.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    if args.rest < 0:
        ap.error(f"--rest must be >= 0, got {args.rest}")
    if args.shm_dir is not None and not Path(args.shm_dir).is_dir():
        ap.error(f"--shm-dir: expected an existing directory, got {args.shm_dir!r}")
    runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for inline in (True, False):
            runs[inline].append(_grow(args, inline))
    new, was = (tuple(statistics.median(r[i] for r in runs[inline]) for i in range(3))
                for inline in (False, True))
    common = dict(rows=args.rows, dim=args.dim, batch=args.batch, rounds=args.rounds)
    size = f"0 -> {args.rows:,} x {args.dim} rows, median of {args.rounds}"
    return [
        result("growth.rows_per_s", new[0], was[0], None, "rows/s",
               baseline_desc="same run: the same growth backing memory inline in the apply",
               note=f"{size}; runs {[round(r[0]) for r in runs[False]]} against "
                    f"{[round(r[0]) for r in runs[True]]}", **common),
        result("growth.apply_max_ms", new[1] * 1e3, was[1] * 1e3, None, "ms",
               ratio=new[1] / was[1], higher_is_better=False,
               baseline_desc="same run: the slowest apply backing memory inline",
               note=f"{size}", **common),
        result("growth.min_window", new[2], was[2], None, "ratio",
               baseline_desc="same run: slowest/median 1-second window backing inline",
               note=f"{size}; goal of issue 12: >= 0.5 each way", **common),
    ]


if __name__ == "__main__":  # pragma: no cover
    from bench._common import emit
    emit(main(sys.argv[1:]), False)
