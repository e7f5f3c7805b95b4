"""Benchmark: the cost of one :func:`~deltastream.publish_delta` round against the rows it
carries.

A :class:`~deltastream.HashTable` of width ``--dim`` holds ``P`` carried rows per size of
``--pending`` (every row moved, then one round of ``SelectionPolicy(k=--k)`` carried all
but ``k`` of them, not timed). Then, ``--rounds`` times: ``--changed`` random rows move (a
recorded lookup and a write, as a training step does) and one round of the same policy is
timed (a real :class:`~deltastream.DeltaPublisher` on the embedded broker, f16). A round
whose cost follows what changed takes about the same time at every ``P``; one that
re-scores the carried set grows with it.

Figures per ``P``: the median round (ms); ``ratio`` = that time ÷ the median round at the
smallest ``P`` (goal: about 1, "no growth with the carried set"; report only).
Run: ``deltastream bench delta-rounds [--pending 10000,100000,1000000] [--changed 2000]
[--k 1000]``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from bench._common import add_threads_flag, result, torch_threads

__all__ = ["main"]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _rounds(args: argparse.Namespace, pending: int, servers: str) -> list[float]:
    """Seconds of each timed round with ``pending`` rows carried."""
    from deltastream import (
        DeltaPublisher,
        DeltaTracker,
        HashTable,
        TrackingMode,
        ensure_topic,
        publish_delta,
    )
    from deltastream.publishing.rounds import SelectionPolicy

    g = torch.Generator().manual_seed(args.seed)
    n = pending + args.k
    model = torch.nn.ModuleDict({"t": HashTable(args.dim, name="t", capacity=2 * n)})
    table = model["t"]
    table.insert(torch.arange(n), torch.randn(n, args.dim, generator=g))
    tracker = DeltaTracker(model, consumers=["p"], mode=TrackingMode.EMBEDDING)
    policy = SelectionPolicy(k=args.k, max_age=None)
    topic = f"bench.delta_rounds.{pending}.{time.time_ns()}"
    ensure_topic(servers, topic, partitions=1)

    def move(ids: torch.Tensor) -> None:
        with torch.no_grad():
            table.insert(ids, table(ids) + 0.01 * torch.randn(ids.numel(), args.dim,
                                                             generator=g))
        tracker.step()

    out = []
    with DeltaPublisher(servers, topic, model="bench", shard=0, dtype="f16") as pub:
        for lo in range(0, n, 1 << 18):  # every row moved, in steps of bounded size
            move(torch.arange(lo, min(n, lo + (1 << 18))))
        publish_delta(tracker, pub, "p", policy, step=0)  # all but k carried
        pub.flush()
        for r in range(args.rounds):
            move(torch.randint(0, n, (args.changed,), generator=g).unique())
            t0 = time.perf_counter()
            publish_delta(tracker, pub, "p", policy, step=r + 1)
            out.append(time.perf_counter() - t0)
            pub.flush()  # delivery is not what is timed
    tracker.close()
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    """Time publish_delta rounds at each carried-set size; one figure per size."""
    p = argparse.ArgumentParser(prog="deltastream bench delta-rounds", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pending", type=_ints, default=[10_000, 100_000, 1_000_000],
                   help="carried rows before the timed rounds (10000,100000,1000000)")
    p.add_argument("--changed", type=int, default=2000, help="rows moved per round (2000)")
    p.add_argument("--k", type=int, default=1000, help="rows a round publishes (1000)")
    p.add_argument("--dim", type=int, default=32, help="row width (32)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per size (7)")
    p.add_argument("--servers", default=None, help="a Kafka broker (default: embedded)")
    add_threads_flag(p)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.pending, default=0) <= 0 or args.changed <= 0 or args.k <= 0:
        p.error("--pending sizes, --changed and --k must be positive")
    out: list[dict] = []
    with torch_threads(args.threads), contextlib.ExitStack() as stack:
        servers = args.servers
        if servers is None:
            from deltastream.broker import EmbeddedBroker
            servers = stack.enter_context(EmbeddedBroker()).bootstrap_servers
        base = None
        for pending in sorted(args.pending):
            ms = statistics.median(_rounds(args, pending, servers)) * 1e3
            base = ms if base is None else base
            out.append(result(f"delta_rounds.p{pending}", ms, base, None, "ms/round",
                              ratio=ms / base, higher_is_better=False, pending=pending,
                              changed=args.changed, k=args.k,
                              baseline_desc=f"the round at {min(args.pending):,} carried",
                              note=f"{args.changed:,} rows changed, k={args.k:,}"))
    return out


if __name__ == "__main__":  # pragma: no cover
    from bench._common import emit
    emit(main(), False)
