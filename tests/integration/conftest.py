"""Fixtures shared by the sync daemon's integration modules."""

from __future__ import annotations

import pytest

from deltastream.publishing.publisher import ensure_topic

from .test_sync import Feed


@pytest.fixture
def feed(broker, topic_name):
    """A 2-partition topic of its own and a :class:`Feed` publishing to it."""
    ensure_topic(broker.bootstrap_servers, topic_name, 2)
    f = Feed(broker.bootstrap_servers, topic_name, 2)
    yield f
    f.close()
