"""Thread scheduling policies (consumers.sched_policy): parsing, setting and restoring a
thread's policy, inheritance, and the refusal without the privilege."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from consumers.sched_policy import (
    Policy,
    parse_policy,
    policy_arg,
    refusal,
    set_thread_policy,
    thread_policy,
)

_REPO = Path(__file__).resolve().parents[2]
linux = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux policies")


def _in_thread(fn):
    """``fn()``'s result (or exception) on a fresh thread: policies are per thread, so
    the test's own thread keeps its policy whatever ``fn`` does."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


realtime = pytest.mark.skipif(refusal("fifo:1") is not None,
                              reason="no CAP_SYS_NICE or RLIMIT_RTPRIO for fifo:1 here")


@pytest.mark.parametrize("spec, want", [
    ("fifo:1", Policy("fifo", 1)), ("rr:99", Policy("rr", 99)), (" other ", Policy("other")),
    ("batch", Policy("batch")), ("idle", Policy("idle")), ("fifo: 5", Policy("fifo", 5)),
    ("batch:0", Policy("batch")), (Policy("rr", 3), Policy("rr", 3)),
])
def test_policies_parse(spec, want):
    assert parse_policy(spec) == want


@pytest.mark.parametrize("spec, match", [
    ("fifo", r"'fifo' needs a priority, as in 'fifo:1'"),
    ("fifo:0", r"priority in \[1, 99\], got 0"), ("rr:100", r"in \[1, 99\], got 100"),
    ("other:1", "other takes no priority"),
    ("deadline", "unknown policy 'deadline'; expected one of other, batch, idle, fifo, rr"),
    ("fifo:x", "must be a number"), ("fifo:-1", "must be a number"), (5, "got 5"),
])
def test_bad_policies_are_refused_saying_what_was_expected(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(spec)


def test_policy_priorities_are_checked_on_the_dataclass_too():
    with pytest.raises(ValueError, match="must be an int, got True"):
        Policy("fifo", True)
    with pytest.raises(ValueError, match="unknown policy"):
        Policy("FIFO", 1)


def test_policies_print_as_they_parse():
    for spec in ("fifo:1", "rr:42", "other", "batch", "idle"):
        assert str(parse_policy(spec)) == spec


@linux
def test_lowering_a_threads_policy_is_never_refused():
    assert refusal("batch") is None and refusal("idle") is None and refusal("other") is None
    with pytest.raises(ValueError, match="unknown policy"):
        refusal("deadline")  # a bad spec is an error, not a refusal


def test_policy_option_errors_are_usage_errors_without_the_prefix():
    assert policy_arg("fifo:2") == Policy("fifo", 2)
    with pytest.raises(argparse.ArgumentTypeError) as e:
        policy_arg("fifo:0")
    assert str(e.value) == "fifo needs a priority in [1, 99], got 0"


@linux
def test_a_policy_applies_to_the_calling_thread_only_and_restores():
    mine = thread_policy()

    def lower_then_restore():
        was = set_thread_policy("batch")
        now = thread_policy()
        seen_by_child = _in_thread(thread_policy)  # started after: inherits it
        set_thread_policy(was)
        return was, now, seen_by_child, thread_policy()

    was, now, child, back = _in_thread(lower_then_restore)
    assert was == Policy("other") and now == Policy("batch") and child == Policy("batch")
    assert back == Policy("other")
    assert thread_policy() == mine  # the test's thread was never touched


@linux
@realtime
def test_a_realtime_policy_is_set_inherited_and_dropped_without_privilege():
    def raise_then_drop():
        was = set_thread_policy("fifo:1")
        got = thread_policy(), _in_thread(thread_policy)
        set_thread_policy(was)  # lowering needs no privilege
        return got, thread_policy()

    (now, child), back = _in_thread(raise_then_drop)
    assert now == child == Policy("fifo", 1)
    assert back == Policy("other")


@linux
def test_a_realtime_policy_without_the_privilege_names_what_grants_it():
    """In a process with no RLIMIT_RTPRIO and (for root: a setuid to nobody) no
    CAP_SYS_NICE, fifo:1 is refused with one line saying what would allow it; leaving
    idle without RLIMIT_NICE room is refused without that hint."""
    code = textwrap.dedent("""
        import os, resource
        from consumers.sched_policy import refusal, set_thread_policy
        resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)  # drops every capability
        try:
            set_thread_policy("fifo:1")
        except ValueError as e:
            assert refusal("fifo:1") == str(e)  # the probe says the same
            print("refused:", e)
        else:
            print("allowed")
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))  # leaving idle needs nice room
        set_thread_policy("idle")
        try:
            set_thread_policy("other")
        except ValueError as e:
            print("refused:", e)
        else:
            print("left idle")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(_REPO)), timeout=60)
    assert r.returncode == 0, r.stderr
    fifo, idle = r.stdout.strip().splitlines()
    if fifo == "allowed":  # CAP_SYS_NICE kept (not root, yet privileged)
        pytest.skip("this process keeps CAP_SYS_NICE without RLIMIT_RTPRIO")
    assert fifo == (
        "refused: policy: not allowed to run this thread at fifo:1: needs CAP_SYS_NICE or "
        "an RLIMIT_RTPRIO of at least 1 (this process: 0); e.g. systemd LimitRTPRIO=1, "
        "docker --ulimit rtprio=1")
    # not a real-time policy: no RLIMIT_RTPRIO hint
    assert idle == ("refused: policy: not allowed to run this thread at other "
                    "(Operation not permitted)")
