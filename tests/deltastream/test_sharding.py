"""The slice partition matches RecIS's gen_slice for many shard counts and slice sizes."""

from __future__ import annotations

import pytest
import torch

from deltastream.sharding import Slice, gen_slice, owner_of, slice_of


def recis_reference(shard_index: int, shard_num: int, slice_size: int) -> tuple[int, int]:
    """RecIS's algorithm, written out as a list of ranges (the behaviour users expect)."""
    base = slice_size // shard_num
    sizes = [base + 1 if i < slice_size % shard_num else base for i in range(shard_num)]
    begin = sum(sizes[:shard_index])
    return begin, begin + sizes[shard_index]


@pytest.mark.parametrize("slice_size", [1, 7, 100, 1000, 65536])
@pytest.mark.parametrize("shard_num", [1, 2, 3, 5, 7, 8, 13, 64, 100, 999])
def test_gen_slice_matches_recis_and_owner_of(shard_num, slice_size):
    if shard_num > slice_size:
        with pytest.raises(ValueError, match="shard_num"):
            gen_slice(0, shard_num, slice_size)
        return
    slices = [gen_slice(i, shard_num, slice_size) for i in range(shard_num)]
    assert [(s.begin, s.end) for s in slices] == [
        recis_reference(i, shard_num, slice_size) for i in range(shard_num)]
    assert slices[0].begin == 0 and slices[-1].end == slice_size
    sizes = [s.end - s.begin for s in slices]
    assert max(sizes) - min(sizes) <= 1
    ids = torch.arange(-2 * slice_size - 3, 2 * slice_size + 5, dtype=torch.int64)
    owners = owner_of(ids, shard_num, slice_size)
    for i, s in enumerate(slices):
        assert torch.equal(s.contains(ids), owners == i)


def test_slice_of_is_nonnegative_modulo_for_negative_and_huge_ids():
    ids = torch.tensor([-1, -65536, -65537, 0, 65535, 65536, 2**62 + 3, -(2**62) - 1])
    s = slice_of(ids)
    assert (s >= 0).all() and (s < 65536).all()
    assert s.tolist() == [i % 65536 for i in ids.tolist()]


def test_owner_of_random_ids_against_python():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-(2**40), 2**40, (10000,), generator=g)
    for n in (3, 6, 17):
        expected = []
        for i in ids.tolist():
            sl = i % 65536
            expected.append(next(r for r in range(n)
                                 if recis_reference(r, n, 65536)[0] <= sl
                                 < recis_reference(r, n, 65536)[1]))
        assert owner_of(ids, n).tolist() == expected


@pytest.mark.parametrize("args, match", [
    ((2, 2), "shard_index"), ((-1, 2), "shard_index"), ((0, 0), "shard_num"),
    ((0, 1, 0), "slice_size"),
])
def test_gen_slice_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        gen_slice(*args)


def test_slice_validation():
    with pytest.raises(ValueError, match="begin"):
        Slice(5, 3, 10)
    with pytest.raises(TypeError, match="int"):
        Slice(0.5, 3, 10)
    assert Slice(0, 65536).full and not Slice(0, 10).full
