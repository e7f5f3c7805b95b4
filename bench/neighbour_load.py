"""Benchmark: what a busy neighbour CPU costs the training step, with no deltastream at all.

``bench trainer-cost`` runs the publisher's worker process on the CPU the training thread
leaves spare. On a VM that CPU may share a physical core or its caches and memory bandwidth
with the training thread's: the worker's own CPU time then slows the training step though
nothing waits on it. This benchmark measures that machine property, so that a trainer-cost
ratio can be read against it.

The step is ``trainer-cost``'s (the README's loop: two HashTables of width 32, Zipf ids, the
MLP, SparseAdam + Adam, batch ``--batch``, one torch thread), pinned to CPU 0. A load
process pinned to CPU 1 runs one of:

* ``python`` — an interpreter loop (a worker's Python: the round logic, the Kafka client);
* ``matmul`` — 64x64 float32 products in the cache (vectorized compute);
* ``l2copy`` — copying 256 KiB over and over (the core's own caches);
* ``stream`` — copying 64 MiB over and over (memory bandwidth, the shared last-level cache).

Each load runs ``--duty`` of the time, in bursts of ``--burst-ms`` (1.0: all the time; a
worker process at ``rounds-10`` is busy ~15-30 % of its CPU). Figures: the mean step with
the load ÷ the mean step with CPU 1 idle, chunks of ``--steps`` steps interleaved
``--rounds`` times (median over rounds); ``per_busy`` is the step's slowdown per unit of
the load's duty (ratio − 1) ÷ duty: the share of the neighbour's busy time the training
thread pays.

Run: ``deltastream bench neighbour-load [--duty 1.0] [--rounds 6]``. Needs two CPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from bench._common import result, torch_threads
from bench.train_step import LOOP_BATCHES, TableCTR, zipf_loop

#: each load's loop body; ``busy()`` is True while its burst lasts
LOADS = {
    "python": "x = 0\nwhile busy():\n    x += 1",
    "matmul": "while busy():\n    a @ a",
    "l2copy": "while busy():\n    np.copyto(d, s)",
    "stream": "while busy():\n    np.copyto(D, S)",
}

_PRELUDE = """
import os, sys, time
import numpy as np
os.sched_setaffinity(0, {{1}})
a = np.random.rand(64, 64).astype(np.float32)
s = np.ones(256 << 10, dtype=np.uint8); d = np.empty_like(s)
S = np.ones(64 << 20, dtype=np.uint8); D = np.empty_like(S)
on, off = {on}, {off}
end = 0.0
def busy():
    return time.perf_counter() < end
while True:
    end = time.perf_counter() + on
{body}
    if off:
        time.sleep(off)
"""


def _load(name: str, duty: float, burst_s: float) -> subprocess.Popen:
    """The load process ``name`` on CPU 1, busy ``duty`` of the time in ``burst_s`` bursts."""
    on = burst_s if duty < 1.0 else 3600.0
    off = 0.0 if duty >= 1.0 else burst_s * (1.0 - duty) / duty
    body = "\n".join("    " + line for line in LOADS[name].splitlines())
    code = _PRELUDE.format(on=on, off=off, body=body)
    return subprocess.Popen([sys.executable, "-c", code])


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; one figure per load."""
    p = argparse.ArgumentParser(prog="deltastream bench neighbour-load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4096, help="examples per step (4096)")
    p.add_argument("--steps", type=int, default=100, help="steps per chunk (100)")
    p.add_argument("--rounds", type=int, default=6, help="chunks per load (6)")
    p.add_argument("--duty", type=float, default=1.0,
                   help="share of the time each load is busy (1.0: all the time)")
    p.add_argument("--burst-ms", type=float, default=8.0,
                   help="length of a busy burst with --duty below 1 (8 ms)")
    p.add_argument("--loads", default=",".join(LOADS),
                   help=f"comma-separated loads ({','.join(LOADS)})")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    loads = [x for x in args.loads.split(",") if x]
    unknown = sorted(set(loads) - set(LOADS))
    if unknown:
        p.error(f"unknown loads {unknown}; known: {sorted(LOADS)}")
    if not 0.0 < args.duty <= 1.0:
        p.error("--duty must be in (0, 1]")
    if not hasattr(os, "sched_setaffinity") or not {0, 1} <= os.sched_getaffinity(0):
        return [result("neighbour_load", float("nan"), float("nan"), None, "x",
                       note="needs CPUs 0 and 1 (Linux affinity)")]
    mask = os.sched_getaffinity(0)
    with torch_threads(1):
        try:
            os.sched_setaffinity(0, {0})
            return _measure(args, loads)
        finally:
            os.sched_setaffinity(0, mask)


def _measure(args: argparse.Namespace, loads: list[str]) -> list[dict]:
    step = zipf_loop(TableCTR(32, 200_000, 50_000, torch.device("cpu")), [200_000, 50_000],
                     args.batch, torch.Generator().manual_seed(args.seed), torch.device("cpu"))

    def chunk(k: int) -> float:
        t0 = time.perf_counter()
        for i in range(args.steps):
            step(k + i)
        return (time.perf_counter() - t0) / args.steps

    for k in range(LOOP_BATCHES):  # warm-up: ids resident, optimizer state allocated
        step(k)
    k = LOOP_BATCHES
    idle: list[float] = []
    loaded: dict[str, list[float]] = {name: [] for name in loads}
    for _ in range(args.rounds):
        for name in loads:
            idle.append(chunk(k))
            k += args.steps
            proc = _load(name, args.duty, args.burst_ms / 1e3)
            try:
                time.sleep(0.3)  # the interpreter started, its arrays touched
                loaded[name].append(chunk(k))
                k += args.steps
            finally:
                proc.kill()
                proc.wait()
    # each loaded chunk against the idle chunk just before it
    out = []
    for j, name in enumerate(loads):
        before = idle[j::len(loads)]
        ratios = [w / b for w, b in zip(loaded[name], before, strict=True)]
        ratio = statistics.median(ratios)
        out.append(result(f"neighbour_load.{name}", statistics.median(loaded[name]) * 1e3,
                          statistics.median(before) * 1e3, None, "ms/step", ratio=ratio,
                          higher_is_better=False, duty=args.duty, batch=args.batch,
                          per_busy=(ratio - 1.0) / args.duty, pair_ratios=ratios,
                          baseline_desc="the same step with CPU 1 idle, the chunk before"))
    return out


if __name__ == "__main__":  # pragma: no cover
    from bench._common import emit
    emit(main(), False)
