"""tensor_views: the views the C extensions read tensors through share the tensor's memory."""

import numpy as np
import pytest
import torch

from deltastream.tensor_views import as_buffer, as_bytes, head_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.bool])
def test_as_buffer_is_the_tensors_memory_as_as_bytes_reads_it(dtype: torch.dtype) -> None:
    t = (torch.arange(24, dtype=torch.float32) - 7).reshape(6, 4).to(dtype)
    buf = as_buffer(t)
    assert buf.flags["C_CONTIGUOUS"] and buf.nbytes == t.numel() * t.element_size()
    assert bytes(memoryview(buf).cast("B")) == as_bytes(t).tobytes()
    t[2, 1] = 1  # a view, not a copy: the C code reads what the tensor holds now
    assert bytes(memoryview(buf).cast("B")) == as_bytes(t).tobytes()


def test_as_buffer_of_a_tensor_that_requires_grad() -> None:
    w = torch.ones(3, 2, requires_grad=True)
    buf = as_buffer(w)
    assert buf.dtype == np.uint8 and buf.tobytes() == w.detach().numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 4, 6])
def test_head_rows_is_the_first_rows_memory(dtype: torch.dtype, n: int) -> None:
    t = (torch.arange(24, dtype=torch.float32) - 7).reshape(6, 4).to(dtype)
    head = head_rows(as_buffer(t), n, 4 * t.element_size())  # bf16: numpy has no dtype
    assert head.flags["C_CONTIGUOUS"] and head.nbytes == n * 4 * t.element_size()
    assert head.tobytes() == as_bytes(t[:n]).tobytes()
    if n:
        t[n - 1, 3] = 5  # a view of the tensor's memory
        assert head.tobytes() == as_bytes(t[:n]).tobytes()
