"""One complete dense version, read-only: what the daemon serves in-process
(:class:`~consumers.dense_assembly.DenseAssembler`) and what a reader process maps
(:class:`~consumers.serving.dense_shm.DenseReader`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DenseView"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DenseView:
    """One complete dense version, read-only.

    version: (epoch, step) of the trainer; ts: trainer wall clock (ns) of the version;
    shard: the trainer shard that published it; tensors: name -> float32 array in its
    shape (read-only; never changes).
    """

    shard: int
    epoch: int
    step: int
    ts: int
    tensors: Mapping[str, np.ndarray] = field(repr=False)

    @property
    def version(self) -> tuple[int, int]:
        """(epoch, step) of this version."""
        return (self.epoch, self.step)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def names(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self.tensors)
