"""A trainer rank's batches, optionally made one step ahead on a thread.

The click stream is generated in numpy (:class:`~deltastream_demo.data.ClickStream`): about
0.4-0.6 ms for 512 examples and 4-5 ms for 8,192 on this project's 2-core VM, a large part
of the demo's step when the training thread makes it itself. With ``ahead``,
:class:`BatchPrefetcher` makes step ``k + 1``'s batch on its own thread while step ``k``
trains; on CUDA it also stages the arrays in pinned memory, so the training thread only
issues the asynchronous copies. That pays where the batch's array work (numpy releases the
GIL in it) outweighs its Python, or the training thread waits on a device: on the 2-core VM
the CPU demo's examples/s rose 20 % at 8,192 examples and fell 19 % at 512, where the
thread's Python holds the GIL the step needs (measured before the stream remembered its
session roots; ``BENCHMARKS.md``, stop 63; the demo's ``--prefetch``). Batches depend only
on their step (the stream is a pure function of its positions), so prefetching changes
nothing a rank trains on.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from deltastream_demo.data import ClickStream

__all__ = ["BatchPrefetcher"]


class BatchPrefetcher:
    """Rank ``rank`` of ``world``'s training batches: step ``k`` is the stream's examples
    ``[(k·world + rank)·batch_size, … + batch_size)``.

    Args:
        stream: the click stream (its ``batch`` is thread-safe).
        rank, world: this rank and the number of ranks.
        batch_size: examples per rank per step.
        device: a ``torch.device``; on CUDA the host arrays are pinned.
        torch: the ``torch`` module (the demo's parent process never imports it).
        ahead: make the next step's batch on a thread (else each on the caller's thread).
    """

    def __init__(self, stream: ClickStream, rank: int, world: int, batch_size: int,
                 device: Any, torch: Any, ahead: bool = True) -> None:
        self.stream, self.rank, self.world = stream, rank, world
        self.batch_size, self.device, self.torch = batch_size, device, torch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"demo-batches-{rank}") \
            if ahead else None
        self._ahead: Optional[tuple[int, Future]] = None

    def _host(self, step: int) -> tuple:
        """Step ``step``'s user ids, item ids ``[B]`` (int64), dense features
        ``[B, n_dense]`` and labels ``[B]`` (float32), as CPU tensors (pinned on CUDA)."""
        b = self.stream.batch((step * self.world + self.rank) * self.batch_size,
                              self.batch_size)
        out = tuple(self.torch.from_numpy(a)
                    for a in (b.user_ids, b.item_ids, b.dense, b.labels))
        return tuple(t.pin_memory() for t in out) if self.device.type == "cuda" else out

    def get(self, step: int) -> tuple:
        """Step ``step``'s batch on the device (see :meth:`_host`); with ``ahead``, starts
        making ``step + 1``'s. Any step may be asked for: one not made ahead is made now."""
        ahead, self._ahead = self._ahead, None
        fut = ahead[1] if ahead is not None and ahead[0] == step else None
        if ahead is not None and fut is None:
            ahead[1].cancel()
        host = fut.result() if fut is not None else self._host(step)
        if self._pool is not None:
            self._ahead = (step + 1, self._pool.submit(self._host, step + 1))
        if self.device.type != "cuda":
            return host
        return tuple(t.to(self.device, non_blocking=True) for t in host)

    def close(self) -> None:
        """Drop the batch made ahead and stop the thread (waits for a batch being made)."""
        if self._ahead is not None:
            self._ahead[1].cancel()
            self._ahead = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
