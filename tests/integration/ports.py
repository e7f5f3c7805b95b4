"""A free TCP port on localhost, for a process group's rendezvous (multi-process tests)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A port nothing listens on right now (bound and released: a race is possible but
    harmless for a test's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
