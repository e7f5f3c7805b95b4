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
* ``hashtable.find_<B>`` / ``hashtable.find_or_insert_<B>`` -- with ``--device cuda`` (or
  ``--sizes``): for each ``BATCHxROWS`` of ``--sizes`` (default on CUDA: a 64K batch over
  1M rows and a 1M batch over 4M rows) a fresh table of ``ROWS`` rows, and per batch size:
  ids/s of ``HashTable.positions`` (find), and of a training-mode forward without grad where
  ``--new-frac`` of the ids are unseen (find-or-insert: the index, the new rows from the
  initializer and the row gather), each against the ``index_select`` floor of the same
  batch (ratio; goal for find >= 0.5). The issue's absolute goals (H100: find >= 1.0 G ids/s
  at 64K and >= 2.0 G ids/s at 1M, find-or-insert >= 0.3 G ids/s) are in ``goal_ids_s`` and
  ``meets_goal_ids_s``. On CUDA these run the Triton kernels of ``deltastream.kernels``
  (``DELTASTREAM_KERNELS=off`` times the torch path instead).

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
from deltastream.kernels.runtime import use_kernels

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
    ap.add_argument("--sizes", type=_sizes, default=None,
                    help="BATCHxROWS[,BATCHxROWS...] of the per-batch-size figures (default on "
                         "cuda: 65536x1000000,1048576x4000000; none on cpu)")
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
    if args.sizes is None:
        args.sizes = list(_CUDA_SIZES) if device.type == "cuda" else []
    with torch_threads(args.threads):
        out = _run(args, device)
        for batch, rows in args.sizes:
            out += _per_batch_size(args, device, batch, rows)
        return out


# (batch, resident rows) of the per-batch-size figures on CUDA, and the absolute
# goals in ids/s (H100) for find at that batch size and for find-or-insert
_CUDA_SIZES = ((65536, 1_000_000), (1 << 20, 4_000_000))
_FIND_GOAL_IDS_S = {65536: 1.0e9, 1 << 20: 2.0e9}
_FIND_OR_INSERT_GOAL_IDS_S = 0.3e9


def _sizes(text: str) -> list[tuple[int, int]]:
    """argparse type of ``--sizes``: ``BATCHxROWS`` pairs, comma-separated."""
    out = []
    for part in text.split(","):
        try:
            batch, rows = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected BATCHxROWS[,BATCHxROWS...], got {text!r}") from None
        if batch <= 0 or rows <= 0:
            raise argparse.ArgumentTypeError(f"batch and rows must be positive, got {part!r}")
        out.append((batch, rows))
    return out


def _build(rows: int, dim: int, batch: int, n_batches: int, zipf: float, seed: int,
           device: torch.device) -> tuple[HashTable, torch.Tensor, list[torch.Tensor], float]:
    """A table of ``rows`` resident ids and ``n_batches`` Zipf batches of ``batch`` of them.

    Returns ``(table, resident ids (CPU), batches (on device), build seconds)``.
    """
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    # Resident ids: distinct random 62-bit ids (positive and negative), inserted in random order.
    raw = torch.randint(-(1 << 61), 1 << 61, (int(rows * 1.01) + 16,), generator=gen)
    resident = torch.unique(raw)[:rows]
    if resident.numel() < rows:
        raise RuntimeError("could not draw enough distinct ids")
    resident = resident[torch.randperm(rows, generator=gen)]
    table = HashTable(dim, name="bench", device=device, capacity=rows,
                      initializer=normal_initializer(0.01, seed=seed))
    t0 = time.perf_counter()
    table.insert(resident.to(device), torch.randn(rows, dim, generator=gen).to(device))
    _sync(device)
    build_s = time.perf_counter() - t0
    log.info("built %d rows in %.2fs (%d slots)", len(table), build_s, table.num_slots)

    # Zipf batches: rank -> resident id through a random permutation (hot ids spread out).
    hot = torch.from_numpy(rng.permutation(rows))
    batches = []
    for _ in range(n_batches):
        # ranks from the numpy stream that drew ``hot`` (bits=None: ranks, not scattered ids)
        ranks = zipf_ids(batch, vocab=rows, alpha=zipf, generator=rng, bits=None)
        batches.append(resident[hot[ranks]].to(device))
    return table, resident, batches, build_s


