"""Sharding plans: which rank holds which rows and columns of which table.

A :class:`ShardingPlan` maps every table to a :class:`TablePlan`: the table's full width
``dim`` and its shards, in **shard order**. A :class:`ShardSpec` is one shard: the ``rank``
that holds it, its column range ``cols = (begin, end)`` and, for row-wise shards, its slice
range ``rows`` (a :class:`~deltastream.Slice`; ``None`` = every row). Four kinds:

* ``row``: shard ``i`` on rank ``i`` holds slice range ``gen_slice(i, W)``, every column
  (today's :class:`~deltastream.ShardedEmbedding`);
* ``table``: one shard, every row and every column, on one rank;
* ``column``: shards hold every row and a column range each; shard ``i`` holds the columns
  after shard ``i - 1``'s, whatever its rank;
* table-wise-column-wise: a ``column`` plan whose shards sit on a subset of the ranks, several
  on one rank and out of rank order (e.g. ranks ``[0, 1, 0]``). Outputs are stitched in
  shard order, never rank order (see :mod:`deltastream.embedding.collection`).

The position of a shard in its table's list is its **shard id**: the ``shard`` its rows
are published under (wire ``shard``, Kafka key ``<model>/<table>/<shard>``), so the
predictor's per-(table, shard) sequence tracking sees one stream per column shard. For a
row-wise table shard id = rank, as before.

Validation (:meth:`TablePlan.validate`, run on construction) raises
:class:`~deltastream.errors.PlanError` naming the table and the range: ranks out of
``[0, world_size)``, column ranges out of ``[0, dim)``, gaps and overlaps between column
ranges or slice ranges, columns not covered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from deltastream.errors import PlanError
from deltastream.sharding import DEFAULT_SLICE_SIZE, Slice, gen_slice

__all__ = ["ShardSpec", "TablePlan", "ShardingPlan", "PLAN_KINDS", "row_wise", "table_wise",
           "column_wise", "even_columns"]

PLAN_KINDS = ("row", "table", "column")


def _int(what: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise PlanError(f"{what}: expected an int, got {v!r}")
    return v


@dataclass(frozen=True)
class ShardSpec:
    """One shard: ``rank`` holds columns ``[cols[0], cols[1])`` of the rows in ``rows``
    (a slice range; ``None`` = every row)."""

    rank: int
    cols: tuple[int, int]
    rows: Optional[Slice] = None

    @property
    def width(self) -> int:
        """Number of columns this shard holds."""
        return self.cols[1] - self.cols[0]


@dataclass(frozen=True)
class TablePlan:
    """How one table of width ``dim`` is split: ``shards`` in shard order."""

    name: str
    dim: int
    shards: tuple[ShardSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))

    @property
    def kind(self) -> str:
        """``row``, ``table`` or ``column``."""
        if any(s.rows is not None for s in self.shards):
            return "row"
        return "table" if len(self.shards) == 1 else "column"

    def validate(self, world_size: int) -> None:
        """Raise :class:`PlanError` (naming this table and the range) unless executable."""
        t = self.name
        if not isinstance(t, str) or not t or "/" in t:
            raise PlanError(f"table name: expected a non-empty str without '/', got {t!r}")
        if _int(f"table {t!r}: dim", self.dim) < 1:
            raise PlanError(f"table {t!r}: dim must be positive, got {self.dim}")
        if not self.shards:
            raise PlanError(f"table {t!r}: no shards (every column must be held by a rank)")
        for i, s in enumerate(self.shards):
            if not isinstance(s, ShardSpec):
                raise PlanError(f"table {t!r} shard {i}: expected a ShardSpec, got {s!r}")
            r = _int(f"table {t!r} shard {i}: rank", s.rank)
            if not 0 <= r < world_size:
                raise PlanError(f"table {t!r} shard {i}: rank {r} out of range [0, {world_size})")
            if not (isinstance(s.cols, tuple) and len(s.cols) == 2):
                raise PlanError(f"table {t!r} shard {i}: cols must be a (begin, end) tuple, "
                                f"got {s.cols!r}")
            b, e = (_int(f"table {t!r} shard {i}: cols", c) for c in s.cols)
            if not 0 <= b < e <= self.dim:
                raise PlanError(f"table {t!r} shard {i}: columns [{b}, {e}) are not a "
                                f"non-empty range within [0, {self.dim})")
            if s.rows is not None and not isinstance(s.rows, Slice):
                raise PlanError(f"table {t!r} shard {i}: rows must be a Slice or None, "
                                f"got {s.rows!r}")
        if self.kind == "row":
            self._validate_rows()
        else:
            self._validate_columns()

    def _validate_rows(self) -> None:
        t = self.name
        for i, s in enumerate(self.shards):
            if s.rows is None:
                raise PlanError(f"table {t!r} shard {i}: mixes a row-wise shard with every "
                                "row; row-wise tables need a slice range on every shard")
            if s.cols != (0, self.dim):
                raise PlanError(f"table {t!r} shard {i}: row-wise shards hold every column, "
                                f"got columns [{s.cols[0]}, {s.cols[1]}) of {self.dim} "
                                "(row-and-column sharding is not supported)")
            if s.rank != i:
                raise PlanError(f"table {t!r} shard {i}: a row-wise shard i sits on rank i, "
                                f"got rank {s.rank}")
        size = self.shards[0].rows.size
        at = 0
        for i, s in enumerate(self.shards):
            r = s.rows
            if r.size != size:
                raise PlanError(f"table {t!r} shard {i}: slice space {r.size} differs from "
                                f"shard 0's {size}")
            if r.begin > at:
                raise PlanError(f"table {t!r}: slices [{at}, {r.begin}) are held by no shard "
                                f"(gap before shard {i})")
            if r.begin < at:
                raise PlanError(f"table {t!r} shard {i}: slices [{r.begin}, {min(at, r.end)}) "
                                "overlap the previous shard")
            at = r.end
        if at != size:
            raise PlanError(f"table {t!r}: slices [{at}, {size}) are held by no shard")

    def _validate_columns(self) -> None:
        t = self.name
        at = 0
        for i, s in enumerate(self.shards):
            b, e = s.cols
            if b > at:
                raise PlanError(f"table {t!r}: columns [{at}, {b}) are not covered (gap "
                                f"before shard {i}; shards list columns in order)")
            if b < at:
                raise PlanError(f"table {t!r} shard {i}: columns [{b}, {min(at, e)}) overlap "
                                "the previous shard")
            at = e
        if at != self.dim:
            raise PlanError(f"table {t!r}: columns [{at}, {self.dim}) are not covered")

    def describe(self) -> str:
        """One line, e.g. ``item (dim 16, column): s0 r1 cols 0-8 | s1 r0 cols 8-16``."""
        parts = []
        for i, s in enumerate(self.shards):
            rows = "" if s.rows is None else f" slices {s.rows.begin}-{s.rows.end}"
            parts.append(f"s{i} r{s.rank} cols {s.cols[0]}-{s.cols[1]}{rows}")
        return f"{self.name} (dim {self.dim}, {self.kind}): " + " | ".join(parts)


@dataclass(frozen=True)
class ShardingPlan:
    """Every table's :class:`TablePlan` over ``world_size`` ranks (validated on creation)."""

    world_size: int
    tables: Mapping[str, TablePlan] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if _int("world_size", self.world_size) < 1:
            raise PlanError(f"world_size must be positive, got {self.world_size}")
        tables = dict(self.tables)
        for name, tp in tables.items():
            if not isinstance(tp, TablePlan) or tp.name != name:
                raise PlanError(f"tables[{name!r}]: expected a TablePlan named {name!r}, "
                                f"got {tp!r}")
            tp.validate(self.world_size)
        object.__setattr__(self, "tables", tables)

    @classmethod
    def of(cls, world_size: int, tables: Iterable[TablePlan]) -> ShardingPlan:
        """A plan from a list of table plans."""
        return cls(world_size, {t.name: t for t in tables})

    def shards_on(self, rank: int) -> list[tuple[str, int, ShardSpec]]:
        """``(table, shard id, spec)`` of every shard on ``rank``, tables in plan order."""
        return [(name, i, s) for name, tp in self.tables.items()
                for i, s in enumerate(tp.shards) if s.rank == rank]

    def describe(self) -> list[str]:
        """One line per table (for reports and logs)."""
        return [tp.describe() for tp in self.tables.values()]


