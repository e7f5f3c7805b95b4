"""Shared fixtures: a real Kafka-compatible broker and unique topic names.

``broker`` is the embedded Tansu broker (one per test session), or an external Kafka when
``DELTASTREAM_KAFKA_BOOTSTRAP`` is set (e.g. the compose file's Apache Kafka).
``own_broker`` is a private embedded broker per test, for tests that stop or restart it.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import uuid
from dataclasses import dataclass

# No GPU here: Triton kernels run in Triton's interpreter on CPU tensors, which must be chosen
# before anything imports triton (deltastream.kernels.runtime).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from deltastream.broker import EmbeddedBroker  # noqa: E402


def pytest_unconfigure(config):
    """After the summary: Triton's nanobind bindings report ~80 lines of "leaked" types at
    interpreter teardown, a known report about their own teardown order, nothing of ours;
    silence stderr for that last moment, as Triton does for its own worker processes."""
    if "triton" in sys.modules:
        atexit.register(_silence_stderr)


def _silence_stderr() -> None:
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


@pytest.fixture(autouse=True)
def _cli_logging_undone():
    """A CLI's ``main`` run in-process installs a stderr handler on the root logger
    (``clilog.setup_logging``), bound to this test's captured stderr, which is closed after
    the test: take it and its level away, so later tests do not log into a closed stream."""
    root = logging.getLogger()
    level = root.level
    yield
    for h in list(root.handlers):
        if getattr(h, "_deltastream", False):
            root.removeHandler(h)
    root.setLevel(level)


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


@pytest.fixture
def kernel_device():
    """The device Triton kernel tests run on, with kernel mode ``on``: CUDA when there is
    one, else CPU under Triton's interpreter; skipped when triton does not import."""
    import torch

    from deltastream.kernels.runtime import interpreted, kernels_mode, triton_available

    if not triton_available():
        pytest.skip("triton does not import")
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif interpreted():
        device = torch.device("cpu")
    else:
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    with kernels_mode("on"):
        yield device


@pytest.fixture
def checkpoint_hold(monkeypatch):
    """A set ``threading.Event``: clear it and checkpoint writes stay in flight, frozen and
    not written, until it is set (:mod:`tests.held_checkpoints`)."""
    from tests.held_checkpoints import hold_checkpoints
    return hold_checkpoints(monkeypatch)


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
