"""The dense tensors of a model version: which ones, their copy at a step boundary, and which
of them changed since the last version.

* :func:`dense_entries` picks the ``state_dict`` entries a version carries: the floating
  ones (parameters and buffers) outside the tracked tables, or the names the user gives.
* :class:`DenseCopier` copies them on the **training thread**, as cheaply as a copy can be:
  into buffers it allocates once and reuses (no allocation, no page faults per version);
  CUDA tensors are cloned on their stream (asynchronous, no synchronization) and copied
  to pinned host memory on a side stream (:class:`~.handoff.HostCopier`). The worker
  waits for the copy's event before it reads.
* :class:`ChangeFilter` runs on the **worker thread**: it keeps the values of the last
  version sent and keeps of a snapshot only the tensors whose values differ (bitwise).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

import numpy as np
import torch

from deltastream.publishing.handoff import HostCopier

__all__ = ["dense_entries", "DenseCopier", "ChangeFilter"]


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def dense_entries(model: torch.nn.Module, *, exclude: Iterable[str] = (),
                  names: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
    """``{state_dict key: tensor}`` (live tensors, detached, not copied) of a version.

    Args:
        model: the unwrapped model (``state_dict`` keys as the predictor will see them).
        exclude: module paths whose entries are left out (the tracked tables' fqns).
        names: the keys to publish; ``None`` = every floating entry not excluded (integer
            buffers such as BatchNorm's ``num_batches_tracked`` are left out: the wire
            carries floats).

    Raises:
        KeyError: a name that is not in ``state_dict``. TypeError: a named entry that is
            not floating point.
    """
    state = model.state_dict(keep_vars=True)
    if names is None:
        excluded = tuple(exclude)
        return {k: v.detach() for k, v in state.items()
                if v.is_floating_point() and not _under(k, excluded)}
    out = {}
    for k in names:
        if k not in state:
            raise KeyError(f"dense names: {k!r} is not in the model's state_dict (e.g. "
                           f"{sorted(state)[:5]})")
        if not state[k].is_floating_point():
            raise TypeError(f"dense names: {k!r} is {state[k].dtype}; only floating "
                            "tensors are published")
        out[k] = state[k].detach()
    return out


class DenseCopier:
    """Copies a version's tensors into reused host buffers (see the module docstring).

    One copy may be in use by the worker at a time: the caller takes the next one only
    after the worker is done with the last (:class:`~.dense.DensePublisher` defers).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._device = HostCopier()
        self._plan_of: Optional[Mapping[str, torch.Tensor]] = None
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source, buffer)
        self._on_device: list[tuple[str, torch.Tensor]] = []
        self._out: dict[str, torch.Tensor] = {}

    def _plan(self, entries: Mapping[str, torch.Tensor]) -> None:
        """Buffers and copy lists for ``entries``, made once per entries mapping: a
        version's copy is then one ``copy_`` per tensor and nothing else (on a small
        model the per-tensor bookkeeping would cost more than the copies)."""
        self._host, self._on_device, self._out = [], [], {}
        for name, t in entries.items():
            if t.device.type != "cpu":
                self._on_device.append((name, t))
                continue
            buf = self._buffers.get(name)
            if buf is None or buf.shape != t.shape:
                buf = self._buffers[name] = torch.empty(t.shape, dtype=torch.float32)
            self._host.append((t, buf))
            self._out[name] = buf
        self._plan_of = entries

    def copy(self, entries: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
        """``({name: host copy}, event or None)``: the copies are valid once the event
        (CUDA) has completed. Host copies are float32 (bf16/f64 tensors converted)."""
        if entries is not self._plan_of:
            self._plan(entries)
        for src, buf in self._host:
            buf.copy_(src)
        if not self._on_device:
            return self._out, None
        out = dict(self._out)
        for name, t in self._on_device:
            out[name] = self._device.host(t.to(torch.float32, copy=True))
        return out, self._device.finish()


class ChangeFilter:
    """Which tensors of a snapshot differ from the last version sent (worker thread)."""

    def __init__(self) -> None:
        self._last: dict[str, np.ndarray] = {}

    def changed(self, snapshot: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The entries of ``snapshot`` whose shape or values differ from the last
        :meth:`sent` ones (all of them after :meth:`reset`). NaNs compare equal."""
        return {k: v for k, v in snapshot.items()
                if k not in self._last or self._last[k].shape != v.shape
                or not np.array_equal(self._last[k], v, equal_nan=True)}

    def sent(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Remember ``tensors`` as what predictors now hold (copied: the snapshot's
        buffers are reused)."""
        for k, v in tensors.items():
            last = self._last.get(k)
            if last is None or last.shape != v.shape:
                self._last[k] = v.copy()
            else:
                np.copyto(last, v)

    def reset(self) -> None:
        """Forget what was sent: the next version is compared with nothing (full)."""
        self._last.clear()
