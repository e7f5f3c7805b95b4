"""Fixtures of the tracking tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["native", "numpy"])
def fresh_path(request):
    """Run the test once with the C code of :mod:`deltastream.tracking.fresh_rows` (skipped
    where the extension is not built) and once with numpy."""
    from deltastream.tracking import fresh_rows

    native = request.param == "native"
    if native and not fresh_rows.NATIVE_AVAILABLE:
        pytest.skip("deltastream.tracking.native is not built")
    was = fresh_rows.native_enabled()
    fresh_rows.use_native(native)
    yield request.param
    fresh_rows.use_native(was)
