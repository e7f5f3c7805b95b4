"""deltastream_demo.batches: a rank's batches, made one step ahead on a thread."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from deltastream_demo.batches import BatchPrefetcher  # noqa: E402
from deltastream_demo.data import ClickStream, StreamConfig  # noqa: E402


def _expected(stream: ClickStream, step: int, rank: int, world: int, b: int):
    x = stream.batch((step * world + rank) * b, b)
    return x.user_ids, x.item_ids, x.dense, x.labels


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("order", [[0, 1, 2, 3], [0, 2, 3, 1, 1], [5]])
def test_every_step_gets_its_own_slice_of_the_stream_in_any_order(order, ahead):
    """In order the batch comes from the thread; a skipped, repeated or earlier step is
    made on the spot. Either way it is the rank's slice of the stream, bit for bit."""
    stream = ClickStream(StreamConfig(seed=3, n_users=500, n_items=100))
    p = BatchPrefetcher(stream, rank=1, world=3, batch_size=64, device=torch.device("cpu"),
                        torch=torch, ahead=ahead)
    try:
        for step in order:
            got = p.get(step)
            want = _expected(stream, step, 1, 3, 64)
            assert len(got) == 4
            for g, w in zip(got, want, strict=True):
                assert isinstance(g, torch.Tensor) and g.dtype == torch.from_numpy(w).dtype
                np.testing.assert_array_equal(g.numpy(), w)
    finally:
        p.close()
    p.close()  # twice is harmless


class _Recording(ClickStream):
    """The stream, noting which thread made each batch (by start position)."""

    def __init__(self, config: StreamConfig) -> None:
        super().__init__(config)
        self.made_by: dict[int, str] = {}

    def batch(self, start: int, count: int, *, salt: int = 0):
        import threading

        self.made_by[start] = threading.current_thread().name
        return super().batch(start, count, salt=salt)


def test_the_next_step_is_made_ahead_on_the_thread():
    """Step 0 is made by the caller (nothing was ahead); from then on each step's batch was
    made on the prefetch thread while the previous one trained."""
    import threading

    stream = _Recording(StreamConfig(seed=3, n_users=500, n_items=100))
    p = BatchPrefetcher(stream, rank=0, world=1, batch_size=32, device=torch.device("cpu"),
                        torch=torch)
    try:
        for step in range(4):
            p.get(step)
    finally:
        p.close()
    me = threading.current_thread().name
    assert stream.made_by[0] == me
    assert all(stream.made_by[s * 32].startswith("demo-batches-0") for s in (1, 2, 3))


def test_without_ahead_every_batch_is_made_by_the_caller():
    import threading

    stream = _Recording(StreamConfig(seed=3, n_users=500, n_items=100))
    p = BatchPrefetcher(stream, rank=0, world=1, batch_size=32, device=torch.device("cpu"),
                        torch=torch, ahead=False)
    for step in range(3):
        p.get(step)
    p.close()
    assert set(stream.made_by) == {0, 32, 64}
    assert set(stream.made_by.values()) == {threading.current_thread().name}
