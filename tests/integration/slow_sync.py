"""``deltastream-sync`` that sleeps after each record, so kill -9 tests land mid-stream.

Run as ``python -m tests.integration.slow_sync SECONDS [deltastream-sync flags...]``. The
delay is a test's need, so it lives here, not in the daemon: this wraps the daemon's
per-record step and then runs the real command line.
"""

from __future__ import annotations

import sys
import time

from consumers.sync import cli
from consumers.sync.daemon import SyncDaemon


def main(argv: list[str]) -> int:
    delay = float(argv[0])
    record = SyncDaemon._record

    def slow_record(self: SyncDaemon, partition: int, rec: object) -> object:
        out = record(self, partition, rec)
        time.sleep(delay)
        return out

    SyncDaemon._record = slow_record
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
