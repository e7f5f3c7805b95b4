"""Benchmark: how long the daemon's kernel work keeps a model server's thread off its CPU.

A kernel running ``preempt=none`` (the default of many server and VM kernels, this one
included: ``dmesg`` says ``Dynamic Preempt: none``) does not preempt a task inside a system
call until the call returns or reaches a preemption point. Two calls of the sync daemon did
long stretches of such work:

* ``stalls.write`` — checkpoint files written in 16 MiB ``write()`` calls (the page cache
  copy of a whole call runs without a preemption point), against the 256 KiB calls of
  :class:`consumers.files.HashingWriter`;
* ``stalls.collapse`` — ``MADV_COLLAPSE`` of a shared table's 2 MiB blocks zeroes each new
  huge page in one stretch. On a VM whose host backs memory on first touch, that took about
  3 ms per block. This is measured against :func:`consumers.serving.hugemap.collapse`, which
  first faults in (preemptibly) and frees an anonymous huge page for the collapse to reuse.

A probe process pinned to the same CPU sleeps ``--sleep-us`` in a loop and records how
late it wakes: the latency a model server's thread sees. Each figure is the probe's p99
under the old way (baseline) and under the current one; the ratio is current / old (lower is
better). Both ways run on CPU 0, alternating ``--rounds`` times. ``--rest`` seconds pass
before each run, so that a VM's host has taken freed memory back (free-page reporting) and
every run starts on fresh memory, as a growing table does.

Run: ``deltastream bench stalls [--mib 512] [--rounds 2] [--rest 10]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from bench._common import result

__all__ = ["main"]

_OLD_WRITE = 16 << 20  # the rows chunk of a checkpoint (65536 rows x 256 bytes), one call


def _probe(seconds: float, sleep_us: int) -> None:
    """Probe process: oversleep of each ``sleep_us`` sleep on CPU 0 -> one line, ms."""
    os.sched_setaffinity(0, {0})
    late = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        time.sleep(sleep_us / 1e6)
        late.append(time.perf_counter() - t0 - sleep_us / 1e6)
    ms = np.array(late) * 1e3
    print(f"{np.percentile(ms, 99):.4f} {np.percentile(ms, 99.9):.4f} {ms.max():.4f}")


def _write(path: Path, data: np.ndarray, old: bool) -> None:
    from consumers.files import HashingWriter

    with open(path, "wb") as f:
        if old:
            mv = memoryview(data)
            for i in range(0, data.nbytes, _OLD_WRITE):
                f.write(mv[i: i + _OLD_WRITE])
        else:
            HashingWriter(f).write(data)
        f.flush()
        os.fsync(f.fileno())
    path.unlink()


def _collapse(shm: Path, nbytes: int, old: bool) -> int:
    from consumers.serving import hugemap

    fd, name = tempfile.mkstemp(dir=shm, prefix="ds-bench-stalls-")
    os.unlink(name)
    try:
        os.ftruncate(fd, nbytes)
        buf = hugemap.map_file(fd, nbytes, True)
        done = 0
        for b in range(0, nbytes, hugemap.BLOCK):
            os.posix_fallocate(fd, b, 4096)  # as the shared storage backs a block
            done += hugemap.collapse(buf, b, b + hugemap.BLOCK, warm=not old)
        return done
    finally:
        os.close(fd)


def _under_probe(work, args: argparse.Namespace) -> tuple[float, float, float]:
    """Run ``work()`` on CPU 0 beside the probe; the probe's (p99, p99.9, max) in ms."""
    time.sleep(args.rest)
    probe = subprocess.Popen(
        [sys.executable, "-m", "bench.stalls", "--_probe", str(args.probe_seconds),
         str(args.sleep_us)], cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    work()
    out, _ = probe.communicate(timeout=args.probe_seconds + 60)
    p99, p999, mx = (float(x) for x in out.split())
    return p99, p999, mx


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns the two figures as :func:`bench._common.result` dicts."""
    if argv and argv[0] == "--_probe":
        _probe(float(argv[1]), int(argv[2]))
        return []
    ap = argparse.ArgumentParser(prog="deltastream bench stalls", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="MiB written / collapsed per run (512)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each way, alternating (2)")
    ap.add_argument("--rest", type=float, default=10.0,
                    help="seconds of rest before each run (10; 0 on bare metal)")
    ap.add_argument("--sleep-us", type=int, default=200, help="the probe's sleep (200 µs)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="tmpfs of the collapse runs")
    args = ap.parse_args(argv)
    for flag in ("mib", "rounds", "sleep_us"):
        if getattr(args, flag) <= 0:
            ap.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.rest < 0:
        ap.error(f"--rest must be >= 0, got {args.rest}")
    if not hasattr(os, "sched_setaffinity") or 0 not in os.sched_getaffinity(0):
        ap.error("needs Linux and CPU 0 in this process's affinity")
    shm = Path(args.shm_dir)
    if not shm.is_dir():
        ap.error(f"--shm-dir: {shm} is not a directory")
    nbytes = args.mib << 20
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    # the probe must outlast the work: the old ways take up to ~3 ms per MiB here
    args.probe_seconds = 1.0 + 0.005 * args.mib
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        return _run(args, data, shm, nbytes)
    finally:
        os.sched_setaffinity(0, cpus)


def _run(args: argparse.Namespace, data: np.ndarray, shm: Path, nbytes: int) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory(prefix="ds-bench-stalls-") as tmp:
        works = {
            "write": (partial(_write, Path(tmp) / "f.bin", data), "16 MiB write() calls"),
            "collapse": (partial(_collapse, shm, nbytes), "MADV_COLLAPSE of fresh blocks"),
        }
        for name, (work, how) in works.items():
            runs: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
            for _ in range(args.rounds):
                for old in (True, False):
                    runs[old].append(_under_probe(partial(work, old=old), args))
            new, was = (tuple(statistics.median(r[i] for r in runs[old]) for i in range(3))
                        for old in (False, True))
            out.append(result(
                f"stalls.{name}", new[0], was[0], None, "ms", ratio=new[0] / was[0],
                higher_is_better=False, p999_ms=new[1], max_ms=new[2], old_p999_ms=was[1],
                old_max_ms=was[2], mib=args.mib, rounds=args.rounds,
                baseline_desc=f"same run: a same-CPU probe's p99 wake-up delay beside {how}",
                note=f"p99/p99.9/max {new[0]:.3f}/{new[1]:.3f}/{new[2]:.3f} ms, old way "
                     f"{was[0]:.3f}/{was[1]:.3f}/{was[2]:.3f} ms ({args.mib} MiB per run, "
                     f"median of {args.rounds})"))
    return out


if __name__ == "__main__":  # pragma: no cover
    from bench._common import emit
    emit(main(sys.argv[1:]), False)  # the probe (--_probe) prints its own line, emits nothing
