"""The README's trainer example runs as written (against the embedded broker)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.integration


def test_trainer_example_runs_and_publishes(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "DeltaTracker(" in b and "EmbeddedBroker" in b)
    script = tmp_path / "example.py"
    script.write_text(example)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    stats = ast.literal_eval(out.stdout.strip().splitlines()[-1])  # the example prints stats()
    # 100 budget ticks of 8 KB (each pays for rows of at least one of the two tables) and
    # the final flush, each at most one publish per table
    assert 101 <= stats["publishes"] <= 2 * 101 and stats["rows"] > 0
    assert stats["failed_messages"] == 0 and stats["acked_messages"] == stats["messages"]
