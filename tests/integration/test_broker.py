"""The embedded broker starts, answers Kafka requests, and never outlives its owner."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from deltastream.broker import BrokerError, EmbeddedBroker, kafka_ready

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_produce_and_fetch_roundtrip():
    with EmbeddedBroker() as b:
        host, port = b.bootstrap_servers.split(":")
        assert host == "127.0.0.1" and kafka_ready(host, int(port))
        p = KafkaProducer(bootstrap_servers=b.bootstrap_servers, acks="all")
        p.send("rt", value=b"hello", key=b"k", partition=0).get(timeout=10)
        p.close()
        c = KafkaConsumer(bootstrap_servers=b.bootstrap_servers, enable_auto_commit=False)
        tp = TopicPartition("rt", 0)
        c.assign([tp])
        c.seek(tp, 0)
        got = c.poll(timeout_ms=5000).get(tp, [])
        c.close()
        assert [(m.key, m.value) for m in got] == [(b"k", b"hello")]


def test_stop_kills_process_and_restart_reuses_port():
    b = EmbeddedBroker().start()
    pid, port = b.pid, b.port
    b.stop()
    assert _wait_dead(pid)
    assert not kafka_ready("127.0.0.1", port)
    b.start()
    assert b.port == port and kafka_ready("127.0.0.1", port)
    b.close()


def test_garbage_collection_kills_process_and_removes_its_log():
    b = EmbeddedBroker().start()
    pid, log_path = b.pid, b._log_file.name
    assert os.path.exists(log_path)
    del b
    import gc

    gc.collect()
    assert _wait_dead(pid)
    assert not os.path.exists(log_path)


def _owner_env(tmp_path) -> dict:
    """An owner process's environment: its broker log goes to ``tmp_path`` (a killed owner
    cannot remove it)."""
    return {**os.environ, "TMPDIR": str(tmp_path)}


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_no_orphan_when_owner_dies(tmp_path, how):
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from deltastream.broker import EmbeddedBroker
        b = EmbeddedBroker().start()
        print(b.pid, flush=True)
        if {how!r} == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env=_owner_env(tmp_path))
    pid = int(out.stdout.split()[0])
    assert _wait_dead(pid), f"broker pid {pid} outlived its owner ({how})"
    logs = list(tmp_path.glob("deltastream-broker-*.log"))
    assert len(logs) == (1 if how == "sigkill" else 0)  # an exit removes the log


def test_missing_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("DELTASTREAM_BROKER_BIN", "/nonexistent/tansu")
    with pytest.raises(BrokerError, match="DELTASTREAM_BROKER_BIN"):
        EmbeddedBroker()


def test_bad_arguments():
    with pytest.raises(ValueError, match="port"):
        EmbeddedBroker(port=70000)
    with pytest.raises(ValueError, match="start_timeout"):
        EmbeddedBroker(start_timeout=0)


def test_sigterm_of_owner_kills_broker(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from deltastream.broker import EmbeddedBroker
        b = EmbeddedBroker().start()
        print(b.pid, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=_owner_env(tmp_path))
    pid = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert _wait_dead(pid)


@pytest.mark.parametrize("other", ["listener", "kafka"])
def test_a_taken_port_is_one_plain_line_and_no_address(other):
    """``deltastream broker --port P`` with P taken (by any listener, or by another Kafka
    broker that answers on it) prints no address, one plain line naming the port, exit 3."""
    with contextlib.ExitStack() as stack:
        if other == "kafka":
            port = stack.enter_context(EmbeddedBroker()).port
        else:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            port = sock.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "deltastream.broker", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r
    assert r.stdout == "", "an address was printed for a broker that is not ours"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port}" in lines[0] and "in use" in lines[0], r.stderr
    assert "\x1b" not in r.stderr and "panicked" not in r.stderr
