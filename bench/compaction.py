"""Benchmark: DeltaStore append + compact + get_unique vs TorchRec's compaction algorithm.

Workload (issue 3): ``--batches`` batches (100) of ``--batch-size`` Zipf-distributed ids (64K)
with a ``[batch, dim]`` state per id (dim 64), FIRST mode. Both sides get the same batches.

* baseline — TorchRec's ``DeltaStore``: appends are list appends; the compaction concatenates
  every id and state, ``torch.unique(return_inverse=True)``, ``scatter_reduce("amin")`` over
  positions to find each id's first occurrence, then gathers those states.
* ours — :class:`deltastream.tracking.store.DeltaStore`: ``append`` per batch (sorted, deduplicated
  runs), ``compact(0, batches)``, ``get_unique(0)``.

Both results are checked equal (ids and FIRST states) before timing. The figure is
``ratio = baseline_time / our_time`` (goal 2).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench._common import add_threads_flag, result, torch_threads, zipf_ids
from deltastream.tracking.store import DeltaStore
from deltastream.types import UpdateMode

__all__ = ["main", "torchrec_first"]


def torchrec_first(ids: list[torch.Tensor],
                   states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchRec's FIRST compaction: concat, unique with inverse, amin of positions, gather."""
    cat_ids = torch.cat(ids)
    cat_states = torch.cat(states)
    unique_ids, inverse = torch.unique(cat_ids, return_inverse=True)
    row_idx = torch.arange(cat_ids.numel())
    first = torch.full((unique_ids.numel(),), cat_ids.numel(), dtype=torch.int64).scatter_reduce(
        0, inverse, row_idx, reduce="amin", include_self=False)
    return unique_ids, cat_states[first]


def _ours(ids: list[torch.Tensor], states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    store = DeltaStore(UpdateMode.FIRST)
    for b, (i, s) in enumerate(zip(ids, states, strict=True)):
        store.append(b, "t", i, s)
    store.compact(0, len(ids))
    rows = store.get_unique(0)["t"]
    return rows.ids, rows.states


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns one result record (see ``bench._common.result``)."""
    p = argparse.ArgumentParser(prog="deltastream bench compaction", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=100, help="batches appended (default 100)")
    p.add_argument("--batch-size", type=int, default=65536, help="ids per batch (default 64K)")
    p.add_argument("--dim", type=int, default=64, help="state width (default 64)")
    p.add_argument("--vocab", type=int, default=1_000_000, help="distinct Zipf ranks (1M)")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent (default 1.05)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (5)")
    add_threads_flag(p)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with torch_threads(args.threads):
        return _run(p, args)


def _run(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[dict]:
    for name in ("batches", "batch_size", "dim", "vocab", "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")

    g = torch.Generator().manual_seed(args.seed)
    ids = [zipf_ids(args.batch_size, vocab=args.vocab, alpha=args.alpha, generator=g)
           for _ in range(args.batches)]
    states = [torch.randn(args.batch_size, args.dim, generator=g) for _ in range(args.batches)]

    ref_ids, ref_states = torchrec_first(ids, states)
    our_ids, our_states = _ours(ids, states)
    equal = bool(torch.equal(ref_ids, our_ids) and torch.equal(ref_states, our_states))
    if not equal:
        raise AssertionError("DeltaStore FIRST result differs from TorchRec's algorithm")
    unique = int(ref_ids.numel())
    del ref_ids, ref_states, our_ids, our_states

    # Interleave the two sides so machine noise hits both alike; report medians.
    t_base, t_ours = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        torchrec_first(ids, states)
        t_base.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _ours(ids, states)
        t_ours.append(time.perf_counter() - t0)
    tb, to = statistics.median(t_base), statistics.median(t_ours)
    total = args.batches * args.batch_size
    return [result(
        "compaction.first_append_compact_get", total / to / 1e6, total / tb / 1e6, 2.0,
        "M ids/s", ratio=tb / to, our_s=to, baseline_s=tb, batches=args.batches,
        batch_size=args.batch_size, dim=args.dim, unique_ids=unique, equal=equal,
        threads=torch.get_num_threads())]


if __name__ == "__main__":  # pragma: no cover
    from bench._common import emit
    emit(main(), False)
