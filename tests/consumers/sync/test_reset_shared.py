"""``reset_state`` also removes the shared copies of the old state (issue 27, item 9):
the shm files of a daemon killed before the reset, only those deltastream wrote."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from consumers.serving.shm import shm_root, table_dir
from consumers.sync import SyncDaemon

REPO = Path(__file__).resolve().parents[3]


def test_reset_state_removes_the_old_tables_shared_files(tmp_path):
    state = tmp_path / "state"
    code = ("import numpy as np, time; from consumers.serving.table import ServingTable; "
            "ts = [ServingTable(n, 4) for n in ('old', 'kept')]; "
            "[t.upsert(np.arange(3), np.ones((3, 4), np.float32)) for t in ts]; "
            f"[t.share({str(state)!r}) for t in ts]; print('up', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGKILL)  # its files stay in /dev/shm
    proc.wait()
    mine = table_dir(state, "kept") / "mine.txt"
    mine.write_text("not deltastream's")
    try:
        d = SyncDaemon("127.0.0.1:9", "deltas.m", model="m", state_dir=state,
                       request_timeout=0.5, reset_state=True, share_tables=True,
                       tables={"new": 4})
        d.close()
        assert not table_dir(state, "old").exists()
        assert sorted(p.name for p in table_dir(state, "kept").iterdir()) == ["mine.txt"]
        assert not table_dir(state, "new").exists()  # unshared on stop
    finally:
        mine.unlink()
        table_dir(state, "kept").rmdir()
        shm_root(state).rmdir()
