"""ShardingPlan validation: every kind builds; gaps, overlaps, uncovered columns and bad
ranks are refused with errors naming the table and the range."""

from __future__ import annotations

import pytest

from deltastream.embedding.plan import (
    ShardingPlan,
    ShardSpec,
    TablePlan,
    column_wise,
    even_columns,
    row_wise,
    table_wise,
)
from deltastream.errors import DeltastreamError, PlanError
from deltastream.sharding import Slice, gen_slice


def test_kinds_and_shards_on():
    plan = ShardingPlan.of(2, [row_wise("r", 4, 2), table_wise("t", 3, 1),
                               column_wise("c", 10, [0, 1, 0])])
    assert [plan.tables[n].kind for n in ("r", "t", "c")] == ["row", "table", "column"]
    assert plan.tables["c"].shards[1] == ShardSpec(1, (4, 7))
    assert [s.cols for s in plan.tables["c"].shards] == [(0, 4), (4, 7), (7, 10)]
    on0 = plan.shards_on(0)
    assert [(t, i) for t, i, _ in on0] == [("r", 0), ("c", 0), ("c", 2)]
    assert [(t, i) for t, i, _ in plan.shards_on(1)] == [("r", 1), ("t", 0), ("c", 1)]
    assert plan.tables["r"].shards[1].rows == gen_slice(1, 2)
    lines = plan.describe()
    assert lines[2] == "c (dim 10, column): s0 r0 cols 0-4 | s1 r1 cols 4-7 | s2 r0 cols 7-10"


def test_even_columns_and_widths():
    assert even_columns(5, 2) == [(0, 3), (3, 5)]
    assert [s.cols for s in column_wise("c", 6, [1, 0], widths=[2, 4]).shards] == [(0, 2), (2, 6)]
    with pytest.raises(PlanError, match="cannot split 2 columns into 3"):
        even_columns(2, 3)


@pytest.mark.parametrize("shards, match", [
    ((ShardSpec(0, (0, 4)), ShardSpec(1, (5, 8))), r"table 'x': columns \[4, 5\) are not covered"),
    ((ShardSpec(0, (0, 5)), ShardSpec(1, (4, 8))), r"table 'x' shard 1: columns \[4, 5\) overlap"),
    ((ShardSpec(0, (0, 4)), ShardSpec(1, (4, 6))), r"table 'x': columns \[6, 8\) are not covered"),
    ((ShardSpec(2, (0, 8)),), r"table 'x' shard 0: rank 2 out of range \[0, 2\)"),
    ((ShardSpec(0, (0, 9)),), r"table 'x' shard 0: columns \[0, 9\) are not a non-empty range"),
    ((), r"table 'x': no shards"),
    ((ShardSpec(0, (0, 8), Slice(0, 10, 20)), ShardSpec(1, (0, 8), Slice(12, 20, 20))),
     r"table 'x': slices \[10, 12\) are held by no shard"),
    ((ShardSpec(0, (0, 8), Slice(0, 12, 20)), ShardSpec(1, (0, 8), Slice(10, 20, 20))),
     r"table 'x' shard 1: slices \[10, 12\) overlap"),
    ((ShardSpec(0, (0, 8), Slice(0, 10, 20)),), r"table 'x': slices \[10, 20\) are held"),
    ((ShardSpec(0, (0, 4), Slice(0, 20, 20)),), r"table 'x' shard 0: row-wise shards hold every"),
    ((ShardSpec(0, (0, 8), Slice(0, 20, 20)), ShardSpec(1, (0, 8))), r"table 'x' shard 1: mixes"),
])
def test_invalid_plans_name_table_and_range(shards, match):
    with pytest.raises(PlanError, match=match) as ei:
        ShardingPlan.of(2, [TablePlan("x", 8, shards)])
    assert isinstance(ei.value, DeltastreamError) and isinstance(ei.value, ValueError)


def test_bad_world_and_names():
    with pytest.raises(PlanError, match="world_size must be positive"):
        ShardingPlan(0, {})
    with pytest.raises(PlanError, match="expected a TablePlan named 'a'"):
        ShardingPlan(1, {"a": table_wise("b", 2, 0)})
    with pytest.raises(PlanError, match="table name"):
        ShardingPlan.of(1, [table_wise("a/b", 2, 0)])


def test_output_permute_is_the_seed_example():
    """Shards on ranks [0, 1, 0] arrive as [s0, s2, s1]; permute [0, 2, 1] restores order."""
    from deltastream.embedding.collection import output_permute

    assert output_permute(column_wise("f", 9, [0, 1, 0])) == [0, 2, 1]
    assert output_permute(column_wise("f", 9, [1, 0])) == [1, 0]
    assert output_permute(table_wise("f", 9, 1)) == [0]
