"""``sorted_ids.union`` and ``member_sorted``: the C extension's one-pass merge gives exactly
what the torch path gives (every output, the searchsorted positions of ids not in ``a``
included), refuses ids out of order, and ``member_sorted`` falls back to a binary search
for a query that is not ascending."""

from __future__ import annotations

import pytest
import torch

from deltastream.tracking import sorted_ids
from deltastream.tracking.sorted_ids import member, member_sorted, union

NATIVE = sorted_ids._NATIVE.available
needs_native = pytest.mark.skipif(not NATIVE, reason="deltastream.tracking.native is not built")

I64 = torch.iinfo(torch.int64)


def _ids(g: torch.Generator, n: int, lo: int, hi: int) -> torch.Tensor:
    return torch.unique(torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64))


def _cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    e = torch.empty(0, dtype=torch.int64)
    a = _ids(g, 3000, -5000, 5000)
    out = [(e, e), (a, e), (e, a), (a, a.clone()), (a, a[::3].clone()), (a[::2].clone(), a),
           (torch.tensor([I64.min, 0, I64.max]), torch.tensor([I64.min + 1, I64.max])),
           (torch.tensor([5]), torch.tensor([1, 9])), (torch.tensor([1, 9]), torch.tensor([5]))]
    for n_a, n_b, span in ((1, 1, 3), (40, 7, 60), (7, 40, 60), (2000, 2000, 3000),
                           (20000, 25000, 250000)):
        out.append((_ids(g, n_a, 0, span), _ids(g, n_b, 0, span)))
    return out


@pytest.fixture(params=["native", "torch"])
def path(request):
    if request.param == "native" and not NATIVE:
        pytest.skip("deltastream.tracking.native is not built")
    sorted_ids.use_native(request.param == "native")
    yield request.param
    sorted_ids.use_native(NATIVE)


@needs_native
@pytest.mark.parametrize("case", range(len(_cases())))
def test_native_union_is_the_torch_union(case):
    a, b = _cases()[case]
    try:
        sorted_ids.use_native(False)
        want = union(a, b)
        sorted_ids.use_native(True)
        got = union(a, b)
    finally:
        sorted_ids.use_native(NATIVE)
    names = ("out", "pos_a", "b_only", "pos_b", "in_a", "at_a")
    for name, w, x in zip(names, want, got, strict=True):
        assert x.dtype == w.dtype and torch.equal(x, w), name
    assert (got[0] is a) == (want[0] is a)  # nothing new in b: a itself


def test_union_is_the_sorted_union_with_positions(path):
    for a, b in _cases():
        out, pos_a, b_only, pos_b, in_a, at_a = union(a, b)
        assert torch.equal(out, torch.unique(torch.cat([a, b])))
        assert torch.equal(out[pos_a], a) and torch.equal(out[pos_b], b[b_only])
        assert torch.equal(in_a, torch.isin(b, a))
        assert torch.equal(a[at_a[in_a]], b[in_a])
        if not len(b_only):
            assert out is a


@needs_native
@pytest.mark.parametrize("bad", ["a", "b"])
def test_native_union_refuses_ids_out_of_order(bad):
    good, wrong = torch.tensor([1, 4, 9]), torch.tensor([1, 9, 9, 12])
    a, b = (wrong, good) if bad == "a" else (good, wrong)
    sorted_ids.use_native(True)
    try:
        with pytest.raises(ValueError, match=rf"{bad}: not strictly ascending at index 2"):
            union(a, b)
    finally:
        sorted_ids.use_native(NATIVE)


@pytest.mark.parametrize("case", range(len(_cases())))
def test_member_sorted_is_member(path, case):
    a, b = _cases()[case]
    for query in (b, b.flip(0)):  # ascending (the merge), and not (a binary search per id)
        got, want = member_sorted(a, query), member(a, query)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
