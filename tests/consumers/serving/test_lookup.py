"""The read path (consumers.serving.lookup): the native probe + gather against numpy, edge
cases of the index layout and of the arguments, and readers racing a writer with the GIL
released."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from consumers.errors import ConsumerError
from consumers.serving import lookup
from consumers.serving.id_index import DELETED_SLOT, IdIndex, bucket_of
from consumers.serving.id_index import lookup_slots as numpy_lookup_slots
from consumers.serving.memory import H_PREP, H_SEQ, HEADER_BYTES
from consumers.serving.table import ServingTable

REPO = Path(__file__).resolve().parents[3]
native = pytest.mark.skipif(not lookup.NATIVE_AVAILABLE, reason="native probe not built")


def _index(buckets: int) -> IdIndex:
    return IdIndex(np.zeros((buckets, 2), np.int64), "t")


def _hdr(seq: int = 0) -> np.ndarray:
    hdr = np.zeros(HEADER_BYTES // 8, np.int64)
    hdr[H_SEQ] = hdr[H_PREP] = seq
    return hdr


def _both(tab, rows, keys, col=0):
    """read_rows through the native path and through numpy: (native out, numpy out)."""
    outs = []
    for on in (True, False):
        lookup.use_native(on)
        try:
            out = np.full((keys.size, rows.shape[1]), np.nan, np.float32)
            assert lookup.read_rows(_hdr(col), tab, rows, col, keys, out)
            outs.append(out)
        finally:
            lookup.use_native(lookup.NATIVE_AVAILABLE)
    return outs


@native
@pytest.mark.parametrize("n_query", [0, 1, 37, 256, 5000, 70000])  # 70000: bulk path
def test_native_matches_numpy_with_deletes_absent_ids_and_both_copies(n_query):
    rng = np.random.default_rng(n_query)
    idx = _index(1 << 12)
    keys = rng.choice(1 << 40, 1300, replace=False).astype(np.int64) - (1 << 39)
    pos = idx.insert(keys, np.arange(1, keys.size + 1, dtype=np.int32), None)
    idx.set(pos[:300], DELETED_SLOT, None)
    idx.set(pos[300:500], np.arange(2000, 2200, dtype=np.int32), 1)  # copy 1 differs
    rows = rng.standard_normal((2300, 8)).astype(np.float32)
    rows[0] = 0  # slot 0 of a table: never written (numpy reads it for absent ids)
    q = rng.choice(np.concatenate([keys, rng.integers(-(1 << 39), 1 << 39, 400)]), n_query)
    for col in (0, 1):
        nat, ref = _both(idx.tab, rows, q, col)
        assert np.array_equal(nat, ref)
        lookup.use_native(True)
        assert np.array_equal(lookup.lookup_slots(idx.tab, q, col),
                              numpy_lookup_slots(idx.tab, q, col))
    gone = np.isin(q, keys[:300])
    assert not nat[gone].any()  # DELETED_SLOT in both copies: zeros


@native
def test_probe_runs_wrap_around_the_last_bucket():
    idx = _index(64)
    cand = np.arange(1, 50000, dtype=np.int64)
    keys = cand[bucket_of(cand, 64) == 62][:6]  # home 62: the run wraps to 0, 1, 2, ...
    idx.insert(keys, np.arange(1, 7, dtype=np.int32), None)
    assert set(np.flatnonzero(idx.tab[:, 0])) == {62, 63, 0, 1, 2, 3}
    idx.set(np.array([63]), DELETED_SLOT, None)  # a DELETED_SLOT marker inside the wrapped run
    rows = np.arange(7 * 4, dtype=np.float32).reshape(7, 4)
    rows[0] = 0
    lookup.use_native(True)
    want = [0 if k == idx.tab[63, 0] else r for r, k in enumerate(keys, 1)]
    assert want.count(0) == 1
    assert lookup.lookup_slots(idx.tab, keys, 0).tolist() == want
    nat, ref = _both(idx.tab, rows, np.concatenate([keys, [10**15]]))
    assert np.array_equal(nat, ref) and not nat[-1].any()


@native
@pytest.mark.parametrize("dim", [7, 16, 67])  # scalar code only; F16C; F16C + a scalar tail
def test_f16_rows_convert_exactly_like_numpy(dim):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every float16
    bits = np.concatenate([bits, bits[: (-bits.size) % dim]])
    rows = np.concatenate([np.zeros(dim, np.uint16), bits]).view(np.float16).reshape(-1, dim)
    n = rows.shape[0] - 1
    idx = _index(1 << (3 * n).bit_length())
    keys = np.arange(100, 100 + n, dtype=np.int64)
    idx.insert(keys, np.arange(1, n + 1, dtype=np.int32), None)
    q = np.resize(keys[::-1], 70000)  # > 65536 ids: the bulk path; the first 999 alone
    for nat, ref in (_both(idx.tab, rows, q), _both(idx.tab, rows, q[:999])):
        nan = np.isnan(ref)
        assert np.array_equal(np.isnan(nat), nan)
        assert np.array_equal(nat[~nan].view(np.uint32), ref[~nan].view(np.uint32))


@native
def test_a_slot_beyond_the_rows_is_never_read_and_raises():
    idx = _index(16)
    idx.insert(np.array([5], np.int64), np.array([1000], np.int32), None)
    rows = np.ones((10, 4), np.float32)
    lookup.use_native(True)
    for n in (1, 70000):  # the chunked and the bulk path
        out = np.empty((n, 4), np.float32)
        with pytest.raises(ConsumerError, match="beyond the 10 slots"):
            lookup.read_rows(_hdr(), idx.tab, rows, 0, np.full(n, 5, np.int64), out)
    hdr = _hdr()
    hdr[H_PREP] = 2  # overtaken: retry, whatever it read
    assert not lookup.read_rows(hdr, idx.tab, rows, 0, np.full(n, 5, np.int64), out)


@native
def test_native_agrees_on_the_header_layout():
    assert lookup.native.H_PREP == H_PREP
    assert lookup.native.F16 in ("f16c", "portable")


@native
def test_native_rejects_bad_buffers():
    idx = _index(16)
    rows = np.zeros((4, 4), np.float32)
    keys = np.array([1], np.int64)
    out = np.zeros((1, 4), np.float32)
    call = lookup.native.read_rows
    with pytest.raises(ValueError, match="power of 2"):
        call(_hdr(), np.zeros((24, 2), np.int64), rows, 0, keys, out, False)
    with pytest.raises(ValueError, match="keys"):
        call(_hdr(), idx.tab, rows, 0, keys.astype(np.int32), out, False)
    with pytest.raises(ValueError, match="rows"):
        call(_hdr(), idx.tab, rows.astype(np.float64), 0, keys, out, False)
    with pytest.raises(ValueError, match="out"):
        call(_hdr(), idx.tab, rows, 0, keys, np.zeros((2, 4), np.float32), False)
    with pytest.raises(ValueError, match="out"):
        call(_hdr(), idx.tab, rows, 0, keys, out.astype(np.float64), False)
    with pytest.raises(ValueError, match="C-contiguous"):
        call(_hdr(), idx.tab, rows, 0, np.arange(4, dtype=np.int64)[::2], out, False)
    with pytest.raises(ValueError, match="writable"):
        ro = out.copy()
        ro.flags.writeable = False
        call(_hdr(), idx.tab, rows, 0, keys, ro, False)
    with pytest.raises(ValueError, match="col"):
        lookup.native.lookup_slots(idx.tab, keys, 2, np.zeros(1, np.int32), False)


@native
def test_native_index_writes_reject_bad_arguments():
    idx = _index(16)
    keys, slots = np.array([1, 2], np.int64), np.array([1, 2], np.int32)
    pos = np.zeros(2, np.int64)
    find, insert = lookup.native.index_find, lookup.native.index_insert
    with pytest.raises(ValueError, match="pos"):
        find(idx.tab, keys, 0, pos.astype(np.int32), np.zeros(2, np.int32), False)
    with pytest.raises(ValueError, match="slot"):
        find(idx.tab, keys, 0, pos, np.zeros(3, np.int32), False)
    with pytest.raises(ValueError, match="col"):
        find(idx.tab, keys, -1, pos, np.zeros(2, np.int32), False)  # both: inserts only
    with pytest.raises(ValueError, match="slots"):
        insert(idx.tab, keys, slots.astype(np.int64), 0, -1, pos, False)
    with pytest.raises(ValueError, match="other"):
        insert(idx.tab, keys, slots, 1, 1, pos, False)
    with pytest.raises(ValueError, match="other"):
        insert(idx.tab, keys, slots, 0, 2, pos, False)
    ro = idx.tab.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        insert(ro, keys, slots, 0, -1, pos, False)
    with pytest.raises(TypeError, match="7 arguments"):
        insert(idx.tab, keys, slots, 0, -1, pos)
    assert not idx.tab.any()  # nothing was written by a refused call
    assert insert(idx.tab, keys, slots, -1, -1, pos, False) == 2  # both copies: 2 used
    assert np.array_equal(idx.tab.view(np.int32)[pos, 2:], [[1, 1], [2, 2]])


@pytest.mark.usefixtures("lookup_path")
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_table_lookups_out_arrays_odd_ids_and_empty_requests(dtype):
    t = ServingTable("e", 5, dtype=dtype)
    ids = np.arange(0, 3000, 3, dtype=np.int64)
    t.upsert(ids, np.repeat(ids[:, None], 5, axis=1).astype(np.float32) / 8)
    want = np.repeat(ids[:, None], 5, axis=1).astype(np.float32) / 8
    if dtype == "f16":
        want = want.astype(np.float16).astype(np.float32)
    out = np.full((1000, 5), np.nan, np.float32)
    assert t.lookup(ids, out=out) is out and np.array_equal(out, want)
    assert np.array_equal(t.lookup(ids[::2]), want[::2])  # non-contiguous ids: copied
    assert np.array_equal(t.lookup(ids[:10].astype(np.uint16)), want[:10])
    assert np.array_equal(t.lookup(ids[:3].tolist()), want[:3])
    assert np.array_equal(t.lookup(np.int64(3)), want[1:2])
    assert not t.lookup([1, 2, -5]).any()
    assert t.lookup([]).shape == (0, 5) and t.lookup(np.zeros(0, np.int32)).shape == (0, 5)
    with pytest.raises(TypeError):
        t.lookup([1.5])
    with pytest.raises(ValueError):
        t.lookup(np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match="out"):
        t.lookup(ids, out=np.zeros((5, 1000), np.float32).T)  # F order
    assert t.contains([0, 1, 2997, 3000]).tolist() == [True, False, True, False]


@pytest.fixture
def split_into_three(monkeypatch):
    """Native requests of 1,000+ ids gathered by 3 threads."""
    monkeypatch.setattr(lookup, "SPLIT_IDS", 1000)
    before = lookup.bulk_threads()
    lookup.bulk_threads(3)
    yield
    lookup.bulk_threads(before)


@native
@pytest.mark.parametrize("n", [1000, 5000, 70000])  # split in parts of the chunked/bulk path
def test_split_bulk_requests_match_numpy_and_say_overtaken_or_corrupt(split_into_three, n):
    rng = np.random.default_rng(n)
    idx = _index(1 << 12)
    keys = rng.choice(1 << 40, 1300, replace=False).astype(np.int64)
    pos = idx.insert(keys, np.arange(1, keys.size + 1, dtype=np.int32), None)
    idx.set(pos[:100], DELETED_SLOT, None)
    rows = rng.standard_normal((1400, 8)).astype(np.float32)
    rows[0] = 0  # slot 0: the zero row unknown ids map to
    query = np.concatenate([keys, keys + 1])[rng.integers(0, 2600, n)]
    nat, ref = _both(idx.tab, rows, query)
    assert np.array_equal(nat, ref)
    lookup.use_native(True)
    hdr = _hdr()
    hdr[H_PREP] = 2  # overtaken: every part says retry
    assert not lookup.read_rows(hdr, idx.tab, rows, 0, query, nat)
    idx.set(pos[-1:], 5000, None)  # one part meets a slot beyond the rows
    query[-1] = keys[-1]
    with pytest.raises(ConsumerError, match="beyond the 1400 slots"):
        lookup.read_rows(_hdr(), idx.tab, rows, 0, query, nat)


def test_bulk_threads_are_validated():
    with pytest.raises(ValueError, match="1..64 threads, got 0"):
        lookup.bulk_threads(0)


@native
@pytest.mark.parametrize("n, rounds, split", [(4096, 150, False), (70000, 40, False),
                                              (4096, 100, True)])  # chunked, bulk, split
def test_readers_racing_a_writer_without_the_gil_never_see_torn_rows(monkeypatch, n, rounds,
                                                                     split, request):
    """Every native call releases the GIL here (NOGIL_IDS = 0), so the C loop itself runs
    while the writer applies: each row constant, all rows of a lookup from one batch (also
    when several threads gather parts of one lookup)."""
    monkeypatch.setattr(lookup, "NOGIL_IDS", 0)
    if split:
        request.getfixturevalue("split_into_three")
    lookup.use_native(True)
    dim = 64
    ids = np.arange(n, dtype=np.int64) * 7
    t = ServingTable("e", dim, dtype="f32")
    t.upsert(ids, np.zeros((n, dim), np.float32))
    stop, bad, seen = threading.Event(), [], []

    def reader() -> None:
        out = np.empty((n, dim), np.float32)
        while not stop.is_set():
            t.lookup(ids, out=out)
            if not ((out.min(axis=1) == out.max(axis=1)).all() and out[:, 0].min() ==
                    out[:, 0].max()):
                bad.append(np.unique(out[:, 0]))
                return
            seen.append(out[0, 0])

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        for v in range(1, rounds):
            t.upsert(ids, np.full((n, dim), float(v), np.float32))
            if v % 10 == 0:  # new ids too: slots reused, the index grows and migrates
                more = np.arange(n * v, n * (v + 1), dtype=np.int64) * 7 + 1
                t.upsert(more, np.zeros((n, dim), np.float32))
    finally:
        stop.set()
        for r in readers:
            r.join(10)
    assert not bad, bad
    assert len(set(seen)) > 2  # the readers really ran during the applies


def test_without_the_extension_numpy_is_used_and_said_once():
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO); "
            "sys.modules['consumers.serving.native'] = None; "  # its import fails
            "from consumers.serving import lookup; import numpy as np; "
            "from consumers.serving.table import ServingTable; "
            "t = ServingTable('e', 2); t.upsert([1], np.ones((1, 2))); "
            "assert (t.lookup([1, 2]) == [[1, 1], [0, 0]]).all(); "
            "print(lookup.NATIVE_AVAILABLE, lookup.native_enabled())\n"
            "try:\n    lookup.use_native(True)\nexcept RuntimeError as e:\n    print(e)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("DELTASTREAM_NATIVE", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    first, refused = p.stdout.splitlines()
    assert first == "False False" and "not built" in refused
    assert p.stderr.count("native lookup probe unavailable") == 1


@native
def test_environment_switch_turns_native_off():
    env = dict(os.environ, PYTHONPATH=str(REPO), DELTASTREAM_NATIVE="0")
    p = subprocess.run([sys.executable, "-c", "from consumers.serving import lookup; "
                        "print(lookup.NATIVE_AVAILABLE, lookup.native_enabled())"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.stdout.split() == ["True", "False"], p.stderr

