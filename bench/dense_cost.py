"""Benchmark: what publishing dense weights costs the training thread.

Two models, each trained with Adam on random batches (``--batch``) on the CPU:

* ``demo``: the demo's click MLP (``deltastream_demo.model.click_mlp``, ``[u, v, u*v,
  dense]`` → 64 → 32 → 1, dim 32, 4 dense features);
* ``mlp10m``: an MLP 1024 → 2048 → 2048 → 2048 → 1 (10.5M parameters).

A :class:`~deltastream.publishing.dense.DensePublisher` (f32, full every 10 versions) sends to a real broker (the embedded one) through a
:class:`~deltastream.DeltaPublisher`. Per model:

* **copy** — the training thread's time per version (``stats()["copy_ms"]``: picking the
  ``state_dict`` entries and copying them into the reused buffers), taken with the worker
  idle so every tick takes a version; figure: its median, **ratio** = copy ÷ the train
  step alone (the median chunk without dense, per step; goal ≤ 0.05); the note gives
  the worker's time per version (compare, encode, hand to the producer);
* **with worker** — chunks of ``--chunk`` steps with ``tick`` after each and a version due
  every ``--every`` steps (the worker encoding and sending concurrently, due versions
  deferred while it is busy) against
  adjacent chunks of the step alone: median ratio of chunk totals (report only: on a
  machine with few cores the worker competes with the step).

Clock: wall time on the training thread. Run: ``deltastream bench dense-cost``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from bench._common import add_threads_flag, result, torch_threads

__all__ = ["main"]

RATIO_GOAL = 0.05


def _models(which: list[str]) -> dict[str, tuple[torch.nn.Module, int]]:
    """``{name: (model, input width)}``."""
    from deltastream_demo.model import click_mlp

    out: dict[str, tuple[torch.nn.Module, int]] = {}
    if "demo" in which:
        out["demo"] = (click_mlp(32, 4, (64, 32), torch.device("cpu")), 3 * 32 + 4)
    if "mlp10m" in which:
        widths = [1024, 2048, 2048, 2048]
        layers: list[torch.nn.Module] = []
        for a, b in zip(widths, widths[1:], strict=False):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(widths[-1], 1))
        out["mlp10m"] = (torch.nn.Sequential(*layers), widths[0])
    return out


def _measure(name: str, model: torch.nn.Module, width: int, args: argparse.Namespace,
             servers: str, topic: str) -> list[dict]:
    from deltastream import DeltaPublisher
    from deltastream.publishing.dense import DenseOptions, DensePublisher

    g = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    pool = [(torch.randn(args.batch, width, generator=g),
             torch.randint(0, 2, (args.batch,), generator=g).float()) for _ in range(8)]

    def step(k: int) -> None:
        x, y = pool[k % len(pool)]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for k in range(3):
        step(k)
    with_dense, chunk_alone, chunk_dense = [], [], []
    params = sum(p.numel() for p in model.parameters())
    with DeltaPublisher(servers, topic, model="bench", shard=0) as pub, \
            DensePublisher(pub, model, DenseOptions(every_steps=1)) as dense:
        k = 3
        for _ in range(args.versions):  # the copy, worker idle: every tick takes a version
            step(k)
            dense.tick(k)
            dense.wait()
            k += 1
        copy_st = dense.stats()
        copy_ms = copy_st["copy_ms"]
        send_ms = copy_st["send_s"] * 1e3 / max(1, copy_st["versions"])
    with DeltaPublisher(servers, topic, model="bench", shard=0) as pub, \
            DensePublisher(pub, model, DenseOptions(every_steps=args.every)) as dense:
        for _ in range(args.rounds):  # chunks alone, then chunks ticking
            dense.wait()
            t0 = time.perf_counter()
            for _ in range(args.chunk):
                step(k)
                k += 1
            chunk_alone.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(args.chunk):
                step(k)
                dense.tick(k)
                k += 1
            chunk_dense.append(time.perf_counter() - t0)
            with_dense.append(chunk_dense[-1] / chunk_alone[-1])
        dense.wait()
        st = dense.stats()
    # the step alone: per step in the chunks without dense (steady, unlike the steps
    # between versions in the copy phase, which the worker's last send disturbs)
    step_ms = statistics.median(chunk_alone) / args.chunk * 1e3
    extra = dict(model=name, params=params, step_alone_ms=step_ms, copy_p50_ms=copy_ms["p50"],
                 copy_max_ms=copy_ms["max"], worker_ms_per_version=send_ms,
                 versions=st["versions"], deferred=st["deferred"],
                 bytes=st["bytes"])
    return [
        result(f"dense_cost.{name}.copy", copy_ms["p50"], step_ms, RATIO_GOAL, "ms/version",
               ratio=copy_ms["p50"] / step_ms, higher_is_better=False,
               baseline_desc="the train step alone (median chunk / steps)",
               note=f"{params:,} parameters, copy max {copy_ms['max']:.3g} ms, worker "
               f"{send_ms:.3g} ms per version", **extra),
        result(f"dense_cost.{name}.with_worker", statistics.median(chunk_dense) * 1e3,
               statistics.median(chunk_alone) * 1e3, None, "ms/chunk",
               ratio=statistics.median(with_dense), higher_is_better=False,
               baseline_desc="adjacent chunks of the step alone",
               note=f"{st['versions']} versions, {st['deferred']} deferred", **extra),
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; two figures per model."""
    p = argparse.ArgumentParser(prog="deltastream bench dense-cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="demo,mlp10m", help="demo,mlp10m")
    p.add_argument("--batch", type=int, default=256, help="examples per step (256)")
    p.add_argument("--versions", type=int, default=10, help="versions timed for the copy (10)")
    p.add_argument("--chunk", type=int, default=10, help="steps per timed chunk (10)")
    p.add_argument("--every", type=int, default=5,
                   help="a version every this many steps in the chunks with the worker (5)")
    p.add_argument("--rounds", type=int, default=3, help="chunk pairs per model (3)")
    p.add_argument("--servers", default=None, help="a Kafka broker (default: embedded)")
    add_threads_flag(p)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from deltastream import ensure_topic

    with torch_threads(args.threads), contextlib.ExitStack() as stack:
        servers = args.servers
        if servers is None:
            from deltastream.broker import EmbeddedBroker
            servers = stack.enter_context(EmbeddedBroker()).bootstrap_servers
        out = []
        for name, (model, width) in _models(args.models.split(",")).items():
            topic = f"bench.dense_cost.{name}.{time.time_ns()}"
            ensure_topic(servers, topic, partitions=1)
            out += _measure(name, model, width, args, servers, topic)
        return out


if __name__ == "__main__":  # pragma: no cover
    from bench._common import emit
    emit(main(), False)
