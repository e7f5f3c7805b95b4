"""consumers.serving.stop_mark: the clean-stop mark a daemon leaves for readers."""

from __future__ import annotations

import os
import time

from consumers.serving.stop_mark import (
    STOP_MARK,
    clear_stopped,
    leave_stop_mark,
    mark_stopped,
    stopped_at,
)


def test_the_mark_says_when_and_is_gone_after_clear(tmp_path):
    me = frozenset({os.geteuid()})
    assert stopped_at(tmp_path, me) is None
    t0 = time.time()
    mark_stopped(tmp_path)
    assert t0 <= stopped_at(tmp_path, me) <= time.time()
    assert (tmp_path / STOP_MARK).stat().st_mode & 0o777 == 0o644  # readable by readers
    assert stopped_at(tmp_path, frozenset({os.geteuid() + 1})) is None  # not trusted
    clear_stopped(tmp_path)
    clear_stopped(tmp_path)  # none: nothing to do
    assert stopped_at(tmp_path, me) is None and list(tmp_path.iterdir()) == []


def test_a_damaged_mark_is_no_mark_and_a_failed_write_is_only_logged(tmp_path, caplog):
    (tmp_path / STOP_MARK).write_text("not json")
    assert stopped_at(tmp_path, frozenset({os.geteuid()})) is None
    leave_stop_mark(tmp_path / "missing")  # no such state dir: a warning, no error
    assert "cannot leave the clean-stop mark" in caplog.text
