"""A hand-off packed into one buffer and back (the worker process's bytes): the C copy and
torch's give the same bytes, and a piece outside the buffer is refused before anything is
written."""

from __future__ import annotations

import mmap

import pytest
import torch

from deltastream.publishing import handoff_pack
from deltastream.publishing.handoff import Handoff, TableHandoff
from deltastream.publishing.handoff_pack import describe, layout, pack, unpack

native = pytest.importorskip("deltastream.publishing.native")


def _handoff() -> Handoff:
    g = torch.Generator().manual_seed(0)
    a = TableHandoff(fqn="a", ids=torch.tensor([3, 9, 1], dtype=torch.int64),
                     first=torch.randn(3, 5, generator=g),
                     current=torch.randn(5, 3, generator=g).t(),  # not contiguous: torch's copy
                     new=torch.tensor([True, False, True]), tombstones=torch.tensor([7]))
    b = TableHandoff(fqn="b", ids=torch.arange(4), first=torch.randn(4, 2).bfloat16(),
                     current=torch.randn(4, 2).bfloat16(), new=None,
                     tombstones=torch.empty(0, dtype=torch.int64), ordered=False,
                     inserted=torch.tensor([2]))
    return Handoff(tick=3, step=12, ts=5, units=1.0, read_units=0.25, tables=[a, b], charged=7)


@pytest.mark.parametrize("use_c", [True, False], ids=["c", "torch"])
def test_a_packed_hand_off_unpacks_to_the_same_tensors(use_c):
    h = _handoff()
    places, nbytes = layout(h)
    buf = mmap.mmap(-1, nbytes)
    handoff_pack.use_native(use_c)
    try:
        pack(h, places, buf)
    finally:
        handoff_pack.use_native(True)
    out = unpack(buf, describe(h, places))
    for f in ("tick", "step", "ts", "units", "read_units", "final", "charged"):
        assert getattr(out, f) == getattr(h, f), f
    for src, got in zip(h.tables, out.tables, strict=True):
        for f in handoff_pack.FIELDS:
            s, o = getattr(src, f), getattr(got, f)
            assert (s is None) == (o is None), f
            if s is not None:
                assert o.dtype == s.dtype and torch.equal(o, s), (src.fqn, f)
    del out, got, o  # views of the map: it cannot close while they live
    buf.close()


def test_a_piece_outside_the_buffer_is_refused_before_anything_is_written():
    buf = bytearray(64)
    src = torch.arange(8, dtype=torch.int64)  # 64 bytes
    with pytest.raises(ValueError, match="piece 1 .*outside the 64-byte buffer"):
        native.pack(buf, [(0, src.data_ptr(), 8), (8, src.data_ptr(), 64)])
    assert buf == bytearray(64)
    assert native.pack(buf, [(56, src.data_ptr() + 56, 8)]) == 8
    assert bytes(buf[56:]) == bytes(src.numpy()[7:].tobytes())
