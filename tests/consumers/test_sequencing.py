"""SeqTracker: ok / duplicate / gap / new_epoch / stale_epoch, and state round trip."""

from __future__ import annotations

import json

import pytest

from consumers.sequencing import SeqTracker, SeqVerdict


def test_first_message_is_ok_whatever_its_seq():
    tr = SeqTracker()
    assert tr.check("emb", 0, 3, 0) == SeqVerdict("ok")
    assert tr.check("emb", 0, 3, 17) == SeqVerdict("ok")  # e.g. started from a snapshot
    assert tr.get("emb", 0) is None  # check changes nothing
    assert len(tr) == 0


def test_in_order_duplicates_and_gaps():
    tr = SeqTracker()
    tr.commit("emb", 0, 1, 0)
    assert tr.check("emb", 0, 1, 1) == SeqVerdict("ok")
    tr.commit("emb", 0, 1, 1)
    assert tr.check("emb", 0, 1, 1).kind == "duplicate"
    assert tr.check("emb", 0, 1, 0).kind == "duplicate"
    v = tr.check("emb", 0, 1, 5)
    assert v == SeqVerdict("gap", (2, 4)) and v.accept
    tr.commit("emb", 0, 1, 5)
    assert tr.check("emb", 0, 1, 3).kind == "duplicate"  # late arrival after a gap
    assert tr.check("emb", 0, 1, 6) == SeqVerdict("ok")
    assert not tr.check("emb", 0, 1, 5).accept


def test_epochs():
    tr = SeqTracker()
    tr.commit("emb", 2, 5, 40)
    v = tr.check("emb", 2, 6, 0)
    assert v == SeqVerdict("new_epoch") and v.missing is None and v.accept
    assert tr.check("emb", 2, 9, 3) == SeqVerdict("new_epoch", (0, 2))
    assert tr.check("emb", 2, 4, 100).kind == "stale_epoch"
    assert not tr.check("emb", 2, 4, 100).accept
    tr.commit("emb", 2, 6, 0)
    assert tr.check("emb", 2, 5, 41).kind == "stale_epoch"  # the old trainer is a zombie
    assert tr.check("emb", 2, 6, 1).kind == "ok"


def test_streams_are_independent():
    tr = SeqTracker()
    tr.commit("a", 0, 1, 10)
    assert tr.check("a", 1, 1, 0).kind == "ok"
    assert tr.check("b", 0, 1, 0).kind == "ok"
    assert tr.check("a", 0, 1, 11).kind == "ok"


def test_state_round_trip_is_json():
    tr = SeqTracker()
    tr.commit("user/emb", 0, 1, 10)
    tr.commit("item", 3, 2, 0)
    st = json.loads(json.dumps(tr.state()))
    tr2 = SeqTracker.from_state(st)
    assert tr2.state() == tr.state()
    assert tr2.check("user/emb", 0, 1, 10).kind == "duplicate"
    assert tr2.check("item", 3, 2, 2) == SeqVerdict("gap", (1, 1))
    assert len(SeqTracker.from_state({})) == 0


@pytest.mark.parametrize("bad", [
    {"version": 2, "streams": []},
    {"streams": []},
    {"version": 1, "streams": [{"table": "a", "shard": -1, "epoch": 0, "seq": 0}]},
    {"version": 1, "streams": [{"shard": 0, "epoch": 0, "seq": 0}]},
    [1, 2],
])
def test_from_state_rejects_malformed(bad):
    with pytest.raises(ValueError):
        SeqTracker.from_state(bad)


def test_arguments_validated():
    tr = SeqTracker()
    with pytest.raises(ValueError, match="seq"):
        tr.check("a", 0, 0, -1)
    with pytest.raises(ValueError, match="epoch"):
        tr.commit("a", 0, True, 0)


def test_steps_are_recorded_and_survive_the_state():
    tr = SeqTracker()
    tr.commit("user", 0, 1, 0, step=10)
    tr.commit("user", 0, 1, 1)  # a message without a step keeps the recorded one
    tr.commit("item", 1, 1, 0, step=12)
    assert tr.steps() == {("user", 0): 10, ("item", 1): 12}
    again = SeqTracker.from_state(tr.state())
    assert again.steps() == tr.steps() and again.get("user", 0) == (1, 1)
    old = {"version": 1, "streams": [{"table": "user", "shard": 0, "epoch": 1, "seq": 3}]}
    assert SeqTracker.from_state(old).steps() == {}  # a state written before steps
