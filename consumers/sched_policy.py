"""Scheduling policy of a thread: run a model server's lookup thread above the sync daemon.

On a busy predictor host, a lookup preempted mid-call waits in the run queue while the
CPU runs the daemon (applying at full speed, or its checkpoint thread) for a scheduler
slice or more: 1–4 ms on a 2-core VM, the whole p99.9 of a reader process in ``bench
serving``. Under the fair scheduler every thread of equal weight gets its turn; the daemon
at ``SCHED_BATCH``/``SCHED_IDLE``, or shorter scheduler slices for the readers, did not
change that (BENCHMARKS.md).
A lookup thread at a real-time policy (``fifo:1``) runs whenever it is runnable, ahead of
every ordinary thread, and is never preempted by one: it is the setting for a thread that
serves requests and sleeps in between. Two cautions, both the OS's rules:

* a real-time thread that never sleeps starves ordinary threads on its CPU (the kernel
  still leaves them 5% by default): only threads that do bounded work per request;
* threads inherit the policy of the thread that starts them, so start helper threads
  first, or have them call :func:`set_thread_policy` ``("other")`` (the table reader's
  page warmer does that itself).

Raising a thread to ``fifo``/``rr`` needs ``CAP_SYS_NICE`` or an ``RLIMIT_RTPRIO`` at least
its priority (systemd ``LimitRTPRIO=``, ``docker run --ulimit rtprio=N`` or ``--cap-add
SYS_NICE``); lowering it back never does. Linux only; the policy is per thread.
"""

from __future__ import annotations

import argparse
import os
import resource
import threading
from dataclasses import dataclass
from typing import Union

__all__ = ["Policy", "POLICIES", "parse_policy", "thread_policy", "set_thread_policy",
           "refusal", "policy_arg"]

#: policy name -> ``os.SCHED_*`` constant name
POLICIES = {"other": "SCHED_OTHER", "batch": "SCHED_BATCH", "idle": "SCHED_IDLE",
            "fifo": "SCHED_FIFO", "rr": "SCHED_RR"}
_REALTIME = ("fifo", "rr")


@dataclass(frozen=True)
class Policy:
    """A scheduling policy: ``name`` (a key of :data:`POLICIES`) and its static
    ``priority`` (1–99 for ``fifo``/``rr``, 0 for the others)."""

    name: str
    priority: int = 0

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"policy: unknown policy {self.name!r}; expected one of "
                             f"{', '.join(POLICIES)}")
        p = self.priority
        if isinstance(p, bool) or not isinstance(p, int):
            raise ValueError(f"policy: priority must be an int, got {p!r}")
        if self.name in _REALTIME and not 1 <= p <= 99:
            raise ValueError(f"policy: {self.name} needs a priority in [1, 99], got {p}")
        if self.name not in _REALTIME and p != 0:
            raise ValueError(f"policy: {self.name} takes no priority (0), got {p}")

    def __str__(self) -> str:
        return f"{self.name}:{self.priority}" if self.name in _REALTIME else self.name


def parse_policy(spec: Union[str, Policy]) -> Policy:
    """``"fifo:1"``, ``"rr:10"``, ``"other"``, ``"batch"`` or ``"idle"`` (or a
    :class:`Policy`) -> :class:`Policy`; ValueError saying what was expected."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"policy: expected a string like 'fifo:1', got {spec!r}")
    name, sep, prio = spec.strip().partition(":")
    if sep and not prio.strip().isdigit():
        raise ValueError(f"policy: {spec!r}: the priority after ':' must be a number, as "
                         "in 'fifo:1'")
    if name in _REALTIME and not sep:
        raise ValueError(f"policy: {spec!r} needs a priority, as in '{name}:1'")
    return Policy(name, int(prio) if sep else 0)


def _name_of(const: int) -> str:
    for name, attr in POLICIES.items():
        if getattr(os, attr, None) == const:
            return name
    raise ValueError(f"policy: the thread runs under an unknown policy ({const})")


def _check_linux() -> None:
    if not hasattr(os, "sched_setscheduler"):
        raise ValueError("policy: setting a thread's scheduling policy needs Linux "
                         "(os.sched_setscheduler)")


def thread_policy() -> Policy:
    """The calling thread's policy."""
    _check_linux()
    return Policy(_name_of(os.sched_getscheduler(0)), os.sched_getparam(0).sched_priority)


def set_thread_policy(policy: Union[str, Policy]) -> Policy:
    """Run the calling thread (and the threads it starts from now on) under ``policy``;
    returns the policy it had, to restore later. ValueError for a bad spec, or when the
    OS refuses — for ``fifo``/``rr`` without the privilege, naming what grants it. The
    nice value is left as it is (it matters under ``other``/``batch``)."""
    pol = parse_policy(policy)
    was = thread_policy()
    try:
        # 0: the calling thread (a thread is a task on Linux)
        os.sched_setscheduler(0, getattr(os, POLICIES[pol.name]), os.sched_param(pol.priority))
    except PermissionError as e:
        if pol.name not in _REALTIME:  # e.g. leaving idle beyond what RLIMIT_NICE allows
            raise ValueError(f"policy: not allowed to run this thread at {pol} "
                             f"({e.strerror})") from None
        soft = resource.getrlimit(resource.RLIMIT_RTPRIO)[0]
        raise ValueError(
            f"policy: not allowed to run this thread at {pol}: needs CAP_SYS_NICE or an "
            f"RLIMIT_RTPRIO of at least {pol.priority} (this process: {soft}); e.g. systemd "
            f"LimitRTPRIO={pol.priority}, docker --ulimit rtprio={pol.priority}") from None
    except OSError as e:
        raise ValueError(f"policy: cannot run this thread at {pol} ({e.strerror})") from None
    return was


def refusal(policy: Union[str, Policy]) -> str | None:
    """Why a thread of this process may not run under ``policy`` (the
    :func:`set_thread_policy` error, tried on a throwaway thread), or None when it may.
    ValueError for a bad spec."""
    pol = parse_policy(policy)
    why: list[str] = []

    def attempt() -> None:
        try:
            set_thread_policy(pol)
        except ValueError as e:
            why.append(str(e))
    t = threading.Thread(target=attempt, name="policy probe")
    t.start()
    t.join()
    return why[0] if why else None


def policy_arg(text: str) -> Policy:
    """argparse ``type=`` of a policy option: :func:`parse_policy`, its errors as usage
    errors."""
    try:
        return parse_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("policy: ")) from None
