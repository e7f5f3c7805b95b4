"""A predictor's base: one snapshot or several (merged); another topic's is refused unless
asked for; one that records no topic is accepted with a warning."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from consumers.dense_assembly import DenseAssembler
from consumers.errors import SnapshotError
from consumers.serving.table import ServingTable
from consumers.storage.merge import merge_snapshots
from consumers.storage.snapshot import read_snapshot, write_snapshot
from consumers.sync.base_snapshot import read_base
from deltastream.dense_wire import chunk_version, decode_dense, encode_dense


def _snap(path, ids, *, topic="deltas.m", model="m", partition=0, dense=None):
    ids = np.asarray(ids, np.int64)
    t = ServingTable.from_arrays("user", ids, np.ones((ids.size, 2), np.float32))
    meta = {k: v for k, v in (("topic", topic), ("model", model)) if v is not None}
    write_snapshot(path, tables={"user": t}, offsets={partition: 3}, seqs={}, meta=meta,
                   dense=dense)
    return path


def _dense_state(shard: int, step: int) -> tuple[bytes, np.ndarray]:
    """An assembler's state serving one version of ``shard`` at ``step``, and its tensor."""
    w = np.full((3, 2), float(step), np.float32)
    a = DenseAssembler()
    for m in encode_dense(chunk_version({"mlp.0.weight": w}, model="m", shard=shard, epoch=1,
                                        seq=0, step=step, ts=1, max_message_bytes=4096)):
        a.offer(decode_dense(m))
    return a.state(), w


def test_merged_bases_keep_the_dense_state_of_each_trainer_shard(tmp_path):
    d0, w0 = _dense_state(0, 7)
    d1, w1 = _dense_state(1, 9)
    a = _snap(tmp_path / "a", [0, 2], dense=d0)
    b = _snap(tmp_path / "b", [1], partition=1)
    c = _snap(tmp_path / "c", [5], partition=2, dense=d1)
    one = DenseAssembler.from_state(read_base([a, b], model="m", topic="deltas.m").dense)
    assert one.view(0).step == 7 and np.array_equal(one.view(0)["mlp.0.weight"], w0)
    both = DenseAssembler.from_state(read_base([a, b, c], model="m", topic="deltas.m").dense)
    assert {s: v.step for s, v in both.views().items()} == {0: 7, 1: 9}
    assert np.array_equal(both.view(1)["mlp.0.weight"], w1)
    # without a way to join two dense states the merge refuses, never drops them
    with pytest.raises(SnapshotError, match="each hold dense versions' state"):
        merge_snapshots([read_snapshot(a), read_snapshot(c)])


def test_merged_bases_with_one_shards_dense_state_twice_are_refused(tmp_path):
    a = _snap(tmp_path / "a", [0], dense=_dense_state(0, 7)[0])
    b = _snap(tmp_path / "b", [1], partition=1, dense=_dense_state(0, 8)[0])
    with pytest.raises(SnapshotError, match="dense shard 0 has state in both .*a and .*b"):
        read_base([a, b], model="m", topic="deltas.m")


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
