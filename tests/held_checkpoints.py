"""Keep a real checkpoint in flight for as long as a test needs (nothing is mocked).

The background writer (:class:`consumers.storage.background.CheckpointWriter`) freezes a
checkpoint in the applying thread, then calls ``CheckpointStore.finish`` in its writing
thread. :func:`hold_checkpoints` wraps that method: while the returned event is clear, the
writing thread waits there — after the freeze, before writing anything. The wait is a
test's need, so it lives here, not in the writer (the ``checkpoint_hold`` fixture).
"""

from __future__ import annotations

import threading

import pytest

from consumers.storage.checkpoint import CheckpointResult, CheckpointStore, PreparedCheckpoint


def hold_checkpoints(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """A set event; clear it and every checkpoint write of this process waits, after the
    freeze and before writing, until it is set again (undone when the test ends)."""
    gate = threading.Event()
    gate.set()
    finish = CheckpointStore.finish

    def held_finish(self: CheckpointStore, prep: PreparedCheckpoint) -> CheckpointResult:
        gate.wait()
        return finish(self, prep)

    monkeypatch.setattr(CheckpointStore, "finish", held_finish)
    return gate
