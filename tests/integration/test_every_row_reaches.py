"""Every changed row reaches the predictors, whatever the model (issue #10).

The matrix: {HashTable + SparseSGD / RowWiseAdagrad / SparseAdam, nn.Embedding + SGD with
momentum / Adam / AdamW with weight decay / Adagrad, nn.Embedding(sparse=True) + SparseAdam
(watched: the lookups path), nn.EmbeddingBag (sum, mean with padding_idx, per_sample_weights)
+ Adam} x {ID_ONLY, EMBEDDING} x {every row, a top-k fraction with retain, a threshold}.
Random lookups on changing subsets of rows, a ``publish_delta`` round at random steps, a
final flush; the rows travel through the real wire format (encode -> decode) into a
``consumers.ServingTable``, which must then equal the trainer's weights for every row that
ever differed from its initial value (f32 on the wire: exactly), and hold no other row
that differs from the trainer's. Two representative combinations go through the embedded
broker (f32 exact, and f16 within the wire's documented bound); the DDP case is in
``test_ddp_tracking.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from consumers import ServingTable, TopicReader
from deltastream import (
    DeltaPublisher,
    DeltaTracker,
    HashTable,
    RowWiseAdagrad,
    SparseAdam,
    SparseSGD,
    TrackingMode,
    ensure_topic,
    normal_initializer,
    publish_delta,
    wire,
)
from deltastream.publishing.rounds import SelectionPolicy

DIM = 8
ROWS = 96  # dense tables
ID_SPACE = 400  # HashTable ids
STEPS = 36

POLICIES = {
    "every_row": SelectionPolicy(),
    "topk_retain": SelectionPolicy(fraction=0.3, max_age=3),
    "threshold": SelectionPolicy(threshold=0.05),
}


class Loopback:
    """A publisher whose messages go through wire.encode -> wire.decode into ServingTables."""

    def __init__(self, dtype: str = "f32") -> None:
        self.dtype = dtype
        self.serving: dict[str, ServingTable] = {}
        self.seq = 0

    def publish(self, table: str, ids, rows, *, step: int, tombstones=None, ts=None) -> Any:
        batch = wire.DeltaBatch(model="m", table=table, shard=0, epoch=1, seq=self.seq,
                                step=step, ts=time.time_ns() if ts is None else ts,
                                ids=ids.cpu().numpy(), rows=rows.cpu().numpy(),
                                dtype=self.dtype,
                                tombstones=None if tombstones is None else tombstones.numpy())
        msgs = wire.encode(batch)
        serving = self.serving.setdefault(table, ServingTable(table, rows.shape[1]))
        for msg in msgs:
            self.seq += 1
            serving.apply(wire.decode(msg))
        return _Sent(len(ids), 0 if tombstones is None else len(tombstones), len(msgs),
                     sum(len(m) for m in msgs))


class _Sent:
    def __init__(self, rows: int, tombstones: int, messages: int, nbytes: int) -> None:
        self.rows, self.tombstones, self.messages, self.bytes = rows, tombstones, messages, nbytes


# ---------------------------------------------------------------------- the trainers


class Case:
    """One model + optimizer. ``step(g)`` runs one training step on random subsets."""

    def __init__(self, kind: str, opt: str, seed: int) -> None:
        torch.manual_seed(seed)
        self.kind, self.opt_name = kind, opt
        self.bag_mode = None
        if kind == "hashtable":
            self.table = HashTable(DIM, name="user", capacity=64,
                                   initializer=normal_initializer(0.1, seed=seed))
        elif kind.startswith("bag"):
            mode = "mean" if kind == "bag_mean" else "sum"
            self.table = torch.nn.EmbeddingBag(ROWS, DIM, mode=mode,
                                               padding_idx=0 if kind == "bag_mean" else None)
            self.bag_mode = kind
        else:
            self.table = torch.nn.Embedding(ROWS, DIM, sparse=kind == "embedding_sparse")
        self.model = torch.nn.ModuleDict({"emb": self.table})
        params = list(self.table.parameters())
        self.opt = {
            "sparse_sgd": lambda: SparseSGD(self.table, lr=0.3),
            "rowwise_adagrad": lambda: RowWiseAdagrad(self.table, lr=0.3),
            "sparse_adam": lambda: SparseAdam(self.table, lr=0.05),
            "sgd_momentum": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            "adam": lambda: torch.optim.Adam(params, lr=0.05),
            "adamw_wd": lambda: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
            "adagrad": lambda: torch.optim.Adagrad(params, lr=0.1),
            "torch_sparse_adam": lambda: torch.optim.SparseAdam(params, lr=0.05),
        }[opt]()
        self.w0 = None if kind == "hashtable" else self.table.weight.detach().clone()
        self.ever = None if kind == "hashtable" else torch.zeros(ROWS, dtype=torch.bool)
        self.target = torch.randn(DIM)

    def step(self, g: torch.Generator, subset: torch.Tensor) -> None:
        ids = subset[torch.randint(0, subset.numel(), (12,), generator=g)]
        if self.bag_mode is None:
            out = self.table(ids)
        else:
            offsets = torch.tensor([0, 3, 7])  # bags of 3, 4 and 5 ids
            psw = torch.rand(12, generator=g) if self.bag_mode == "bag_psw" else None
            out = self.table(ids, offsets, psw)
        ((out @ self.target - 1.0) ** 2).mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        if self.ever is not None:
            self.ever |= (self.table.weight.detach() != self.w0).any(1)

    def evict_some(self, g: torch.Generator) -> None:
        ids = self.table.ids()
        if ids.numel() > 4:
            self.table.evict(ids[torch.randint(0, ids.numel(), (2,), generator=g)])


def run(kind: str, opt: str, mode: TrackingMode, policy: SelectionPolicy, publisher,
        seed: int, flush: Callable[[], None] = lambda: None) -> Case:
    """Train with random reads; publish every round through ``publisher``; final flush."""
    case = Case(kind, opt, seed)
    tracker = DeltaTracker(case.model, consumers=["pub"], mode=mode)
    if kind == "embedding_sparse":
        assert tracker.watch_optimizer(case.opt) == {"emb": "lookups"}
    g = torch.Generator().manual_seed(seed)
    space = ID_SPACE if kind == "hashtable" else ROWS
    subset = torch.randperm(space, generator=g)[:20]
    for step in range(STEPS):
        if step % 6 == 0:  # lookups move to another subset of rows
            subset = torch.randperm(space, generator=g)[:20]
        case.step(g, subset)
        tracker.step()
        if kind == "hashtable" and torch.rand(1, generator=g).item() < 0.1:
            case.evict_some(g)
        if torch.rand(1, generator=g).item() < 0.3:  # a read at a random interval
            publish_delta(tracker, publisher, "pub", policy, step=step)
    # the last steps after the last read keep moving rows (momentum): the flush gets them
    case.step(g, subset)
    publish_delta(tracker, publisher, "pub", policy, step=STEPS, final=True)
    flush()
    assert tracker.stats()["degradations"] == 0
    return case


def check(case: Case, serving: dict[str, ServingTable], dtype: str = "f32") -> int:
    """The predictor equals the trainer for every row that ever changed; returns how many."""
    name = "user" if case.kind == "hashtable" else "emb"
    table = serving.get(name, ServingTable(name, DIM))
    if case.kind == "hashtable":
        ids = case.table.ids()
        want = case.table.lookup(ids).numpy()
        held = set(table.ids().tolist())
        assert held == set(ids.tolist()), "evicted ids gone, every live row present"
    else:
        ids = case.ever.nonzero().squeeze(1)
        want = case.table.weight.detach()[ids].numpy()
        # any row the predictor holds is the trainer's current row
        extra = np.asarray(table.ids(), dtype=np.int64)
        assert_rows(table.lookup(extra), case.table.weight.detach()[extra].numpy(), dtype)
    got = table.lookup(ids.numpy())
    assert_rows(got, want, dtype)
    return int(ids.numel())


def assert_rows(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    if dtype == "f32":
        bad = np.flatnonzero((got != want).any(1))
        assert bad.size == 0, f"{bad.size} rows differ, up to {np.abs(got - want).max()}"
    else:  # f16: relative error <= 2**-11 in the normal range, absolute 2**-24 below it
        np.testing.assert_allclose(got, want, rtol=2.0 ** -11, atol=2.0 ** -24)


CASES = [("hashtable", "sparse_sgd"), ("hashtable", "rowwise_adagrad"),
         ("hashtable", "sparse_adam"), ("embedding", "sgd_momentum"), ("embedding", "adam"),
         ("embedding", "adamw_wd"), ("embedding", "adagrad"),
         ("embedding_sparse", "torch_sparse_adam"), ("bag_sum", "adam"),
         ("bag_mean", "adam"), ("bag_psw", "adam")]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("mode", [TrackingMode.ID_ONLY, TrackingMode.EMBEDDING],
                         ids=["id_only", "embedding"])
@pytest.mark.parametrize("kind,opt", CASES, ids=[f"{k}-{o}" for k, o in CASES])
def test_serving_table_equals_the_trainer(kind, opt, mode, policy):
    seed = 1000 + 17 * CASES.index((kind, opt)) + (mode is TrackingMode.EMBEDDING)
    sink = Loopback()
    case = run(kind, opt, mode, POLICIES[policy], sink, seed)
    assert check(case, sink.serving) > 20  # the run changed plenty of rows


def _broker_run(servers: str, topic: str, kind: str, opt: str, dtype: str) -> None:
    ensure_topic(servers, topic, 1)
    with DeltaPublisher(servers, topic, model="m", shard=0, dtype=dtype) as pub:
        case = run(kind, opt, TrackingMode.EMBEDDING, POLICIES["topk_retain"], pub, 7,
                   flush=pub.flush)
    serving: dict[str, ServingTable] = {}
    with TopicReader(servers, topic, timeout=15.0) as reader:
        for rec in reader.read(reader.beginning_offsets(), reader.end_offsets()):
            batch = wire.decode(rec.value)
            serving.setdefault(batch.table, ServingTable(batch.table, DIM)).apply(batch)
    assert check(case, serving, dtype) > 20


@pytest.mark.integration
def test_through_the_broker_embedding_adam_f32(broker, topic_name):
    _broker_run(broker.bootstrap_servers, topic_name, "embedding", "adam", "f32")


@pytest.mark.integration
def test_through_the_broker_embedding_bag_f16(broker, topic_name):
    _broker_run(broker.bootstrap_servers, topic_name, "bag_psw", "adam", "f16")
