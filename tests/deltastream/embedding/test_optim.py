"""Unit tests for the sparse optimizers in deltastream.embedding.optim against dense references.

The update tests run over both paths (``dev``): the torch reference (kernel mode off, CPU)
and the fused Triton kernels (``kernel_device``: CUDA, or CPU under Triton's interpreter).
"""

from __future__ import annotations

import doctest

import pytest
import torch

import deltastream.embedding.optim as optim_mod
from deltastream.embedding.hashtable import HashTable
from deltastream.embedding.initializers import constant_initializer
from deltastream.embedding.optim import RowWiseAdagrad, SparseAdam, SparseSGD
from deltastream.embedding.sparse_grad import coalesce_rows
from deltastream.kernels.runtime import kernels_mode

VOCAB, DIM = 30, 6


@pytest.fixture(params=["reference", "kernels"])
def dev(request):
    """The device tables live on, with the path under test in force."""
    if request.param == "kernels":
        yield request.getfixturevalue("kernel_device")
        return
    with kernels_mode("off"):
        yield torch.device("cpu")


def _id(rows: torch.Tensor) -> torch.Tensor:
    """Dense row index -> table id (spread out, negative too)."""
    return rows * 7919 - 50_000


def _pair(seed: int = 0, capacity: int = 4, device: torch.device | str = "cpu"):
    """A HashTable (on ``device``) and a dense CPU weight holding the same VOCAB rows."""
    w = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(seed))
    t = HashTable(DIM, name="t", capacity=capacity, device=device)
    t.insert(_id(torch.arange(VOCAB)), w)
    return t, w.clone()


def _batches(n: int, seed: int = 1, size: int = 12, fixed: torch.Tensor | None = None):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        rows = fixed if fixed is not None else torch.randint(0, VOCAB, (size,), generator=gen)
        out.append((rows, torch.randn(rows.numel(), DIM, generator=gen)))
    return out


def _table_rows(t: HashTable) -> torch.Tensor:
    return t.lookup(_id(torch.arange(VOCAB))).cpu()


