"""DeltaStore: TorchRec's store semantics (ported behaviours), plus our guarantees.

The reference for every FIRST/LAST result is TorchRec's algorithm written out naively:
concatenate the records in (index, append) order, ``torch.unique(return_inverse=True)`` and
``scatter_reduce`` amin/amax over positions.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltastream.tracking.store as store_mod
from deltastream.tracking.store import DeltaStore
from deltastream.types import DeltaRows, UpdateMode

DIM = 3


@pytest.fixture(autouse=True, params=["eager", "lazy"])
def dedupe_path(request, monkeypatch):
    """Run every test with appends deduplicated at once and kept as recorded."""
    monkeypatch.setattr(store_mod, "EAGER_DEDUPE_MIN", 1 if request.param == "eager" else 1 << 40)
    return request.param


def reference(records, mode: UpdateMode, from_idx: int = 0):
    """TorchRec's get_delta on raw records [(idx, ids, states)] (stable by idx)."""
    recs = sorted((r for r in records if r[0] >= from_idx), key=lambda r: r[0])
    if not recs:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, DIM)
    ids = torch.cat([r[1] for r in recs])
    if mode is UpdateMode.NONE:
        return torch.unique(ids), None
    states = torch.cat([r[2] for r in recs])
    uniq, inv = torch.unique(ids, return_inverse=True)
    pos = torch.arange(ids.numel())
    red = "amin" if mode is UpdateMode.FIRST else "amax"
    pick = torch.zeros(uniq.numel(), dtype=torch.int64).scatter_reduce(
        0, inv, pos, reduce=red, include_self=False)
    return uniq, states[pick]


def rec(idx, ids, gen=None):
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return idx, ids, torch.randn(ids.numel(), DIM, generator=gen)


def fill(mode, records):
    s = DeltaStore(mode)
    for idx, ids, states in records:  # an ids-only store refuses states
        s.append(idx, "t", ids, None if mode is UpdateMode.NONE else states)
    return s


def assert_rows(rows: DeltaRows, ids, states):
    assert torch.equal(rows.ids, ids)
    if states is None:
        assert rows.states is None
    else:
        assert torch.equal(rows.states, states)


@pytest.mark.parametrize("mode", list(UpdateMode))
def test_unique_ascending_and_mode_picks_state(mode):
    g = torch.Generator().manual_seed(0)
    records = [rec(0, [5, 1, 5, 9], g), rec(1, [9, 2, 1], g), rec(2, [5], g)]
    rows = fill(mode, records).get_unique()["t"]
    assert rows.ids.tolist() == [1, 2, 5, 9]
    if mode is UpdateMode.NONE:
        assert rows.states is None
        return
    s0, s1, s2 = (r[2] for r in records)
    if mode is UpdateMode.FIRST:  # earliest occurrence, also inside one batch
        want = torch.stack([s0[1], s1[1], s0[0], s0[3]])
    else:  # latest occurrence
        want = torch.stack([s1[2], s1[1], s2[0], s1[0]])
    assert torch.equal(rows.states, want)


@pytest.mark.parametrize("mode", [UpdateMode.FIRST, UpdateMode.LAST])
def test_out_of_order_append_is_ordered_by_index(mode):
    g = torch.Generator().manual_seed(1)
    late, early = rec(5, [1, 2], g), rec(2, [2, 3], g)
    s = fill(mode, [late, early])
    rows = s.get_unique()["t"]
    uniq, states = reference([late, early], mode)
    assert_rows(rows, uniq, states)
    # id 2: FIRST comes from index 2 although it was appended after index 5
    want = early[2][0] if mode is UpdateMode.FIRST else late[2][1]
    assert torch.equal(rows.states[1], want)


def test_delete_at_arbitrary_indices():
    g = torch.Generator().manual_seed(2)
    records = [rec(i, [i, 100 + i], g) for i in (1, 3, 5, 7)]
    s = fill(UpdateMode.FIRST, records)
    s.delete(up_to_idx=4)
    assert s.get_unique()["t"].ids.tolist() == [5, 7, 105, 107]
    s.delete(up_to_idx=4)  # idempotent
    s.delete(up_to_idx=6)
    assert s.get_unique()["t"].ids.tolist() == [7, 107]
    assert s.num_rows() == 2
    s.delete()
    rows = s.get_unique()["t"]
    assert rows.ids.numel() == 0 and tuple(rows.states.shape) == (0, DIM)
    assert s.num_rows() == 0


