"""Helpers every benchmark uses: timing, the result record and its printing, workloads.

A benchmark module ``bench/<name>.py`` defines ``main(argv=None) -> list[dict]``. Each
dict comes from :func:`result`; ``deltastream bench <name> [--json]`` prints them.
Every figure is set against a baseline measured in the same run, because the machines
these run on are shared and noisy: the ratio is what is compared with the goal.

Also here: :func:`zipf_ids` (the Zipf id workload), :func:`add_threads_flag` with
:func:`torch_threads` (the common ``--threads`` option). This module must not import torch at
import time: torch-free benchmarks (apply, codec) import it too, so the torch helpers import it
inside. Plots use :func:`deltastream_demo.plots.pyplot`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing torch/numpy here would load them for every bench
    import numpy as np
    import torch

__all__ = ["result", "best_time", "emit", "zipf_ids", "row_ids", "torch_threads",
           "add_threads_flag",
           "THREADS_HELP", "Loopback", "LoopbackSent"]

log = logging.getLogger(__name__)

#: Odd multiplier (2**32 / golden ratio) that scatters Zipf ranks over the id space. Being odd,
#: it is a bijection modulo any power of two, so distinct ranks stay distinct ids.
_SPREAD = 0x9E3779B1

#: Help text of the common ``--threads`` flag (``{default}`` is filled in).
THREADS_HELP = ("torch intra-op threads for the run (default {default}; 0 = leave torch's "
                "setting). On a shared, oversubscribed machine many small multi-threaded ATen "
                "ops stall whenever a sibling core is busy, and the figures then measure the "
                "scheduler; 1 keeps them stable")


def result(name: str, value: float, baseline: float, goal: float | None, unit: str, *,
           ratio: float | None = None, higher_is_better: bool = True, **extra) -> dict:
    """One benchmark figure.

    ``ratio`` defaults to ``value / baseline`` (both throughputs, higher is better). Pass it
    explicitly when the figure is a time or an overhead. ``goal`` is a goal for the ratio
    (``ratio >= goal`` passes, or ``<=`` with ``higher_is_better=False``); ``None`` = report only.
    """
    if ratio is None:
        ratio = value / baseline if baseline else float("nan")
    if goal is None:
        ok = None
    else:
        ok = bool(ratio >= goal) if higher_is_better else bool(ratio <= goal)
    rec = {"name": name, "value": value, "baseline": baseline, "ratio": ratio, "goal": goal,
           "unit": unit, "higher_is_better": higher_is_better, "pass": ok}
    rec.update(extra)
    return rec


def best_time(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs: wall
    time, or the calling thread's CPU time with ``clock=time.thread_time``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def emit(results: Iterable[dict], as_json: bool) -> None:
    """Print results: one JSON object per line, or an aligned human table."""
    results = list(results)
    if as_json:
        for r in results:
            print(json.dumps(r, sort_keys=False))
        return
    for r in results:
        status = {True: "PASS", False: "SHORT", None: "info"}[r["pass"]]
        goal = "" if r["goal"] is None else ("≥ " if r["higher_is_better"] else "≤ ") + f"{r['goal']:g}"
        print(f"{r['name']:<40} {r['value']:>14.4g} {r['unit']:<10} baseline {r['baseline']:>12.4g}"
              f"  ratio {r['ratio']:>8.3f}  goal {goal:<8} {status}")


def row_ids(i: np.ndarray) -> np.ndarray:
    """Id of a table's i-th row (int64, the shape of ``i``): splitmix64 of i — hash-like, as
    trainers' ids are, and distinct (every step is a bijection of 64-bit integers)."""
    import numpy as np

    z = i.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))).view(np.int64)


