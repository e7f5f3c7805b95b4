"""The console entry points of the predictor-side tools (see :mod:`deltastream.launch`:
a Ctrl-C while the tool loads is one line, not a traceback)."""

from __future__ import annotations

from deltastream.launch import launch

__all__ = ["sync", "replay"]


def sync() -> int:
    """``deltastream-sync`` (:func:`consumers.sync.cli.main`)."""
    return launch("deltastream-sync", "consumers.sync.cli:main", service=True)


def replay() -> int:
    """``deltastream-replay`` (:func:`consumers.replay.cli.main`)."""
    return launch("deltastream-replay", "consumers.replay.cli:main")
