"""CPU sets for the sync daemon: parse ``"0-3,6"``, check, pin the calling thread.

A predictor host runs the sync daemon beside model-server processes. On a busy host a
model server's lookup that the scheduler preempts waits in the run queue behind whatever
runs on its CPU — the daemon applying at full speed, or its checkpoint thread — for a
scheduler slice or more (1–3 ms here). Pinning the daemon's threads to CPUs the model
servers leave free keeps them off the model servers' CPUs (``bench serving
--daemon-cpus``: BENCHMARKS.md). Affinity is per thread on Linux: :func:`pin_thread` pins
the calling thread, and threads it starts afterwards inherit the set; other threads of the
process (a model server's, in-process) keep theirs.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable
from typing import Union

__all__ = ["CpuSpec", "parse_cpus", "check_cpus", "format_cpus", "pin_thread", "cpu_list_arg"]

#: a CPU list (``"0-3,6"``) or CPU numbers
CpuSpec = Union[str, Iterable[int]]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_MAX_CPU = 1 << 16


def parse_cpus(spec: CpuSpec) -> frozenset[int]:
    """CPU numbers of ``spec``: a list like ``"0-3,6"`` (the ``taskset -c`` syntax) or
    ints. ValueError naming the bad part."""
    if isinstance(spec, str):
        cpus: set[int] = set()
        for part in spec.split(","):
            m = _RANGE.match(part.strip())
            if not m or (m[2] is not None and int(m[2]) < int(m[1])):
                raise ValueError(f"cpus: {part.strip()!r} in {spec!r} is not a CPU number or "
                                 "range; expected a list like '0-3,6'")
            cpus.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    else:
        try:
            items = list(spec)
        except TypeError:
            raise ValueError(f"cpus: expected a list like '0-3,6' or CPU numbers, got "
                             f"{spec!r}") from None
        bad = [c for c in items if isinstance(c, bool) or not isinstance(c, int) or c < 0]
        if bad:
            raise ValueError(f"cpus: expected CPU numbers ≥ 0, got {bad[0]!r}")
        cpus = set(items)
    if not cpus or max(cpus) >= _MAX_CPU:
        raise ValueError(f"cpus: expected between 1 and {_MAX_CPU} CPU numbers below "
                         f"{_MAX_CPU}, got {spec!r}")
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 6}`` -> ``"0-2,6"``."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_cpus(spec: CpuSpec) -> frozenset[int]:
    """:func:`parse_cpus`, and the CPUs must be ones this process may run on (Linux).
    ValueError naming the CPUs allowed."""
    cpus = parse_cpus(spec)
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("cpus: pinning threads to CPUs needs Linux (os.sched_setaffinity)")
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"cpus: {format_cpus(cpus - allowed)} not among the CPUs this "
                         f"process may run on ({format_cpus(allowed)})")
    return cpus


def pin_thread(cpus: Iterable[int]) -> frozenset[int]:
    """Run the calling thread, and the threads it starts from now on, on ``cpus`` only
    (checked with :func:`check_cpus` first); returns the CPUs it ran on before. ValueError
    when the OS refuses (a CPU taken offline, a cgroup narrowed since the check)."""
    was = frozenset(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, set(cpus))  # 0: the calling thread (a thread is a task)
    except OSError as e:
        raise ValueError(f"cpus: cannot run on {format_cpus(cpus)} ({e.strerror}); this "
                         f"process may run on {format_cpus(was)}") from None
    return was


def cpu_list_arg(text: str) -> frozenset[int]:
    """argparse ``type=`` of a CPU list option: :func:`check_cpus`, its errors as usage
    errors."""
    try:
        return check_cpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("cpus: ")) from None
