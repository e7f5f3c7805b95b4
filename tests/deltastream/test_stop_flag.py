"""StopFlag: a stop request a signal handler may raise while its thread waits on it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from deltastream.stop_flag import StopFlag

STORM = textwrap.dedent("""
    import signal, time
    from deltastream.stop_flag import StopFlag
    flag, n = StopFlag(), [0]
    def on_alarm(signum, frame):
        n[0] += 1
        flag.set()
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 1e-3, 1e-3)
    end = time.monotonic() + 2
    while time.monotonic() < end:
        flag.wait(0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    print(n[0], flag.is_set())
""")


def test_set_from_a_signal_handler_while_the_thread_waits_never_hangs():
    # threading.Event here: the handler's set() waits for the lock its own thread holds in
    # wait(); the process hangs, or recurses to death as the next signals pile up
    r = subprocess.run([sys.executable, "-c", STORM], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    signals, is_set = r.stdout.split()
    assert int(signals) > 100 and is_set == "True"


def test_wait_times_out_unset_and_returns_at_once_when_set():
    flag = StopFlag()
    t = time.monotonic()
    assert flag.wait(0.05) is False and not flag.is_set()
    assert time.monotonic() - t >= 0.04
    flag.set()
    assert flag.wait(None) is True and flag.wait(0) is True and flag.is_set()


def test_a_set_from_another_thread_wakes_every_waiter():
    flag, woke = StopFlag(), []
    waiters = [threading.Thread(target=lambda: woke.append(flag.wait(30))) for _ in range(3)]
    for w in waiters:
        w.start()
    time.sleep(0.05)
    t = time.monotonic()
    flag.set()
    for w in waiters:
        w.join(10)
    assert woke == [True] * 3 and time.monotonic() - t < 5


def test_many_sets_never_block_on_the_full_pipe():
    flag = StopFlag()
    for _ in range(100_000):  # more bytes than a pipe holds
        flag.set()
    assert flag.wait(0)
