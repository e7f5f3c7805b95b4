"""Publish a model's dense weights as versioned updates, off the training loop.

A recommendation model is embedding tables and dense parameters (MLPs, interaction layers,
biases, batch-norm buffers). :class:`DensePublisher` sends the second part: at a cadence
(steps and/or seconds, :class:`DenseOptions`) it takes a **version** ``(epoch, step)`` of
the ``state_dict`` entries outside the tracked tables (or the ones named), and publishes it
with :meth:`DeltaPublisher.publish_dense <deltastream.DeltaPublisher.publish_dense>` as
wire kind dense (:mod:`deltastream.dense_wire`) on the model's topic: chunked under the
publisher's ``max_message_bytes``, each chunk CRC-checked, f32 unless ``dtype`` says bf16
or f16.

Only the tensors that changed since the previous version go out (a **partial** version,
``base_step`` = that version's step), with a **full** version every ``full_every``
versions, as the first version, after any failure and at :meth:`DensePublisher.flush`. A
predictor that missed a version of the chain therefore waits at most ``full_every``
versions for a full one.

Threads. :meth:`~DensePublisher.tick` runs on the training thread after the optimizer
step; when a version is due it only copies the tensors (:class:`~.dense_snapshot.
DenseCopier`: reused host buffers; on CUDA an asynchronous copy) and hands the copy to the
worker thread, which finds the changed tensors, encodes and sends them. When the worker is
still busy with the last version, the due version is deferred to the next tick (counted:
``deferred``): versions are "newest wins", none queues up. A failed version's error is
raised by the next ``tick`` or ``flush``; the version after it is full.

DDP: every rank may call ``tick``; only ``DenseOptions.rank`` publishes (the others return
at once), since the replicas hold the same dense weights.

Use it next to :func:`~deltastream.publish_delta` or a
:class:`~deltastream.BudgetPublisher` (their ``dense=`` argument ticks it with them),
sharing their :class:`~deltastream.DeltaPublisher`::

    dense = DensePublisher(pub, model, DenseOptions(every_steps=50), tracker=tracker)
    for step, batch in enumerate(loader):
        ...; optimizer.step(); tracker.step()
        budget.tick(step)        # BudgetPublisher(..., dense=dense) ticks it too
    budget.flush(step)           # and sends a final full version
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from deltastream.dense_wire import DENSE_DTYPES
from deltastream.publishing.dense_snapshot import ChangeFilter, DenseCopier, dense_entries
from deltastream.tracking.discovery import unwrap

__all__ = ["DenseOptions", "DensePublisher"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DenseOptions:
    """How a model's dense weights are published.

    Attributes:
        every_steps: a version at most every this many steps (``None``: steps do not
            decide). every_s: … or seconds (``None``: time does not decide). With both,
            whichever comes first; with neither, every tick.
        full_every: every this many versions is a full one (1: always full).
        dtype: wire dtype, ``"f32"``, ``"bf16"`` or ``"f16"``.
        names: ``state_dict`` keys to publish; ``None`` = every floating entry outside the
            tracked tables.
        rank: the DDP rank that publishes (the others' ticks do nothing).
        threaded: encode and send on the worker thread (default); ``False`` does it inside
            ``tick`` (tests, debugging).
    """

    every_steps: Optional[int] = 100
    every_s: Optional[float] = None
    full_every: int = 10
    dtype: str = "f32"
    names: Optional[tuple[str, ...]] = None
    rank: int = 0
    threaded: bool = True

    def __post_init__(self) -> None:
        for name, lo in (("every_steps", 1), ("full_every", 1), ("rank", 0)):
            v = getattr(self, name)
            if v is None and name == "every_steps":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"DenseOptions.{name} must be an int >= {lo}, got {v!r}")
        s = self.every_s
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float))
                              or not math.isfinite(s) or s <= 0):
            raise ValueError(f"DenseOptions.every_s must be positive seconds or None, got {s!r}")
        if self.dtype not in DENSE_DTYPES:
            raise ValueError(f"DenseOptions.dtype must be one of {list(DENSE_DTYPES)}, got "
                             f"{self.dtype!r}")
        if self.names is not None and (isinstance(self.names, str) or not all(
                isinstance(n, str) and n for n in self.names)):
            raise ValueError(f"DenseOptions.names must be a tuple of state_dict keys, got "
                             f"{self.names!r}")
        if not isinstance(self.threaded, bool):
            raise ValueError(f"DenseOptions.threaded must be a bool, got {self.threaded!r}")


@dataclass
class _Version:
    step: int
    ts: int
    tensors: dict[str, torch.Tensor]
    ready: Any  # CUDA event the host copies complete at, or None
    final: bool


class DensePublisher:
    """Publish ``model``'s dense tensors through ``publisher`` (see the module docstring).

    Args:
        publisher: a :class:`~deltastream.DeltaPublisher` (anything with ``publish_dense``).
        model: the model, wrapped or not (DDP, DataParallel, ``torch.compile``).
        options: cadence, dtype, names, rank.
        tracker: its tracked tables are left out (default: none left out).
        clock: seconds, monotonic (for ``every_s``).
    """

    def __init__(self, publisher: Any, model: torch.nn.Module,
                 options: Optional[DenseOptions] = None, *, tracker: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.publisher = publisher
        self.options = DenseOptions() if options is None else options
        if not isinstance(self.options, DenseOptions):
            raise TypeError(f"options must be DenseOptions, got {type(options).__name__}")
        self.model = unwrap(model)[0]
        self._exclude = tuple(tracker.get_tracked_modules()) if tracker is not None else ()
        self._entries = self._pick()  # checked here, at construction
        self._active = _publishing_rank(self.options.rank)
        self._clock = clock
        self._copier = DenseCopier()
        self._filter = ChangeFilter()
        self._last_step: Optional[int] = None
        self._last_t = 0.0
        self._versions = 0  # versions published
        self._taken = 0  # versions copied
        self._base_step = 0  # the step of the last version published
        self._force_full = True
        self._cond = threading.Condition()
        self._job: Optional[_Version] = None
        self._busy = False
        self._errors: list[BaseException] = []
        self._stopping = False
        self._copy_s: deque = deque(maxlen=256)
        self._stats = dict(versions=0, full_versions=0, tensors=0, messages=0, bytes=0,
                           deferred=0, unchanged=0, send_s=0.0)
        self._thread = None
        if self.options.threaded and self._active:
            self._thread = threading.Thread(target=self._run, name="deltastream-dense",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ training thread

    def due(self, step: int) -> bool:
        """Whether a version is due at ``step`` by the cadence (always for the first)."""
        o = self.options
        if self._last_step is None:
            return True
        if o.every_steps is None and o.every_s is None:
            return True
        return (o.every_steps is not None and step - self._last_step >= o.every_steps) or \
            (o.every_s is not None and self._clock() - self._last_t >= o.every_s)

    def tick(self, step: int, *, ts: Optional[int] = None) -> None:
        """After a training step: copy a version when one is due and hand it to the worker
        (synchronous mode: publish it here). Never waits for the worker or the broker.

        Raises:
            PublishError / WireError: a version since the last call failed (the next one
                is full).
        """
        self._raise_error()
        if not self._active or not self.due(step):
            return
        with self._cond:
            busy = self._busy or self._job is not None
        if busy:
            self._stats["deferred"] += 1  # the due version goes out at a later tick
            return
        self._take(step, ts, final=False)

    def flush(self, step: int, *, ts: Optional[int] = None,
              timeout: Optional[float] = None) -> None:
        """Wait for the version in flight, then publish a full version of ``step`` (the
        final one on stop; when a tick sent a partial version of the same step, predictors
        get both, the full one last). Raises the error of a failed version."""
        if not self._active:
            return
        self.wait(timeout)
        self._raise_error()
        self._take(step, ts, final=True)
        self.wait(timeout)
        self._raise_error()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait until the worker has sent every version handed to it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._job is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"dense publisher: a version still in flight after "
                                       f"{timeout} s")
                self._cond.wait(left)

    def close(self) -> None:
        """Stop the worker (no final version: call :meth:`flush` first). Safe twice."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> DensePublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict:
        """Counters (versions, full_versions, tensors, messages, bytes sent; deferred:
        due versions left for a later tick; unchanged: versions with nothing changed,
        not sent; send_s: seconds spent comparing, encoding and handing versions to the
        producer, on the worker) and ``copy_ms`` (training-thread copy time, p50 / max)."""
        t = np.asarray(self._copy_s, dtype=np.float64) * 1e3
        return dict(self._stats, active=self._active, copy_ms={
            "p50": float(np.quantile(t, 0.5)), "max": float(t.max())} if t.size else None)

    @property
    def sent_bytes(self) -> int:
        """Bytes of the versions sent so far (what ``BudgetPolicy.charge_dense`` charges)."""
        return int(self._stats["bytes"])

    def _pick(self) -> dict[str, torch.Tensor]:
        return dense_entries(self.model, exclude=self._exclude, names=self.options.names)

    def _take(self, step: int, ts: Optional[int], *, final: bool) -> None:
        if self._stopping:
            raise RuntimeError("the dense publisher is closed")
        t0 = time.perf_counter()
        if final or self._taken % self.options.full_every == 0:
            # looked up again now and then, not per version (half the copy's cost on a
            # small model): a tensor the model replaces (not updates in place) is seen
            # within full_every versions
            self._entries = self._pick()
        self._taken += 1
        tensors, ready = self._copier.copy(self._entries)
        self._copy_s.append(time.perf_counter() - t0)
        self._last_step, self._last_t = step, self._clock()
        job = _Version(step=step, ts=time.time_ns() if ts is None else ts, tensors=tensors,
                       ready=ready, final=final)
        if self._thread is None:
            self._send(job)
            return
        with self._cond:
            self._job = job
            self._cond.notify_all()

    def _raise_error(self) -> None:
        with self._cond:
            errors, self._errors = self._errors, []
        for e in errors[1:]:
            log.warning("dense publisher: another version failed too: %s", e)
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._stopping:
                    self._cond.wait()
                if self._job is None:
                    return
                job, self._job, self._busy = self._job, None, True
            try:
                self._send(job)
            except BaseException as e:  # kept for the training thread
                with self._cond:
                    self._errors.append(e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, job: _Version) -> None:
        t0 = time.perf_counter()
        try:
            self._publish(job)
        finally:
            self._stats["send_s"] += time.perf_counter() - t0

    def _publish(self, job: _Version) -> None:
        """Publish ``job``: the changed tensors against the last version, or all of them."""
        if job.ready is not None:
            job.ready.synchronize()
        snapshot = {k: v.numpy() for k, v in job.tensors.items()}
        full = job.final or self._force_full or self._versions % self.options.full_every == 0
        tensors = snapshot if full else self._filter.changed(snapshot)
        if not tensors:
            self._stats["unchanged"] += 1
            return
        base = None if full else self._base_step
        self._force_full = True  # until this version is handed over whole
        if full:
            self._filter.reset()
        res = self.publisher.publish_dense(tensors, step=job.step, base_step=base, ts=job.ts,
                                           dtype=self.options.dtype)
        self._filter.sent(tensors)
        self._force_full = False
        self._versions += 1
        self._base_step = job.step
        st = self._stats
        st["versions"] += 1
        st["full_versions"] += int(full)
        st["tensors"] += len(tensors)
        st["messages"] += int(res.messages)
        st["bytes"] += int(res.bytes)


def _publishing_rank(rank: int) -> bool:
    """True on the rank that publishes (every process when torch.distributed is not
    initialized)."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return True
    return dist.get_rank() == rank