def _dense_grad(w: torch.Tensor, rows: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    emb = torch.nn.Embedding.from_pretrained(w.clone(), freeze=False)
    (emb(rows) * coef * coef.sum(1, keepdim=True)).sum().backward()  # nonlinear in coef only
    return emb.weight.grad


def _sparse_step(t: HashTable, opt, rows, coef) -> None:
    coef = coef.to(t.device)
    out = t(_id(rows).to(t.device))
    (out * coef * coef.sum(1, keepdim=True)).sum().backward()
    opt.step()
    opt.zero_grad()


# ----------------------------------------------------------------------------- SGD


def test_sgd_equals_torch_sgd_on_sparse_embedding(dev):
    t, w = _pair(device=dev)
    emb = torch.nn.Embedding.from_pretrained(w.clone(), freeze=False, sparse=True)
    ref = torch.optim.SGD(emb.parameters(), lr=0.1)
    opt = SparseSGD(t, lr=0.1)
    for rows, coef in _batches(6):
        _sparse_step(t, opt, rows, coef)
        (emb(rows) * coef * coef.sum(1, keepdim=True)).sum().backward()
        ref.step()
        ref.zero_grad()
    torch.testing.assert_close(_table_rows(t), emb.weight.detach())


def test_sgd_weight_decay_and_untouched_rows_unchanged(dev):
    t, w = _pair(device=dev)
    opt = SparseSGD([t], lr=0.05, weight_decay=0.1)
    rows, coef = _batches(1)[0]
    g = _dense_grad(w, rows, coef)
    _sparse_step(t, opt, rows, coef)
    touched = g.abs().sum(1) > 0
    expect = w.clone()
    expect[touched] -= 0.05 * (g[touched] + 0.1 * w[touched])
    torch.testing.assert_close(_table_rows(t), expect)
    assert torch.equal(_table_rows(t)[~touched], w[~touched])  # weight decay: touched only


# ----------------------------------------------------------------------------- Adagrad


def _rowwise_adagrad_ref(w, batches, lr, eps, wd=0.0):
    w = w.clone()
    acc = torch.zeros(VOCAB)
    for rows, coef in batches:
        g = _dense_grad(w, rows, coef)
        touched = g.abs().sum(1) > 0
        g = g + wd * w
        acc[touched] += g[touched].square().mean(1)
        w[touched] -= lr * g[touched] / (acc[touched].sqrt() + eps).unsqueeze(1)
    return w


def test_rowwise_adagrad_equals_dense_reference(dev):
    t, w = _pair(device=dev)
    batches = _batches(8)
    opt = RowWiseAdagrad(t, lr=0.2, eps=1e-8, weight_decay=0.01)
    for rows, coef in batches:
        _sparse_step(t, opt, rows, coef)
    ref = _rowwise_adagrad_ref(w, batches, 0.2, 1e-8, 0.01)
    torch.testing.assert_close(_table_rows(t), ref, rtol=1e-5, atol=1e-6)
    assert opt.state["t"]["sum"].shape[0] >= VOCAB


# ----------------------------------------------------------------------------- Adam


def _lazy_adam_ref(w, batches, lr, betas=(0.9, 0.999), eps=1e-8):
    """Adam where a row's moments and step only advance when it gets a gradient."""
    w = w.clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    step = torch.zeros(VOCAB)
    b1, b2 = betas
    for rows, coef in batches:
        g = _dense_grad(w, rows, coef)
        r = (g.abs().sum(1) > 0).nonzero().squeeze(1)
        step[r] += 1
        m[r] = b1 * m[r] + (1 - b1) * g[r]
        v[r] = b2 * v[r] + (1 - b2) * g[r] ** 2
        bc1 = (1 - b1 ** step[r]).unsqueeze(1)
        bc2 = (1 - b2 ** step[r]).unsqueeze(1)
        w[r] -= (lr / bc1) * m[r] / (v[r].sqrt() / bc2.sqrt() + eps)  # torch.optim.Adam's order
    return w


def test_adam_equals_lazy_dense_reference_on_random_batches(dev):
    t, w = _pair(device=dev)
    batches = _batches(10)
    opt = SparseAdam(t, lr=0.05)
    for rows, coef in batches:
        _sparse_step(t, opt, rows, coef)
    torch.testing.assert_close(_table_rows(t), _lazy_adam_ref(w, batches, 0.05),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_equals_torch_adam_when_same_rows_touched(wd, dev):
    t, w = _pair(device=dev)
    fixed = torch.tensor([0, 3, 3, 8, 21, 29])
    batches = _batches(7, fixed=fixed)
    emb = torch.nn.Embedding.from_pretrained(w.clone(), freeze=False)
    cls = torch.optim.AdamW if wd else torch.optim.Adam
    ref = cls(emb.parameters(), lr=0.03, betas=(0.8, 0.99), eps=1e-7, weight_decay=wd)
    opt = SparseAdam(t, lr=0.03, betas=(0.8, 0.99), eps=1e-7, weight_decay=wd)
    for rows, coef in batches:
        _sparse_step(t, opt, rows, coef)
        (emb(rows) * coef * coef.sum(1, keepdim=True)).sum().backward()
        ref.step()
        ref.zero_grad()
    r = fixed.unique()
    torch.testing.assert_close(_table_rows(t)[r], emb.weight.detach()[r], rtol=1e-5, atol=1e-6)
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[r] = False
    assert torch.equal(_table_rows(t)[others], w[others])


# ----------------------------------------------------------------------------- growth, eviction


@pytest.mark.parametrize("cls", [SparseSGD, RowWiseAdagrad, SparseAdam])
def test_state_grows_with_table_inserted_by_forward(cls, dev):
    """Rows enter the table through training forward across steps (storage grows from 1)."""
    w = torch.zeros(VOCAB, DIM)
    t = HashTable(DIM, name="t", capacity=1, initializer=constant_initializer(0.0), device=dev)
    opt = cls(t, lr=0.1)
    batches = []
    gen = torch.Generator().manual_seed(3)
    for k in range(6):  # each step reaches further into the vocabulary
        rows = torch.randint(0, 5 * (k + 1), (10,), generator=gen)
        batches.append((rows, torch.randn(10, DIM, generator=gen)))
    caps = set()
    for k, (rows, coef) in enumerate(batches):
        _sparse_step(t, opt, rows, coef)
        caps.add(t.capacity)
        # unrelated rows grow the storage (and rebuild the index) between steps
        filler = torch.arange(1500) + 10**9 + 1500 * k
        t.insert(filler.to(dev), torch.zeros(1500, DIM, device=dev))
    assert len(caps) > 3
    if cls is SparseAdam:
        ref = _lazy_adam_ref(w, batches, 0.1)
    elif cls is RowWiseAdagrad:
        ref = _rowwise_adagrad_ref(w, batches, 0.1, 1e-8)
    else:
        ref = w.clone()
        for rows, coef in batches:
            ref -= 0.1 * _dense_grad(ref, rows, coef)
    seen = torch.cat([r for r, _ in batches]).unique()
    torch.testing.assert_close(_table_rows(t)[seen], ref[seen], rtol=1e-5, atol=1e-6)
    for tensor in opt.state["t"].values():  # grown lazily, to the capacity at the last step
        assert tensor.shape[0] in caps and tensor.shape[0] >= len(t) - 1500


@pytest.mark.parametrize("cls", [RowWiseAdagrad, SparseAdam])
def test_evicted_row_state_is_reset_for_reused_slot(cls, dev):
    def ids(*v):
        return torch.tensor(v, device=dev)

    t = HashTable(DIM, name="t", capacity=4, device=dev)
    t.insert(ids(1, 2), torch.zeros(2, DIM, device=dev))
    opt = cls(t, lr=0.1)
    coef = torch.randn(1, DIM, generator=torch.Generator().manual_seed(0)).to(dev)
    for _ in range(5):  # build up state for id 1
        (t(ids(1)) * coef).sum().backward()
        opt.step()
        opt.zero_grad()
    pos1 = int(t.positions(ids(1)))
    t.evict(ids(1))
    t.insert(ids(99), torch.zeros(1, DIM, device=dev))
    assert int(t.positions(ids(99))) == pos1  # same storage row reused
    (t(ids(99)) * coef).sum().backward()
    opt.step()
    # a fresh row's first step, computed independently
    fresh = HashTable(DIM, name="t", capacity=4, device=dev)
    fresh.insert(ids(99), torch.zeros(1, DIM, device=dev))
    opt2 = cls(fresh, lr=0.1)
    (fresh(ids(99)) * coef).sum().backward()
    opt2.step()
    torch.testing.assert_close(t.lookup(ids(99)), fresh.lookup(ids(99)))


def test_clear_resets_all_state(dev):
    t, _ = _pair(device=dev)
    opt = RowWiseAdagrad(t, lr=0.1)
    rows, coef = _batches(1)[0]
    _sparse_step(t, opt, rows, coef)
    assert float(opt.state["t"]["sum"].sum()) > 0
    t.clear()
    assert float(opt.state["t"]["sum"].sum()) == 0


# ----------------------------------------------------------------------------- state_dict


@pytest.mark.parametrize("cls", [SparseSGD, RowWiseAdagrad, SparseAdam])
def test_state_dict_round_trip_continues_identically(cls, dev):
    batches = _batches(6, seed=9)
    model = torch.nn.ModuleDict({"emb": _pair(seed=2, device=dev)[0]})
    opt = cls(model, lr=0.05)
    for rows, coef in batches[:3]:
        _sparse_step(model["emb"], opt, rows, coef)
    model["emb"].evict(_id(torch.tensor([4, 5])).to(dev))
    msd, osd = model.state_dict(), opt.state_dict()
    assert set(osd["state"].get("t", {})) == ({"ids"} | set(cls._row_state) if cls._row_state
                                              else set())
    # a fresh model and optimizer, different capacity, restored: table first, then optimizer
    clone = torch.nn.ModuleDict({"emb": HashTable(DIM, name="t", capacity=1000, device=dev)})
    clone["emb"].insert(torch.tensor([123456], device=dev), torch.ones(1, DIM, device=dev))
    opt2 = cls(clone, lr=0.9)
    clone.load_state_dict(msd)
    opt2.load_state_dict(osd)
    assert opt2.param_groups[0]["lr"] == 0.05
    for rows, coef in batches[3:]:
        _sparse_step(model["emb"], opt, rows, coef)
        _sparse_step(clone["emb"], opt2, rows, coef)
    # same contents (storage order may differ: the original reuses evicted positions)
    assert sorted(clone["emb"].ids().tolist()) == sorted(model["emb"].ids().tolist())
    assert len(clone["emb"]) == VOCAB \
        and not bool(clone["emb"].contains(torch.tensor([123456], device=dev)))
    torch.testing.assert_close(_table_rows(clone["emb"]), _table_rows(model["emb"]))


def test_load_state_dict_validation():
    t, _ = _pair()
    opt = SparseAdam(t)
    with pytest.raises(ValueError, match="param_groups"):
        opt.load_state_dict({"state": {}})
    with pytest.raises(ValueError, match="do not match"):
        opt.load_state_dict(SparseSGD(t).state_dict())
    sd = opt.state_dict()
    sd["state"]["other"] = {"ids": torch.tensor([1])}
    with pytest.raises(ValueError, match="does not hold"):
        opt.load_state_dict(sd)


# ----------------------------------------------------------------------------- construction, API


def test_construction_finds_tables_and_validates():
    a, b = HashTable(2, name="a"), HashTable(2, name="b")
    model = torch.nn.Sequential(torch.nn.ModuleDict({"x": a, "y": b}), torch.nn.Linear(2, 2))
    assert [t.name for t in SparseSGD(model).tables] == ["a", "b"]
    assert [t.name for t in SparseAdam([a, model, b]).tables] == ["a", "b"]  # deduplicated
    with pytest.raises(TypeError, match="torch.optim"):
        SparseSGD(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="no HashTable"):
        SparseSGD(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unique"):
        SparseSGD([a, HashTable(2, name="a")])
    with pytest.raises(ValueError, match="lr"):
        SparseSGD(a, lr=-1)
    with pytest.raises(ValueError, match="betas"):
        SparseAdam(a, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps"):
        RowWiseAdagrad(a, eps=float("nan"))


def test_grads_accumulate_until_zero_grad_and_lr_is_adjustable(dev):
    one = torch.tensor([1], device=dev)
    t = HashTable(2, name="t", device=dev)
    t.insert(one, torch.zeros(1, 2, device=dev))
    opt = SparseSGD(t, lr=1.0)
    t(one).sum().backward()
    t(one).sum().backward()
    opt.step()
    assert t.lookup(one).tolist() == [[-2.0, -2.0]]
    opt.zero_grad()
    opt.step()  # nothing touched: no change
    assert t.lookup(one).tolist() == [[-2.0, -2.0]]
    opt.param_groups[0]["lr"] = 0.5
    t(one).sum().backward()
    opt.step()
    assert t.lookup(one).tolist() == [[-2.5, -2.5]]
    assert opt.step(closure=lambda: torch.tensor(3.0)) == torch.tensor(3.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_tables_update_in_float32(dtype, dev):
    t = HashTable(4, name="t", dtype=dtype, device=dev)
    opt = SparseAdam(t, lr=0.01)
    for _ in range(3):
        t(torch.tensor([5, 6], device=dev)).sum().backward()
        opt.step()
        opt.zero_grad()
    got = t.lookup(torch.tensor([5], device=dev)).float().cpu()
    torch.testing.assert_close(got, torch.full((1, 4), -0.03), atol=1e-3, rtol=1e-2)
    assert opt.state["t"]["exp_avg"].dtype == torch.float32


def test_docstring_example_runs():
    failures, tried = doctest.testmod(optim_mod, verbose=False)
    assert tried > 0 and failures == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cls", [SparseSGD, RowWiseAdagrad, SparseAdam])
def test_cuda_matches_cpu(cls):
    batches = _batches(5, seed=11)
    cpu, _ = _pair(seed=3)
    gpu_t = HashTable(DIM, name="t", device="cuda", capacity=4)
    gpu_t.insert(cpu.ids().cuda(), cpu.embeddings().cuda())
    o_cpu, o_gpu = cls(cpu, lr=0.05), cls(gpu_t, lr=0.05)
    for rows, coef in batches:
        _sparse_step(cpu, o_cpu, rows, coef)
        _sparse_step(gpu_t, o_gpu, rows.cuda(), coef.cuda())
    torch.testing.assert_close(_table_rows(cpu), _table_rows(gpu_t).cpu(), rtol=1e-5,
                               atol=1e-5)


# ----------------------------------------------------------------------------- kernel path

_ALL_OPTIONS = [
    (SparseSGD, {"lr": 0.1, "weight_decay": 0.05}),
    (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-6, "weight_decay": 0.01,
                      "initial_accumulator_value": 0.1}),
    (SparseAdam, {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-7, "weight_decay": 0.1}),
    (SparseAdam, {"lr": 0.05, "betas": (0.0, 0.999)}),  # beta1 = 0: no first moment
]


def _run_with_evictions(device, cls, kw, dtype, steps=5):
    """Train on random batches (duplicates, new ids, an eviction midway); returns the rows
    of every id seen (CPU, float32) and the optimizer's state_dict."""
    gen = torch.Generator().manual_seed(5)
    t = HashTable(DIM, name="t", dtype=dtype, device=device,
                  initializer=constant_initializer(0.25))
    opt = cls(t, lr=kw["lr"], **{k: v for k, v in kw.items() if k != "lr"})
    for step in range(steps):
        rows = torch.randint(0, 3 * VOCAB, (40,), generator=gen)
        coef = torch.randn(40, DIM, generator=gen)
        _sparse_step(t, opt, rows, coef)
        if step == 2:  # freed rows: their state resets and the positions are reused
            t.evict(_id(torch.arange(0, 3 * VOCAB, 4)).to(device))
    every = _id(torch.arange(3 * VOCAB)).to(device)
    return t.lookup(every).float().cpu(), opt.state_dict()


@pytest.mark.parametrize("cls,kw", _ALL_OPTIONS, ids=["sgd", "adagrad", "adam", "adam-b1=0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_equal_reference_with_every_option(kernel_device, cls, kw, dtype):
    got_rows, got_sd = _run_with_evictions(kernel_device, cls, kw, dtype)
    with kernels_mode("off"):
        ref_rows, ref_sd = _run_with_evictions("cpu", cls, kw, dtype)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else \
        {"rtol": 1e-3, "atol": 1e-3}
    torch.testing.assert_close(got_rows, ref_rows, **tol)
    assert got_sd["param_groups"] == ref_sd["param_groups"]
    for name, ref in ref_sd["state"].get("t", {}).items():
        got = got_sd["state"]["t"][name].cpu()
        if name in ("ids", "step"):
            assert torch.equal(got, ref)
        else:
            torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("cls,fn", [(SparseSGD, "sgd_update"),
                                    (RowWiseAdagrad, "rowwise_adagrad_update"),
                                    (SparseAdam, "adam_update")])
def test_one_kernel_launch_per_table_per_step(dev, monkeypatch, cls, fn):
    """The kernel path updates each touched table with one call (one launch); the
    reference path never calls the kernels."""
    calls = []
    kernel = _kernel_path(dev)
    if kernel:
        from deltastream.kernels import sparse_optim

        real = getattr(sparse_optim, fn)
        monkeypatch.setattr(sparse_optim, fn, lambda *a, **k: (calls.append(1), real(*a, **k)))
    a, b = (HashTable(DIM, name=n, device=dev) for n in "ab")
    opt = cls([a, b], lr=0.1)
    for _ in range(3):
        (a(torch.tensor([1, 2, 1], device=dev)).sum()
         + b(torch.tensor([7], device=dev)).sum()).backward()
        opt.step()
        opt.zero_grad()
    assert len(calls) == (6 if kernel else 0)


def _kernel_path(device) -> bool:
    from deltastream.kernels.runtime import use_kernels

    return use_kernels(torch.zeros(1, device=device))


def test_coalesce_rows_sums_duplicates_and_drops_invalid():
    pos = torch.tensor([5, 2, 5, 9, 2, 7, 5])
    valid = torch.tensor([True, True, True, False, True, True, False])
    grad = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    uniq, summed = coalesce_rows(pos, grad, valid, capacity=10)
    assert uniq.tolist() == [2, 5, 7]
    torch.testing.assert_close(summed, torch.stack([grad[1] + grad[4], grad[0] + grad[2],
                                                    grad[5]]))
    none = coalesce_rows(pos, grad, torch.zeros(7, dtype=torch.bool), capacity=10)
    assert none[0].numel() == 0 and none[1].shape == (0, 3)
    empty = coalesce_rows(pos[:0], grad[:0], valid[:0], capacity=10)
    assert empty[0].numel() == 0 and empty[1].shape == (0, 3)
