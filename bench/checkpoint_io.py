"""Benchmark: CPU a checkpoint costs per byte, written and verified (the file checksum).

Every file of a checkpoint, snapshot or table directory is checksummed as it is written
and checked when it is read back (:mod:`consumers.files`). Format version 1 used
sha256; in the sync daemon's checkpoint thread that was the largest cost (about 40 % of its
CPU while ``bench serving`` applied 1M rows/s). Version 2 uses CRC-32C.

* ``checkpoint_io.write`` — a segment-sized file (``--rows`` × ``--dim`` f32 rows of a
  table twice that size, gathered in the 16 MiB chunks a checkpoint writes, as
  :class:`FrozenChanges` does) through :class:`HashingWriter`, fsync included: MB per
  CPU second of the writing thread, against the same writer hashing with sha256 (format
  version 1) in the same run.
* ``checkpoint_io.verify`` — :func:`read_verified` of that file with its CRC-32C entry,
  against the same read with a sha256 entry (how a version 1 checkpoint is read).

CPU time is the thread's own (``time.thread_time``): what the daemon's other threads and
the model servers on the host lose. Median of ``--repeat`` runs.

Run: ``deltastream bench checkpoint-io [--rows 1000000] [--dim 64] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from bench._common import best_time, result

__all__ = ["main"]

_CHUNK_ROWS = 1 << 16  # rows per chunk, as a checkpoint gathers them (views.CHUNK_ROWS)


def main(argv: list[str] | None = None) -> list[dict]:
    from consumers import files

    ap = argparse.ArgumentParser(prog="deltastream bench checkpoint-io", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows in the file (1000000)")
    ap.add_argument("--dim", type=int, default=64, help="f32 values per row (64)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per figure (5)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.dim < 1 or args.repeat < 1:
        ap.error("--rows, --dim and --repeat must be at least 1")

    class Sha256Writer(files.HashingWriter):
        """The writer of format version 1: sha256 over the same write() calls."""

        def __init__(self, f) -> None:
            super().__init__(f)
            self.h = hashlib.sha256()

        def entry(self) -> dict:
            return {"sha256": self.h.hexdigest(), "bytes": self.n}

    rng = np.random.default_rng(0)
    table = rng.standard_normal((2 * args.rows, args.dim)).astype(np.float32)
    slots = np.sort(rng.choice(2 * args.rows, args.rows, replace=False))
    mb = args.rows * args.dim * 4 / 1e6
    entries: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ds-bench-ckio-") as d:
        path = Path(d) / "seg.bin"

        def write(writer: type) -> None:
            with open(path, "wb") as f:
                w = writer(f)
                for i in range(0, args.rows, _CHUNK_ROWS):
                    w.write(np.take(table, slots[i: i + _CHUNK_ROWS], axis=0))
                f.flush()
                os.fsync(f.fileno())
            entries[writer.__name__] = w.entry()

        def cpu(fn) -> float:  # median CPU seconds of this thread
            return best_time(fn, repeat=args.repeat, clock=time.thread_time)

        ours_w = cpu(lambda: write(files.HashingWriter))
        base_w = cpu(lambda: write(Sha256Writer))
        ours_r = cpu(lambda: files.read_verified(path, entries["HashingWriter"]))
        base_r = cpu(lambda: files.read_verified(path, entries["Sha256Writer"]))
    note = f"{args.rows} x {args.dim} f32 ({mb:.0f} MB); MB per CPU second of the thread"
    return [
        result("checkpoint_io.write", mb / ours_w, mb / base_w, None, "MB/cpu-s",
               note=note + ", fsync included; baseline: sha256 (format version 1)"),
        result("checkpoint_io.verify", mb / ours_r, mb / base_r, None, "MB/cpu-s",
               note=note + "; baseline: a version 1 entry (sha256)"),
    ]


if __name__ == "__main__":
    from bench._common import emit

    emit(main(), as_json=False)
