"""Benchmark: what deltastream costs the user's training loop.

The step is ``train-step``'s (two :class:`~deltastream.HashTable` s of width ``--dim``, Zipf
user/item ids, an MLP ``[u, v, u*v] -> 64 -> 32 -> 1``, SparseAdam + Adam, batch ``--batch``;
with ``--tables N``, N feature tables and an MLP over their concatenation instead).
One model per batch size; the configurations take turns on it, chunk by chunk (at least
``--chunk`` steps and ``--chunk-s`` seconds, so a chunk holds many of the budget's rounds
as a run does), each timed against the step alone in the chunks on either side of it:

* ``tracker``: a :class:`~deltastream.DeltaTracker` (EMBEDDING) read every 10 steps
  (``get_delta`` on the training thread: the floor of any publishing that reads it as
  often, ``rounds-10`` and ``delta-10``);
* ``tracker-idle``: the same tracker never read: what its lookup hooks cost once every
  row the ids reach is marked (a budget reads about every 0.5 s, close to this);
* ``budget-<B>``: tracker + :class:`~deltastream.BudgetPublisher` at ``B`` bytes/s
  (``--budgets``), ticked after every step, in the default mode (``worker="auto"``: a
  worker process where torch's one thread leaves a core spare, as here; the figure's
  ``worker`` says which);
* ``budget-<B>-sync``: the same with ``threaded=False`` (every round on the training thread,
  as before the worker existed) at the first budget (``--sync``);
* ``budget-<B>-thread``: the same with ``worker="thread"`` (rounds on threads of the
  training process, sharing its GIL) at the first budget (``--no-thread`` leaves it out);
* ``budget-<B>-uncapped``: the first budget with ``max_worker_share=None`` (a round every
  ``min_interval_s`` whatever the worker's CPU; ``--uncapped``);
* ``budget-<B>-residuals`` / ``budget-<B>-unweighted``: the first budget with the transport
  of issue 29's goal, ``residuals=True`` and ``wide_dtype="i8"`` on wire v5 (``r1e``;
  ``--residuals``) / ``read_decay=None`` (``--unweighted``);
* ``delta-10``: tracker + :func:`~deltastream.publish_delta` every 10 steps
  (``SelectionPolicy(fraction=0.5)``, the leftover carried), on the training thread;
* ``rounds-10``: the same rounds off the training loop: a
  :class:`~deltastream.RoundPublisher` (``RoundPolicy(SelectionPolicy(fraction=0.5),
  every=10)``, the default worker) ticked after every step.

``--only NAMES`` runs just those configurations (more pairs of one in the same time).
``--fresh N`` puts N never-seen ids in every step's batch per table and ``--evict-every E``
evicts those older than ``--ttl`` steps every E steps (:class:`bench.train_step.Churn`): the
cycled batches alone insert nothing after their first cycle and evict nothing, where a
production table does both all the time. ``--snapshot-every N`` gives every tracker a
second consumer read every N steps, as the demo's trainer has (the hand-off is unordered
and owed only while the publisher's consumer is the tracker's only one).
Rows go to a real broker (the embedded one, f16). Each budget first runs one chunk
untimed (its worker's first rounds, CUDA's side stream and pinned host memory growing to
the hand-offs' size are paid once per run, not per step). With ``--pending N`` each budget starts
with ``N`` rows already pending (fresh ids inserted and handed off before the clock starts),
so a tick's cost can be read against a large pending set (``rounds-10`` starts empty).

Figures per configuration and batch: **ratio** = median over pairs of (the mean step with
deltastream, over its chunk and its *tail* ÷ the mean step alone in the two alone chunks
around them — the pair's own, just before, and the next pair's, just after: totals, so
rare slow ticks count) — goal ≤ 1.05 — with a bootstrap 95 % interval of that median
(``ratio_ci95``: on a VM whose speed moves 10-20 % between seconds a pair is mostly noise;
``--rounds`` buys a narrower interval). The two chunks around a pair cancel a step time
that drifts over it; ``ratio_adjacent`` (before 2026-12-05 the ratio) divides by the chunk
before alone: over 22 configurations of four runs its pairs' standard deviation was 0.052
against 0.043 bracketed, with no trend between them (the next alone chunk was the faster
in half the pairs). The tail is the steps after the chunk
(every tracker paused) until the configuration's worker has finished the rounds the chunk
handed it, so a round that runs after its chunk still counts as its cost; the **p99
time the training thread spends in** ``tick`` (goal ≤ 1 ms at B = 4096) and its mean
(``tick_mean_ms``: ÷ the step alone, what the training thread pays inside ``tick``; the rest
of the ratio is paid outside it: GIL waits, caches and cores shared with the worker);
``cpu_ratio``, the same ratio in the training thread's CPU time (``time.thread_time``: a
GIL wait is not in it, nor, where the kernel accounts steal time, a stalled vCPU; a step
slowed beside the worker is — where it stays low and the ratio does not, the difference
is waiting, not work); ``faults_per_step`` and ``faults_alone_per_step``, the training
thread's minor page faults a step with deltastream and alone (a loop whose temporaries glibc
maps afresh every step can fault thousands of times a step, ~1 µs each; where the two
differ, the ratio is partly the allocator's); ``extra_us``, where the steps with
deltastream took longer than alone, µs a step: ``forward`` (the tracker's lookup hooks run
there), ``backward`` and ``optimizer`` (no deltastream code runs in them on the CPU: what
they gain is the machine shared with the worker and the broker), ``rest`` (``tracker.step``
and ``tick``), in host time (on CUDA, the time to queue the work); **bytes/s** a budget
sends when it runs alone after the chunks (``--rate-s`` seconds, and at least two rounds,
after a second that spends its bucket's burst; not over the chunks, between which its
bucket refills by at most one burst, nor ``stats()["bytes_per_s"]``, which counts from
the publisher's creation; ``delta-10``: acknowledged bytes over its chunks), and of those
``tombstone_bytes_per_s``, evicted ids' tombstones (8 bytes an id, not charged to a
budget: ``--evict-every``); the worker's
busy share (worker seconds ÷ measured seconds: near 1 it cannot keep up) and its largest
backlog. Every configuration's worker is drained before each "alone" chunk, so the alone
chunks measure the step by itself (before 2026-12-02 only the measured configuration's
was, and a configuration's alone chunk could run beside the previous one's last round,
which read as a lower ratio for it).

Clock: wall time on the training thread (a worker competing for the GIL or the cores shows
as a slower step); on CUDA (``--device cuda``) each chunk ends with a device synchronize,
counted in its last step, so work the chunk queued (or a stall it caused) is in its time.

Picture: ``--out``/``trainer_cost.png`` (``trainer_cost_t<N>.png`` with ``--tables N``;
with matplotlib): every pair's ratio, the median and its interval against the goal, and
the tick's p50 and p99 against 1 ms, per configuration (``bench/_trainer_cost_plot.py``).
One configuration's tracker and publishing, and its untimed set-up: ``bench/_trainer_cost_run.py``.
Each record's ``pair_ratios`` holds the pairs themselves.
Run: ``deltastream bench trainer-cost [--device cuda] [--batches 512,4096] [--pending N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench._common import add_threads_flag, result, torch_threads
from bench._trainer_cost_plot import plot
from bench._trainer_cost_run import Run, paused, prefill, warm
from bench.train_step import LOOP_BATCHES, Churn, FeatureCTR, TableCTR, zipf_loop

__all__ = ["main", "parser"]

TICK_GOAL_MS = 1.0
RATIO_GOAL = 1.05


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _median_interval(pairs: list[float], level: float = 0.95, draws: int = 2000
                     ) -> tuple[float, float]:
    """A bootstrap interval (``level``, fixed seed) of the median of ``pairs``: on a VM
    whose speed moves by 10-20 % from one second to the next, one pair's ratio is mostly
    that noise, and the interval says how far the median of this many pairs can be
    trusted."""
    x = np.asarray(pairs, dtype=np.float64)
    rng = np.random.default_rng(0)
    meds = np.median(x[rng.integers(0, x.size, (draws, x.size))], axis=1)
    lo, hi = np.quantile(meds, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _faults() -> int:
    """Minor page faults of the calling thread so far (Linux ``RUSAGE_THREAD``; else the
    process's). A step that faults pays ~1 µs a page; glibc's malloc hands large freed
    blocks back to the kernel, so a training loop's own temporaries can fault every step,
    in the alone chunks as in the others — the figure tells that noise from our cost."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def _added(total: list[float], now: list[float], before: list[float]) -> list[float]:
    """``total`` plus what each of ``now`` gained since ``before`` (phase seconds)."""
    return [t + x - y for t, x, y in zip(total, now, before, strict=True)]


def _extra_us(r: Run) -> dict[str, float]:
    """Where ``r``'s steps took longer than the step alone, µs per step (means over every
    pair, not bracketed): ``forward`` (the tracker's lookup hooks, and a slower machine),
    ``backward``, ``optimizer`` (with ``zero_grad``; no deltastream code runs in either
    on the CPU: what they gain is the machine shared with the worker and the broker),
    ``rest`` (``tracker.step``, ``tick``, and time between the phases)."""
    n_with = len(r.times) + sum(r.tail_steps)
    n_alone = max(1, len(r.alone))
    out = {name: 1e6 * (w / max(1, n_with) - a / n_alone) for name, w, a in zip(
        ("forward", "backward", "optimizer"), r.phases_with, r.phases_alone, strict=True)}
    with_s = (sum(r.times) + sum(r.tail_s)) / max(1, n_with)
    out["rest"] = 1e6 * (with_s - sum(r.alone) / n_alone) - sum(out.values())
    return out


def _chunk_steps(args: argparse.Namespace, step_s: float) -> int:
    """Steps per chunk: ``--chunk``, or more to last ``--chunk-s`` seconds at ``step_s``
    a step. A chunk shorter than the budget's ``min_interval_s`` would hold one round in
    every chunk — rounds five to ten times as dense as in a run at batch 512 — and measure
    a burst, not what a training loop pays."""
    if args.chunk_s <= 0 or step_s <= 0:
        return args.chunk
    return max(args.chunk, math.ceil(args.chunk_s / step_s))


def _chunk_pair(r: Run, runs: list[Run], step: Callable[[int], None], k: int,
                chunk: int, done: Callable[[], None], alones: list[tuple[float, float]],
                phases: list[float]) -> int:
    """One timed pair for ``r``: ``chunk`` steps alone, ``chunk`` steps with ``r``'s tracker
    and publishing, then ``r``'s tail; returns the next step number.

    Every run's worker is drained first, so no configuration's leftover round runs beside
    another's alone chunk (it made the next configuration's baseline slow and its ratio
    low). The tail: the steps after the chunk (every tracker paused) until ``r``'s worker
    has finished the rounds the chunk handed it, timed as ``r``'s — without it a worker's
    last round of each chunk would slow no chunk of its own. ``done`` waits for the
    device's queued work (CUDA): its wait counts to the last step of each loop.
    ``alones``: every alone chunk's mean step (s; wall and the thread's CPU) so far, in
    order; this pair's is added. ``phases``: what ``step`` adds its forward, backward and
    optimizer seconds to (:func:`~bench.train_step.zipf_loop`); ``r`` sums them over its
    alone chunks and over its chunks with their tails."""

    def finish(times: list[float]) -> None:
        t0 = time.perf_counter()
        done()
        times[-1] += time.perf_counter() - t0

    for other in runs:
        other.idle()
    with paused(runs):
        alone = []
        p0 = list(phases)
        c0, f0 = time.thread_time(), _faults()
        for _ in range(chunk):  # the step alone (trackers paused)
            t0 = time.perf_counter()
            step(k)
            k += 1
            alone.append(time.perf_counter() - t0)
        finish(alone)
        cpu_alone, faults_alone = time.thread_time() - c0, _faults() - f0
    r.phases_alone = _added(r.phases_alone, phases, p0)
    p0 = list(phases)
    b0, t_start = r.acked_bytes(), time.perf_counter()
    c0, f0 = time.thread_time(), _faults()
    times = []
    with paused(runs, but=r):
        for _ in range(chunk):
            t0 = time.perf_counter()
            step(k)
            r.tracker.step()
            r.after_step(k)
            k += 1
            times.append(time.perf_counter() - t0)
        finish(times)
    r.measured_s += time.perf_counter() - t_start
    r.bytes0 += r.acked_bytes() - b0
    tail = []
    with paused(runs):
        settled = r.budget is None
        while not settled:
            t0 = time.perf_counter()
            step(k)
            k += 1
            settled = r.settled()
            tail.append(time.perf_counter() - t0)
        if tail:
            finish(tail)
    cpu, faults = time.thread_time() - c0, _faults() - f0
    r.phases_with = _added(r.phases_with, phases, p0)
    r.faults += faults
    r.faults_alone += faults_alone
    r.alone += alone
    r.times += times
    n = len(times) + len(tail)
    r.with_s.append(((sum(times) + sum(tail)) / n, cpu / n))
    r.alone_at.append(len(alones))
    alones.append((sum(alone) / len(alone), cpu_alone / len(alone)))
    r.tail_steps.append(len(tail))
    r.tail_s.append(sum(tail))
    return k


def _pair_ratios(r: Run, alones: list[tuple[float, float]], col: int, bracketed: bool
                 ) -> list[float]:
    """Each pair's mean step with deltastream ÷ the step alone (``col`` 0: wall, 1: the
    training thread's CPU): ``bracketed``, the mean of the pair's alone chunk and the next
    one (the next pair's, whatever configuration it was for; the run's last pair: its own),
    which lie on either side of the pair's chunk and tail, so a step time that drifts
    linearly over the pair cancels; else its own alone chunk, just before."""
    out = []
    for w, i in zip(r.with_s, r.alone_at, strict=True):
        base = alones[i][col]
        if bracketed and i + 1 < len(alones):
            base = (base + alones[i + 1][col]) / 2
        out.append(w[col] / base)
    return out


def _configurations(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """``(name, Run keywords)`` of the configurations the arguments ask for, in the order
    they take turns (``--only``: those named, in that order too)."""
    b = args.budgets[0] if args.budgets else None
    out = [("tracker", {}), ("tracker-idle", {"reads_every": None})]
    out += [(f"budget-{int(x)}", {"budget": x}) for x in args.budgets]
    variants = [("sync", args.sync, {"threaded": False}),
                ("thread", args.thread, {"worker": "thread"}),
                ("uncapped", args.uncapped, {"max_worker_share": None}),
                ("residuals", args.residuals, {"residuals": True}),
                ("unweighted", args.unweighted, {"read_decay": None})]
    out += [(f"budget-{int(b)}-{v}", {"budget": b, **kw}) for v, on, kw in variants
            if on and b is not None]
    out += [("delta-10", {"delta_every": 10}), ("rounds-10", {"rounds_every": 10})]
    if args.only:
        names = dict(out)
        unknown = [n for n in args.only if n not in names]
        if unknown:
            raise SystemExit(f"--only: no configuration {unknown} among {list(names)}")
        out = [(n, names[n]) for n in args.only]
    return out


def _measure(args: argparse.Namespace, batch: int, servers: str) -> list[dict]:
    from deltastream import ensure_topic

    g = torch.Generator().manual_seed(args.seed)
    dev = torch.device(args.device)
    if args.tables:  # --tables N: N feature tables of vocabulary --users each
        model = FeatureCTR(args.dim, args.tables, args.users, dev)
        vocabs = [args.users] * args.tables
    else:  # the README's loop: users and items
        model = TableCTR(args.dim, args.users, args.items, dev)
        vocabs = [args.users, args.items]
    phases = [0.0, 0.0, 0.0]
    churn = Churn(args.fresh, args.evict_every, args.ttl) if args.fresh else None
    step = zipf_loop(model, vocabs, batch, g, dev, phases, churn)
    done = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n = LOOP_BATCHES
    for k in range(n):  # warm-up: ids resident, optimizer state allocated
        if k == n // 2:
            done()
            t_warm = time.perf_counter()
        step(k)
    done()
    chunk = _chunk_steps(args, (time.perf_counter() - t_warm) / (n - n // 2))
    topic = f"bench.trainer_cost.{batch}.{time.time_ns()}"
    ensure_topic(servers, topic, partitions=1)
    runs = [Run(name, model, servers, topic, snapshot_every=args.snapshot_every, **kw)
            for name, kw in _configurations(args)]
    k = n
    try:
        for r in runs:  # every tracker sees every step; each reads only its own chunks
            if r.budget is not None:
                k = warm(r, runs, step, k, chunk)
            if args.pending and r.prefills():
                prefill(r, runs, model, args.pending, k)
        if args.pending:  # the optimizer's state grows to the prefilled table: untimed
            with paused(runs):
                step(k)
                k += 1
        alones: list[tuple[float, float]] = []
        for _ in range(args.rounds):
            for r in runs:
                k = _chunk_pair(r, runs, step, k, chunk, done, alones, phases)
        busy = {}
        for r in runs:
            if r.budget is not None:
                r.idle()
                busy[r.name] = (r.budget.stats()["worker_s"] or 0.0) - r.worker_s0
                with paused(runs, but=r):
                    k = r.steady_rate(step, k, args.rate_s)
        out = []
        for r in runs:
            # chunk totals, not medians: the user pays every slow tick too
            pairs = _pair_ratios(r, alones, 0, bracketed=True)
            adjacent = _pair_ratios(r, alones, 0, bracketed=False)
            ratio = statistics.median(pairs)
            tick = np.asarray(r.tick_s) * 1e3
            st = r.budget.stats() if r.budget is not None else {}
            worker = busy.get(r.name)
            extra = dict(
                batch=batch, config=r.name, tables=args.tables or 2,
                churn=None if churn is None else dataclasses.asdict(churn),
                tick_p99_ms=float(np.quantile(tick, 0.99))
                if tick.size else None, tick_p50_ms=float(np.median(tick)) if tick.size
                else None, tick_mean_ms=float(tick.mean()) if tick.size else None,
                cpu_ratio=statistics.median(_pair_ratios(r, alones, 1, bracketed=True)),
                faults_per_step=r.faults / max(1, len(r.times) + sum(r.tail_steps)),
                faults_alone_per_step=r.faults_alone / max(1, len(r.alone)),
                ratio_ci95=_median_interval(pairs), pairs=len(pairs), pair_ratios=pairs,
                ratio_adjacent=statistics.median(adjacent),
                ratio_adjacent_ci95=_median_interval(adjacent), pair_ratios_adjacent=adjacent,
                bytes_per_s=r.rate if r.budget is not None
                else r.bytes0 / r.measured_s, tombstone_bytes_per_s=r.tombstone_rate,
                step_alone_ms=statistics.median(r.alone) * 1e3,
                worker_share=None if worker is None else worker / r.measured_s,
                max_backlog=(st.get("backlog") or {}).get("max_handoffs"), chunk_steps=chunk,
                tail_steps=statistics.median(r.tail_steps),
                pending=st.get("pending"), prefilled=args.pending if r.prefills() else 0,
                worker=st.get("worker"), extra_us=_extra_us(r))
            note = (f"tick p99 {extra['tick_p99_ms']:.3g} ms" if tick.size else "no tick")
            lo, hi = extra["ratio_ci95"]
            note += f", ratio 95 % interval {lo:.3f}-{hi:.3f} ({len(pairs)} pairs)"
            note += f", against the alone chunk before only {extra['ratio_adjacent']:.3f}"
            note += f", CPU ratio {extra['cpu_ratio']:.3f}"
            note += (f", page faults {extra['faults_per_step']:.0f}/step "
                     f"(alone {extra['faults_alone_per_step']:.0f})")
            note += ", per step more than alone: " + ", ".join(
                f"{k} {v:+.0f} µs" for k, v in extra["extra_us"].items())
            note += f", {extra['bytes_per_s']:,.0f} B/s acked"
            if worker is not None:
                note += (f", {st['worker']} worker busy {extra['worker_share']:.0%}, "
                         f"pending {st['pending']:,}")
            model_tag = f".t{args.tables}" if args.tables else ""
            out.append(result(f"trainer_cost.{r.name}.b{batch}{model_tag}",
                              statistics.median(r.times) * 1e3, extra["step_alone_ms"],
                              RATIO_GOAL, "ms/step", ratio=ratio, higher_is_better=False,
                              baseline_desc="the same step alone, adjacent chunks",
                              note=note, **extra))
        return out
    finally:
        for r in runs:
            r.close()


def parser() -> argparse.ArgumentParser:
    """The benchmark's flags (``deltastream bench trainer-cost --help``)."""
    p = argparse.ArgumentParser(prog="deltastream bench trainer-cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=_ints, default=[512, 4096], help="batch sizes (512,4096)")
    p.add_argument("--dim", type=int, default=32, help="embedding width (32)")
    p.add_argument("--users", type=int, default=200_000, help="Zipf user vocabulary (200K)")
    p.add_argument("--items", type=int, default=50_000, help="Zipf item vocabulary (50K)")
    p.add_argument("--tables", type=int, default=0,
                   help="instead of the user/item model, this many feature tables of "
                        "vocabulary --users each (a DLRM-like model; 0: the README's loop)")
    p.add_argument("--budgets", type=_ints, default=[50_000, 5_000, 500_000],
                   help="BudgetPublisher bytes/s, the first also in sync mode "
                        "(50000,5000,500000)")
    p.add_argument("--only", type=lambda t: [x for x in t.split(",") if x], default=None,
                   help="run only these configurations (comma-separated names, e.g. "
                        "rounds-10,budget-50000): more pairs of one in the same time")
    p.add_argument("--no-sync", dest="sync", action="store_false",
                   help="leave out the synchronous-mode configuration")
    p.add_argument("--no-thread", dest="thread", action="store_false",
                   help="leave out the thread-worker configuration")
    p.add_argument("--uncapped", action="store_true",
                   help="also the first budget with BudgetPolicy(max_worker_share=None): "
                        "rounds every min_interval_s whatever the worker's CPU")
    p.add_argument("--residuals", action="store_true",
                   help="also the first budget with BudgetPolicy(residuals=True, "
                        "wide_dtype='i8') on wire v5")
    p.add_argument("--unweighted", action="store_true",
                   help="also the first budget with BudgetPolicy(read_decay=None): keys "
                        "not weighted by reads")
    p.add_argument("--fresh", type=int, default=0,
                   help="ids never seen before in every step's batch, per table (0: the "
                        "cycled batches insert nothing after the first cycle)")
    p.add_argument("--evict-every", type=int, default=0, metavar="E",
                   help="with --fresh: every E steps evict the fresh ids older than --ttl "
                        "steps from every table (0: never)")
    p.add_argument("--ttl", type=int, default=50,
                   help="steps a fresh id lives before an eviction removes it (50)")
    p.add_argument("--snapshot-every", type=int, default=0, metavar="N",
                   help="give every tracker a second consumer, read every N steps on the "
                        "training thread, as the demo's snapshots are (0: one consumer)")
    p.add_argument("--pending", type=int, default=0,
                   help="rows pending in each budget before timing (0)")
    p.add_argument("--chunk", type=int, default=10,
                   help="steps per timed chunk, at least (10)")
    p.add_argument("--chunk-s", type=float, default=1.0,
                   help="seconds per timed chunk, at least (1.0; 0: --chunk steps): a chunk "
                        "spans many rounds (min_interval_s), as a run does")
    p.add_argument("--rounds", type=int, default=6, help="chunks per configuration (6)")
    p.add_argument("--rate-s", type=float, default=10.0,
                   help="seconds each budget runs alone after the chunks, for its bytes/s "
                        "(10.0: rounds up to a second apart leave up to a second's refill "
                        "in or out of a short window)")
    p.add_argument("--servers", default=None, help="a Kafka broker (default: embedded)")
    p.add_argument("--switch-interval", type=float, default=None, metavar="S",
                   help="sys.setswitchinterval for the run (default: Python's 0.005 s); a "
                        "shorter one shows how much of the threaded cost is the training "
                        "thread waiting for the GIL the worker holds")
    add_threads_flag(p)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model trains (cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out",
                   help="directory of the PNG (trainer_cost.png; trainer_cost_t<N>.png "
                        "with --tables N)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; one figure per configuration and batch size."""
    args = parser().parse_args(argv)
    old_interval = sys.getswitchinterval()
    with torch_threads(args.threads), contextlib.ExitStack() as stack:
        if args.switch_interval is not None:
            sys.setswitchinterval(args.switch_interval)
            stack.callback(sys.setswitchinterval, old_interval)
        servers = args.servers
        if servers is None:
            from deltastream.broker import EmbeddedBroker
            servers = stack.enter_context(EmbeddedBroker()).bootstrap_servers
        out = [r for b in args.batches for r in _measure(args, b, servers)]
    tag = f"_t{args.tables}" if args.tables else ""
    png = plot(Path(args.out) / f"trainer_cost{tag}.png", out, ratio_goal=RATIO_GOAL,
               tick_goal_ms=TICK_GOAL_MS)
    for r in out:
        r["plot"] = None if png is None else str(png)
    return out


if __name__ == "__main__":  # pragma: no cover
    from bench._common import emit
    emit(main(), False)
