"""Unit tests for deltastream.embedding.hashtable.HashTable.

Tests taking ``dev`` run twice: on the torch reference path (CPU) and on the Triton kernel
path (CUDA when there is one, else CPU under Triton's interpreter): one contract, one suite.
Sizes are smaller on the kernel path where the interpreter would be slow. CUDA-only
comparisons are marked ``gpu``.
"""

from __future__ import annotations

import copy
import doctest
import pickle
import random

import pytest
import torch

import deltastream.embedding.hashtable as ht_mod
from deltastream.embedding.hashtable import HashTable
from deltastream.embedding.initializers import (
    constant_initializer,
    normal_initializer,
    uniform_initializer,
)
from deltastream.kernels.runtime import current_mode, kernels_mode
from deltastream.sharding import gen_slice, slice_of

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


@pytest.fixture(params=["torch", "kernels"])
def dev(request):
    """Device for the table, with the kernel mode of the path under test."""
    if request.param == "torch":
        with kernels_mode("off"):
            yield torch.device("cpu")
    else:
        yield request.getfixturevalue("kernel_device")


def _kernel_path() -> bool:
    """Whether the test runs on the kernel path (smaller sizes: the interpreter is slow)."""
    return current_mode() == "on"


def _rows(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def _contents(table: HashTable) -> dict[int, torch.Tensor]:
    return dict(zip(table.ids().tolist(), table.embeddings().cpu(), strict=True))


def test_insert_lookup_contains_ids_embeddings_aligned(dev):
    t = HashTable(4, name="t", capacity=8, device=dev)
    ids = torch.tensor([5, -3, 10**15, 0, 7])
    rows = _rows(5, 4)
    t.insert(ids, rows)
    assert len(t) == 5
    assert torch.equal(t.lookup(ids).cpu(), rows)
    assert t.contains(torch.tensor([5, 6, -3, 0])).tolist() == [True, False, True, True]
    got = _contents(t)
    assert sorted(got) == sorted(ids.tolist())
    for i, r in zip(ids.tolist(), rows, strict=True):
        assert torch.equal(got[i], r)
    # unknown ids read as zeros (no initializer) and are not inserted by lookup
    assert torch.equal(t.lookup(torch.tensor([99, 5]))[0].cpu(), torch.zeros(4))
    assert len(t) == 5
    # any id shape, empty batches included
    assert t.lookup(ids.view(5, 1)).shape == (5, 1, 4)
    assert t.contains(ids.view(1, 5)).shape == (1, 5)
    empty = torch.empty(0, dtype=torch.int64)
    assert t(empty).shape == (0, 4) and t.lookup(empty.view(0, 3)).shape == (0, 3, 4)
    assert t.evict(empty) == 0 and len(t) == 5
    t.insert(empty, torch.empty(0, 4))
    assert len(t) == 5


def test_insert_upserts_and_last_duplicate_wins(dev):
    t = HashTable(3, name="t", device=dev)
    new_seen = []
    t.register_insert_hook(lambda tab, ids: new_seen.append(ids.tolist()))
    t.insert(torch.tensor([1, 2]), torch.ones(2, 3))
    t.insert(torch.tensor([2, 3, 3, 2]), torch.arange(12.0).view(4, 3))
    assert len(t) == 3
    assert t.lookup(torch.tensor([1, 2, 3])).tolist() == [[1.0] * 3, [9.0, 10.0, 11.0],
                                                          [6.0, 7.0, 8.0]]
    assert new_seen == [[1, 2], [3]]  # only ids that were not present, once per call


def test_evict_frees_and_reuses_rows(dev):
    t = HashTable(2, name="t", capacity=4, device=dev)
    evicted = []
    t.register_evict_hook(lambda tab, ids: evicted.append(ids.tolist()))
    t.insert(torch.arange(4), _rows(4, 2))
    cap = t.capacity
    pos_before = t.positions(torch.tensor([1, 3]))
    assert t.evict(torch.tensor([3, 1, 1, 42])) == 2
    assert evicted == [[1, 3]]
    assert len(t) == 2 and t.contains(torch.tensor([0, 1, 2, 3])).tolist() == [
        True, False, True, False]
    assert t.lookup(torch.tensor([1])).tolist() == [[0.0, 0.0]]
    assert t.evict(torch.tensor([1, 3])) == 0 and evicted == [[1, 3]]  # no hook, nothing gone
    # two new ids take exactly the freed positions; storage does not grow
    t.insert(torch.tensor([100, 200]), torch.full((2, 2), 7.0))
    assert t.capacity == cap
    assert sorted(t.positions(torch.tensor([100, 200])).tolist()) == sorted(pos_before.tolist())
    assert t.lookup(torch.tensor([100, 200])).tolist() == [[7.0, 7.0]] * 2
    assert sorted(t.ids().tolist()) == [0, 2, 100, 200]


def test_growth_across_many_blocks_and_index_rebuilds(dev):
    n = 12_800 if _kernel_path() else 50_000  # the interpreter is slow
    t = HashTable(8, name="t", capacity=1, device=dev)
    all_ids = torch.randperm(n, generator=torch.Generator().manual_seed(1)) * 7919 - 10**9
    rows = _rows(n, 8)
    caps, slots = set(), set()
    step = n // 40
    for chunk in range(0, n, step):
        t.insert(all_ids[chunk:chunk + step], rows[chunk:chunk + step])
        caps.add(t.capacity)
        slots.add(t.num_slots)
        assert len(t) <= t.num_slots * 0.5  # load factor bound holds at all times
    assert len(t) == n
    assert t.capacity >= n and len(caps) > 5 and len(slots) >= 3
    assert torch.equal(t.lookup(all_ids).cpu(), rows)
    assert t.capacity % 1024 == 0  # grown in whole blocks


def test_tombstones_do_not_grow_index_under_churn(dev):
    t = HashTable(2, name="t", capacity=1024, device=dev)
    gen = torch.Generator().manual_seed(2)
    live = torch.arange(1000)
    t.insert(live, torch.zeros(1000, 2))
    for step in range(20 if _kernel_path() else 60):  # 20: > 2 rebuilds of 4096 slots
        fresh = torch.randint(10**6, 10**12, (500,), generator=gen).unique()
        t.evict(live[:500])
        live = torch.cat([live[500:], fresh])
        t.insert(fresh, torch.full((fresh.numel(), 2), float(step)))
    assert len(t) == live.numel()
    assert t.num_slots <= 8192 and t.capacity <= 2048  # bounded: slots and rows reused
    assert bool(t.contains(live).all())
    assert sorted(t.ids().tolist()) == sorted(live.tolist())


def test_negative_and_extreme_ids_and_adversarial_patterns(dev):
    t = HashTable(1, name="t", capacity=2, device=dev)
    ids = torch.tensor([I64_MIN, I64_MAX, 0, -1, 1, I64_MIN + 1, I64_MAX - 1])
    patt = torch.cat([torch.arange(1, 2000) << 32, torch.arange(1, 2000) << 40,
                      -(torch.arange(1, 2000) << 20)])
    ids = torch.cat([ids, patt]).unique()  # (k << 40) == ((256 k) << 32): drop repeats
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))]
    vals = torch.arange(ids.numel(), dtype=torch.float32).view(-1, 1)
    t.insert(ids, vals)
    assert len(t) == ids.numel()
    assert torch.equal(t.lookup(ids).cpu(), vals)
    assert torch.equal(t(ids).detach().cpu(), vals)  # training forward: all found
    assert t.evict(torch.tensor([I64_MIN, -1])) == 2
    assert t.contains(torch.tensor([I64_MIN, I64_MAX, -1, 0])).tolist() == [
        False, True, False, True]