@pytest.mark.parametrize("mode", list(UpdateMode))
def test_get_unique_from_idx_matches_reference(mode):
    g = torch.Generator().manual_seed(3)
    records = [rec(i, torch.randint(0, 20, (15,), generator=g).tolist(), g) for i in range(6)]
    s = fill(mode, records)
    for frm in range(8):
        ids, states = reference(records, mode, frm)
        assert_rows(s.get_unique(frm)["t"], ids, None if mode is UpdateMode.NONE else states)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                   HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(list(UpdateMode)),
       batches=st.lists(st.lists(st.integers(-5, 30), max_size=12), min_size=1, max_size=10),
       cuts=st.lists(st.integers(0, 10), max_size=6), seed=st.integers(0, 2**16))
def test_compaction_of_ranges_equals_no_compaction(mode, batches, cuts, seed):
    """Compacting disjoint ranges never changes a read that starts at a range boundary."""
    g = torch.Generator().manual_seed(seed)
    records = [rec(i, b, g) for i, b in enumerate(batches)]
    plain, compacted = fill(mode, records), fill(mode, records)
    bounds = sorted(set(cuts) | {0, len(batches)})
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        compacted.compact(start, end)
    assert compacted.num_records("t") <= len(bounds) - 1
    for frm in bounds:
        a, b = plain.get_unique(frm)["t"], compacted.get_unique(frm)["t"]
        ids, states = reference(records, mode, frm)
        assert torch.equal(a.ids, ids) and torch.equal(b.ids, ids)
        if mode is not UpdateMode.NONE:
            assert torch.equal(a.states, states) and torch.equal(b.states, states)


@pytest.mark.parametrize("mode", [UpdateMode.FIRST, UpdateMode.LAST])
def test_incremental_compaction_matches_reference(mode):
    """auto-compaction style: compact [0, i+1) after every append (two-run merges)."""
    g = torch.Generator().manual_seed(4)
    records, s = [], DeltaStore(mode)
    for i in range(12):
        r = rec(i, torch.randint(0, 40, (25,), generator=g).tolist(), g)
        records.append(r)
        s.append(*r[:1], "t", *r[1:])
        s.compact(0, i + 1)
        assert s.num_records("t") == 1
        assert_rows(s.get_unique()["t"], *reference(records, mode))


def test_first_merge_of_known_ids_copies_nothing():
    """A FIRST compaction whose newer run holds only known ids keeps the old run's tensors."""
    s = DeltaStore(UpdateMode.FIRST)
    s.append(0, "t", torch.arange(1000), torch.randn(1000, DIM))
    before = s.get_unique()["t"]
    s.append(1, "t", torch.tensor([3, 500, 999, 3]), torch.randn(4, DIM))
    s.compact(0, 2)
    after = s.get_unique()["t"]
    assert after.ids is before.ids and after.states is before.states
    assert s.compactions == 1 and s.num_records("t") == 1


@pytest.mark.parametrize("mode", list(UpdateMode))
@pytest.mark.parametrize("runs", [2, 3, 17])
def test_large_zipf_merge_equals_torchrec(mode, runs):
    g = torch.Generator().manual_seed(5)
    p = torch.arange(1, 5001, dtype=torch.float).pow(-1.1)
    records = [(i, torch.multinomial(p, 2000, replacement=True, generator=g) * 7919,
                torch.randn(2000, DIM, generator=g)) for i in range(runs)]
    s = fill(mode, records)
    s.compact(0, runs)
    ids, states = reference(records, mode)
    assert_rows(s.get_unique()["t"], ids, None if mode is UpdateMode.NONE else states)


