"""A dense table (``nn.Embedding``/``EmbeddingBag``, or a TorchRec shard) seen as a
positional table by the recorder: id = position (+ the shard's first global row)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DenseRows"]


class DenseRows:
    """An ``nn.Embedding``/``EmbeddingBag`` (or a TorchRec shard) seen as a positional table:
    id = position (+ the shard's first global row)."""

    ids_ascending = True  # ascending positions are ascending ids: no sort at the flush

    def __init__(self, module: Any, offset: int = 0) -> None:
        self.module = module
        self.offset = int(offset)  # a row-wise shard's first global row

    @property
    def capacity(self) -> int:
        return int(self.module.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.module.weight.device

    def ids_at(self, positions: torch.Tensor) -> torch.Tensor:
        return positions + self.offset if self.offset else positions
