"""DeltaTracker on an accelerator: sync-free training hooks, reads that stay on the device.

Without a GPU the hooks are proven sync-free on the ``meta`` device: a meta tensor has a
shape but no data, so every operation that would need a device->host read on CUDA
(``.item()``, ``bool()``, ``nonzero``, ``unique``, boolean-mask indexing, ``.cpu()``)
raises there. With a GPU the same hooks run under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import pytest
import torch
from torch.utils.hooks import RemovableHandle

from deltastream.embedding.hashtable import HashTable
from deltastream.embedding.optim import SparseAdam
from deltastream.tracking.store import EAGER_DEDUPE_MIN
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import TrackingMode

DIM = 4
MODES = [TrackingMode.ID_ONLY, TrackingMode.EMBEDDING]


class FakeTable(torch.nn.Module):
    """A positional dynamic table (the HashTable hook surface) that only fires hooks with
    tensors of the right shape on ``device``: what the tracker's hooks receive in training."""

    def __init__(self, device: str, capacity: int = 1 << 16) -> None:
        super().__init__()
        self.embedding_dim, self.capacity = DIM, capacity
        self.device, self.dtype = torch.device(device), torch.float32
        self._hooks = {k: OrderedDict() for k in ("lookup", "insert", "evict", "write")}
        self._listeners = []

    def _register(self, kind, fn):
        handle = RemovableHandle(self._hooks[kind])
        self._hooks[kind][handle.id] = fn
        return handle

    def register_lookup_hook(self, fn):
        return self._register("lookup", fn)

    def register_insert_hook(self, fn):
        return self._register("insert", fn)

    def register_evict_hook(self, fn):
        return self._register("evict", fn)

    def register_write_hook(self, fn):
        return self._register("write", fn)

    def register_row_listener(self, cb):
        self._listeners.append(cb)

    def ids_at(self, positions):
        return positions

    def forward(self, n: int) -> torch.Tensor:
        pos = torch.zeros(n, dtype=torch.int64, device=self.device)
        rows = torch.zeros(n, DIM, device=self.device)
        for fn in list(self._hooks["lookup"].values()):
            fn(self, pos, rows)
        return rows

    def inserted(self, n: int) -> None:
        """``insert`` of ``n`` new ids: insert hooks, then write hooks (their rows)."""
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        for fn in list(self._hooks["insert"].values()):
            fn(self, ids)
        rows = torch.zeros(n, DIM, device=self.device)
        for fn in list(self._hooks["write"].values()):
            fn(self, ids, rows)


