"""A shared table on a real tmpfs that fills up (a small tmpfs mounted in a private mount
namespace, most of it taken by a filler file): the apply that finds no memory fails with
``OSError`` naming the file and publishes nothing, readers keep reading the last state,
and once space is freed the same batch applies and the table grows on — readers see every
row. Wide rows fill the rows file first; one-column rows fill the index first (its
migration, after a publish, waits for memory and finishes once space is freed)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.disk_faults import mount_namespace

_CHILD = textwrap.dedent("""
    import json, logging, os, sys
    import numpy as np
    from consumers.serving import TableReader
    from consumers.serving.table import ServingTable
    from deltastream.wire import DeltaBatch

    shm, state, dim, filler_mib = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    warnings = []
    h = logging.Handler(logging.WARNING)
    h.emit = lambda rec: warnings.append(rec.getMessage())
    logging.getLogger("consumers").addHandler(h)
    filler = os.path.join(shm, "filler")
    with open(filler, "wb") as f:
        f.write(b"\\1" * (filler_mib << 20))
    t = ServingTable("emb", dim)
    t.share(state, shm_dir=shm)
    r = TableReader.open(state, "emb", shm_dir=shm)
    rows = lambda ids: np.repeat((ids[:, None] % 1000 + 1).astype(np.float32), dim, 1)
    batch = lambda seq: DeltaBatch("b", "emb", 0, 0, seq, seq, 0, ids=ids_of(seq),
                                   rows=rows(ids_of(seq)), dtype="f32")
    ids_of = lambda seq: np.arange(seq * 4096, (seq + 1) * 4096, dtype=np.int64)
    out = {"failed": None, "published_before": 0}
    seq, names = 0, {}
    def index_files():  # name -> inode of every index file there is now
        for e in os.scandir(t.shared):
            if ".idx-" in e.name:
                names.setdefault(e.name, set()).add(e.inode())
    while seq < 2000:
        migrating = t.stats()["index_migrating"]
        try:
            t.apply(batch(seq))
        except OSError as e:
            out["failed"], out["migrating_at_fail"] = str(e), migrating
            break
        index_files()
        seq += 1
    done = np.arange(seq * 4096)
    out["published_before"] = seq
    out["len_after_fail"] = len(t)
    out["old_rows_read"] = bool((r.lookup(done) == rows(done)).all())
    out["failed_ids_absent"] = bool((r.lookup(ids_of(seq)) == 0).all())
    out["warnings"] = warnings[:]
    os.unlink(filler)
    for k in range(seq, seq + 8):  # the failed batch again, then more
        t.apply(batch(k))
        index_files()
    out["reused_names"] = sorted(n for n, inodes in names.items() if len(inodes) > 1)
    done = np.arange((seq + 8) * 4096)
    out["len_end"] = len(t)
    out["all_rows_read"] = bool((r.lookup(done) == rows(done)).all())
    out["table_rows"] = bool((t.lookup(done) == rows(done)).all())
    t.unshare()
    out["left"] = [str(p) for p in __import__("pathlib").Path(shm).rglob("*") if p.is_file()]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("dim,filler_mib", [(64, 20), (1, 26)], ids=["rows", "index"])
def test_a_full_tmpfs_fails_an_apply_cleanly_and_the_table_recovers(tmp_path, dim,
                                                                     filler_mib):
    ns = mount_namespace()
    mnt, state = tmp_path / "shm", tmp_path / "state"
    mnt.mkdir()
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        ns + ["sh", "-c", f"mount -t tmpfs -o size=32m tmpfs {mnt} && exec \"$0\" -c \"$1\" "
              f"{mnt} {state} {dim} {filler_mib}", sys.executable, _CHILD],
        capture_output=True, text=True, timeout=120, cwd=repo, env={"PYTHONPATH": str(repo)})
    if proc.returncode != 0 and "mount" in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["published_before"] > 0, out  # the table grew before the tmpfs was full
    assert out["failed"] and "No space left on device" in out["failed"], out
    assert str(mnt) in out["failed"], out  # the message names the file
    assert out["len_after_fail"] == out["published_before"] * 4096  # nothing half-applied
    assert out["old_rows_read"] and out["failed_ids_absent"], out
    assert out["len_end"] == (out["published_before"] + 8) * 4096, out
    assert out["all_rows_read"] and out["table_rows"], out
    assert len(out["warnings"]) <= 1, out  # a migration waiting for memory: said once
    if dim == 1:  # the index filled the tmpfs: its migration waited, then finished
        assert any("waits for memory" in w for w in out["warnings"]), out
    # an abandoned migration (the apply failed during it) never hands its index file name
    # to the next one: a reader may have mapped the abandoned file
    assert out["migrating_at_fail"] and out["reused_names"] == [], out
    assert out["left"] == [], out  # unshare removed every file the table wrote