def _time_find_or_insert(table: HashTable, batches: list[torch.Tensor], new_frac: float,
                         repeat: int, seed: int, device: torch.device) -> float:
    """Median seconds of a training-mode forward (no grad) of a batch where ``new_frac`` of
    the ids are unseen; the new ids are evicted after each call (untimed), so the table
    keeps its size and evicted rows/slots are reused."""
    gen = torch.Generator().manual_seed(seed + 1)
    batch = batches[0].numel()
    n_new = int(round(batch * new_frac))
    table.train()
    times = []
    with torch.no_grad():
        for r in range(repeat + 1):
            fresh = torch.randint(1 << 61, 1 << 62, (n_new,), generator=gen)
            mixed = torch.cat([batches[r % len(batches)][: batch - n_new].cpu(), fresh])
            mixed = mixed[torch.randperm(mixed.numel(), generator=gen)].to(device)
            _sync(device)
            t0 = time.perf_counter()
            table(mixed)
            _sync(device)
            if r:  # first one is warm-up
                times.append(time.perf_counter() - t0)
            table.evict(fresh.to(device))
    return float(np.median(times))


def _per_batch_size(args: argparse.Namespace, device: torch.device, batch: int,
                    rows: int) -> list[dict]:
    """find and find-or-insert ids/s at one batch size vs the index_select floor."""
    table, _, batches, build_s = _build(rows, args.dim, batch, args.batches, args.zipf,
                                        args.seed, device)
    positions = [table.positions(b) for b in batches]
    weight = table.storage
    for b, p in zip(batches, positions, strict=True):  # correctness before speed
        if not torch.equal(table.lookup(b), weight.index_select(0, p)):
            raise AssertionError("HashTable.lookup disagrees with the dense gather")
    t_floor, t_find = _interleaved([
        lambda i: weight.index_select(0, positions[i]),
        lambda i: table.positions(batches[i]),
    ], args.batches, args.repeat, device)
    t_foi = _time_find_or_insert(table, batches, args.new_frac, args.repeat, args.seed, device)
    assert len(table) == rows
    label = f"{batch // 1024}K" if batch < 1 << 20 else f"{batch / (1 << 20):g}M"
    info = {"rows": rows, "batch": batch, "dim": args.dim, "zipf": args.zipf,
            "device": str(device), "kernels": use_kernels(batches[0]),
            "slots": table.num_slots, "build_s": round(build_s, 3)}
    find_goal = _FIND_GOAL_IDS_S.get(batch)
    return [
        result(f"hashtable.find_{label}", batch / t_find, batch / t_floor, 0.5, "ids/s",
               ms_ours=t_find * 1e3, ms_floor=t_floor * 1e3, goal_ids_s=find_goal,
               meets_goal_ids_s=None if find_goal is None else batch / t_find >= find_goal,
               **info),
        result(f"hashtable.find_or_insert_{label}", batch / t_foi, batch / t_floor, None,
               "ids/s", new_frac=args.new_frac, ms_ours=t_foi * 1e3, ms_floor=t_floor * 1e3,
               goal_ids_s=_FIND_OR_INSERT_GOAL_IDS_S,
               meets_goal_ids_s=batch / t_foi >= _FIND_OR_INSERT_GOAL_IDS_S, **info),
    ]


def _run(args: argparse.Namespace, device: torch.device) -> list[dict]:
    table, resident, batches, build_s = _build(args.rows, args.dim, args.batch, args.batches,
                                               args.zipf, args.seed, device)
    positions = [table.positions(b) for b in batches]
    assert all(bool((p >= 0).all()) for p in positions)
    weight = table.storage  # the same storage the table gathers from
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
    t_ins = _time_find_or_insert(table, batches, args.new_frac, args.repeat, args.seed, device)
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
    return out


if __name__ == "__main__":
    from bench._common import emit

    emit(main(), False)
