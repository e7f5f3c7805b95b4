"""Benchmark: DeltaTracker on a TorchRec model sharded by DistributedModelParallel, against
the same model untracked and against TorchRec's own ``ModelDeltaTracker`` (same run).

Model (one process, gloo, CPU): an ``EmbeddingCollection`` (``--collection ec``, the
default: TorchRec's tracker supports EMBEDDING mode only there) or ``EmbeddingBagCollection``
of two tables (``user``: ``--rows`` rows, ``item``: ``--rows // 4``, width ``--dim``; Zipf
ids, ``--bag`` ids per example and feature, summed, ``--batch`` examples) sharded
table-wise by DMP with the fused ``EXACT_ROWWISE_ADAGRAD`` optimizer, an MLP on the pooled
features and BCE loss (its dense optimizer Adam). Configurations, each its own model built from the same seed and fed the
same batches:

* ``none``: untracked (the baseline);
* ``deltastream_embedding`` / ``deltastream_id_only``: ``DeltaTracker`` in EMBEDDING /
  ID_ONLY mode (the lookups path: the fused kernels' ids, FIRST rows gathered at the
  lookup);
* ``torchrec_embedding`` / ``torchrec_id_only``: TorchRec's tracker through
  ``dmp.init_torchrec_delta_tracker`` (ids and rows recorded at every lookup).

Every configuration reads its delta every ``--read-every`` steps (the read is timed).
Timing is interleaved: each round runs one chunk of ``--read-every`` steps per
configuration in a rotating order; ``ratio`` = median over rounds of the chunk's time over
the baseline's, by ``--clock``: ``wall`` (the default: the time the training loop takes) or
``cpu`` (the process's CPU time, every thread's); both are reported (``wall_ratio``,
``cpu_ratio``). The default was ``cpu`` until 2026-12-02, when DeltaTracker began copying
FIRST rows on a spare core while the kernels run (:func:`deltastream.tracking.fresh_rows.
spare_core`): process CPU time counts that copy, which the training loop does not wait for.
Goals: 1.10 for DeltaTracker in EMBEDDING mode against the untracked model; ``vs_torchrec``
(DeltaTracker's time over TorchRec's tracker's, same mode) is reported with goal 1.0.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench._common import add_threads_flag, result, torch_threads, zipf_ids

__all__ = ["main"]

CONFIGS = ("none", "deltastream_embedding", "deltastream_id_only", "torchrec_embedding",
           "torchrec_id_only")


def _model(args: argparse.Namespace):
    import torch.distributed as dist
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    bag = args.collection == "ebc"
    tables = (("user", args.rows), ("item", max(args.rows // 4, 1)))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            meta = torch.device("meta")
            if bag:
                self.emb = torchrec.EmbeddingBagCollection(device=meta, tables=[
                    torchrec.EmbeddingBagConfig(name=n, embedding_dim=args.dim,
                                                num_embeddings=r, feature_names=[n])
                    for n, r in tables])
            else:
                self.emb = torchrec.EmbeddingCollection(device=meta, tables=[
                    torchrec.EmbeddingConfig(name=n, embedding_dim=args.dim,
                                             num_embeddings=r, feature_names=[n])
                    for n, r in tables])
            self.mlp = torch.nn.Sequential(torch.nn.Linear(2 * args.dim, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 1))

        def forward(self, kjt: torchrec.KeyedJaggedTensor) -> torch.Tensor:
            if bag:
                pooled = self.emb(kjt).values()
            else:  # every example has --bag ids per feature: sum them
                out = self.emb(kjt)
                pooled = torch.cat([out[n].values().view(-1, args.bag, args.dim).sum(1)
                                    for n, _ in tables], dim=1)
            return self.mlp(pooled).squeeze(1)

    torch.manual_seed(args.seed)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.02,
             "eps": 1e-3}
    sharder = EmbeddingBagCollectionSharder(fused_params=fused) if bag \
        else EmbeddingCollectionSharder(fused_params=fused)
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    net = Net()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={n: ParameterConstraints(sharding_types=["table_wise"],
                                             compute_kernels=["fused"])
                     for n in ("user", "item")})
    plan = planner.collective_plan(net, [sharder], dist.GroupMember.WORLD)
    # the planner may size the shards it does not need to split any way: table-wise it is
    dmp = torchrec.distributed.DistributedModelParallel(net, device=torch.device("cpu"),
                                                        plan=plan, sharders=[sharder])
    dense = torch.optim.Adam([p for n, p in dmp.named_parameters() if "mlp" in n], lr=1e-3)
    return dmp, dense


def _batches(args: argparse.Namespace, n: int) -> list:
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(args.seed + 1)
    out = []
    per = args.batch * args.bag
    for _ in range(n):
        user = zipf_ids(per, vocab=args.rows, alpha=1.05, generator=g, bits=None, offset=0)
        item = zipf_ids(per, vocab=max(args.rows // 4, 1), alpha=1.05, generator=g,
                        bits=None, offset=0)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["user", "item"], values=torch.cat([user % args.rows,
                                                     item % max(args.rows // 4, 1)]),
            lengths=torch.full((2 * args.batch,), args.bag))
        out.append((kjt, torch.rand(args.batch, generator=g).round()))
    return out


def _reader(cfg: str, dmp: torch.nn.Module):
    """``(step(), read())``: the tracker's per-step call and a read returning the rows in
    the delta; ``None`` for the baseline."""
    if cfg == "none":
        return None
    if cfg.startswith("deltastream"):
        from deltastream import DeltaTracker, TrackingMode

        mode = TrackingMode.EMBEDDING if cfg.endswith("embedding") else TrackingMode.ID_ONLY
        tracker = DeltaTracker(dmp, consumers=["publish"], mode=mode)
        return tracker.step, lambda: sum(len(d) for d in tracker.get_delta("publish").values())
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    mode = TrackingMode.EMBEDDING if cfg.endswith("embedding") else TrackingMode.ID_ONLY
    trec = dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(
        tracking_mode=mode, consumers=["publish"], delete_on_read=True))

    def read() -> int:
        return sum(r.ids.numel() for r in trec.get_unique("publish").values())
    return trec.step, read


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; one result record per tracker configuration."""
    p = argparse.ArgumentParser(prog="deltastream bench torchrec-tracker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=500_000, help="rows of the user table (500K)")
    p.add_argument("--dim", type=int, default=32, help="embedding width (32)")
    p.add_argument("--batch", type=int, default=2048, help="examples per step (2048)")
    p.add_argument("--bag", type=int, default=4, help="ids per example and feature (4)")
    p.add_argument("--collection", choices=("ec", "ebc"), default="ec",
                   help="EmbeddingCollection (default; TorchRec's tracker supports EMBEDDING "
                        "mode only there) or EmbeddingBagCollection")
    p.add_argument("--read-every", type=int, default=10, help="steps between reads (10)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (6)")
    p.add_argument("--configs", default=",".join(CONFIGS[1:]),
                   help=f"comma-separated subset of {','.join(CONFIGS[1:])}")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="the clock of ratio: wall (default) or process CPU time")
    p.add_argument("--seed", type=int, default=0)
    add_threads_flag(p)
    args = p.parse_args(argv)
    for name in ("rows", "dim", "batch", "bag", "read_every", "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not chosen or any(c not in CONFIGS[1:] for c in chosen):
        p.error(f"--configs: choose from {','.join(CONFIGS[1:])}")
    if args.collection == "ebc" and "torchrec_embedding" in chosen:
        # TorchRec 1.8: "EBC's lookup returns pooled embeddings ... we do not support
        # tracking raw embeddings"
        chosen.remove("torchrec_embedding")
    try:
        import torchrec  # noqa: F401
    except ImportError:
        p.error("TorchRec is not installed: pip install 'deltastream[torchrec]' and "
                "pip install --no-deps torchrec==1.8.0")
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch_threads(args.threads):
            return _run(args, ["none", *chosen])
    finally:
        if own_group:
            dist.destroy_process_group()


def _run(args: argparse.Namespace, configs: list[str]) -> list[dict]:
    k = args.read_every
    batches = _batches(args, k * (args.rounds + 1))
    runs = {}
    for cfg in configs:
        dmp, dense = _model(args)
        runs[cfg] = (dmp, dense, _reader(cfg, dmp))

    def steps(cfg: str, chunk: list) -> int:
        dmp, dense, tracker = runs[cfg]
        for kjt, y in chunk:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(kjt), y)
            loss.backward()  # the fused optimizer updates the tables here
            dense.step()
            dense.zero_grad(set_to_none=True)
            if tracker is not None:
                tracker[0]()
        return tracker[1]() if tracker is not None else 0

    for cfg in configs:  # warm-up chunk: allocations, optimizer state, first scan
        steps(cfg, batches[:k])
    times: dict[str, dict[str, list[float]]] = {"wall": {c: [] for c in configs},
                                                 "cpu": {c: [] for c in configs}}
    rows = dict.fromkeys(configs, 0)
    for r in range(args.rounds):
        chunk = batches[(r + 1) * k:(r + 2) * k]
        for cfg in configs[r % len(configs):] + configs[:r % len(configs)]:
            t0, c0 = time.perf_counter(), time.process_time()
            rows[cfg] += steps(cfg, chunk)
            times["wall"][cfg].append((time.perf_counter() - t0) / k)
            times["cpu"][cfg].append((time.process_time() - c0) / k)
    per_step = times[args.clock]

    def ratios(a: str, b: str) -> dict[str, float]:
        """Median over rounds of ``a``'s chunk time over ``b``'s, per clock."""
        return {clock: statistics.median(x / y for x, y in zip(t[a], t[b], strict=True))
                for clock, t in times.items()}

    base = statistics.median(per_step["none"])
    out = []
    for cfg in configs[1:]:
        goal = 1.10 if cfg == "deltastream_embedding" else None
        extra = {}
        twin = cfg.replace("deltastream", "torchrec")
        if cfg.startswith("deltastream") and twin in per_step:
            extra["vs_torchrec"] = ratios(cfg, twin)[args.clock]
        vs_none = ratios(cfg, "none")
        out.append(result(
            f"torchrec_tracker.{cfg}", statistics.median(per_step[cfg]) * 1e3, base * 1e3,
            goal, "ms/step", ratio=vs_none[args.clock], higher_is_better=False,
            overhead_pct=(vs_none[args.clock] - 1) * 100, rows=args.rows, dim=args.dim,
            batch=args.batch, bag=args.bag, read_every=k, rounds=args.rounds,
            rows_per_read=rows[cfg] / args.rounds, threads=torch.get_num_threads(),
            clock=args.clock, wall_ratio=vs_none["wall"], cpu_ratio=vs_none["cpu"],
            **extra))
    return out


if __name__ == "__main__":  # pragma: no cover
    from bench._common import emit
    emit(main(), False)
