"""The ``path`` fixture: select_changed's torch reference path (kernels off, CPU) and its
Triton kernel path (``kernel_device``: CUDA, or CPU under Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from deltastream.kernels.runtime import kernels_mode
from tests.deltastream.publishing.selection_cases import SelectPath


@pytest.fixture(params=["torch", "kernels"])
def path(request):
    if request.param == "kernels":
        yield SelectPath("kernels", request.getfixturevalue("kernel_device"))
    else:
        with kernels_mode("off"):
            yield SelectPath("torch", torch.device("cpu"))