def test_empty_store_tables_and_intervals_never_raise():
    s = DeltaStore(UpdateMode.FIRST)
    assert s.get_unique() == {}
    s.compact(0, 10)
    s.compact(3, 3)
    s.delete(5)
    s.delete()
    s.add_table("declared", DIM)
    s.append(0, "t", torch.empty(0, dtype=torch.int64), torch.empty(0, DIM))
    out = s.get_unique()
    assert set(out) == {"declared", "t"}
    for rows in out.values():
        assert rows.ids.numel() == 0 and rows.ids.dtype == torch.int64
        assert tuple(rows.states.shape) == (0, DIM)
    s.append(0, "t", torch.tensor([1]), torch.ones(1, DIM))
    assert s.get_unique(from_idx=1)["t"].ids.numel() == 0  # empty interval
    none = DeltaStore()
    none.append(0, "x", torch.tensor([2, 2]))
    assert none.get_unique(1)["x"].ids.numel() == 0 and none.get_unique(1)["x"].states is None


def test_store_does_not_alias_inputs():
    ids, states = torch.tensor([4, 2, 2]), torch.ones(3, DIM)
    s = DeltaStore(UpdateMode.FIRST)
    s.append(0, "t", ids, states)
    ids.fill_(7)
    states.fill_(-1)
    rows = s.get_unique()["t"]
    assert rows.ids.tolist() == [2, 4] and bool((rows.states == 1).all())


def test_multidim_ids_and_states_are_flattened():
    s = DeltaStore(UpdateMode.LAST)
    s.append(0, "t", torch.tensor([[1, 2], [1, 3]]), torch.arange(12.0).reshape(2, 2, DIM))
    rows = s.get_unique()["t"]
    assert rows.ids.tolist() == [1, 2, 3]
    assert rows.states[0].tolist() == [6.0, 7.0, 8.0]  # LAST of id 1: flattened row 2


def test_discard_and_degrade():
    s = DeltaStore(UpdateMode.FIRST)
    s.append(0, "t", torch.tensor([1, 2, 3]), torch.randn(3, DIM))
    s.append(1, "t", torch.tensor([3, 4]), torch.randn(2, DIM))
    assert s.discard("t", torch.tensor([3, 9])) == 2
    assert s.get_unique()["t"].ids.tolist() == [1, 2, 4]
    assert s.num_state_rows() == 3
    assert s.degrade("t") == 3
    assert s.is_degraded("t") and s.num_state_rows() == 0 and s.num_rows() == 3
    s.append(2, "t", torch.tensor([5]), torch.randn(1, DIM))  # states ignored while degraded
    s.append(3, "t", torch.tensor([6]))  # states may be omitted while degraded
    rows = s.get_unique()["t"]
    assert rows.ids.tolist() == [1, 2, 4, 5, 6] and rows.states is None
    s.delete()
    assert not s.is_degraded("t")  # nothing held: states are kept again
    s.append(4, "t", torch.tensor([7]), torch.ones(1, DIM))
    assert s.get_unique()["t"].states.shape == (1, DIM)


def test_argument_validation():
    s = DeltaStore(UpdateMode.FIRST)
    with pytest.raises(ValueError, match="needs states"):
        s.append(0, "t", torch.tensor([1]))
    with pytest.raises(TypeError, match="integer ids"):
        s.append(0, "t", torch.tensor([1.0]), torch.ones(1, DIM))
    with pytest.raises(ValueError, match=r"\[N, dim\]"):
        s.append(0, "t", torch.tensor([1, 2]), torch.ones(3, DIM))
    s.append(0, "t", torch.tensor([1]), torch.ones(1, DIM))
    with pytest.raises(ValueError, match="has dim 3"):
        s.append(0, "t", torch.tensor([1]), torch.ones(1, DIM + 1))
    with pytest.raises(ValueError, match="must not exceed"):
        s.compact(5, 3)
    with pytest.raises(TypeError):
        s.append("0", "t", torch.tensor([1]), torch.ones(1, DIM))
    with pytest.raises(ValueError, match="update_mode"):
        DeltaStore("middle")
    assert DeltaStore("last").update_mode is UpdateMode.LAST
    with pytest.raises(KeyError):
        s.degrade("nope")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", list(UpdateMode))