def test_forward_training_inserts_with_initializer_and_duplicates(dev):
    t = HashTable(3, name="t", initializer=constant_initializer(0.5), device=dev)
    seen = []
    t.register_insert_hook(lambda tab, ids: seen.append(ids.clone()))
    ids = torch.tensor([[4, 4, -9], [4, 11, -9]])
    out = t(ids)
    assert out.shape == (2, 3, 3) and out.requires_grad
    assert len(t) == 3 and torch.equal(out.cpu(), torch.full((2, 3, 3), 0.5))
    assert len(seen) == 1 and seen[0].tolist() == [-9, 4, 11]  # once, vectorized, ascending
    t(torch.tensor([4, 11]))
    assert len(seen) == 1  # nothing new -> no hook call


def test_eval_mode_reads_without_insert(dev):
    t = HashTable(2, name="t", initializer=constant_initializer(0.25), device=dev)
    t.insert(torch.tensor([1]), torch.tensor([[3.0, 4.0]]))
    t.eval()
    out = t(torch.tensor([1, 2, 2]))
    assert not out.requires_grad
    assert out.tolist() == [[3.0, 4.0], [0.25, 0.25], [0.25, 0.25]]
    assert len(t) == 1
    t.train()
    t(torch.tensor([2]))
    assert len(t) == 2
    # random initializers read as their mean in eval mode
    n = HashTable(2, name="n", initializer=normal_initializer(1.0, mean=0.0), device=dev).eval()
    assert n(torch.tensor([5])).tolist() == [[0.0, 0.0]]
    u = HashTable(2, name="u", initializer=uniform_initializer(0.1, seed=3), device=dev)
    assert bool((u(torch.tensor([1, 2])).abs() <= 0.1).all())


