"""One daemon per state dir (issue 27, item 4), a lock no other user can hold (item 7) and
a state dir another user owns refused (item 8)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from consumers.errors import ConsumerError
from consumers.sync import SyncDaemon
from consumers.sync.state_lock import LOCK_FILE, lock_state_dir
from tests.other_user import NOBODY, as_nobody, need_root, open_dir, shared_lock_attempt

REPO = Path(__file__).resolve().parents[3]


def _daemon(state: Path, model: str = "m", **kw) -> SyncDaemon:
    return SyncDaemon("127.0.0.1:9", f"deltas.{model}", model=model, state_dir=state,
                      request_timeout=0.5, **kw)


def test_a_second_daemon_refuses_naming_the_holder(tmp_path):
    first = _daemon(tmp_path)
    try:
        for model in ("m", "other"):  # the same model, or another one on a fresh dir
            with pytest.raises(ConsumerError, match=rf"pid {os.getpid()} on host "
                               rf"{socket.gethostname()}.*one daemon per state dir"):
                _daemon(tmp_path, model)
    finally:
        first.close()
    _daemon(tmp_path).close()  # released on stop
    assert os.stat(tmp_path / LOCK_FILE).st_mode & 0o777 == 0o600


def test_the_cli_exits_2_naming_the_holder(tmp_path):
    held = lock_state_dir(tmp_path)
    try:
        r = subprocess.run([sys.executable, "-m", "consumers.sync.cli", "--bootstrap-servers",
                            "127.0.0.1:9", "--model", "m", "--state-dir", str(tmp_path)],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    finally:
        held.release()
    assert r.returncode == 2, r.stderr
    assert f"pid {os.getpid()}" in r.stderr and "in use by another" in r.stderr


def test_another_user_cannot_hold_the_lock_of_a_killed_daemon():
    need_root()
    state = Path(open_dir()) / "state"
    try:
        code = ("import sys, time; from consumers.sync import SyncDaemon; "
                f"d = SyncDaemon('127.0.0.1:9', 'deltas.m', model='m', state_dir={str(state)!r});"
                " print('up', flush=True); time.sleep(60)")
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "up"
        os.chmod(state, 0o755)  # a state dir others may read: the lock is still private
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with as_nobody(shared_lock_attempt(state / LOCK_FILE)) as got:
            assert isinstance(got, PermissionError), got
            _daemon(state).close()  # the restarted writer is not blocked
    finally:
        shutil.rmtree(state.parent)


def test_a_state_dir_of_another_user_is_refused(tmp_path):
    need_root()
    state = tmp_path / "theirs"
    state.mkdir()
    os.chown(state, NOBODY, NOBODY)
    with pytest.raises(ConsumerError, match=rf"owned by uid {NOBODY}.*state_dir_any_owner"):
        _daemon(state)
    assert not (state / LOCK_FILE).exists()  # nothing written there
    _daemon(state, state_dir_any_owner=True).close()


def test_a_planted_lock_link_is_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep")
    state = tmp_path / "state"
    state.mkdir()
    (state / LOCK_FILE).symlink_to(target)
    with pytest.raises(ConsumerError, match="symbolic link"):
        _daemon(state)
    assert target.read_text() == "keep"
