"""Ctrl-C while an installed console script is still loading its tool (numpy, kafka-python:
up to a second) is one line and the exit code of a later Ctrl-C, not an import-time
traceback (:mod:`deltastream.launch`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltastream.broker import free_port
from deltastream.cliargs import EXIT_INTERRUPTED, EXIT_OK

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


def _default_sigint() -> None:
    """In the child: Ctrl-C's default action (a runner in the background ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _loading(pid: int) -> bool:
    """Whether process ``pid`` has mapped numpy's core: only the tool imports it, so the
    console script's own start is behind it and the tool is loading (or loaded)."""
    try:
        return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _ctrl_c_while_loading(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_default_sigint,
                            env={k: v for k, v in os.environ.items()
                                 if not k.startswith("DELTASTREAM_")})
    try:
        deadline = time.monotonic() + 60
        while not _loading(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.parametrize("script, args, code", [
    ("deltastream", ["topic"], EXIT_INTERRUPTED),
    ("deltastream-replay", ["stats", "--topic", "t"], EXIT_INTERRUPTED),
    ("deltastream-sync", ["--model", "m", "--state-dir", "s", "--log-level", "WARNING"],
     EXIT_OK),  # a service: Ctrl-C is its normal stop
], ids=["deltastream topic", "deltastream-replay stats", "deltastream-sync"])
def test_ctrl_c_while_a_tool_loads_is_one_line(script, args, code, tmp_path):
    if not (BIN / script).is_file():
        pytest.skip(f"{script} is not installed next to {sys.executable}")
    r = _ctrl_c_while_loading([str(BIN / script), *args, "--bootstrap-servers",
                               f"127.0.0.1:{free_port()}"], tmp_path)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, r.stderr
    lines = r.stderr.strip().splitlines()
    assert all(x.endswith(": interrupted") for x in lines), r.stderr
    # one line; none when the daemon's own clean stop came first (it logs at INFO only)
    assert len(lines) == 1 or (code == EXIT_OK and not lines), r.stderr
