"""The ``path`` fixture: select_changed's torch reference path (kernels off, CPU) and its
Triton kernel path (``kernel_device``: CUDA, or CPU under Triton's interpreter). The
``native`` fixture: the budget worker's C passes (:mod:`deltastream.publishing.native`)
and their torch twins."""

from __future__ import annotations

import pytest
import torch

from deltastream.kernels.runtime import kernels_mode
from deltastream.publishing import row_moves, serving_error
from tests.deltastream.publishing.selection_cases import SelectPath


@pytest.fixture(params=["torch", "kernels"])
def path(request):
    if request.param == "kernels":
        yield SelectPath("kernels", request.getfixturevalue("kernel_device"))
    else:
        with kernels_mode("off"):
            yield SelectPath("torch", torch.device("cpu"))


@pytest.fixture(params=["native", "torch"])
def native(request):
    """Run the test with the C extension's ``row_errors`` and ``move_rows``, and with
    torch's."""
    exts = (serving_error._NATIVE, row_moves._NATIVE)
    if request.param == "native" and not exts[0].available:
        pytest.skip(f"deltastream.publishing.native is not built ({exts[0].why})")
    for e in exts:
        e.use(request.param == "native")
    yield request.param == "native"
    for e in exts:
        e.use(e.available)