def row_wise(name: str, dim: int, world_size: int,
             slice_size: int = DEFAULT_SLICE_SIZE) -> TablePlan:
    """Shard ``i`` on rank ``i`` holds slice range ``gen_slice(i, world_size)``."""
    return TablePlan(name, dim, tuple(ShardSpec(r, (0, dim), gen_slice(r, world_size, slice_size))
                                      for r in range(world_size)))


def table_wise(name: str, dim: int, rank: int) -> TablePlan:
    """The whole table on ``rank``."""
    return TablePlan(name, dim, (ShardSpec(rank, (0, dim)),))


def even_columns(dim: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous column ranges covering ``[0, dim)``, sizes differing by at most 1."""
    if not 1 <= n <= dim:
        raise PlanError(f"cannot split {dim} columns into {n} non-empty shards")
    base, extra = divmod(dim, n)
    out, at = [], 0
    for i in range(n):
        w = base + (1 if i < extra else 0)
        out.append((at, at + w))
        at += w
    return out


def column_wise(name: str, dim: int, ranks: Sequence[int],
                widths: Optional[Sequence[int]] = None) -> TablePlan:
    """Shard ``i`` (columns in order) on ``ranks[i]``; ``widths`` default to an even split.

    ``ranks`` may repeat and be out of order (table-wise-column-wise), e.g. ``[0, 1, 0]``.
    """
    if widths is None:
        cols = even_columns(dim, len(ranks))
    else:
        if len(widths) != len(ranks):
            raise PlanError(f"table {name!r}: {len(widths)} widths for {len(ranks)} ranks")
        cols, at = [], 0
        for w in widths:
            cols.append((at, at + w))
            at += w
    return TablePlan(name, dim, tuple(ShardSpec(r, c) for r, c in zip(ranks, cols, strict=True)))
