"""bench._transport: varint sizes at every 7-bit boundary, sorted-delta ids, the id mix, and
the byte split and compression of real wire messages."""

from __future__ import annotations

import numpy as np
import pytest

from bench import _transport
from deltastream import wire


def test_varint_sizes_at_each_boundary():
    for k in range(1, 10):
        edge = np.array([2 ** (7 * k) - 1, 2 ** (7 * k)], dtype=np.uint64)
        assert _transport.varint_bytes(edge[:1]) == k
        assert _transport.varint_bytes(edge[1:]) == k + 1
    assert _transport.varint_bytes(np.array([0, 2 ** 64 - 1], dtype=np.uint64)) == 1 + 10
    # sorted: 3, then gaps 2 and 195 -> 1 + 1 + 2 bytes, whatever the order given
    assert _transport.delta_varint_bytes(np.array([200, 3, 5])) == 4
    assert _transport.delta_varint_bytes(np.array([], dtype=np.int64)) == 0


def test_mix64_is_one_to_one_and_spreads_dense_ids():
    ids = np.arange(10_000, dtype=np.int64)
    mixed = _transport.mix64(ids)
    assert np.unique(mixed).size == ids.size
    assert (mixed >> np.uint64(56)).astype(np.int64).std() > 50  # high byte used, not 0
    assert _transport.delta_varint_bytes(ids) < 1.1 * ids.size  # gaps of 1: one byte each
    assert _transport.delta_varint_bytes(mixed) > 7 * ids.size


def _message(ids: np.ndarray, dim: int, dtype: str, step: int,
             version: int = 2) -> tuple[int, str, bytes]:
    rows = np.random.default_rng(step).normal(size=(ids.size, dim)).astype(np.float32)
    batch = wire.DeltaBatch(model="m", table=f"t{dim}", shard=0, epoch=1, seq=step, step=step,
                            ts=step, ids=ids, rows=rows, dtype=dtype)
    (msg,) = wire.encode(batch, version=version)
    return step, batch.table, msg


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("dtype", ["f16", "i8"])
def test_summary_splits_every_byte_and_compresses_each_message(dtype, version):
    from kafka import codec

    ids = [np.arange(0, 400, 2, dtype=np.int64), np.array([7, 3], dtype=np.int64),
           np.arange(50, dtype=np.int64)]
    msgs = [_message(ids[0], 8, dtype, 1, version), _message(ids[1], 1, dtype, 1, version),
            _message(ids[2], 8, dtype, 2, version)]
    t = _transport.summarize(msgs)
    assert t["bytes"] == sum(len(m) for _, _, m in msgs) and t["messages"] == 3
    assert t["rows"] == 252 and t["ids_raw"] == 8 * 252
    assert t["ids"] == sum(wire.id_bytes(np.sort(i), version) for i in ids)
    assert (t["ids"] < t["ids_raw"]) == (version == 3)
    scale = 4 * 252 if dtype == "i8" else 0
    assert t["rows_bytes"] == (200 * 8 + 2 + 50 * 8) * (1 if dtype == "i8" else 2) + scale
    assert t["other"] == t["bytes"] - t["ids"] - t["rows_bytes"] > 0
    assert t["per_message"]["gzip"] == sum(len(codec.gzip_encode(m)) for _, _, m in msgs)
    steps = [msgs[0][2] + msgs[1][2], msgs[2][2]]
    assert t["per_step"]["gzip"] == sum(len(codec.gzip_encode(b)) for b in steps)
    # the same messages with hashed ids: same length, the ids no longer compress
    assert t["per_message_hashed"]["gzip"] > t["per_message"]["gzip"]
    assert t["by_table"]["t1"] == {"bytes": len(msgs[1][2]), "rows": 2,
                                   "ids": wire.id_bytes(ids[1], version)}
