"""``describe_undelivered``: runs of failed messages name their table, shard and ids;
``PublishResult.settled``: a result's outcome that crosses processes."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from deltastream.errors import PublishError
from deltastream.publishing.results import PublishResult, SentMessage, describe_undelivered


def _msg(table: str, shard: int, seq: int, ids: list[int], tombs=None, col: int = 0,
         width=None) -> SentMessage:
    return SentMessage(table, shard, seq, np.array(ids, dtype=np.int64),
                       None if tombs is None else np.array(tombs, dtype=np.int64), col,
                       width, 100, future=None)


def test_runs_are_per_table_and_shard_and_carry_every_id():
    # two column shards of one table, each its own seq stream from 0, interleaved
    records = [_msg("t", 1, 0, [1, 2], col=0, width=8), _msg("t", 2, 0, [1, 2], col=4, width=8),
               _msg("t", 1, 1, [5], tombs=[9], col=0, width=8),
               _msg("t", 2, 1, [5], col=4, width=8), _msg("u", 0, 3, [7])]
    out = describe_undelivered(records, lambda r: "down")
    got = [(u.table, u.shard, u.first_seq, u.last_seq, u.ids.tolist(), u.tombstone_ids.tolist(),
            u.col, u.width) for u in out]
    assert got == [("t", 1, 0, 1, [1, 2, 5], [9], 0, 8), ("t", 2, 0, 1, [1, 2, 5], [], 4, 8),
                   ("u", 0, 3, 3, [7], [], 0, None)]
    assert [(u.rows, u.tombstones) for u in out] == [(3, 1), (3, 0), (1, 0)]


def test_a_gap_or_another_reason_starts_a_new_run():
    records = [_msg("t", 0, 0, [1]), _msg("t", 0, 2, [2]), _msg("t", 0, 3, [3])]
    out = describe_undelivered(records, lambda r: "late" if r.seq == 3 else "down")
    assert [(u.first_seq, u.last_seq, u.ids.tolist(), u.reason) for u in out] == [
        (0, 0, [1], "down"), (2, 2, [2], "down"), (3, 3, [3], "late")]


class _Future:
    """A producer future's outcome (pure logic: no producer here)."""

    def __init__(self, offset=None, exception=None, done=True):
        self.is_done, self.exception = done, exception
        self.value = SimpleNamespace(offset=offset)


def _result(*futures) -> PublishResult:
    res = PublishResult("t", 0, 1, 0, -1, 0, 0, 0, 0)
    for seq, f in enumerate(futures):
        res.add(SentMessage("t", 0, seq, np.array([seq], dtype=np.int64), None, 0, None, 10, f))
    return res


def test_a_settled_result_pickles_with_its_offsets():
    back = pickle.loads(pickle.dumps(_result(_Future(7), _Future(8)).settled()))
    assert back.offsets == [7, 8] and back.done and back.wait(0) is back
    assert (back.first_seq, back.last_seq, back.messages, back.rows) == (0, 1, 2, 2)


def test_a_settled_result_keeps_a_failure_and_a_message_still_in_flight():
    back = pickle.loads(pickle.dumps(_result(
        _Future(7), _Future(exception=PublishError("broker down")), _Future(done=False))
        .settled()))
    assert back.offsets is None
    with pytest.raises(PublishError, match="not fully delivered") as e:
        back.wait(0)
    reasons = sorted(u.reason for u in e.value.undelivered)
    assert len(reasons) == 2 and "broker down" in reasons[0] and "settled" in reasons[1]
