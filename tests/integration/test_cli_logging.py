"""One log-level policy, seen on the real entry points' stderr: the services
(``deltastream-sync``, ``deltastream broker``) log at INFO by default, the one-shot tools
(``deltastream topic``, ``deltastream-replay``) at WARNING; ``--log-level`` and
``DELTASTREAM_LOG_LEVEL`` change it (README "Logging")."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from deltastream.broker import free_port
from deltastream.cliargs import EXIT_OK, EXIT_UNAVAILABLE

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DS = ["-m", "deltastream.cli"]
REPLAY = ["-m", "consumers.replay.cli"]
SYNC = ["-m", "consumers.sync.cli"]


def _env(**extra: str) -> dict[str, str]:
    """This environment without the caller's DELTASTREAM_* variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTASTREAM_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``args`` in a fresh interpreter (see :func:`_env`)."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(**env),
                          capture_output=True, text=True, timeout=120)


def _levels(stderr: str) -> set[str]:
    """The levels of the log lines in ``stderr`` (both formats: ``… INFO name: …`` and
    ``deltastream-replay: INFO: …``)."""
    names = ("DEBUG", "INFO", "WARNING", "ERROR")
    return {w.rstrip(":") for line in stderr.splitlines() for w in line.split()[:4]
            if w.rstrip(":") in names}


def test_a_one_shot_tool_logs_only_what_went_wrong_by_default(broker, topic_name, tmp_path):
    servers = broker.bootstrap_servers
    r = _run([*DS, "topic", "--bootstrap-servers", servers, "--topic", topic_name], tmp_path)
    assert r.returncode == EXIT_OK, r.stderr
    assert r.stdout.startswith(f"{topic_name}: 1 partitions") and r.stderr == ""
    for flag, env in ((["--log-level", "INFO"], {}), ([], {"DELTASTREAM_LOG_LEVEL": "INFO"})):
        again = f"{topic_name}-{len(flag)}"  # a new topic: "created topic" is logged
        r = _run([*DS, "topic", "--bootstrap-servers", servers, "--topic", again, *flag],
                 tmp_path, **env)
        assert r.returncode == EXIT_OK, r.stderr
        assert f"INFO deltastream.publishing.topics: created topic {again!r}" in r.stderr

    rebuild = [*REPLAY, "rebuild", "--bootstrap-servers", servers, "--topic", topic_name,
               "--model", "m"]
    r = _run([*rebuild, "--out", "quiet"], tmp_path)
    assert r.returncode == EXIT_OK, r.stderr
    assert "rebuilt 0 tables" in r.stderr and _levels(r.stderr) == set()  # its summary only
    r = _run([*rebuild, "--out", "told", "--log-level", "INFO"], tmp_path)
    assert r.returncode == EXIT_OK, r.stderr
    assert f"deltastream-replay: INFO: rebuild of {topic_name}: 0 records" in r.stderr


def test_a_service_logs_what_it_does_by_default(tmp_path):
    proc = subprocess.Popen([sys.executable, *DS, "broker", "--port", "0"], cwd=tmp_path,
                            env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the broker printed no address in time"
        addr = proc.stdout.readline().strip()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_OK, err
    assert f"INFO deltastream.broker: embedded broker (in memory) at {addr}" in err

    # the sync daemon: what it does at INFO, the reason it gives up at WARNING and above
    def sync(state: str) -> list[str]:
        return [*SYNC, "--model", "m", "--state-dir", state, "--bootstrap-servers",
                f"127.0.0.1:{free_port()}", "--startup-timeout", "1"]

    with ThreadPoolExecutor(2) as pool:  # each waits out the client's bootstrap: run both
        told, default = pool.map(lambda a: _run(a, tmp_path),
                                 [[*sync("s1"), "--log-level", "WARNING"], sync("s2")])
    for r in (told, default):
        assert r.returncode == EXIT_UNAVAILABLE, r.stderr
        assert "not syncing after 1 s (--startup-timeout)" in r.stderr.splitlines()[-1]
    assert "INFO" in _levels(default.stderr)
    assert "INFO" not in _levels(told.stderr)