def test_cuda_matches_cpu(mode):
    g = torch.Generator().manual_seed(6)
    records = [rec(i, torch.randint(0, 500, (300,), generator=g).tolist(), g) for i in range(5)]
    cpu = fill(mode, records)
    gpu = DeltaStore(mode)
    for idx, ids, states in records:
        gpu.append(idx, "t", ids.cuda(), None if mode is UpdateMode.NONE else states.cuda())
    gpu.compact(1, 4)
    cpu.compact(1, 4)
    for frm in (0, 1, 4):
        a, b = cpu.get_unique(frm)["t"], gpu.get_unique(frm)["t"]
        assert b.ids.is_cuda and torch.equal(a.ids, b.ids.cpu())
        if mode is not UpdateMode.NONE:
            assert torch.equal(a.states, b.states.cpu())


def test_borrowed_states_modified_in_place_degrade_the_table(dedupe_path):
    s = DeltaStore(UpdateMode.FIRST)
    states = torch.ones(3, DIM)
    s.append(0, "t", torch.tensor([3, 1, 3]), states, copy_states=False)
    s.append(0, "u", torch.tensor([1]), torch.ones(1, DIM), copy_states=False)
    if dedupe_path == "lazy":
        states.mul_(2)  # kept by reference: detected through the version counter
        out = s.get_unique()
        assert s.states_modified == 1 and s.is_degraded("t")
        assert out["t"].ids.tolist() == [1, 3] and out["t"].states is None
    else:  # deduplicated (copied) at append: later changes cannot matter
        states.mul_(2)
        out = s.get_unique()
        assert s.states_modified == 0 and bool((out["t"].states == 1).all())
    assert out["u"].states.tolist() == [[1.0] * DIM]


def test_ids_only_store_refuses_states():
    """TorchRec's store refuses states in NONE mode; so does this one, naming what to do."""
    s = DeltaStore(UpdateMode.NONE)
    with pytest.raises(ValueError, match=r"UpdateMode.NONE.*ids only.*states=None"):
        s.append(0, "t", torch.tensor([1, 2]), torch.ones(2, DIM))
    with pytest.raises(ValueError, match="ids only"):
        s.append_unique(0, "t", torch.tensor([1, 2]), torch.ones(2, DIM))
    assert s.num_rows() == 0  # nothing half-recorded
    s.append(0, "t", torch.tensor([2, 1]))
    assert s.get_unique()["t"].ids.tolist() == [1, 2]


def test_an_empty_tables_result_follows_its_declaration():
    # a table holding nothing is skipped by compact/delete and its empty result reuses
    # zero-row tensors: each result is still a new DeltaRows, shaped as declared now
    s = DeltaStore(UpdateMode.FIRST)
    s.add_table("t", DIM)
    a, b = s.get_unique()["t"], s.get_unique()["t"]
    assert a is not b and tuple(a.states.shape) == (0, DIM) and a.ids.dtype == torch.int64
    s.add_table("t", DIM, dtype=torch.float16)
    assert s.get_unique()["t"].states.dtype == torch.float16
    s.degrade("t")  # nothing held: ids only until the next delete
    assert s.is_degraded("t") and s.get_unique()["t"].states is None
    s.compact(0, 5)
    s.delete()
    assert not s.is_degraded("t") and tuple(s.get_unique()["t"].states.shape) == (0, DIM)
    s.append(0, "t", torch.tensor([3, 1]), torch.ones(2, DIM, dtype=torch.float16))
    s.delete(1)
    assert s.num_rows("t") == 0 and s.get_unique()["t"].ids.numel() == 0