def zipf_ids(n: int, *, vocab: int, alpha: float,
             generator: torch.Generator | np.random.Generator | None = None,
             seed: int | None = None, bits: int | None = 62, offset: int = 12345) -> torch.Tensor:
    """``n`` int64 ids drawn Zipf(``alpha``) over ``vocab`` ranks; shape ``[n]``, on the CPU.

    Rank ``k`` in ``[0, vocab)`` is drawn with probability proportional to
    ``(k + 1) ** -alpha`` (inverse CDF of ``n`` float64 uniforms). Ranks become ids
    ``(k * 0x9E3779B1 + offset) mod 2**bits``, so hot ids are not small consecutive integers
    (global ids of a real table are hashes) and distinct ranks give distinct ids while
    ``vocab <= 2**bits``; ``bits=None`` returns the ranks themselves (``offset`` unused).

    The uniforms come from ``generator``: a ``torch.Generator``, or a
    ``numpy.random.Generator`` for a benchmark that draws the rest of its workload with numpy
    (so its stream stays one); or, without one, from a torch generator seeded with ``seed``.
    Give exactly one of ``generator`` and ``seed``.
    """
    import torch

    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"zipf_ids: n must be an int >= 0, got {n!r}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= 1 << 31:
        # the bound keeps rank * 0x9E3779B1 inside int64
        raise ValueError(f"zipf_ids: vocab must be an int in [1, 2**31], got {vocab!r}")
    if not math.isfinite(alpha):
        raise ValueError(f"zipf_ids: alpha must be a finite number, got {alpha!r}")
    if bits is not None and not 1 <= bits <= 62:
        raise ValueError(f"zipf_ids: bits must be in [1, 62] or None, got {bits!r}")
    if not 0 <= offset < 1 << 62:
        raise ValueError(f"zipf_ids: offset must be in [0, 2**62), got {offset!r}")
    if (generator is None) == (seed is None):
        raise ValueError("zipf_ids: give exactly one of generator and seed")

    if generator is None:
        generator = torch.Generator().manual_seed(seed)
    if isinstance(generator, torch.Generator):
        u = torch.rand(n, generator=generator, dtype=torch.float64)
    else:
        import numpy as np

        if not isinstance(generator, np.random.Generator):
            raise TypeError("zipf_ids: generator must be a torch.Generator or a "
                            f"numpy.random.Generator, got {type(generator).__name__}")
        u = torch.from_numpy(generator.random(n))
    cdf = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-alpha).cumsum(0)
    cdf /= cdf[-1].clone()
    ranks = torch.searchsorted(cdf, u).clamp_(max=vocab - 1)
    if bits is None:
        return ranks
    return (ranks * _SPREAD + offset) & ((1 << bits) - 1)


def _threads_arg(text: str) -> int:
    """argparse type of ``--threads``: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 0 (0 = leave torch's setting), got {text!r}")
    return value


def add_threads_flag(parser: argparse.ArgumentParser, default: int = 1) -> None:
    """Add the common ``--threads N`` option (an int >= 0, ``default``) to ``parser``.

    Use its value with :func:`torch_threads` around the benchmark's run.
    """
    if isinstance(default, bool) or not isinstance(default, int) or default < 0:
        raise ValueError(f"add_threads_flag: default must be an int >= 0, got {default!r}")
    parser.add_argument("--threads", type=_threads_arg, default=default, metavar="N",
                        help=THREADS_HELP.format(default=default))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run the block with ``n`` torch intra-op threads, then restore the previous count.

    ``n = 0`` leaves torch's setting alone. Yields the number of threads in effect.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"torch_threads: n must be an int >= 0 (0 = leave torch's setting), "
                         f"got {n!r}")
    import torch

    prev = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        if n:
            torch.set_num_threads(prev)  # later benches in this process keep their setting


@dataclass
class LoopbackSent:
    """Counters of one :meth:`Loopback.publish` call (those of a ``PublishResult``)."""

    rows: int
    tombstones: int
    messages: int
    bytes: int


class Loopback:
    """In-process stand-in for ``DeltaPublisher``: each batch is encoded in the wire format
    (``dtype``; the encoded bytes are counted), decoded and applied to ``serving`` (table
    name -> ``consumers.ServingTable``). One seq counter over all tables (shard 0, epoch 1).
    ``ids``/``rows``/``tombstones`` may be numpy arrays or CPU tensors. With ``keep`` (a
    list), every encoded message is also appended to it as ``(step, table, message)``.
    ``wire_version``: the wire version encoded; ``dtype`` of a call: as ``DeltaPublisher``'s."""

    def __init__(self, serving: dict, dtype: str, *, model: str = "bench",
                 keep: list | None = None, wire_version: int = 2) -> None:
        self.serving, self.dtype, self.model, self.seq = serving, dtype, model, 0
        self.keep, self.wire_version = keep, wire_version

    def publish(self, table: str, ids, rows, *, step: int, tombstones=None,
                ts: int | None = None, dtype: str | None = None, fresh=None) -> LoopbackSent:
        import numpy as np

        from deltastream import wire

        batch = wire.DeltaBatch(model=self.model, table=table, shard=0, epoch=1, seq=self.seq,
                                step=step, ts=time.time_ns() if ts is None else ts,
                                ids=np.asarray(ids), rows=np.asarray(rows),
                                dtype=dtype or self.dtype,
                                tombstones=None if tombstones is None else np.asarray(tombstones),
                                fresh=None if fresh is None else np.asarray(fresh))
        msgs = wire.encode(batch, version=self.wire_version)
        for msg in msgs:
            self.seq += 1
            self.serving[table].apply(wire.decode(msg))
            if self.keep is not None:
                self.keep.append((step, table, msg))
        return LoopbackSent(rows=len(ids),
                            tombstones=0 if tombstones is None else len(tombstones),
                            messages=len(msgs), bytes=sum(len(m) for m in msgs))
