"""A predictor's base: one snapshot or several (merged); another topic's is refused unless
asked for; one that records no topic is accepted with a warning."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from consumers.serving.table import ServingTable
from consumers.storage.snapshot import write_snapshot
from consumers.sync.base_snapshot import read_base


def _snap(path, ids, *, topic="deltas.m", model="m", partition=0):
    ids = np.asarray(ids, np.int64)
    t = ServingTable.from_arrays("user", ids, np.ones((ids.size, 2), np.float32))
    meta = {k: v for k, v in (("topic", topic), ("model", model)) if v is not None}
    write_snapshot(path, tables={"user": t}, offsets={partition: 3}, seqs={}, meta=meta)
    return path


def test_one_or_several_bases(tmp_path):
    a = _snap(tmp_path / "a", [0, 2])
    b = _snap(tmp_path / "b", [1], partition=1)
    assert len(read_base(a, model="m", topic="deltas.m").tables["user"]) == 2
    both = read_base([a, b], model="m", topic="deltas.m")
    assert len(both.tables["user"]) == 3 and both.offsets == {0: 3, 1: 3}


def test_another_topic_is_refused_naming_both(tmp_path):
    a = _snap(tmp_path / "a", [0], topic="deltas.demo")
    with pytest.raises(ValueError) as e:
        read_base(a, model="m", topic="deltas.ctr")
    assert "'deltas.demo'" in str(e.value) and "'deltas.ctr'" in str(e.value)
    assert "--base-any-topic" in str(e.value)
    assert len(read_base(a, model="m", topic="deltas.ctr", any_topic=True).tables) == 1


def test_another_model_is_refused(tmp_path):
    a = _snap(tmp_path / "a", [0], model="other")
    with pytest.raises(ValueError, match="model 'other'.*model 'm'"):
        read_base(a, model="m", topic="deltas.m")


def test_no_recorded_topic_is_accepted_with_a_warning(tmp_path, caplog):
    a = _snap(tmp_path / "a", [0], topic=None)
    saved = tmp_path / "saved"
    ServingTable.from_arrays("item", np.array([5]), np.ones((1, 2), np.float32)).save(saved)
    with caplog.at_level(logging.WARNING, logger="consumers.sync.base_snapshot"):
        snap = read_base([a, saved], model="m", topic="deltas.m")
    assert set(snap.tables) == {"user", "item"}
    warned = [r.getMessage() for r in caplog.records if "records no topic" in r.getMessage()]
    assert len(warned) == 2 and "'deltas.m'" in warned[0]


@pytest.mark.parametrize("base", [[], [1], 3])
def test_bad_base_arguments(base):
    with pytest.raises(ValueError, match="base: expected"):
        read_base(base, model="m", topic="t")


def test_not_a_snapshot(tmp_path):
    with pytest.raises(ValueError, match="holds no snapshot"):
        read_base(tmp_path, model="m", topic="t")
