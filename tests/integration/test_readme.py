"""The README's snippets run as written: the trainer examples (their own embedded broker) —
one with HashTables and deltastream's sparse optimizer, one with nn.Embedding /
nn.EmbeddingBag trained by torch.optim.Adam behind a wrapper — and the predictor snippet
(against the session broker, on a topic with data); its metrics table lists every metric the
daemon exports."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.integration


def _examples() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return [b for b in blocks if "DeltaTracker(" in b and "EmbeddedBroker" in b
            and "DistributedModelParallel(" not in b]  # TorchRec's: test_torchrec_readme


def test_readme_has_a_hashtable_and_an_nn_embedding_example():
    examples = _examples()
    assert len(examples) == 2
    assert "HashTable(" in examples[0] and "torch.nn.Embedding(" in examples[1]
    # one publishes through the byte budget, one in fixed rounds; neither resolves tables by hand
    assert "BudgetPublisher(" in examples[0] and "publish_delta(" in examples[1]
    assert all("get_submodule" not in e for e in examples)


@pytest.mark.parametrize("which,paths,publishes", [
    # 100 budget ticks of 8 KB and the final flush, each at most one round of one publish
    # per table; ticks that find the worker busy coalesce into the next round, so at
    # least the final flush's two
    (0, {"user": "lookups", "item": "lookups"}, (2, 2 * 101)),
    # fixed rounds every 10 steps: a publish per table each
    (1, {"user": "scan", "history": "scan"}, (20, float("inf"))),
])
def test_trainer_example_runs_and_publishes(tmp_path, which, paths, publishes):
    script = tmp_path / "example.py"
    script.write_text(_examples()[which])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    *_, path_line, stats_line = out.stdout.strip().splitlines()
    assert ast.literal_eval(path_line) == paths  # the example prints the tracker's paths
    stats = ast.literal_eval(stats_line)  # and the publisher's stats()
    assert publishes[0] <= stats["publishes"] <= publishes[1] and stats["rows"] > 0
    assert stats["failed_messages"] == 0 and stats["acked_messages"] == stats["messages"]
    assert set(stats["next_seq"]) == set(paths)  # published under the tables' names


def test_daemon_example_runs_against_a_topic_with_data(broker, topic_name, tmp_path):
    """The predictor snippet, with the broker, topic and state directory substituted."""
    import numpy as np

    from consumers.storage.snapshot import read_snapshot
    from deltastream.publishing.publisher import DeltaPublisher, ensure_topic

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "SyncDaemon(" in b
                   and "DistributedModelParallel(" not in b)
    ensure_topic(broker.bootstrap_servers, topic_name, 1)
    ids = np.array([3, 14, 159, 2000], np.int64)
    rows = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    with DeltaPublisher(broker.bootstrap_servers, topic_name, model="ctr", shard=0,
                        dtype="f32") as pub:
        pub.publish("user", ids, rows, step=1)
        pub.publish("item", ids[:2], rows[:2], step=1)
        pub.flush()
    state = tmp_path / "state"
    script = tmp_path / "daemon_example.py"
    script.write_text(example.replace('"kafka:9092"', repr(broker.bootstrap_servers))
                      .replace('"deltas.ctr"', repr(topic_name))
                      .replace('"/var/lib/deltastream"', repr(str(state))))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=README.parent,
                         env={**os.environ, "PYTHONPATH": str(README.parent)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == \
        "(3, 32) 0 0 {'quarantine': 0, 'checkpoint': 0, 'apply': 0}"
    snap = read_snapshot(state / "checkpoint")  # stop() wrote the final checkpoint
    np.testing.assert_array_equal(snap.tables["user"].lookup(ids), rows)


def test_reader_example_runs_against_a_sharing_daemon(broker, topic_name, tmp_path):
    """The TableReader snippet, in its own process, reads what a sharing daemon applied."""
    import threading

    import numpy as np

    from consumers import SyncDaemon
    from deltastream.publishing.publisher import DeltaPublisher, ensure_topic

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "TableReader.open(" in b)
    ensure_topic(broker.bootstrap_servers, topic_name, 1)
    with DeltaPublisher(broker.bootstrap_servers, topic_name, model="ctr", shard=0,
                        dtype="f32") as pub:
        pub.publish("user", np.array([3, 14]), np.ones((2, 32), np.float32), step=1)
        pub.flush()
    state = tmp_path / "state"
    daemon = SyncDaemon(broker.bootstrap_servers, topic_name, model="ctr",
                        state_dir=str(state), share_tables=True)
    threading.Thread(target=daemon.run, daemon=True).start()
    try:
        assert daemon.wait_caught_up(timeout=60)
        script = tmp_path / "reader_example.py"
        script.write_text(example.replace('"/var/lib/deltastream"', repr(str(state))))
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=120, cwd=README.parent,
                             env={**os.environ, "PYTHONPATH": str(README.parent)})
    finally:
        daemon.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "(3, 32) True"


def test_metrics_table_lists_every_metric():
    from consumers.sync.metrics import METRICS

    text = README.read_text()
    missing = [n for n, _, _ in METRICS
               if f"`{n}" not in text and f"`{n[len('deltastream_sync'):]}`" not in text]
    assert missing == []