def test_states_kept_by_reference_are_released_once_nothing_refers_to_them():
    """``append(copy_states=False, released=...)``: the caller hears once the store no
    longer refers to the rows — its record read into a sorted copy, or deleted — not
    while the record holds them (another record appended beside it), and at once when no
    states are kept."""
    calls = []
    for end in ("read", "delete"):
        s = DeltaStore(UpdateMode.FIRST)
        held = torch.arange(6.0).reshape(3, 2)
        s.append(0, "t", torch.tensor([5, 1, 9]), held, copy_states=False, unique=True,
                 released=lambda end=end: calls.append(end))
        del held
        s.append(1, "t", torch.tensor([2]), torch.ones(1, 2))
        assert calls == ([] if end == "read" else ["read"])
        if end == "read":
            got = s.get_unique(0)["t"]
            assert got.ids.tolist() == [1, 2, 5, 9] and got.states[2].tolist() == [0.0, 1.0]
        else:
            s.delete(1)
    assert calls == ["read", "delete"]
    DeltaStore(UpdateMode.NONE).append(0, "t", torch.tensor([1]),
                                       released=lambda: calls.append("none"))
    assert calls == ["read", "delete", "none"]


def test_grown_records_join_until_their_table_is_read_or_changed(dedupe_path):
    """Ids-only appends with ``grow`` join the table's last record (at its index) until the
    table is read, compacted, trimmed or changed; a record handed out before keeps its ids
    as it grows on; another table's read does not stop it."""
    if dedupe_path == "eager":
        pytest.skip("appends deduplicated at once are sorted records of their own")
    s = DeltaStore(UpdateMode.NONE)
    s.append(1, "t", torch.tensor([5, 3]), grow=True)
    s.append(2, "t", torch.tensor([[3, 9]]), grow=True)  # flattened, repeats kept
    s.append(2, "u", torch.tensor([1]), grow=True)
    assert s.num_records("t") == 1 and s.num_rows("t") == 4
    ids, _ = s.raw_since("t", 0, take=False)
    assert ids.tolist() == [5, 3, 3, 9]
    s.append(3, "t", torch.tensor([7]), grow=True)  # a new record: the read sealed the last
    s.append(4, "t", torch.tensor([8] * 40), grow=True)  # grown past its room
    assert ids.tolist() == [5, 3, 3, 9] and s.num_records("t") == 2
    assert s.raw_since("t", 3, take=True)[0].tolist() == [7] + [8] * 40
    assert s.get_unique(2)["t"].ids.tolist() == []  # the record at 1 spans 1-2
    assert s.get_unique()["t"].ids.tolist() == [3, 5, 9]
    s.append(5, "t", torch.tensor([1]))  # without grow: a record of its own
    s.append(6, "t", torch.tensor([2]), grow=True)
    assert s.num_records("t") == 3
    s.raw_since("u", 0, take=True)
    s.append(6, "t", torch.tensor([2]), grow=True)
    assert s.num_records("t") == 3
    for call in (lambda: s.delete(0), lambda: s.compact(0, 7),
                 lambda: s.discard("t", torch.tensor([0])), lambda: s.get_unique(7)):
        s.append(7, "t", torch.tensor([4]), grow=True)
        call()
        n = s.num_records("t")
        s.append(7, "t", torch.tensor([4]), grow=True)
        assert s.num_records("t") == n + 1  # each call sealed the record before it


def test_records_of_ids_only_and_reads_of_ids():
    """An ``ids_only`` record holds no states in a store of states; ``states=False`` reads
    ids only across any records; a read of states that spans an ids-only record gets None,
    one past it the FIRST states."""
    s = DeltaStore(UpdateMode.FIRST)
    s.append(0, "t", torch.tensor([3, 1]), torch.ones(2, 2))
    s.append(1, "t", torch.tensor([5, 1]), ids_only=True, unique=True)
    s.append(2, "t", torch.tensor([7, 3]), torch.zeros(2, 2))
    assert s.num_state_rows("t") == 4 and s.num_rows("t") == 6
    ids = s.get_unique(0, states=False)["t"]
    assert ids.ids.tolist() == [1, 3, 5, 7] and ids.states is None
    assert s.get_unique(0)["t"].states is None
    past = s.get_unique(2)["t"]
    assert past.ids.tolist() == [3, 7] and torch.equal(past.states, torch.zeros(2, 2))
    assert s.get_unique(3, states=False)["t"].states is None
    with pytest.raises(ValueError, match="ids_only"):
        s.append(3, "t", torch.tensor([1]), torch.ones(1, 2), ids_only=True)
