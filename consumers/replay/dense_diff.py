"""Compare the dense versions two states serve (a snapshot's or checkpoint's dense state, a
rebuild's assembler): versions per shard and, tensor by tensor, their values.

A tensor differs when it is on one side only, its shape differs, or an element differs by
more than the tolerance (absolute; NaN equal to NaN). Used by
:mod:`consumers.replay.diff`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from consumers.dense_assembly import DenseAssembler, DenseView
from consumers.errors import ReplayError

__all__ = ["DenseDiff", "diff_dense"]

log = logging.getLogger(__name__)

DenseSide = Union[DenseAssembler, bytes, None]


@dataclass
class DenseDiff:
    """How the served dense versions of A and B differ.

    versions_a / versions_b: shard -> [epoch, step] served. differing: ``"<shard>/<name>"``
    of tensors that differ (one side only, shape, or values). max_abs_diff: the largest
    element difference over tensors of equal shape (0.0 when none).
    """

    versions_a: dict = field(default_factory=dict)
    versions_b: dict = field(default_factory=dict)
    differing: list = field(default_factory=list)
    max_abs_diff: float = 0.0

    @property
    def equal(self) -> bool:
        return self.versions_a == self.versions_b and not self.differing

    def to_json(self) -> dict:
        return {"versions_a": {str(k): v for k, v in self.versions_a.items()},
                "versions_b": {str(k): v for k, v in self.versions_b.items()},
                "differing": list(self.differing), "max_abs_diff": self.max_abs_diff,
                "equal": self.equal}

    def format_text(self) -> str:
        if self.equal:
            return (f"dense: equal (versions {self.versions_a}, max abs diff "
                    f"{self.max_abs_diff:g})")
        return (f"dense: DIFFERENT: versions A {self.versions_a}, B {self.versions_b}; "
                f"{len(self.differing)} tensors differ"
                + (f" ({', '.join(self.differing[:10])})" if self.differing else ""))


def _views(side: DenseSide, label: str) -> dict[int, DenseView]:
    if side is None:
        return {}
    if isinstance(side, DenseAssembler):
        return side.views()
    try:
        return DenseAssembler.from_state(side).views()
    except ValueError as e:
        raise ReplayError(f"{label}: {e}") from None


def diff_dense(a: DenseSide, b: DenseSide, *, tolerance: float = 0.0,
               a_label: str = "A", b_label: str = "B") -> Optional[DenseDiff]:
    """Compare the dense versions of A and B; None when neither holds any."""
    va, vb = _views(a, a_label), _views(b, b_label)
    if not va and not vb:
        return None
    out = DenseDiff({s: list(v.version) for s, v in va.items()},
                    {s: list(v.version) for s, v in vb.items()})
    for shard in sorted(set(va) | set(vb)):
        ta = va[shard].tensors if shard in va else {}
        tb = vb[shard].tensors if shard in vb else {}
        for name in sorted(set(ta) | set(tb)):
            x, y = ta.get(name), tb.get(name)
            if x is None or y is None or x.shape != y.shape:
                out.differing.append(f"{shard}/{name}")
                continue
            d = np.abs(x.astype(np.float32) - y.astype(np.float32))
            d = np.where(np.isnan(x) & np.isnan(y), 0.0, d)
            worst = float(np.nanmax(d, initial=0.0)) if d.size else 0.0
            if np.isnan(d).any() or worst > tolerance:
                out.differing.append(f"{shard}/{name}")
            out.max_abs_diff = max(out.max_abs_diff, worst)
    return out
