"""Shared fixtures: a real Kafka-compatible broker and unique topic names.

``broker`` is the embedded Tansu broker (one per test session), or an external Kafka when
``DELTASTREAM_KAFKA_BOOTSTRAP`` is set (e.g. the compose file's Apache Kafka).
``own_broker`` is a private embedded broker per test, for tests that stop or restart it.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import pytest

from deltastream.broker import EmbeddedBroker


@dataclass
class ExternalBroker:
    bootstrap_servers: str


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return  # no torch import needed: keeps torch-free test runs torch-free
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def broker():
    external = os.environ.get("DELTASTREAM_KAFKA_BOOTSTRAP")
    if external:
        yield ExternalBroker(external)
        return
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture
def own_broker():
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture
def topic_name(request) -> str:
    """A topic name unique to this test (the session broker is shared)."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40]
    return f"deltas.t-{base}-{uuid.uuid4().hex[:8]}"
