"""Fixtures of the predictor-side tests."""

from __future__ import annotations

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
