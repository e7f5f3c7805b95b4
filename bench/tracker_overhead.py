"""Benchmark: cost of DeltaTracker on a CTR training step, per kind of embedding table.

Models (``--models``; batch ``--batch`` 4096 of Zipf ids, BCE loss, an MLP
``[u, v, u*v] -> 64 -> 32 -> 1`` trained by ``torch.optim.Adam``):

* ``hashtable``: two :class:`~deltastream.HashTable` s (user ``--users``, item ``--items``
  Zipf vocabularies) with row-wise Adagrad (the tracker's lookups path).
* ``embedding_adam``: ``nn.Embedding`` user table of ``--rows`` (1M) rows and an item table,
  trained by dense ``torch.optim.Adam`` with everything else (the scan path).
* ``embedding_bag_adam``: the user table is an ``nn.EmbeddingBag`` (mean of ``--bag`` ids per
  example: a user's recent items), dense Adam (the scan path).
* ``embedding_sparse``: ``nn.Embedding(sparse=True)`` tables with ``torch.optim.SparseAdam``:
  the default tracker (scan path: the tracker cannot know the optimizer) and one that was
  shown the optimizer (``watch_optimizer``: the lookups path).

For the dense models the warm-up ends with one step over every row of the big table, so
Adam's moments move every row at every later step: the scan's worst case (every row
changed and reported at every read), as in a long training run.

Configurations run the same batches: no tracker (baseline), then trackers in ID_ONLY and
EMBEDDING mode, each calling ``get_delta`` every ``--read-every`` (10) steps (the read is
timed too). Timing is interleaved: every round runs one chunk of ``--read-every`` steps per
configuration, in a rotating order; trackers are attached before the chunk and closed after
it. Figures: ``ratio = t_with / t_without`` (per round, same batches; the median over
rounds; process CPU time by default, ``--clock wall`` for elapsed time), goals 1.03
(HashTable ID_ONLY) and 1.10 (every other), lower is better.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench._common import add_threads_flag, result, torch_threads, zipf_ids
from deltastream.embedding.hashtable import HashTable, normal_initializer
from deltastream.embedding.optim import RowWiseAdagrad
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import TrackingMode

__all__ = ["main", "CTR", "DenseCTR", "MODELS"]

MODELS = ("hashtable", "embedding_adam", "embedding_bag_adam", "embedding_sparse")
ID_ONLY, EMBEDDING = TrackingMode.ID_ONLY, TrackingMode.EMBEDDING


def _mlp(dim: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3 * dim, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


class CTR(torch.nn.Module):
    """User/item HashTables + MLP click model (logits ``[B]``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.user = HashTable(dim, name="user", initializer=normal_initializer(0.05, seed=1),
                              capacity=1 << 16)
        self.item = HashTable(dim, name="item", initializer=normal_initializer(0.05, seed=2),
                              capacity=1 << 16)
        self.mlp = _mlp(dim)

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        a, b = self.user(u), self.item(i)
        return self.mlp(torch.cat([a, b, a * b], 1)).squeeze(1)


class DenseCTR(torch.nn.Module):
    """``nn.Embedding`` user table (``rows``; an ``EmbeddingBag`` averaging ``[B, bag]`` ids
    with ``bag``) and item table + MLP (logits ``[B]``)."""

    def __init__(self, dim: int, rows: int, items: int, *, bag: int = 0,
                 sparse: bool = False) -> None:
        super().__init__()
        self.user = torch.nn.EmbeddingBag(rows, dim, mode="mean") if bag else \
            torch.nn.Embedding(rows, dim, sparse=sparse)
        self.item = torch.nn.Embedding(items, dim, sparse=sparse)
        for t in (self.user, self.item):
            torch.nn.init.normal_(t.weight, std=0.05)
        self.mlp = _mlp(dim)

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        a, b = self.user(u), self.item(i)
        return self.mlp(torch.cat([a, b, a * b], 1)).squeeze(1)


@dataclass
class Workload:
    """A model, its optimizers, the batches and the tracker configurations to compare."""

    model: torch.nn.Module
    optimizers: list
    batches: list
    warmup: list
    #: config name -> (tracker factory, goal for the ratio)
    configs: dict[str, tuple[Callable[[], DeltaTracker], float]] = field(default_factory=dict)


def _tracker(model: torch.nn.Module, mode: TrackingMode,
             watch: tuple = ()) -> Callable[[], DeltaTracker]:
    def make() -> DeltaTracker:
        t = DeltaTracker(model, consumers=["publish"], mode=mode)
        for opt in watch:
            t.watch_optimizer(opt)
        return t
    return make


def _workload(name: str, args: argparse.Namespace, g: torch.Generator) -> Workload:
    n = args.rounds * args.read_every if name == "hashtable" or name == "embedding_sparse" \
        else args.dense_rounds * args.read_every
    labels = [torch.randint(0, 2, (args.batch,), generator=g).float() for _ in range(n)]
    if name == "hashtable":
        model = CTR(args.dim)
        opts = [RowWiseAdagrad(model, lr=0.05), torch.optim.Adam(model.mlp.parameters(),
                                                                  lr=1e-3)]
        # 40-bit ids, offset 0: the id space this bench has always drawn (figures comparable)
        zipf = dict(alpha=1.05, generator=g, bits=40, offset=0)
        batches = [(zipf_ids(args.batch, vocab=args.users, **zipf),
                    zipf_ids(args.batch, vocab=args.items, **zipf), y) for y in labels]
        w = Workload(model, opts, batches, batches)  # warm-up inserts every id
        w.configs = {"id_only": (_tracker(model, ID_ONLY), 1.03),
                     "embedding": (_tracker(model, EMBEDDING), 1.10)}
        return w
    bag = args.bag if name == "embedding_bag_adam" else 0
    sparse = name == "embedding_sparse"
    model = DenseCTR(args.dim, args.rows, args.items, bag=bag, sparse=sparse)
    if sparse:
        tables = list(model.user.parameters()) + list(model.item.parameters())
        opts = [torch.optim.SparseAdam(tables, lr=1e-3),
                torch.optim.Adam(model.mlp.parameters(), lr=1e-3)]
    else:
        opts = [torch.optim.Adam(model.parameters(), lr=1e-3)]
    zipf = dict(alpha=1.05, generator=g, bits=None)
    shape = (args.batch, bag) if bag else (args.batch,)
    batches = [(zipf_ids(args.batch * max(bag, 1), vocab=args.rows, **zipf).reshape(shape),
                zipf_ids(args.batch, vocab=args.items, **zipf), y) for y in labels]
    warm = batches[:3]
    if not sparse:  # every row gets Adam moments: every row moves at every later step
        every = torch.arange(args.rows)
        every = every.reshape(-1, 1).expand(-1, bag) if bag else every
        warm = warm + [(every, torch.arange(args.rows) % args.items,
                        torch.randint(0, 2, (args.rows,), generator=g).float())]
    w = Workload(model, opts, batches, warm)
    w.configs = {"id_only": (_tracker(model, ID_ONLY), 1.10),
                 "embedding": (_tracker(model, EMBEDDING), 1.10)}
    if sparse:
        w.configs["embedding_watched"] = (_tracker(model, EMBEDDING, watch=tuple(opts)), 1.10)
    return w


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns one result record per model and tracker configuration."""
    p = argparse.ArgumentParser(prog="deltastream bench tracker-overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated subset of {','.join(MODELS)} (all)")
    p.add_argument("--batch", type=int, default=4096, help="examples per step (4096)")
    p.add_argument("--dim", type=int, default=32, help="embedding width (32)")
    p.add_argument("--read-every", type=int, default=10, help="steps between get_delta (10)")
    p.add_argument("--rounds", type=int, default=30,
                   help="interleaved rounds, hashtable and embedding_sparse models (30)")
    p.add_argument("--dense-rounds", type=int, default=5,
                   help="interleaved rounds of the dense-Adam models (5; their steps are slow)")
    p.add_argument("--users", type=int, default=200_000, help="Zipf user vocabulary (hashtable)")
    p.add_argument("--items", type=int, default=50_000, help="Zipf item vocabulary")
    p.add_argument("--rows", type=int, default=1_000_000,
                   help="rows of the nn.Embedding/EmbeddingBag user table (1M)")
    p.add_argument("--bag", type=int, default=4, help="ids per bag, embedding_bag_adam (4)")
    add_threads_flag(p)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: process CPU time (default; robust to other processes on a shared "
                        "machine), wall: elapsed time")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("batch", "dim", "read_every", "rounds", "dense_rounds", "users", "items",
                 "rows", "bag"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        p.error(f"--models: unknown {bad or models}; choose from {','.join(MODELS)}")
    out = []
    with torch_threads(args.threads):
        for name in models:
            out += _run(name, args)
    return out


def _run(name: str, args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    w = _workload(name, args, g)
    model, k = w.model, args.read_every

    def train_step(u, i, y, tracker):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(u, i), y)
        loss.backward()
        for opt in w.optimizers:
            opt.step()
        for opt in w.optimizers:
            opt.zero_grad(set_to_none=True)
        if tracker is not None:
            tracker.step()

    for u, i, y in w.warmup:  # inserts ids, allocates optimizer state
        train_step(u, i, y, None)

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    configs = ["none", *w.configs]
    per_step: dict[str, list[float]] = {c: [] for c in configs}
    rows_read = dict.fromkeys(configs, 0)
    paths: dict[str, dict] = {}
    rounds = len(w.batches) // k
    for r in range(rounds):
        chunk = w.batches[r * k:(r + 1) * k]
        order = configs[r % len(configs):] + configs[:r % len(configs)]  # rotate the order
        for cfg in order:
            tracker = None if cfg == "none" else w.configs[cfg][0]()
            t0 = clock()
            for u, i, y in chunk:
                train_step(u, i, y, tracker)
            if tracker is not None:
                delta = tracker.get_delta("publish")
            per_step[cfg].append((clock() - t0) / k)
            if tracker is not None:
                rows_read[cfg] += sum(len(d) for d in delta.values())
                paths[cfg] = tracker.paths
                tracker.close()

    base = statistics.median(per_step["none"])
    prefix = "tracker_overhead" if name == "hashtable" else f"tracker_overhead.{name}"
    out = []
    for cfg, (_, goal) in w.configs.items():
        t = statistics.median(per_step[cfg])
        # paired: each round's chunk against the same round's baseline chunk (same batches,
        # same machine conditions), then the median over rounds
        ratio = statistics.median(a / b for a, b in zip(per_step[cfg], per_step["none"],
                                                          strict=True))
        out.append(result(
            f"{prefix}.{cfg}", t * 1e3, base * 1e3, goal, "ms/step", ratio=ratio,
            higher_is_better=False, overhead_pct=(ratio - 1) * 100,
            min_ratio=min(per_step[cfg]) / min(per_step["none"]), batch=args.batch,
            dim=args.dim, read_every=k, rounds=rounds, rows_per_read=rows_read[cfg] / rounds,
            paths=paths.get(cfg), threads=torch.get_num_threads(), clock=args.clock))
    return out


if __name__ == "__main__":  # pragma: no cover
    from bench._common import emit
    emit(main(), False)
