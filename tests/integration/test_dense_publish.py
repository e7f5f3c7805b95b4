"""Dense versions through the embedded broker: a trained model publishes its rows and its
dense weights on one topic; the raw records are read back, told apart by their headers,
decoded with dense_wire.decode_dense and assembled here, version by version (a partial
one on top of its base), and every assembled version equals the model at its step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consumers import TopicReader
from deltastream import (
    BudgetPolicy,
    BudgetPublisher,
    DeltaPublisher,
    DeltaTracker,
    TrackingMode,
    ensure_topic,
    publish_delta,
    wire,
)
from deltastream.dense_wire import decode_dense, dense_key, is_dense
from deltastream.publishing.dense import DenseOptions, DensePublisher

pytestmark = pytest.mark.integration


class Ranker(torch.nn.Module):
    def __init__(self, rows: int = 50) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(rows, 8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 1))
        self.bn = torch.nn.BatchNorm1d(8)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bn(self.emb(ids))).squeeze(-1)


def _dense_state(model: Ranker) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()
            if v.is_floating_point() and not k.startswith("emb.")}


def _versions(records: list) -> list[tuple[int, dict[str, np.ndarray]]]:
    """``(step, tensors)`` of every complete version in publish order, partial ones applied
    to their base. Versions are runs of chunks from index 0 (two may share a step: a
    version deferred to the last step, then the final flush's full one of that step)."""
    runs: list[list] = []
    for r in records:  # in seq order (one partition)
        c = decode_dense(r.value)
        if c.index == 0:
            runs.append([])
        runs[-1].append(c)
    out: list[tuple[int, dict[str, np.ndarray]]] = []
    for cs in runs:
        step = cs[0].step
        assert [c.index for c in cs] == list(range(cs[0].chunks)), step  # complete
        assert {c.step for c in cs} == {step}
        base = {} if cs[0].full else next(t for s, t in reversed(out) if s == cs[0].base_step)
        tensors = {k: v.copy() for k, v in base.items()}
        for c in cs:
            flat = tensors.setdefault(c.name, np.full(c.shape, np.nan, np.float32)).reshape(-1)
            flat[c.offset:c.offset + len(c.values)] = c.values_f32()
        assert len({c.name for c in cs}) == cs[0].tensors
        out.append((step, tensors))
    return out


def _train(model: Ranker, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    loss = (model(ids) - 1.0).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _read(servers: str, topic: str) -> list:
    with TopicReader(servers, topic, timeout=15.0) as reader:
        return list(reader.read(reader.beginning_offsets(), reader.end_offsets()))


@pytest.mark.parametrize("loop", ["publish_delta", "budget"])
def test_dense_versions_reach_the_topic_and_assemble_to_the_model(broker, topic_name, loop):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 2)
    torch.manual_seed(0)
    model = Ranker()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker = DeltaTracker(model, consumers=["pub"], mode=TrackingMode.EMBEDDING)
    states: dict[int, dict[str, np.ndarray]] = {}
    with DeltaPublisher(servers, topic_name, model="m", shard=1, dtype="f32",
                        max_message_bytes=4096) as pub, \
            DensePublisher(pub, model, DenseOptions(every_steps=3, full_every=3),
                           tracker=tracker) as dense:
        budget = BudgetPublisher(tracker, pub, "pub", BudgetPolicy(bytes_per_step=2000),
                                 dense=dense) if loop == "budget" else None
        for step in range(1, 16):
            _train(model, opt, torch.arange(step % 10, step % 10 + 16))
            tracker.step()
            states[step] = _dense_state(model)
            if budget is None:
                publish_delta(tracker, pub, "pub", step=step, dense=dense)
            else:
                budget.tick(step)
        if budget is None:
            publish_delta(tracker, pub, "pub", step=15, final=True, dense=dense)
        else:
            budget.flush(15)
            budget.close()
        stats = dense.stats()
    records = _read(servers, topic_name)
    dense_recs = [r for r in records if is_dense(r.headers)]
    rows = [wire.decode(r.value) for r in records if not is_dense(r.headers)]
    assert rows and {b.table for b in rows} == {"emb"}
    assert {(r.partition, r.key) for r in dense_recs} == {(1, dense_key("m", 1))}
    seqs = [decode_dense(r.value).seq for r in dense_recs]
    assert seqs == list(range(len(seqs)))  # one stream, in order, no gap
    versions = _versions(dense_recs)
    assert versions[-1][0] == 15 and len(versions) >= 3
    for step, tensors in versions:
        assert set(tensors) == set(states[step])
        for name, want in states[step].items():
            np.testing.assert_array_equal(tensors[name], want, err_msg=f"{name} @ {step}")
    decoded = [decode_dense(r.value) for r in dense_recs]
    assert any(not c.full for c in decoded)  # partial versions went out …
    assert all("frozen.weight" != c.name for c in decoded if not c.full)  # … without frozen
    assert max(len(c.values) for c in decoded) < 256 * 8  # mlp.0.weight took several chunks
    assert stats["versions"] == len(versions)


#: rows of the budget tests' model: more rows change per step than the budget buys
_ROWS = 5000


def _budget_run(servers: str, topic: str, charge: bool, steps: int, per_step: float
                ) -> tuple[dict, list[int]]:
    """``steps`` budget ticks (synchronous) with a DensePublisher every 10 steps; the
    budget's stats and the dense bytes sent, as they stood at each tick."""
    torch.manual_seed(0)
    model = Ranker(_ROWS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = DeltaTracker(model, consumers=["pub"], mode=TrackingMode.EMBEDDING)
    sent = []
    with DeltaPublisher(servers, topic, model="m", shard=0, dtype="f32",
                        max_message_bytes=1 << 16) as pub, \
            DensePublisher(pub, model, DenseOptions(every_steps=10, threaded=False),
                           tracker=tracker) as dense:
        budget = BudgetPublisher(tracker, pub, "pub", BudgetPolicy(
            bytes_per_step=per_step, charge_dense=charge), threaded=False, dense=dense)
        for step in range(1, steps + 1):
            _train(model, opt, torch.randint(0, _ROWS, (512,)))
            tracker.step()
            sent.append(dense.sent_bytes)  # before this tick's hand-off
            budget.tick(step)
        stats = budget.stats()
        budget.close()
    return stats, sent


def test_a_budget_shared_with_the_dense_versions_holds_for_rows_and_dense_together(
        broker, topic_name):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    steps, per_step = 40, 3000.0
    burst = BudgetPolicy(bytes_per_step=per_step).burst
    shared, sent = _budget_run(servers, topic_name, True, steps, per_step)
    # every version sent before the last tick is charged, once
    assert shared["charged_bytes"] == sent[-1] > 0
    version = max(np.diff([0, *sent]))  # the largest version
    # rows + dense within the budget: the bucket's bound (refills + burst), plus the last
    # charge, which may leave a debt
    assert shared["bytes"] + shared["charged_bytes"] <= per_step * steps + burst + version
    own, sent_own = _budget_run(servers, topic_name, False, steps, per_step)
    # not shared: the rows spend the whole budget and the dense versions come on top
    assert own["charged_bytes"] == 0 and own["bytes"] > shared["bytes"]
    assert own["bytes"] + sent_own[-1] > per_step * steps + burst + version


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_the_dense_charge_reaches_the_budget_worker(broker, topic_name, worker):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    torch.manual_seed(0)
    model = Ranker(_ROWS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = DeltaTracker(model, consumers=["pub"], mode=TrackingMode.EMBEDDING)
    with DeltaPublisher(servers, topic_name, model="m", shard=0, dtype="f32",
                        max_message_bytes=1 << 16) as pub, \
            DensePublisher(pub, model, DenseOptions(every_steps=3, threaded=False),
                           tracker=tracker) as dense:
        with BudgetPublisher(tracker, pub, "pub", BudgetPolicy(
                bytes_per_step=3000.0, charge_dense=True), worker=worker,
                dense=dense) as budget:
            for step in range(1, 11):
                _train(model, opt, torch.randint(0, _ROWS, (512,)))
                tracker.step()
                budget.tick(step)
            before = dense.sent_bytes
            budget.flush(10)  # its hand-off carries what was not charged yet
            stats = budget.stats()
    # every version sent before the flush charged once, wherever the rounds ran; the
    # flush's own final version is not (a final flush is outside the budget)
    assert stats["worker"] == worker and stats["charged_bytes"] == before > 0
    assert dense.sent_bytes > before