class Model(torch.nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.fake = FakeTable(device)
        self.scan = torch.nn.Embedding(64, DIM, device=device)  # default: scan path
        self.lookups = torch.nn.Embedding(64, DIM, device=device)  # declared sparse-only

    def train_step(self, tracker: DeltaTracker, n: int) -> None:
        ids = torch.zeros(n, dtype=torch.int64, device=self.fake.device)
        self.fake(n)
        self.fake.inserted(n)
        self.scan(ids)
        self.lookups(ids)
        tracker.step()


def _hooks_run(device: str, mode: TrackingMode, bound, hot=contextlib.nullcontext) -> None:
    """Build a tracked model, then train it inside ``hot`` (what must not sync)."""
    model = Model(device)
    tracker = DeltaTracker(model, mode=mode, sparse_updates_only=["lookups"],
                           max_tracked_rows=bound)
    assert tracker.paths == {"fake": "lookups", "scan": "scan", "lookups": "lookups"}
    with hot():
        for n in (3, 100, EAGER_DEDUPE_MIN + 5):  # a large insert: no eager dedupe
            model.train_step(tracker, n)
        with tracker.pause():
            model.fake(7)
    assert tracker.stats()["lookups_paused"] == 1


def test_meta_tensors_raise_on_every_syncing_op():
    m = torch.zeros(3, device="meta")
    for op in (lambda: m.nonzero(), lambda: torch.unique(m), lambda: bool(m.sum()),
               lambda: m.cpu(), lambda: m[m > 0], lambda: int(m[0])):
        with pytest.raises((NotImplementedError, RuntimeError)):
            op()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bound", [None, 10**9], ids=["unbounded", "under-bound"])
def test_training_hooks_need_no_value_from_the_device(mode, bound):
    """Lookups, inserts (and their writes), scan marks and steps on meta tensors: any sync
    would raise."""
    _hooks_run("meta", mode, bound)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", MODES)
def test_training_hooks_do_not_sync_on_cuda(mode):
    @contextlib.contextmanager
    def sync_is_an_error():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    _hooks_run("cuda", mode, None, sync_is_an_error)


def _devices():
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


@contextlib.contextmanager
def _no_host_copies():
    """Fail on any copy of a non-CPU tensor to the host (``.cpu()``, ``.tolist()``,
    ``.numpy()``, ``.to("cpu")``)."""
    mp = pytest.MonkeyPatch()

    def to_host(name, args, kwargs) -> bool:
        if name != "to":
            return True
        return any(isinstance(x, (str, torch.device)) and torch.device(x).type == "cpu"
                   for x in (*args, kwargs.get("device")))

    def refuse(name, real):
        def wrapper(self, *args, **kwargs):
            if self.device.type != "cpu" and to_host(name, args, kwargs):
                raise AssertionError(f"host copy: Tensor.{name} on {self.device}")
            return real(self, *args, **kwargs)
        return wrapper

    for name in ("cpu", "tolist", "numpy", "to"):
        mp.setattr(torch.Tensor, name, refuse(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        mp.undo()


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("mode", MODES)
def test_get_delta_returns_tensors_on_the_table_device(device, mode):
    table = HashTable(DIM, name="user", device=device)
    other = HashTable(DIM, name="quiet", device=device)
    model = torch.nn.ModuleDict({"user": table, "quiet": other,
                                 "item": torch.nn.Embedding(16, DIM, device=device)})
    opt = SparseAdam(torch.nn.ModuleList([table, other]), lr=0.1)
    tracker = DeltaTracker(model, mode=mode)
    ids = torch.tensor([1, 2, 2, 9], device=device)
    for _ in range(2):
        (table(ids).sum() + model["item"](ids).sum()).backward()
        opt.step()
        opt.zero_grad()
        tracker.step()
    table.evict(torch.tensor([9], device=device))
    with _no_host_copies():
        delta = tracker.get_delta()
    dev = torch.device(device)
    for fqn, rows in delta.items():
        for name in ("ids", "states", "new", "tombstones", "age"):
            x = getattr(rows, name)
            if x is not None:
                assert x.device.type == dev.type, (fqn, name, x.device)
    assert delta["user"].ids.tolist() == [1, 2] and delta["user"].tombstones.tolist() == [9]
    assert len(delta["quiet"]) == 0
    assert (delta["user"].states is not None) == (mode is TrackingMode.EMBEDDING)


@pytest.mark.parametrize("group_elems", [1, 7 * 3, 1 << 24])
def test_first_states_torch_in_groups_matches_cpu_path(monkeypatch, group_elems):
    """The device path concatenates runs in groups; any grouping gives the CPU result."""
    from deltastream.tracking import positions

    monkeypatch.setattr(positions, "_GROUP_ELEMS", group_elems)
    g = torch.Generator().manual_seed(3)
    cap = 50
    pos = [torch.randint(0, cap, (n,), generator=g) for n in (9, 0, 4, 12, 1, 7)]
    states = [torch.arange(cap, dtype=torch.float32)[q].unsqueeze(1) * torch.ones(3) + 100 * k
              for k, q in enumerate(pos)]  # a lookup's rows: one value per position and run
    marks = torch.zeros(cap, dtype=torch.bool)
    want_t, want_rows, want_src = positions.first_states_cpu(marks, pos, states)
    got_t, got_rows, got_src = positions.first_states_torch(marks, pos, states)
    assert torch.equal(got_t, want_t) and not bool(marks.any())
    assert torch.equal(got_rows.index_select(0, got_src), want_rows.index_select(0, want_src))
