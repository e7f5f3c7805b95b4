"""Benchmark: applying wire batches into a ServingTable, and looking rows up.

``apply``: rows/s of ``ServingTable.apply`` (dim 64, 1M resident ids, 4K-row batches that
were f16 on the wire, decoded once up front; the timed work is dequantize + validate +
index + scatter) against a raw numpy scatter of the same rows into a dense float32 array
with precomputed row positions (``dense[pos] = rows.astype(f32)``) in the same run.
Goal: ratio ≥ 0.5.

Also, for information: ``apply_new_ids`` (every id of every batch new to the table — the
index insert path; the ids are deleted again, untimed, between repeats) and ``lookup``
(ids/s of ``ServingTable.lookup`` on 4K-id batches, 10% unknown, against a dense gather
with precomputed positions).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench._common import best_time, result
from consumers.serving.table import ServingTable
from deltastream.wire import DeltaBatch, decode, encode

__all__ = ["main"]


def _batches(ids: np.ndarray, pos: np.ndarray, batch: int, dim: int, rng, dtype: str):
    """Decoded wire batches over ``ids`` (one per ``batch`` slice) and dense positions."""
    out = []
    for i in range(0, ids.shape[0], batch):
        order = np.argsort(ids[i:i + batch])
        bids, bpos = ids[i:i + batch][order], pos[i:i + batch][order]
        rows = rng.standard_normal((bids.shape[0], dim)).astype(np.float32)
        msgs = encode(DeltaBatch("bench", "emb", 0, 0, len(out), 0, 0, ids=bids, rows=rows,
                                 dtype=dtype), max_message_bytes=64 << 20)
        assert len(msgs) == 1
        out.append((decode(msgs[0]), bpos))
    return out


def _paired(fn, base, repeat: int) -> tuple[float, float]:
    """Median times of ``fn`` and ``base``, measured in alternation so that load from other
    processes on a shared machine hits both alike."""
    fn()
    base()
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeat):
        a.append(best_time(fn, repeat=1, warmup=0))
        b.append(best_time(base, repeat=1, warmup=0))
    return float(np.median(a)), float(np.median(b))


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns result records (see bench._common.result)."""
    ap = argparse.ArgumentParser(prog="deltastream bench apply", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=64, help="row width (default 64)")
    ap.add_argument("--resident", type=int, default=1_000_000,
                    help="ids already in the table (default 1M)")
    ap.add_argument("--batch", type=int, default=4096, help="rows per batch (default 4096)")
    ap.add_argument("--batches", type=int, default=32, help="batches per timed run (32)")
    ap.add_argument("--wire-dtype", default="f16", choices=["f32", "f16", "bf16", "i8"],
                    help="dtype the rows had on the wire (default f16)")
    ap.add_argument("--repeat", type=int, default=7,
                    help="timed runs, median; table and baseline alternate (default 7)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.resident < args.batch * args.batches:
        ap.error("--resident must be at least --batch × --batches")
    rng = np.random.default_rng(args.seed)
    dim, n_res = args.dim, args.resident

    # Resident ids: random int64 (hash-like ids, as trainers produce), unique.
    ids = np.unique(rng.integers(0, 1 << 62, size=n_res + n_res // 50, dtype=np.int64))
    ids = rng.permutation(ids)[:n_res]
    table = ServingTable("emb", dim, capacity=n_res)
    init_rows = rng.standard_normal((n_res, dim)).astype(np.float32)
    for i in range(0, n_res, 1 << 18):
        table.upsert(ids[i:i + (1 << 18)], init_rows[i:i + (1 << 18)])
    dense = init_rows  # the baseline's table: row i belongs to ids[i]
    del init_rows

    n_rows = args.batch * args.batches
    pick = rng.permutation(n_res)[:n_rows]
    upd = _batches(ids[pick], pick, args.batch, dim, rng, args.wire_dtype)

    def run_table() -> None:
        for b, _ in upd:
            table.apply(b)

    def run_dense() -> None:
        for b, p in upd:
            dense[p] = b.rows_f32()

    t_table, t_dense = _paired(run_table, run_dense, args.repeat)
    # sanity: both hold the last values written
    b0, p0 = upd[-1]
    assert np.array_equal(table.lookup(b0.ids), dense[p0])

    common = {"dim": dim, "resident": n_res, "batch": args.batch, "wire_dtype": args.wire_dtype}
    out = [result("apply", n_rows / t_table, n_rows / t_dense, 0.5, "rows/s", **common,
                  baseline_name="numpy scatter into dense f32 with precomputed positions")]

    # New ids: insert path of the index (rows/s), deleted again untimed between runs.
    new_ids = np.setdiff1d(np.unique(rng.integers(0, 1 << 62, size=n_rows * 2,
                                                  dtype=np.int64)), ids)
    new_ids = rng.permutation(new_ids)[:n_rows]
    spare = np.zeros((n_rows, dim), np.float32)
    new = _batches(new_ids, np.arange(n_rows), args.batch, dim, rng, args.wire_dtype)
    times, base_times = [], []
    for _ in range(args.repeat + 1):
        table.delete(new_ids)
        t0 = time.perf_counter()
        for b, _ in new:
            table.apply(b)
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b, p in new:
            spare[p] = b.rows_f32()
        base_times.append(time.perf_counter() - t0)
    t_new, t_new_base = float(np.median(times[1:])), float(np.median(base_times[1:]))
    out.append(result("apply_new_ids", n_rows / t_new, n_rows / t_new_base, None, "rows/s",
                      **common, baseline_name="numpy scatter into dense f32"))
    table.delete(new_ids)

    # Lookup: 4K-id batches, 10% unknown ids.
    k = args.batch
    n_unknown = k // 10
    lk = []
    for i in range(args.batches):
        p = rng.integers(0, n_res, size=k - n_unknown)
        q = np.concatenate([ids[p], new_ids[i * n_unknown:(i + 1) * n_unknown]])
        lk.append((q, p))

    def look_table() -> None:
        for q, _ in lk:
            table.lookup(q)

    def look_dense() -> None:
        for _, p in lk:
            np.take(dense, p, axis=0)

    n_look = args.batches * k
    t_lt, t_ld = _paired(look_table, look_dense, args.repeat)
    out.append(result("lookup", n_look / t_lt, n_look / t_ld, None, "ids/s", dim=dim,
                      resident=n_res, batch=k, unknown_fraction=n_unknown / k,
                      baseline_name="numpy gather from dense f32 with precomputed positions"))
    return out


if __name__ == "__main__":
    from bench._common import emit

    emit(main(), False)
