"""RoundPublisher: publish_delta's rounds off the training thread. The rounds it runs on the
rows its hand-offs copied publish what publish_delta publishes at the same steps; the
publisher here records what it is handed (pure selection logic; the broker, the worker
process and outages are in tests/integration/test_round_publisher.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastream import (
    DeltaTracker,
    PublishError,
    RoundPolicy,
    RoundPublisher,
    SelectionPolicy,
    TrackingMode,
    publish_delta,
)
from deltastream.publishing.budget_engine import table_specs
from deltastream.publishing.handoff import Handoff, HostCopier, owed_storages, take_handoff
from deltastream.publishing.results import Undelivered
from deltastream.publishing.round_engine import RoundEngine, unite_deltas
from deltastream.types import DeltaRows
from tests.deltastream.publishing.round_cases import (
    DIM,
    Recorder,
    apply_step,
    random_steps,
    twin_model,
)

POLICIES = {
    "k": SelectionPolicy(k=7),
    "fraction-max_age": SelectionPolicy(fraction=0.1, max_age=3),
    "half": SelectionPolicy(fraction=0.5),
    "threshold-bytes": SelectionPolicy(threshold=1.0, max_bytes=8 * (8 + 2 * DIM), max_age=2),
    "bytes-drift": SelectionPolicy(max_bytes=12 * (8 + 2 * DIM), max_age=4, new_rows="drift"),
    "every-row": SelectionPolicy(),
}


def _twins(seed: int, n: int):
    out = []
    for _ in range(2):
        model = twin_model(n, seed)
        out.append((model, DeltaTracker(model, consumers=["p"], mode=TrackingMode.EMBEDDING),
                    Recorder()))
    return out


def _same(got: list, want: list, where: object) -> None:
    assert [(a[0], a[1], a[3]) for a in got] == [(b[0], b[1], b[3]) for b in want], where
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a[2], b[2], rtol=0, atol=0)


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("mode", ["inline", "thread"])
@pytest.mark.parametrize("seed", [0, 1])
def test_rounds_off_the_loop_publish_what_publish_delta_publishes(policy, mode, seed):
    """Twin models take the same random changes (lookups and moves, inserts, evictions):
    one calls publish_delta every 3 steps, the other ticks a RoundPublisher(every=3) after
    every step (its rounds on a worker thread, drained after each round, or inline). Every
    round hands the publisher the same ids, values and tombstones, the final flush too."""
    n, rounds, every = 300, 12, 3
    plan = random_steps(np.random.default_rng(seed), n, rounds, steps=every)
    (m_ref, t_ref, p_ref), (m_new, t_new, p_new) = _twins(seed, n)
    rp = RoundPublisher(t_new, p_new, "p", RoundPolicy(policy, every=every),
                        threaded=mode == "thread", worker="thread")
    step, carried = 0, 0
    try:
        for r, rnd in enumerate(plan):
            final = r == rounds - 1
            for changes in rnd:
                apply_step(m_ref, t_ref, changes)
                apply_step(m_new, t_new, changes)
                step += 1
                if not final:
                    rp.tick(step)
            if final:
                rp.flush(step)
                publish_delta(t_ref, p_ref, "p", policy, step=step, final=True)
            else:
                rp.drain()
                carried = max(carried, publish_delta(t_ref, p_ref, "p", policy,
                                                     step=step).carried)
            assert rp.last.round.step == step
            _same(p_new.sent, p_ref.sent, (r, mode))
            p_new.sent.clear()
            p_ref.sent.clear()
        st = rp.stats()
    finally:
        rp.close()
    assert st["worker"] == mode and st["failed_rounds"] == 0
    assert st["pending"] == 0 and st["held_rows"] == 0  # all published, nothing held
    if policy.k or policy.fraction or policy.max_bytes or policy.threshold:
        assert carried  # the policy did carry rows across rounds


def test_a_round_never_reads_the_live_table():
    """The round reads the rows the hand-off copied at the step boundary: rows the
    optimizer writes after the tick (while a worker would score) are not what is
    published."""
    (model, tracker, pub), = _twins(0, 50)[:1]
    t = model["u"]
    modules = tracker.get_tracked_modules()
    engine = RoundEngine(pub, RoundPolicy(), table_specs(modules))
    ids = torch.arange(10)
    with torch.no_grad():
        t.insert(ids, t(ids) + 1.0)
    tracker.step()
    at_tick = t.lookup(ids).clone()
    copier = HostCopier()
    tables = take_handoff(tracker, "p", modules, copier, owe=owed_storages(tracker, modules))
    tracker.capture_rows(None)  # the owed rows, as the ticks after the hand-off copy them
    with torch.no_grad():  # the optimizer's next write, before the worker's round
        t.insert(ids, torch.full((10, DIM), 99.0))
    engine.merge(Handoff(tick=1, step=1, ts=0, units=1.0, tables=tables,
                         ready=copier.finish()))
    job = engine.start(1, 1, 0, False)
    engine.send(job)
    engine.settle(job, None)
    (name, got_ids, rows, _), = pub.sent
    assert name == "u" and got_ids == ids.tolist()
    torch.testing.assert_close(rows, at_tick)


def test_united_deltas_keep_the_older_first_state_and_drop_what_was_evicted_since():
    def rows(ids, state, new=None, tombs=None):
        ids = torch.tensor(ids, dtype=torch.int64)
        return DeltaRows(ids=ids, states=torch.full((ids.numel(), 2), float(state)),
                         new=torch.tensor(new if new is not None else [False] * ids.numel()),
                         age=torch.zeros(ids.numel(), dtype=torch.int64),
                         tombstones=None if tombs is None else torch.tensor(tombs))

    old = rows([1, 2, 3], 1.0, tombs=[7, 9])
    fresh = rows([2, 3, 9], 2.0, new=[False, True, True], tombs=[1, 8])
    # 1 evicted later (a tombstone now); 3 evicted and inserted again (its later state);
    # 9 evicted earlier, inserted again (a row, not a tombstone)
    got = unite_deltas(old, fresh, torch.tensor([1, 3, 8]))
    assert got.ids.tolist() == [2, 3, 9]
    assert got.states[:, 0].tolist() == [1.0, 2.0, 2.0]
    assert got.new.tolist() == [False, True, True]
    assert got.tombstones.tolist() == [1, 7, 8]


def test_a_policy_is_checked_when_it_is_built():
    with pytest.raises(ValueError, match="every"):
        RoundPolicy(every=0)
    with pytest.raises(TypeError, match="select"):
        RoundPolicy(select={"k": 3})
    (model, tracker, pub), = _twins(0, 10)[:1]
    with pytest.raises(TypeError, match="RoundPolicy"):
        RoundPublisher(tracker, pub, "p", SelectionPolicy(k=3))


class _LostAcks(Recorder):
    """A Recorder whose next ``lose`` acknowledgements fail: the messages were handed over,
    then reported undelivered (as a broker outage after the send reports them)."""

    def __init__(self, lose: int) -> None:
        super().__init__()
        self.lose = lose

    def publish(self, table, ids, rows, *, step, tombstones=None, ts=None, **kw):
        res = super().publish(table, ids, rows, step=step, tombstones=tombstones, ts=ts)
        if self.lose > 0:
            self.lose -= 1
            lost = Undelivered(table=table, first_seq=0, last_seq=0, rows=int(ids.numel()),
                               tombstones=0, reason="ack lost", ids=ids.numpy().copy())

            def wait(timeout=None):
                raise PublishError("not acknowledged", [lost])

            res.wait = wait
        return res


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_rows_whose_acknowledgement_failed_go_out_again_with_their_current_value(mode):
    """A round's messages handed over, then reported undelivered: the error reaches the
    training thread (at the tick, or the drain), naming them, and the next round sends
    those rows again — with their values now — though they did not change since."""
    (model, tracker, _), = _twins(0, 50)[:1]
    pub = _LostAcks(lose=1)  # the first round's message (table u: v did not change)
    t = model["u"]
    rp = RoundPublisher(tracker, pub, "p", RoundPolicy(every=1), threaded=mode == "thread",
                        worker="thread")
    try:
        ids = torch.arange(20)
        with torch.no_grad():
            t.insert(ids, t(ids) + 1.0)
        tracker.step()
        with pytest.raises(PublishError) as failed:
            rp.tick(1)
            rp.drain()
        notes = "".join(failed.value.__notes__)
        assert "pending again" in notes and "handed back" in notes, notes
        lost = [s[1] for s in pub.sent]
        assert lost == [ids.tolist()]
        pub.sent.clear()
        tracker.step()  # nothing changed since
        rp.tick(2)
        rp.drain()
        assert [(s[0], s[1]) for s in pub.sent] == [("u", ids.tolist())]
        torch.testing.assert_close(pub.sent[0][2], t.lookup(ids))
        assert rp.stats()["pending"] == 0
    finally:
        rp.close()


def test_a_round_due_while_the_last_hand_off_is_still_copied_waits_counted_on_schedule(
        monkeypatch):
    """A hand-off copies its owed rows a few per tick (a tiny ``CAPTURE_BYTES``); a round
    that falls due meanwhile waits for the copy, and its rows stay in the tracker until a
    later round or the final flush: each such tick counts in ``deferred_ticks``, as a tick
    that waits for a busy worker does. The round runs at the first free tick, and the
    next one is due on the schedule (a multiple of ``every``), not ``every`` steps after
    the round that waited."""
    from deltastream.publishing import budget
    from deltastream.tracking import fresh_rows, model_hooks

    monkeypatch.setattr(fresh_rows, "spare_core", lambda: False)
    monkeypatch.setattr(model_hooks, "spare_core", lambda: False)
    monkeypatch.setattr(budget, "CAPTURE_BYTES", 8 * DIM * 4)  # 8 positions a tick
    n, every = 200, 3
    model = twin_model(n, 0)
    tracker = DeltaTracker(model, consumers=["p"], mode=TrackingMode.EMBEDDING)
    rp = RoundPublisher(tracker, Recorder(), "p", RoundPolicy(every=every), worker="thread")
    g = torch.Generator().manual_seed(1)
    waited, rounds = set(), []  # due ticks that started no round; steps that started one
    try:
        for step in range(1, 61):
            ids = torch.randint(0, n, (40,), generator=g).unique()
            with torch.no_grad():
                for t in model.values():
                    t.insert(ids, t(ids) + 1.0)
            tracker.step()
            last = rp._last_round_step
            rp.tick(step)
            if rp._last_round_step != last:
                rounds.append(step)
            elif step - last >= every:
                waited.add(step)
        st = rp.stats()
        assert st["capture_ticks"] > 0 and waited  # the copies did delay rounds
        # (a complete hand-off held for the worker's merge counts at every tick it waits)
        assert st["deferred_ticks"] >= len(waited)
        for s in rounds:  # each ran when due on the schedule, or after waiting since then
            assert all(k in waited for k in range(s - s % every, s)), (s, rounds, waited)
        assert any(s % every for s in rounds)  # some waited
        rp.flush(61)
    finally:
        rp.close()
