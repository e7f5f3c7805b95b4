"""``bench neighbour-load``: its load processes and its arguments (no training)."""

from __future__ import annotations

import os
import time

import pytest

from bench import neighbour_load

needs_two = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or not {0, 1} <= os.sched_getaffinity(0),
    reason="needs CPUs 0 and 1")


@needs_two
@pytest.mark.parametrize("name", sorted(neighbour_load.LOADS))
def test_each_load_runs_pinned_to_cpu_1_until_killed(name):
    proc = neighbour_load._load(name, 0.5, 0.004)
    try:
        deadline = time.monotonic() + 30
        while os.sched_getaffinity(proc.pid) != {1}:  # pinned once its interpreter started
            assert proc.poll() is None, f"load {name} exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the load never pinned itself"
            time.sleep(0.05)
        time.sleep(0.3)  # through several bursts and sleeps
        assert proc.poll() is None, f"load {name} exited with {proc.returncode}"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("argv", [["--loads", "python,nope"], ["--duty", "0"],
                                  ["--duty", "1.5"]])
def test_unknown_loads_and_a_duty_outside_0_1_are_refused(argv):
    with pytest.raises(SystemExit):
        neighbour_load.main(argv)
