"""Benchmark: cost of DeltaTracker on a CTR training step.

Model: two :class:`~deltastream.HashTable` s (user, item; ``--dim`` 32) feeding an MLP
(``[u, v, u*v] -> 64 -> 32 -> 1``), batch ``--batch`` (4096) of Zipf ids, BCE loss,
row-wise Adagrad for the tables and ``torch.optim.Adam`` for the MLP.

Three configurations run the same batches: no tracker (baseline), a tracker in ID_ONLY mode
and one in EMBEDDING mode, each calling ``get_delta`` every ``--read-every`` (10) steps (the
read is timed too). Timing is interleaved: every round runs one chunk of ``--read-every``
steps per configuration, in a rotating order, on the same batches; trackers are attached
(hooks registered) before the chunk and closed after it. Every id is inserted during a
warm-up pass, so no configuration pays the inserts. Figures: ``ratio = t_with / t_without``
(per round, same batches; the median over rounds; process CPU time by default, ``--clock wall`` for
elapsed time), goals 1.03 (ID_ONLY) and 1.10 (EMBEDDING), lower is better.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench._common import add_threads_flag, result, torch_threads, zipf_ids
from deltastream.embedding.hashtable import HashTable, normal_initializer
from deltastream.embedding.optim import RowWiseAdagrad
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import TrackingMode

__all__ = ["main", "CTR"]


class CTR(torch.nn.Module):
    """User/item HashTables + MLP click model (logits ``[B]``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.user = HashTable(dim, name="user", initializer=normal_initializer(0.05, seed=1),
                              capacity=1 << 16)
        self.item = HashTable(dim, name="item", initializer=normal_initializer(0.05, seed=2),
                              capacity=1 << 16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3 * dim, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        a, b = self.user(u), self.item(i)
        return self.mlp(torch.cat([a, b, a * b], 1)).squeeze(1)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns two result records (ID_ONLY, EMBEDDING)."""
    p = argparse.ArgumentParser(prog="deltastream bench tracker-overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4096, help="examples per step (4096)")
    p.add_argument("--dim", type=int, default=32, help="embedding width (32)")
    p.add_argument("--read-every", type=int, default=10, help="steps between get_delta (10)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (30)")
    p.add_argument("--users", type=int, default=200_000, help="Zipf user vocabulary")
    p.add_argument("--items", type=int, default=50_000, help="Zipf item vocabulary")
    add_threads_flag(p)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: process CPU time (default; robust to other processes on a shared "
                        "machine), wall: elapsed time")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("batch", "dim", "read_every", "rounds", "users", "items"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    with torch_threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    model = CTR(args.dim)
    sparse = RowWiseAdagrad(model, lr=0.05)
    dense = torch.optim.Adam(model.mlp.parameters(), lr=1e-3)
    k = args.read_every
    n_batches = args.rounds * k
    # 40-bit ids, offset 0: the id space this bench has always drawn, so figures stay comparable
    zipf = dict(alpha=1.05, generator=g, bits=40, offset=0)
    batches = [(zipf_ids(args.batch, vocab=args.users, **zipf),
                zipf_ids(args.batch, vocab=args.items, **zipf),
                torch.randint(0, 2, (args.batch,), generator=g).float())
               for _ in range(n_batches)]

    def train_step(u, i, y, tracker):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(u, i), y)
        loss.backward()
        sparse.step()
        dense.step()
        sparse.zero_grad()
        dense.zero_grad(set_to_none=True)
        if tracker is not None:
            tracker.step()

    for u, i, y in batches:  # warm-up: inserts every id, allocates optimizer state
        train_step(u, i, y, None)

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    configs = ["none", "id_only", "embedding"]
    per_step: dict[str, list[float]] = {c: [] for c in configs}
    rows_read = {c: 0 for c in configs}
    for r in range(args.rounds):
        chunk = batches[r * k:(r + 1) * k]
        order = configs[r % 3:] + configs[:r % 3]  # rotate: no configuration always first
        for cfg in order:
            tracker = None
            if cfg != "none":
                mode = TrackingMode.ID_ONLY if cfg == "id_only" else TrackingMode.EMBEDDING
                tracker = DeltaTracker(model, consumers=["publish"], mode=mode)
            t0 = clock()
            for u, i, y in chunk:
                train_step(u, i, y, tracker)
            if tracker is not None:
                delta = tracker.get_delta("publish")
            per_step[cfg].append((clock() - t0) / k)
            if tracker is not None:
                rows_read[cfg] += sum(len(d) for d in delta.values())
                tracker.close()

    base = statistics.median(per_step["none"])
    out = []
    for cfg, goal in (("id_only", 1.03), ("embedding", 1.10)):
        t = statistics.median(per_step[cfg])
        # paired: each round's chunk against the same round's baseline chunk (same batches,
        # same machine conditions), then the median over rounds
        ratio = statistics.median(a / b for a, b in zip(per_step[cfg], per_step["none"],
                                                          strict=True))
        out.append(result(
            f"tracker_overhead.{cfg}", t * 1e3, base * 1e3, goal, "ms/step", ratio=ratio,
            higher_is_better=False, overhead_pct=(ratio - 1) * 100,
            min_ratio=min(per_step[cfg]) / min(per_step["none"]), batch=args.batch,
            dim=args.dim, read_every=k, rounds=args.rounds,
            rows_per_read=rows_read[cfg] / args.rounds, threads=torch.get_num_threads(),
            clock=args.clock))
    return out


if __name__ == "__main__":  # pragma: no cover
    from bench._common import emit
    emit(main(), False)