def test_initializer_kwargs_and_validation():
    calls = []

    def init_by_id(n, dim, *, ids, dtype):
        calls.append(ids.clone())
        return ids.to(dtype).view(-1, 1).expand(n, dim) * 2

    t = HashTable(2, name="t", initializer=init_by_id)
    out = t(torch.tensor([3, 1, 3]))
    assert calls[0].tolist() == [1, 3]
    assert out.tolist() == [[6.0, 6.0], [2.0, 2.0], [6.0, 6.0]]
    plain = HashTable(2, name="p", initializer=lambda n, d: torch.ones(n, d))
    assert torch.equal(plain(torch.tensor([9])), torch.ones(1, 2))
    bad = HashTable(2, name="b", initializer=lambda n, d: torch.ones(n, d + 1))
    with pytest.raises(ValueError, match="initializer returned"):
        bad(torch.tensor([1]))
    seeded = [HashTable(4, name="s", initializer=normal_initializer(seed=7))(torch.arange(3))
              for _ in range(2)]
    assert torch.equal(seeded[0], seeded[1])


def test_argument_validation():
    with pytest.raises(ValueError, match="embedding_dim"):
        HashTable(0, name="t")
    with pytest.raises(ValueError, match="dtype"):
        HashTable(2, name="t", dtype=torch.int32)
    with pytest.raises(ValueError, match="name"):
        HashTable(2, name="")
    with pytest.raises(ValueError, match="capacity"):
        HashTable(2, name="t", capacity=0)
    t = HashTable(2, name="t")
    with pytest.raises(TypeError, match="integer"):
        t(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="shape"):
        t.insert(torch.tensor([1, 2]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="1-D"):
        t.insert(torch.tensor([[1]]), torch.zeros(1, 2))
    assert bool(t) and len(t) == 0  # an empty table is not falsy


def test_slice_range_errors_name_id_and_range():
    sl = gen_slice(1, 4)  # slices [16384, 32768) of 65536
    t = HashTable(2, name="shard1", slice=sl)
    inside = torch.tensor([16384, 32767, 16384 + 65536 * 5, 16384 - 65536 * 3])  # incl. negative
    assert bool(((slice_of(inside) >= sl.begin) & (slice_of(inside) < sl.end)).all())
    t.insert(inside, torch.ones(4, 2))
    t(inside)
    assert len(t) == 4
    for call in (lambda x: t.insert(x, torch.zeros(1, 2)), t, t.lookup):
        with pytest.raises(ValueError, match=r"id 5 .*\[16384, 32768\)"):
            call(torch.tensor([5]))
    with pytest.raises(ValueError, match=r"id -1 \(slice 65535\)"):
        t(torch.tensor([16384, -1]))
    assert len(t) == 4  # the failed forward inserted nothing
    assert t.contains(torch.tensor([5, 16384])).tolist() == [False, True]
    assert t.evict(torch.tensor([5])) == 0


def test_gradient_equals_dense_embedding_reference(dev):
    dim, vocab = 5, 40
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(vocab, dim, generator=gen)
    t = HashTable(dim, name="t", capacity=4, device=dev)
    t.insert(torch.arange(vocab) * 1000 - 17, weight)  # id = 1000 * row - 17
    emb = torch.nn.Embedding(vocab, dim, sparse=False)
    emb.weight.data.copy_(weight)
    for _ in range(3):  # gradients accumulate over several forwards/backwards
        rows = torch.randint(0, vocab, (7, 9), generator=gen)
        coef = torch.randn(7, 9, dim, generator=gen)
        (t(rows * 1000 - 17) * coef.to(dev)).sum().backward()
        (emb(rows) * coef).sum().backward()
    g = t.sparse_grad()
    dense = emb.weight.grad
    touched = dense.abs().sum(1).nonzero().squeeze(1)
    assert sorted(g.ids.tolist()) == sorted((touched * 1000 - 17).tolist())
    ref = dense[(g.ids.cpu() + 17) // 1000]
    torch.testing.assert_close(g.values.cpu(), ref)
    assert torch.equal(t.positions(g.ids), g.positions)
    t.zero_grad()
    assert t.sparse_grad() is None


def test_stale_gradients_are_dropped_after_evict_and_reuse(dev):
    t = HashTable(2, name="t", device=dev)
    out = t(torch.tensor([1, 2]))
    t.evict(torch.tensor([1]))
    t.insert(torch.tensor([3]), torch.zeros(1, 2))  # reuses id 1's position
    out.sum().backward()
    g = t.sparse_grad()
    assert g.ids.tolist() == [2]
    # growth between forward and backward keeps positions valid
    t.zero_grad()
    out = t(torch.tensor([2]))
    t.insert(torch.arange(100, 5000), torch.zeros(4900, 2))
    (out * 3).sum().backward()
    g = t.sparse_grad()
    assert g.ids.tolist() == [2] and g.values.tolist() == [[3.0, 3.0]]


def test_no_grad_training_forward_inserts_without_autograd():
    t = HashTable(2, name="t")
    with torch.no_grad():
        out = t(torch.tensor([1, 2]))
    assert not out.requires_grad and len(t) == 2


def test_state_dict_round_trip_nested_and_errors(dev):
    model = torch.nn.ModuleDict({"a": HashTable(3, name="a", capacity=2, device=dev),
                                 "lin": torch.nn.Linear(3, 1)})
    ids = torch.tensor([9, -4, 10**13, 2, 77])
    model["a"].insert(ids, _rows(5, 3))
    model["a"].evict(torch.tensor([2]))
    sd = model.state_dict()
    assert set(sd) == {"a.ids", "a.rows", "lin.weight", "lin.bias"}
    assert sd["a.ids"].tolist() == model["a"].ids().tolist()
    other = torch.nn.ModuleDict({"a": HashTable(3, name="a", capacity=1000, device=dev),
                                 "lin": torch.nn.Linear(3, 1)})
    other["a"].insert(torch.tensor([555]), torch.ones(1, 3))  # replaced by the load
    other.load_state_dict(sd)
    assert other["a"].ids().tolist() == model["a"].ids().tolist()
    assert torch.equal(other["a"].embeddings(), model["a"].embeddings())
    assert not bool(other["a"].contains(torch.tensor([555, 2])).any())
    # errors
    with pytest.raises(RuntimeError, match="Missing key"):
        HashTable(3, name="a").load_state_dict({"ids": sd["a.ids"]})
    with pytest.raises(RuntimeError, match="Unexpected key"):
        HashTable(3, name="a").load_state_dict({"ids": sd["a.ids"], "rows": sd["a.rows"],
                                                "junk": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="expected ids"):
        HashTable(4, name="a").load_state_dict({"ids": sd["a.ids"], "rows": sd["a.rows"]})
    with pytest.raises(RuntimeError, match="outside the slice"):
        HashTable(3, name="a", slice=gen_slice(1, 2)).load_state_dict(
            {"ids": torch.tensor([1]), "rows": torch.zeros(1, 3)})


def test_clear_fires_the_evict_hooks_with_every_id_held_and_a_reload_does_not(dev):
    t = HashTable(2, name="t", device=dev)
    gone = []
    t.register_evict_hook(lambda tab, ids: gone.append(ids.tolist()))
    t.insert(torch.tensor([9, -4, 5]), torch.ones(3, 2))
    t.evict(torch.tensor([5]))
    t.clear()
    assert gone == [[5], [-4, 9]] and len(t) == 0
    t.clear()  # nothing held: no call
    t.insert(torch.tensor([1]), torch.ones(1, 2))
    t.load_state_dict({"ids": torch.tensor([2]), "rows": torch.ones(1, 2)})
    assert gone == [[5], [-4, 9]]  # a reload is reported by the tracker's reload hooks


def test_hooks_remove(dev):
    t = HashTable(2, name="t", device=dev)
    a, b = [], []
    ha = t.register_insert_hook(lambda tab, ids: a.append((tab, ids.tolist())))
    hb = t.register_evict_hook(lambda tab, ids: b.append(ids.tolist()))
    t(torch.tensor([3, 1, 3]))
    t.evict(torch.tensor([1, 8]))
    assert a == [(t, [1, 3])] and b == [[1]]
    ha.remove()
    hb.remove()
    t(torch.tensor([7]))
    t.evict(torch.tensor([7]))
    assert a == [(t, [1, 3])] and b == [[1]]


@pytest.mark.parametrize("training", [True, False])
def test_write_hooks_see_rows_before_an_overwrite_and_after_an_insert(dev, training):
    t = HashTable(2, name="t", device=dev)
    t.insert(torch.tensor([5]), torch.full((1, 2), 5.0))
    t.train(training)
    seen = []
    h = t.register_write_hook(
        lambda tab, pos, rows: seen.append((tab.ids_at(pos).tolist(), rows.tolist())))
    t.insert(torch.tensor([5, 6, 5]), torch.tensor([[1.0, 1], [6, 6], [7, 7]]))
    assert seen == [([5], [[5.0, 5.0]]), ([6], [[6.0, 6.0]])]  # old 5 (last wins), new 6
    assert t.lookup(torch.tensor([5])).tolist() == [[7.0, 7.0]]
    t(torch.tensor([5, 9]))  # lookups and their inserts are not writes
    h.remove()
    t.insert(torch.tensor([6]), torch.zeros(1, 2))
    assert len(seen) == 2


def test_dtype_and_to_conversion():
    t = HashTable(2, name="t", dtype=torch.bfloat16)
    out = t(torch.tensor([1, 2]))
    assert out.dtype == torch.bfloat16
    t.insert(torch.tensor([1]), torch.tensor([[1.5, 2.5]]))
    t.double()
    assert t.dtype == torch.float64 and t.embeddings().dtype == torch.float64
    assert t.lookup(torch.tensor([1])).tolist() == [[1.5, 2.5]]
    assert t.ids().dtype == torch.int64


@pytest.mark.parametrize("seed", [1234, 7, 99])
def test_randomized_against_dict_reference(seed, dev):
    rng = random.Random(seed)
    dim = 3
    t = HashTable(dim, name="r", capacity=2, initializer=constant_initializer(-1.0), device=dev)
    ref: dict[int, list[float]] = {}
    universe = [rng.randrange(-300, 300) for _ in range(150)] + [I64_MIN, I64_MAX]
    steps = 60 if _kernel_path() else 300  # the interpreter is slow
    for step in range(steps):
        op = rng.random()
        ids = [rng.choice(universe) for _ in range(rng.randrange(0, 40))]
        idt = torch.tensor(ids, dtype=torch.int64)
        if op < 0.35:
            rows = torch.tensor([[float(step), float(i), float(k)] for k, i in enumerate(ids)])
            t.insert(idt, rows.view(-1, dim))
            for k, i in enumerate(ids):
                ref[i] = [float(step), float(i), float(k)]
        elif op < 0.55:
            removed = t.evict(idt)
            assert removed == len({i for i in ids if i in ref})
            for i in ids:
                ref.pop(i, None)
        elif op < 0.8:
            t.train()
            out = t(idt)
            for i in ids:
                ref.setdefault(i, [-1.0] * dim)
            assert out.detach().tolist() == [ref[i] for i in ids]
        else:
            assert t.lookup(idt).tolist() == [ref.get(i, [-1.0] * dim) for i in ids]
            assert t.contains(idt).tolist() == [i in ref for i in ids]
        assert len(t) == len(ref)
        if step % 25 == 0 or step == steps - 1:
            got = {i: r.tolist() for i, r in _contents(t).items()}
            assert got == ref


def test_deepcopy_and_pickle_keep_rows_not_pending_grads():
    t = HashTable(3, name="t")
    t.insert(torch.tensor([4, -4]), _rows(2, 3))
    t(torch.tensor([4])).sum().backward()
    for other in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert other.ids().tolist() == t.ids().tolist()
        assert torch.equal(other.lookup(torch.tensor([4, -4])), t.lookup(torch.tensor([4, -4])))
        assert other.sparse_grad() is None
        other.insert(torch.tensor([9]), torch.ones(1, 3))  # independent storage
    assert len(t) == 2 and t.sparse_grad() is not None


def test_docstring_example_runs():
    failures, tried = doctest.testmod(ht_mod, verbose=False)
    assert tried > 0 and failures == 0


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(-10**12, 10**12, (20_000,), generator=gen)
    rows = torch.randn(20_000, 16, generator=gen)
    cpu = HashTable(16, name="c", capacity=16)
    gpu_t = HashTable(16, name="g", device="cuda", capacity=16)
    for t in (cpu, gpu_t):
        t.insert(ids, rows)
        t.evict(ids[:5000])
    q = torch.cat([ids, torch.randint(-10**12, 10**12, (1000,), generator=gen)])
    assert len(cpu) == len(gpu_t)
    assert torch.equal(cpu.lookup(q), gpu_t.lookup(q.cuda()).cpu())
    assert torch.equal(cpu.contains(q), gpu_t.contains(q.cuda()).cpu())
    coef = torch.randn(q.numel(), 16, generator=gen)
    (cpu(q) * coef).sum().backward()
    (gpu_t(q.cuda()) * coef.cuda()).sum().backward()
    gc, gg = cpu.sparse_grad(), gpu_t.sparse_grad()
    oc, og = gc.ids.argsort(), gg.ids.cpu().argsort()
    assert torch.equal(gc.ids[oc], gg.ids.cpu()[og])
    torch.testing.assert_close(gc.values[oc], gg.values.cpu()[og])


@pytest.mark.gpu
@gpu
def test_cuda_to_device_moves_table():
    t = HashTable(4, name="t")
    t.insert(torch.arange(10), _rows(10, 4))
    t.cuda()
    assert t.device.type == "cuda"
    assert torch.equal(t.lookup(torch.arange(10)).cpu(), _rows(10, 4))
    t(torch.arange(20, 30, device="cuda"))
    assert len(t) == 20
