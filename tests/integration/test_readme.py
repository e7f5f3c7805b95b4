"""The README's trainer examples run as written (against the embedded broker): one with
HashTables and deltastream's sparse optimizer, one with nn.Embedding / nn.EmbeddingBag
trained by torch.optim.Adam behind a wrapper."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.integration


def _examples() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return [b for b in blocks if "DeltaTracker(" in b and "EmbeddedBroker" in b]


def test_readme_has_a_hashtable_and_an_nn_embedding_example():
    examples = _examples()
    assert len(examples) == 2
    assert "HashTable(" in examples[0] and "torch.nn.Embedding(" in examples[1]
    assert all("publish_delta(" in e and "get_submodule" not in e for e in examples)


@pytest.mark.parametrize("which,paths", [
    (0, {"user": "lookups", "item": "lookups"}),
    (1, {"user": "scan", "history": "scan"}),
])
def test_trainer_example_runs_and_publishes(tmp_path, which, paths):
    script = tmp_path / "example.py"
    script.write_text(_examples()[which])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    *_, path_line, stats_line = out.stdout.strip().splitlines()
    assert ast.literal_eval(path_line) == paths  # the example prints the tracker's paths
    stats = ast.literal_eval(stats_line)  # and the publisher's stats()
    assert stats["publishes"] >= 20 and stats["rows"] > 0
    assert stats["failed_messages"] == 0 and stats["acked_messages"] == stats["messages"]
    assert set(stats["next_seq"]) == set(paths)  # published under the tables' names
