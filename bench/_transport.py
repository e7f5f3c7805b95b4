"""What the transport could save on the messages a benchmark sends: Kafka's compression
codecs and cheaper ids, measured on the encoded wire messages themselves.

* **Compression**: each codec of kafka-python (``kafka.codec``: gzip at its level 9, lz4
  frames without linked blocks, zstd and snappy when their libraries are installed) on the
  message bytes, at two granularities — *per message* (every message its own record
  batch: what a producer with ``linger_ms=0`` often sends) and *per step* (the messages of
  one publish round in one batch: the best case of one partition, every table of a shard
  going to ``shard % partitions``). Kafka compresses the records section of a batch (keys,
  headers and values); only the values are compressed here.
* **Ids**: the share of message bytes that are ids (8 bytes each on wire v2; wire v3 sends
  dense ids as ``idv`` varints, and ``ids_raw`` keeps their 8 bytes each), and what
  they would cost sorted, as deltas, as LEB128 varints (the first id as a varint too) —
  both for the ids as sent and for the same ids after a 64-bit mix (splitmix64): dense
  ids give tiny deltas, hashed ids (what large models key tables with) do not. For the
  same reason compression is also measured on the messages with their ids mixed
  (``per_message_hashed``: the id bytes replaced in place, same length): the high zero
  bytes of small dense ids are what a codec finds first.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

import numpy as np

__all__ = ["codecs", "varint_bytes", "delta_varint_bytes", "mix64", "summarize"]

log = logging.getLogger(__name__)


def codecs() -> dict[str, Callable[[bytes], bytes]]:
    """kafka-python's compressors whose libraries are installed, by Kafka's name."""
    from kafka import codec

    out = {"gzip": codec.gzip_encode}
    for name, has, enc in (("lz4", codec.has_lz4, "lz4_encode"),
                           ("zstd", codec.has_zstd, "zstd_encode"),
                           ("snappy", codec.has_snappy, "snappy_encode")):
        if has():
            out[name] = getattr(codec, enc)
    return out


def varint_bytes(values: np.ndarray) -> int:
    """Total bytes of ``values`` (``[n]``, read as uint64) as LEB128 varints (7 bits a
    byte)."""
    v = np.asarray(values).astype(np.uint64)
    # one byte, plus one for each 7-bit boundary the value reaches (2^7, 2^14, ... 2^63)
    return int(v.size + sum(int((v >= np.uint64(1 << (7 * k))).sum()) for k in range(1, 10)))


def delta_varint_bytes(ids: np.ndarray) -> int:
    """Bytes of ``ids`` (``[n]`` int64, any order) sent sorted (as uint64), the first as
    a varint and each next one as the varint of its gap to the previous."""
    s = np.sort(np.asarray(ids).astype(np.uint64))
    if s.size == 0:
        return 0
    return varint_bytes(np.concatenate([s[:1], np.diff(s)]))


def mix64(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of ``ids`` (``[n]`` int64 -> uint64): one-to-one, spreads
    dense ids over the 64-bit range as hashed feature ids are."""
    z = np.asarray(ids).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def summarize(messages: list[tuple[int, str, bytes]]) -> dict:
    """Byte counts of ``messages`` (``(step, table, encoded wire message)``, in send
    order): ``bytes``, ``messages``, ``rows``; ``ids``/``rows_bytes``/``other`` (ids as
    sent, row payload incl. i8 scales, everything else: keys, names, counters, CRC);
    ``ids_raw``: 8 bytes an id;
    ``ids_delta_varint`` and ``ids_hashed_delta_varint`` (per message, see the module
    docstring); ``per_message``/``per_step``/``per_message_hashed``: compressed bytes by
    codec (the last with the ids mixed by :func:`mix64`); ``by_table``:
    bytes, rows and ids per table."""
    from dataclasses import replace

    from deltastream import wire

    out = {"bytes": 0, "messages": len(messages), "rows": 0, "ids": 0, "ids_raw": 0,
           "rows_bytes": 0, "ids_delta_varint": 0, "ids_hashed_delta_varint": 0}
    by_table: dict = defaultdict(lambda: {"bytes": 0, "rows": 0, "ids": 0})
    steps: dict = defaultdict(list)
    hashed = []
    for step, table, msg in messages:
        b = wire.decode(msg)
        ids = np.asarray(b.ids)
        payload = np.asarray(b.rows).nbytes + (0 if b.scale is None else
                                               np.asarray(b.scale).nbytes)
        compact = b"\xa3idv\xc6" in msg  # a v3 message with varint ids
        sent_ids = wire.id_bytes(ids, wire.COMPACT_IDS_VERSION) if compact else int(ids.nbytes)
        out["bytes"] += len(msg)
        out["rows"] += int(ids.size)
        out["ids"] += sent_ids
        out["ids_raw"] += int(ids.nbytes)
        out["rows_bytes"] += payload
        out["ids_delta_varint"] += delta_varint_bytes(ids)
        out["ids_hashed_delta_varint"] += delta_varint_bytes(mix64(ids))
        t = by_table[table]
        t["bytes"] += len(msg)
        t["rows"] += int(ids.size)
        t["ids"] += sent_ids
        steps[step].append(msg)
        if compact:  # the same message re-encoded with its ids mixed (v3 keeps them raw)
            hashed.append(wire.encode(replace(b, ids=mix64(ids).view(np.int64)),
                                      version=wire.COMPACT_IDS_VERSION)[0])
            continue
        raw = ids.astype("<i8").tobytes()
        if raw not in msg:
            raise ValueError(f"{table} step {step}: the ids are not one little-endian bin")
        hashed.append(msg.replace(raw, mix64(ids).astype("<u8").tobytes(), 1))
    out["other"] = out["bytes"] - out["ids"] - out["rows_bytes"]
    out["per_message"], out["per_step"], out["per_message_hashed"] = {}, {}, {}
    for name, enc in codecs().items():
        out["per_message"][name] = sum(len(enc(m)) for _, _, m in messages)
        out["per_step"][name] = sum(len(enc(b"".join(ms))) for ms in steps.values())
        out["per_message_hashed"][name] = sum(len(enc(m)) for m in hashed)
    out["by_table"] = dict(by_table)
    return out
