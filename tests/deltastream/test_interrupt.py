"""deltastream.interrupt: Ctrl-C ends a one-shot CLI with exit 130 and one line, also when
something swallows the KeyboardInterrupt (real processes, real signals)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deltastream.cliargs import EXIT_INTERRUPTED
from deltastream.interrupt import Interrupt

REPO = Path(__file__).resolve().parents[2]

# A command under Interrupt. "swallow": a library loop that drops every KeyboardInterrupt
# (as kafka-python's event loop does inside its tasks); "unwind": a command that lets it
# reach main's handler.
_SCRIPT = textwrap.dedent("""
    import sys, time
    from deltastream.interrupt import Interrupt
    mode, grace = sys.argv[1], float(sys.argv[2])
    def command():
        print("ready", flush=True)
        while True:
            try:
                time.sleep(0.01)
            except KeyboardInterrupt:
                if mode == "unwind":
                    raise
    with Interrupt("tool cmd: interrupted", grace=grace) as intr:
        try:
            command()
        except KeyboardInterrupt:
            sys.exit(intr.say())
""")


def _start(mode: str, grace: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, mode, str(grace)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err, time.monotonic() - t0


@pytest.mark.parametrize("mode, grace, at_least", [
    ("unwind", 60.0, 0.0),   # main's handler says the line; no watchdog needed
    ("swallow", 1.0, 0.9),   # the watchdog ends it, after the grace to unwind
])
def test_one_ctrl_c_ends_it_with_130_and_the_line_once(mode, grace, at_least):
    proc = _start(mode, grace)
    proc.send_signal(signal.SIGINT)
    rc, err, took = _finish(proc, 30)
    assert rc == EXIT_INTERRUPTED
    assert err == "tool cmd: interrupted\n"
    assert took >= at_least


def test_a_second_ctrl_c_ends_it_at_once():
    proc = _start("swallow", grace=120)  # only the second signal can end it in time
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    rc, err, _ = _finish(proc, 30)
    assert rc == EXIT_INTERRUPTED
    assert err == "tool cmd: interrupted\n"


def test_leaving_the_block_restores_the_handler_and_stops_the_watchdog():
    before = signal.getsignal(signal.SIGINT)
    intr = Interrupt("x: interrupted", grace=0.2)
    with intr:
        assert signal.getsignal(signal.SIGINT) is not before
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    time.sleep(0.5)  # past the grace: the watchdog saw the block left and did not end us


@pytest.mark.parametrize("line, grace", [("", 1.0), (None, 1.0), ("x", 0), ("x", -1.0)])
def test_bad_arguments_are_refused(line, grace):
    with pytest.raises(ValueError, match="interrupt: "):
        Interrupt(line, grace=grace)
