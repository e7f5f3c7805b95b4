"""deltastream-replay dump and stats show dense-weights messages next to rows: kind,
version, tensor and chunk per line; one ``/dense`` stream per shard in stats, with its
versions, seqs and a damaged chunk counted as undecodable."""

from __future__ import annotations

import json

import numpy as np
import pytest
from kafka import KafkaProducer

from consumers.replay import dump, stats
from consumers.replay.cli import main
from deltastream.dense_wire import STREAM
from deltastream.publishing.publisher import DeltaPublisher, ensure_topic

pytestmark = pytest.mark.integration


@pytest.fixture
def mixed(broker, topic_name):
    """Rows of table "user", two dense versions (a full one cut in chunks, a partial one)
    and a damaged record that says it is dense."""
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 50)).astype(np.float32)
    b = rng.standard_normal(50).astype(np.float32)
    with DeltaPublisher(servers, topic_name, model="m", shard=0, dtype="f32",
                        max_message_bytes=4096) as pub:
        pub.publish("user", np.arange(3), np.ones((3, 4), np.float32), step=1)
        full = pub.publish_dense({"mlp.w": w, "mlp.b": b}, step=2)
        part = pub.publish_dense({"mlp.b": b + 1}, step=4, base_step=2, dtype="bf16")
    prod = KafkaProducer(bootstrap_servers=servers)
    prod.send(topic_name, value=b"\xde\x00\x14not dense at all", headers=[("kind", b"dense")])
    prod.flush()
    prod.close()
    return servers, topic_name, full, part, w


def test_dump_shows_dense_chunks_with_their_version_tensor_and_chunk(mixed):
    servers, topic, full, part, w = mixed
    lines = list(dump(servers, topic))
    kinds = [x["kind"] for x in lines]
    assert kinds.count("rows") == 1
    assert kinds.count("dense") == full.messages + part.messages + 1
    dense = [x for x in lines if x["kind"] == "dense" and "error" not in x]
    assert [x["seq"] for x in dense] == list(range(len(dense)))
    assert {(x["step"], x["full"], x["base_step"]) for x in dense} == {(2, True, 2),
                                                                       (4, False, 2)}
    first = [x for x in dense if x["step"] == 2]
    assert [x["index"] for x in first] == list(range(first[0]["chunks"]))
    assert {x["name"] for x in first} == {"mlp.w", "mlp.b"} and first[0]["tensors"] == 2
    assert sum(x["n"] for x in first if x["name"] == "mlp.w") == w.size
    assert {tuple(x["shape"]) for x in first if x["name"] == "mlp.w"} == {(40, 50)}
    assert all(x["table"] == STREAM for x in dense)
    (bad,) = [x for x in lines if "error" in x]
    assert bad["kind"] == "dense" and bad["error"].startswith("key 0")  # named, not misread
    # values with --rows: the chunk's float32 values, as decode_dense gives them
    with_values = [x for x in dump(servers, topic, rows=True, tables=[STREAM])
                   if "error" not in x]
    assert {x["kind"] for x in with_values} == {"dense"}
    got = np.concatenate([x["values"] for x in with_values if x["name"] == "mlp.w"])
    np.testing.assert_array_equal(got, w.reshape(-1))


def test_stats_lists_the_dense_stream_with_its_versions(mixed, capsys):
    servers, topic, full, part, _ = mixed
    st = stats(servers, topic)
    streams = {s.table: s for s in st.streams}
    assert set(streams) == {"user", STREAM}
    d = streams[STREAM]
    assert (d.messages, d.versions, d.full_versions) == (full.messages + part.messages, 2, 1)
    assert (d.gaps, d.duplicates, d.step_min, d.step_max) == (0, 0, 2, 4)
    assert sorted(d.dtypes) == ["bf16", "f32"] and d.rows == 0
    assert streams["user"].versions == 0 and streams["user"].rows == 3
    assert st.undecodable == 1
    only = stats(servers, topic, tables=["user"])
    assert [s.table for s in only.streams] == ["user"]
    assert main(["stats", "--bootstrap-servers", servers, "--topic", topic, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {s["table"]: s["versions"] for s in out["streams"]} == {"user": 0, STREAM: 2}
