"""Benchmark: HashTable lookup of Zipf-distributed id batches over a large resident table.

Figures (all measured in the same run, on the same row storage):

* ``hashtable.lookup_vs_floor`` -- ``HashTable.lookup`` of ``--batch`` ids (Zipf over
  ``--rows`` resident rows, width ``--dim``) vs a dense ``index_select`` with the row positions
  precomputed (the floor: the gather alone). Goal ratio >= 0.3.
* ``hashtable.lookup_vs_dict`` -- the same lookup vs a Python ``dict`` id -> position index
  followed by the same ``index_select``. Goal >= 20x.
* ``hashtable.find_vs_dict`` -- id -> position resolution alone (no rows) vs the dict (info).
* ``hashtable.insert_heavy`` -- training-mode forward (no grad) of batches where
  ``--new-frac`` of the ids are unseen (inserted with the initializer), vs the pure lookup of
  a batch of the same size (info). The new ids are evicted again after each timed call
  (untimed), so the table stays at ``--rows`` and evicted rows/slots are reused.
* ``hashtable.gpu_find`` -- with ``--device cuda``: ids resolved per second, against the
  issue's absolute goal of 0.5 G ids/s.

Run: ``deltastream bench hashtable [--rows N --batch B --dim D --device cpu|cuda]``.
Methods are timed in alternation (median of ``--repeat`` rounds) with ``--threads 1`` by
default: on shared 2-core machines a multi-threaded ATen op over 64K elements stalls whenever
the sibling core is busy, and a lookup is ~25 such ops, so with 2 threads the figures measure
the scheduler (``--threads 0`` keeps torch's own setting).

The dict goal cannot be met on CPU by any index: the dict path is the dict resolution *plus*
the same row gather as the floor, so lookup_vs_dict <= t_dict / t_floor (~10-14x here) even
for a zero-cost index; ``find_vs_dict`` shows the index-only comparison.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np
import torch

from bench._common import add_threads_flag, best_time, result, torch_threads, zipf_ids
from deltastream.embedding.hashtable import HashTable, normal_initializer

__all__ = ["main"]

log = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved(fns, n_batches: int, repeat: int, device: torch.device) -> list[float]:
    """Median seconds per batch of each ``fn(i)``, timed in alternation.

    The methods take turns (one pass over all batches each, ``repeat`` rounds) so that load
    from other processes on a shared machine hits all of them alike.
    """
    def all_batches(fn):
        def go():
            for i in range(n_batches):
                fn(i)
            _sync(device)
        return go

    passes = [all_batches(fn) for fn in fns]
    for go in passes:  # warm-up
        go()
    samples = [[] for _ in fns]
    for _ in range(repeat):
        for k, go in enumerate(passes):
            samples[k].append(best_time(go, repeat=1, warmup=0))
    return [statistics.median(s) / n_batches for s in samples]


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns the figures as :func:`bench._common.result` dicts."""
    ap = argparse.ArgumentParser(prog="deltastream bench hashtable", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="resident rows (default 1M)")
    ap.add_argument("--batch", type=int, default=65536, help="ids per batch (default 64K)")
    ap.add_argument("--dim", type=int, default=64, help="row width (default 64)")
    ap.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent (default 1.05)")
    ap.add_argument("--batches", type=int, default=8, help="distinct batches cycled per timing")
    ap.add_argument("--repeat", type=int, default=7, help="timed rounds (median)")
    ap.add_argument("--new-frac", type=float, default=0.5,
                    help="fraction of unseen ids in the insert-heavy batches (default 0.5)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    add_threads_flag(ap)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for flag in ("rows", "batch", "dim", "batches", "repeat"):
        if getattr(args, flag) <= 0:
            ap.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    if not 0.0 <= args.new_frac <= 1.0:
        ap.error(f"--new-frac must be in [0, 1], got {args.new_frac}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda requested but torch.cuda.is_available() is False")
    with torch_threads(args.threads):
        return _run(args, device)


def _run(args: argparse.Namespace, device: torch.device) -> list[dict]:

    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    # Resident ids: distinct random 62-bit ids (positive and negative), inserted in random order.
    raw = torch.randint(-(1 << 61), 1 << 61, (int(args.rows * 1.01) + 16,), generator=gen)
    resident = torch.unique(raw)[: args.rows]
    if resident.numel() < args.rows:
        raise RuntimeError("could not draw enough distinct ids")
    resident = resident[torch.randperm(args.rows, generator=gen)]
    table = HashTable(args.dim, name="bench", device=device, capacity=args.rows,
                      initializer=normal_initializer(0.01, seed=args.seed))
    t0 = time.perf_counter()
    table.insert(resident.to(device), torch.randn(args.rows, args.dim, generator=gen).to(device))
    _sync(device)
    build_s = time.perf_counter() - t0
    log.info("built %d rows in %.2fs (%d slots)", len(table), build_s, table.num_slots)

    # Zipf batches: rank -> resident id through a random permutation (hot ids spread out).
    hot = torch.from_numpy(rng.permutation(args.rows))
    batches = []
    for _ in range(args.batches):
        # ranks from the numpy stream that drew ``hot`` (bits=None: ranks, not scattered ids)
        ranks = zipf_ids(args.batch, vocab=args.rows, alpha=args.zipf, generator=rng, bits=None)
        batches.append(resident[hot[ranks]].to(device))
    positions = [table.positions(b) for b in batches]
    assert all(bool((p >= 0).all()) for p in positions)
    weight = table._weight  # the same storage the table gathers from
    unique_frac = float(np.mean([b.unique().numel() / b.numel() for b in batches]))

    # correctness first: the table returns exactly the rows the floor gathers
    for b, p in zip(batches, positions, strict=True):
        if not torch.equal(table.lookup(b), weight.index_select(0, p)):
            raise AssertionError("HashTable.lookup disagrees with the dense gather")

    ids_cpu = resident.tolist()
    pos_of = dict(zip(ids_cpu, table.positions(resident.to(device)).tolist(), strict=True))
    batches_cpu = [b.cpu() for b in batches]

    def dict_find(i):
        return torch.tensor([pos_of[x] for x in batches_cpu[i].tolist()], device=device)

    t_floor, t_ours, t_find, t_dict_find, t_dict = _interleaved([
        lambda i: weight.index_select(0, positions[i]),
        lambda i: table.lookup(batches[i]),
        lambda i: table.positions(batches[i]),
        dict_find,
        lambda i: weight.index_select(0, dict_find(i)),
    ], args.batches, args.repeat, device)

    # insert-heavy: (1 - new_frac) Zipf resident ids + new_frac fresh ids (time insert only)
    n_new = int(round(args.batch * args.new_frac))
    table.train()
    ins_times = []
    with torch.no_grad():
        for r in range(args.repeat + 1):
            fresh = torch.randint(1 << 61, 1 << 62, (n_new,), generator=gen)
            mixed = torch.cat([batches_cpu[r % args.batches][: args.batch - n_new], fresh])
            mixed = mixed[torch.randperm(mixed.numel(), generator=gen)].to(device)
            _sync(device)
            t0 = time.perf_counter()
            table(mixed)
            _sync(device)
            if r:  # first one is warm-up
                ins_times.append(time.perf_counter() - t0)
            table.evict(fresh.to(device))
    t_ins = float(np.median(ins_times))
    assert len(table) == args.rows

    info = {"rows": args.rows, "batch": args.batch, "dim": args.dim, "zipf": args.zipf,
            "unique_frac": round(unique_frac, 4), "device": str(device),
            "threads": torch.get_num_threads(), "slots": table.num_slots,
            "build_s": round(build_s, 3)}
    b = args.batch
    out = [
        result("hashtable.lookup_vs_floor", b / t_ours, b / t_floor, 0.3, "ids/s",
               ms_ours=t_ours * 1e3, ms_floor=t_floor * 1e3, **info),
        result("hashtable.lookup_vs_dict", b / t_ours, b / t_dict, 20.0, "ids/s",
               ms_ours=t_ours * 1e3, ms_dict=t_dict * 1e3, **info),
        result("hashtable.find_vs_dict", b / t_find, b / t_dict_find, None, "ids/s",
               ms_ours=t_find * 1e3, ms_dict=t_dict_find * 1e3, **info),
        result("hashtable.insert_heavy", b / t_ins, b / t_ours, None, "ids/s",
               new_frac=args.new_frac, ms_insert=t_ins * 1e3, ms_lookup=t_ours * 1e3, **info),
    ]
    if device.type == "cuda":
        gids = b / t_find / 1e9
        out.append(result("hashtable.gpu_find", gids, 0.5, 1.0, "Gid/s", ratio=gids / 0.5,
                          note="absolute goal: 0.5 G ids/s (ratio = value / 0.5)", **info))
    return out


if __name__ == "__main__":
    from bench._common import emit

    emit(main(), False)
