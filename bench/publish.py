"""Publish throughput: DeltaPublisher vs a raw KafkaProducer sending the same messages.

Both send to an embedded broker this bench starts (or ``--bootstrap-servers``), one
partition each, with identical producer settings (the publisher's own ``producer_config``:
idempotent, ``acks="all"``, same ``max_request_size``/timeouts/compression).

* value: ``DeltaPublisher.publish`` of float32 rows in batches of ``--batch-rows`` rows,
  then ``flush()``: includes argument checks, the f32→f16 cast, splitting, wire encoding
  and the sends. ``--input torch`` (default; what a trainer hands over) passes CPU
  tensors, ``--input numpy`` numpy arrays in a process without torch (numpy's f32→f16
  cast is several times slower than torch's).
* baseline: ``KafkaProducer.send`` of the very same messages pre-encoded before timing
  (same sizes, keys and headers), then ``flush()``.

Figures: ``publish.rows_per_s`` (goal ratio ≥ 0.8) and ``publish.mb_per_s`` (wire MB/s,
same ratio, report only). Runs alternate publisher and raw producer ``--rounds`` times
(fresh topics each round); the best round of each counts.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
import uuid

import numpy as np

from bench._common import result
from deltastream import wire
from deltastream.publishing.publisher import DeltaPublisher, ensure_topic

__all__ = ["main"]


def _run_publisher(pub: DeltaPublisher, inputs: list, ts: int) -> tuple[float, int]:
    """Seconds to publish every batch and flush; wire bytes sent."""
    t0 = time.perf_counter()
    sent = 0
    for step, (ids, rows) in enumerate(inputs):
        sent += pub.publish("emb", ids, rows, step=step, ts=ts).bytes
    pub.flush()
    return time.perf_counter() - t0, sent


def _run_raw(raw, topic: str, key: bytes, pre: list) -> float:
    """Seconds to send the pre-encoded messages and flush."""
    t0 = time.perf_counter()
    for value, headers in pre:
        raw.send(topic, value=value, key=key, headers=headers, partition=0)
    raw.flush()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="deltastream bench publish", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bootstrap-servers", default=None,
                   help="Kafka to use; default: start an embedded broker")
    p.add_argument("--rows", type=int, default=400_000, help="rows per timed run")
    p.add_argument("--batch-rows", type=int, default=50_000, help="rows per publish() call")
    p.add_argument("--dim", type=int, default=64, help="row width")
    p.add_argument("--dtype", default="f16", choices=sorted(wire.DTYPES), help="wire dtype")
    p.add_argument("--input", default="torch", choices=["torch", "numpy"],
                   help="rows handed to publish(): CPU torch tensors or numpy arrays")
    p.add_argument("--input-dtype", default="f32", choices=["f32", "f16"],
                   help="dtype of the rows handed to publish()")
    p.add_argument("--max-message-bytes", type=int, default=1 << 20)
    p.add_argument("--compression", default=None, choices=["gzip", "snappy", "lz4", "zstd"])
    p.add_argument("--rounds", type=int, default=5, help="alternating timed rounds")
    args = p.parse_args(argv)
    logging.getLogger("kafka").setLevel(logging.ERROR)

    rng = np.random.default_rng(0)
    n_batches = max(1, args.rows // args.batch_rows)
    in_dt = np.float32 if args.input_dtype == "f32" else np.float16
    batches = []
    for b in range(n_batches):
        ids = np.arange(b * args.batch_rows, (b + 1) * args.batch_rows, dtype=np.int64)
        rows = rng.standard_normal((args.batch_rows, args.dim), dtype=np.float32).astype(in_dt)
        batches.append((ids, rows))
    inputs = batches
    if args.input == "torch":
        import torch

        inputs = [(torch.from_numpy(i), torch.from_numpy(r)) for i, r in batches]
    rows_total = n_batches * args.batch_rows

    with contextlib.ExitStack() as stack:
        servers = args.bootstrap_servers
        if servers is None:
            from deltastream.broker import EmbeddedBroker

            servers = stack.enter_context(EmbeddedBroker()).bootstrap_servers
        from kafka import KafkaProducer

        t_pub = t_raw = float("inf")
        wire_bytes = messages = 0
        for rnd in range(max(1, args.rounds)):
            topic_pub = f"bench.publish.{uuid.uuid4().hex[:8]}"
            topic_raw = f"bench.raw.{uuid.uuid4().hex[:8]}"
            for t in (topic_pub, topic_raw):
                ensure_topic(servers, t, 1, max_message_bytes=args.max_message_bytes)

            pub = DeltaPublisher(servers, topic_pub, model="bench", shard=0, dtype=args.dtype,
                                 max_message_bytes=args.max_message_bytes,
                                 compression=args.compression)
            # Pre-encode what the publisher will send (same seqs, sizes, keys, headers).
            limit = pub.max_value_bytes("emb")
            ts = time.time_ns()
            pre = []
            seq = 0
            for step, (ids, rows) in enumerate(batches):
                batch = wire.DeltaBatch(model="bench", table="emb", shard=0, epoch=pub.epoch,
                                        seq=seq, step=step, ts=ts, ids=ids, rows=rows,
                                        dtype=args.dtype)
                for piece in wire.split(batch, limit):
                    pre.append((wire.encode(piece, max_message_bytes=limit)[0],
                                wire.kafka_headers(piece)))
                seq += len(wire.split(batch, limit))
            key = wire.message_key("bench", "emb", 0)
            raw = KafkaProducer(bootstrap_servers=servers, **pub.producer_config)
            try:
                # warm both connections and metadata outside the timing
                pub.publish("warm", ids[:1], rows[:1], step=0)
                pub.flush()
                raw.send(topic_raw, value=b"warm", key=key, partition=0).get(timeout=30)

                if rnd % 2:  # alternate who goes first (the broker's memory grows)
                    t_raw = min(t_raw, _run_raw(raw, topic_raw, key, pre))
                    t, sent = _run_publisher(pub, inputs, ts)
                else:
                    t, sent = _run_publisher(pub, inputs, ts)
                    t_raw = min(t_raw, _run_raw(raw, topic_raw, key, pre))
                t_pub = min(t_pub, t)
            finally:
                raw.close()
                pub.close()
            assert sent == sum(len(v) for v, _ in pre), "publisher and baseline sizes differ"
            wire_bytes, messages = sent, len(pre)

    common = dict(dim=args.dim, dtype=args.dtype, input=args.input,
                  input_dtype=args.input_dtype,
                  rows=rows_total, batch_rows=args.batch_rows, messages=messages,
                  message_bytes=args.max_message_bytes, compression=args.compression,
                  wire_mb=round(wire_bytes / 1e6, 2), broker=args.bootstrap_servers or
                  "embedded (Tansu, in-memory)",
                  baseline_is="raw KafkaProducer.send of the same pre-encoded messages, "
                              "same producer settings, then flush()")
    mb = wire_bytes / 1e6
    return [
        result("publish.rows_per_s", rows_total / t_pub, rows_total / t_raw, 0.8, "rows/s",
               **common),
        result("publish.mb_per_s", mb / t_pub, mb / t_raw, None, "MB/s", **common),
    ]


if __name__ == "__main__":
    from bench._common import emit

    emit(main(), False)
