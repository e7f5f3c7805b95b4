"""publish_delta rounds from carried rows: the choice of a full re-score, at the cost of what
changed. The publisher here records what it is handed (pure selection logic; the broker
tests of publish_delta are in test_rounds.py and tests/integration/)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastream import (
    DeltaTracker,
    HashTable,
    PublishError,
    TrackingMode,
    publish_delta,
    select_changed,
)
from deltastream.publishing import carried_select
from deltastream.publishing.rounds import SelectionPolicy
from tests.deltastream.publishing.round_cases import (
    DIM,
    Recorder,
    apply_step,
    random_steps,
    twin_model,
)


def _reference_round(tracker: DeltaTracker, pub: Recorder, policy: SelectionPolicy,
                     tables: dict) -> None:
    """The loop publish_delta has always run: the full delta (every carried row read and
    scored again), select_changed, retain the leftover."""
    for fqn, delta in tracker.get_delta("p").items():
        n_tomb = 0 if delta.tombstones is None else int(delta.tombstones.numel())
        if len(delta) == 0 and n_tomb == 0:
            continue
        sel = policy.select(delta, tables[fqn], fqn=fqn, wire_dtype=pub.dtype)
        if len(sel.leftover):
            tracker.retain("p", fqn, sel.leftover)
        if len(sel) or n_tomb:
            pub.publish(tables[fqn].name, sel.ids, sel.rows, step=0,
                        tombstones=sel.tombstones if n_tomb else None)


POLICIES = {
    "k": [SelectionPolicy(k=7)],
    "fraction-max_age": [SelectionPolicy(fraction=0.1, max_age=3)],
    "k-no_max_age": [SelectionPolicy(k=5, max_age=None)],
    "threshold": [SelectionPolicy(threshold=1.5)],
    "threshold-bytes": [SelectionPolicy(threshold=1.0, max_bytes=8 * (8 + 2 * DIM),
                                        max_age=2)],
    "fraction-drift": [SelectionPolicy(fraction=0.15, new_rows="drift")],
    "bytes-drift": [SelectionPolicy(max_bytes=12 * (8 + 2 * DIM), max_age=4,
                                    new_rows="drift")],
    # rounds that take a large share run the full path; carried rows go back and forth
    "k-then-half-then-relative": [SelectionPolicy(k=5), SelectionPolicy(k=6),
                                  SelectionPolicy(fraction=0.5),
                                  SelectionPolicy(threshold=0.3, relative=True)],
}


@pytest.mark.parametrize("policies", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("share", [0, carried_select.TAKE_SHARE], ids=["carried", "default"])
def test_rounds_choose_what_a_full_rescore_chooses(policies, seed, share, monkeypatch):
    """Twin models take the same random changes; one publishes with publish_delta (carried
    rows kept scored between rounds), the other re-scores every candidate each round. Every
    round hands the publisher the same ids, values and tombstones (a round's policy cycles
    through ``policies``). ``share`` 0: every round that can runs from carried rows; the
    default: rounds switch between both paths as the carried set grows and shrinks."""
    monkeypatch.setattr(carried_select, "TAKE_SHARE", share)
    n, rounds = 300, 12
    plan = random_steps(np.random.default_rng(seed), n, rounds, steps=3)
    runs = []
    for _ in range(2):
        model = twin_model(n, seed)
        tracker = DeltaTracker(model, consumers=["p"], mode=TrackingMode.EMBEDDING)
        runs.append((model, tracker, Recorder()))
    (m_new, t_new, p_new), (m_ref, t_ref, p_ref) = runs
    tables = t_ref.get_tracked_modules()
    carried_some = False
    for r, rnd in enumerate(plan):
        for step in rnd:
            apply_step(m_new, t_new, step)
            apply_step(m_ref, t_ref, step)
        final, policy = r == rounds - 1, policies[r % len(policies)]
        got = publish_delta(t_new, p_new, "p", policy, step=r, final=final)
        carried_some |= got.carried > 0
        if final:
            _reference_final(t_ref, p_ref, tables)
        else:
            _reference_round(t_ref, p_ref, policy, tables)
        assert len(p_new.sent) == len(p_ref.sent), r
        for a, b in zip(p_new.sent, p_ref.sent, strict=True):
            assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3], (r, a[0])
            torch.testing.assert_close(a[2], b[2], rtol=0, atol=0)
        p_new.sent.clear()
        p_ref.sent.clear()
    assert carried_some  # the budget did carry rows across rounds


def _reference_final(tracker: DeltaTracker, pub: Recorder, tables: dict) -> None:
    for fqn, delta in tracker.get_delta("p").items():
        n_tomb = 0 if delta.tombstones is None else int(delta.tombstones.numel())
        if len(delta) or n_tomb:
            sel = select_changed(delta, tables[fqn], wire_dtype=pub.dtype)
            pub.publish(tables[fqn].name, sel.ids, sel.rows, step=0,
                        tombstones=sel.tombstones if n_tomb else None)


class _CountingTable(HashTable):
    """A HashTable that counts the rows read through ``lookup`` (where rounds read)."""

    read = 0

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        type(self).read += int(ids.numel())
        return super().lookup(ids)


def test_a_round_reads_the_changed_rows_and_the_rows_it_takes_not_the_carried_set():
    carried, changed, k = 5000, 20, 50
    model = torch.nn.ModuleDict({"t": _CountingTable(DIM, name="t", capacity=4 * carried)})
    table = model["t"]
    gen = torch.Generator().manual_seed(3)
    table.insert(torch.arange(carried + k), torch.randn(carried + k, DIM, generator=gen))
    tracker = DeltaTracker(model, consumers=["p"], mode=TrackingMode.EMBEDDING)
    policy, pub = SelectionPolicy(k=k), Recorder()

    def move(ids: torch.Tensor) -> None:
        with torch.no_grad():
            table.insert(ids, table(ids) + torch.randn(ids.numel(), DIM, generator=gen))

    move(torch.arange(carried + k))
    # every row changed: a full round (k out, the rest retained in the tracker); the next
    # round reads those retained rows once and carries them from then on
    publish_delta(tracker, pub, "p", policy, step=1)
    move(torch.arange(changed))
    publish_delta(tracker, pub, "p", policy, step=2)
    for step in range(3, 6):
        move(torch.randint(0, carried + k, (changed,), generator=gen).unique())
        _CountingTable.read = 0
        rnd = publish_delta(tracker, pub, "p", policy, step=step)
        assert rnd.published == k and rnd.carried >= carried - step * k
        # the changed rows are scored, the k taken rows read to be published: nothing else
        assert _CountingTable.read <= changed + k, _CountingTable.read


class _FailingReads(HashTable):
    """A HashTable whose ``lookup`` raises while ``broken`` is set (a table read failing)."""

    broken = False

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if type(self).broken:
            raise RuntimeError("table read failed")
        return super().lookup(ids)


def test_a_round_whose_table_read_fails_loses_no_carried_row(monkeypatch):
    monkeypatch.setattr(carried_select, "TAKE_SHARE", 0)  # every round from carried rows
    n, k = 200, 10
    model = torch.nn.ModuleDict({"t": _FailingReads(DIM, name="t", capacity=4 * n)})
    table = model["t"]
    table.insert(torch.arange(n), torch.randn(n, DIM, generator=torch.Generator().manual_seed(5)))
    tracker = DeltaTracker(model, consumers=["p"], mode=TrackingMode.EMBEDDING)
    with torch.no_grad():
        table.insert(torch.arange(n), table(torch.arange(n)) + 1.0)
    pub = Recorder()
    first = publish_delta(tracker, pub, "p", SelectionPolicy(k=k), step=1)
    assert (first.published, first.carried) == (k, n - k)
    _FailingReads.broken = True  # no row changed: the round only reads the rows it takes
    try:
        with pytest.raises(RuntimeError, match="table read failed"):
            publish_delta(tracker, pub, "p", SelectionPolicy(k=k), step=2)
    finally:
        _FailingReads.broken = False
    last = publish_delta(tracker, pub, "p", SelectionPolicy(k=k), step=3, final=True)
    assert last.published == n - k
    assert sorted(i for _, ids, _, _ in pub.sent for i in ids) == list(range(n))


class _FailsOnce(Recorder):
    """A recorder whose ``fail_at``-th publish call raises PublishError (nothing sent)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.calls, self.fail_at = 0, fail_at

    def publish(self, table, ids, rows, **kw):
        self.calls += 1
        if self.calls == self.fail_at:
            raise PublishError("broker gone")
        return super().publish(table, ids, rows, **kw)


