"""InFlight: the byte bound on unacknowledged messages (backpressure), release in order as
they resolve, and failures kept until the publisher reports them. Pure logic: the producer
futures are stand-ins resolved by the test."""

from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np

from deltastream.publishing.in_flight import InFlight
from deltastream.publishing.results import SentMessage


class _Future:
    """The two things InFlight reads of a kafka-python future: is_done, exception, get."""

    def __init__(self) -> None:
        self.is_done = False
        self.exception: Optional[BaseException] = None
        self._done = threading.Event()

    def resolve(self, error: Optional[BaseException] = None) -> None:
        self.exception, self.is_done = error, True
        self._done.set()

    def get(self, timeout: Optional[float] = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError


def _msg(seq: int, nbytes: int) -> SentMessage:
    return SentMessage("t", 0, seq, np.array([seq], dtype=np.int64), None, 0, None, nbytes,
                       _Future())


def _counts() -> dict:
    return dict(acked_messages=0, failed_messages=0, blocked_s=0.0)


def test_reserve_waits_for_room_then_the_head_resolving_frees_it():
    counts = _counts()
    flight = InFlight(100, counts)
    first, second = _msg(0, 60), _msg(1, 30)
    flight.add(first)
    flight.add(second)
    assert flight.pending_bytes == 90 and len(flight) == 2
    timer = threading.Timer(0.2, first.future.resolve)
    timer.start()
    t0 = time.monotonic()
    assert flight.reserve(50, time.monotonic() + 10)  # 90 + 50 > 100: waits for the head
    assert time.monotonic() - t0 >= 0.15 and counts["blocked_s"] >= 0.15
    assert flight.pending_bytes == 30 and counts["acked_messages"] == 1
    timer.join()


def test_reserve_gives_up_at_the_deadline_and_lets_one_message_through():
    counts = _counts()
    flight = InFlight(100, counts)
    assert flight.reserve(500, time.monotonic())  # empty: one message always goes
    flight.add(_msg(0, 80))
    assert not flight.reserve(50, time.monotonic() + 0.05)
    assert flight.pending_bytes == 80 and counts["acked_messages"] == 0


def test_messages_are_released_in_order_and_failures_kept_until_taken():
    counts = _counts()
    flight = InFlight(1000, counts)
    msgs = [_msg(i, 10) for i in range(3)]
    for m in msgs:
        flight.add(m)
    msgs[1].future.resolve(RuntimeError("lost"))
    flight.failed(msgs[1])  # the producer's errback, on its sender thread
    flight.reap()
    assert len(flight) == 3  # the head is unresolved: nothing behind it is released
    assert flight.has_new_failures() and flight.unresolved() == [msgs[0], msgs[2]]
    msgs[0].future.resolve()
    flight.reap()
    assert len(flight) == 1 and counts == dict(acked_messages=1, failed_messages=1,
                                               blocked_s=0.0)
    assert flight.take_failures() == [msgs[1]] and not flight.has_new_failures()
    assert not flight.resolve_all(time.monotonic() + 0.05) and flight.not_done() == 1
    msgs[2].future.resolve()
    assert flight.resolve_all(time.monotonic() + 1)
