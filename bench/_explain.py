"""Where a thread's time went across a call, from the kernel's own accounting (``bench
serving --explain``): CPU, run-queue wait, otherwise off the CPU, host steal, page faults
and context switches per call (:class:`Where`); how much of the machine this benchmark
and others used during a phase (:class:`Box`); a summary of the calls (:func:`summarize`).
Linux only."""

from __future__ import annotations

import os
import resource
import time

import numpy as np

__all__ = ["Where", "Box", "summarize"]


class Where:
    """Where one thread's time went across a call (``--explain``), from the kernel's own
    per-thread accounting: CPU time (``time.thread_time_ns``: exact; schedstat's CPU
    field lags by up to a tick for a running thread), run-queue wait
    (``/proc/thread-self/schedstat``, ns: complete while the thread runs), minor page
    faults and voluntary / involuntary context switches (``getrusage(RUSAGE_THREAD)``).
    Wall time minus CPU minus run-queue wait is time the thread was off the CPU otherwise:
    asleep (the GIL, a lock, I/O: then it made voluntary switches) or its virtual CPU
    stolen by the hypervisor (no switch at all). ``steal``: time the host took from any of
    the machine's virtual CPUs meanwhile (``/proc/stat``, in whole ticks of
    1/``SC_CLK_TCK`` s: 0 for most calls, a tick or more around a long theft)."""

    FIELDS = ("wall", "cpu", "runq", "off", "steal", "minflt", "vcsw", "ivcsw")
    MEANS = 5  # the first FIELDS are times (mean ms), the others counts (share > 0)

    def __init__(self) -> None:
        self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)  # this thread's
        self._stat = os.open("/proc/stat", os.O_RDONLY)
        self._tick = 1.0 / os.sysconf("SC_CLK_TCK")

    def sample(self) -> tuple[float, ...]:
        """The counters, between two reads of the wall clock: :meth:`delta` takes the
        first of the earlier sample's and the last of the later one's, so every counter
        moved within the wall time it is set against (a thread preempted inside a sample
        would otherwise add run-queue wait that no wall time covers)."""
        t0 = time.perf_counter()
        runq = os.pread(self._fd, 128, 0).split()[1]
        steal = int(os.pread(self._stat, 256, 0).split(b"\n", 1)[0].split()[8])
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        return (t0, time.thread_time_ns(), int(runq), steal * self._tick, ru.ru_minflt,
                ru.ru_nvcsw, ru.ru_nivcsw, time.perf_counter())

    @staticmethod
    def delta(a: tuple, b: tuple) -> tuple[float, ...]:
        wall = b[7] - a[0]
        cpu, runq = (b[1] - a[1]) * 1e-9, (b[2] - a[2]) * 1e-9
        return (wall, cpu, runq, max(0.0, wall - cpu - runq), b[3] - a[3], b[4] - a[4],
                b[5] - a[5], b[6] - a[6])


class Box:
    """CPU seconds of the whole machine (``/proc/stat``: busy, steal, total) and of this
    benchmark's processes, to say how much of the box others used during a phase
    (``--explain``). The processes' CPU time comes from their kernel CPU clocks (ns,
    exited threads included): ``/proc/<pid>/stat`` counts in whole ticks of
    1/``SC_CLK_TCK`` s, which read 0 for readers that ran 6 ms in a 0.3 s phase."""

    def __init__(self, pids: list[int]) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")
        # Linux's process-wide CPU clock id for a pid (CPUCLOCK_SCHED, not per thread),
        # what glibc's clock_getcpuclockid() returns; Python does not wrap that call.
        self.clocks = [(~pid << 3) | 2 for pid in pids]

    def sample(self) -> tuple[float, float, float, float]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        ours = 0
        for clock in self.clocks:
            try:
                ours += time.clock_gettime_ns(clock)
            except OSError:  # the process has exited
                pass
        busy = sum(v) - v[3] - v[4] - v[7]  # minus idle, iowait, steal
        return busy / self.tick, v[7] / self.tick, sum(v) / self.tick, ours * 1e-9

    @staticmethod
    def delta(a: tuple, b: tuple) -> dict:
        busy, steal, total, ours = (y - x for x, y in zip(a, b, strict=True))
        cpus = os.cpu_count() or 1
        return {"cores": cpus, "busy_cores": round(busy / total * cpus, 2),
                "ours_cores": round(ours / total * cpus, 3),
                "others_cores": round(max(0.0, busy - ours) / total * cpus, 2),
                "steal_share": round(steal / total, 3)}


def summarize(rows: list[tuple[float, ...]], slow_ms: float) -> dict:
    """Breakdown of the lookups slower than ``slow_ms``: count, mean ms of wall / cpu /
    run-queue wait / otherwise off the CPU / host steal on any virtual CPU, share with a
    page fault / a voluntary / an involuntary context switch, the slowest five; and the
    same over all lookups."""
    a = np.asarray(rows, np.float64).reshape(-1, len(Where.FIELDS))
    out: dict = {"n": int(a.shape[0])}
    for name, sel in (("all", a), ("slow", a[a[:, 0] * 1e3 > slow_ms])):
        d: dict = {"n": int(sel.shape[0])}
        if sel.shape[0]:
            m = Where.MEANS
            for i, f in enumerate(Where.FIELDS[:m]):
                d[f + "_ms"] = round(float(sel[:, i].mean()) * 1e3, 3)
            for i, f in enumerate(Where.FIELDS[m:], m):
                d[f + "_share"] = round(float((sel[:, i] > 0).mean()), 3)
            d["top"] = [[round(x * 1e3, 2) for x in r[:m]] + [int(x) for x in r[m:]]
                        for r in sel[np.argsort(-sel[:, 0])[:5]]]
        out[name] = d
    return out
