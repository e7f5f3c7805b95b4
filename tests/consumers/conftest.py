"""Fixtures of the predictor-side tests."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest


@pytest.fixture(params=["native", "numpy"])
def lookup_path(request, monkeypatch):
    """Run the test once with the native lookup path (skipped where the C extension is not
    built) and once with numpy (:mod:`consumers.serving.lookup`); processes the test
    starts inherit the choice through ``DELTASTREAM_NATIVE``."""
    from consumers.serving import lookup

    native = request.param == "native"
    if native and not lookup.NATIVE_AVAILABLE:
        pytest.skip("the native lookup probe is not built")
    was = lookup.native_enabled()
    lookup.use_native(native)
    monkeypatch.setenv("DELTASTREAM_NATIVE", "1" if native else "0")
    yield request.param
    lookup.use_native(was)


@pytest.fixture
def gil_gap():
    """``gil_gap(call)`` -> (seconds ``call()`` took, the longest a spinning Python thread
    went without running meanwhile). A call that held the GIL throughout leaves one gap
    spanning it; one that releases the GIL leaves short gaps."""
    ticks: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    t = threading.Thread(target=spin)
    t.start()

    def measure(call) -> tuple[float, float]:
        while not ticks:
            time.sleep(0.001)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        seen = np.array([t0] + [x for x in ticks if t0 < x < t1] + [t1])
        return t1 - t0, float(np.diff(seen).max())

    yield measure
    stop.set()
    t.join()