def test_a_failed_publish_from_carried_rows_hands_back_every_row(monkeypatch):
    """Rounds from carried rows (three tables); the second table's publish fails: its
    selection and the third table's changed rows go back, the carried rows stay carried,
    and a final round publishes every row with its last value."""
    monkeypatch.setattr(carried_select, "TAKE_SHARE", 0)
    n, k = 120, 7
    model = twin_model(n, seed=4)
    model["w"] = HashTable(DIM, name="w", capacity=8 * n)
    model["w"].insert(torch.arange(n), torch.randn(n, DIM))
    before = {name: dict(zip(model[name].ids().tolist(), model[name].lookup(model[name].ids()),
                             strict=True)) for name in ("u", "v", "w")}
    tracker = DeltaTracker(model, consumers=["p"], mode=TrackingMode.EMBEDDING)
    rng = np.random.default_rng(4)
    plan = random_steps(rng, n, rounds=4, steps=2)
    pub = _FailsOnce(fail_at=3 * 2 + 2)  # round 3, table "v"
    for r, rnd in enumerate(plan):
        for step in rnd:
            apply_step(model, tracker, {**step, "w": step["u"]})
        if r == 2:
            with pytest.raises(PublishError, match="broker gone") as info:
                publish_delta(tracker, pub, "p", SelectionPolicy(k=k), step=r)
            assert any("retained for the next round" in note for note in info.value.__notes__)
        else:
            publish_delta(tracker, pub, "p", SelectionPolicy(k=k), step=r)
    publish_delta(tracker, pub, "p", SelectionPolicy(k=k), step=9, final=True)
    assert publish_delta(tracker, pub, "p", SelectionPolicy(k=k), step=10).tables == ()
    looked_up = {name: {int(i) for rnd in plan for step in rnd for i in step[src][0]}
                 for name, src in (("u", "u"), ("v", "v"), ("w", "u"))}
    for name in ("u", "v", "w"):  # every row moved after a lookup: its value now went last
        last: dict[int, torch.Tensor] = {}
        for table, ids, rows, _ in pub.sent:
            if table == name:
                last.update(zip(ids, rows, strict=True))
        live = model[name].ids()
        changed = 0
        for i, row in zip(live.tolist(), model[name].lookup(live), strict=True):
            if i not in looked_up[name] or (i in before[name]
                                            and torch.equal(before[name][i], row)):
                continue
            changed += 1
            torch.testing.assert_close(last[i], row, rtol=0, atol=0)
        assert changed > 2 * k, name
