"""consumers.sync.stall: why a daemon is not syncing, at WARNING every interval; the
start-up deadline. Pure logic over ``stats()``-shaped dicts."""

from __future__ import annotations

import logging

import pytest

from consumers.sync.stall import StallWatch, StartupTimeout, stall_reason


def _stats(broker="connected", applied=0, foreign=0, lag=0):
    return {"topic": "deltas.m", "model": "m", "broker": broker, "applied": applied,
            "foreign_model": foreign, "foreign_models": {"other": foreign} if foreign else {},
            "lag_total": lag}


def test_the_reasons_name_the_broker_state_or_the_other_models():
    assert stall_reason(_stats("disconnected"), "connection refused", "h:1") == (
        "unavailable", "broker h:1: disconnected (connection refused)")
    assert stall_reason(_stats("topic_missing"), "", "h:1")[1] == "broker h:1: topic missing"
    kind, why = stall_reason(_stats(foreign=7), "", "h:1")
    assert kind == "model" and "7 messages of other models (other)" in why
    assert "none of model 'm' (--model)" in why
    assert stall_reason(_stats(applied=1, foreign=7), "", "h:1") is None
    assert stall_reason(_stats("stopped"), "", "h:1") is None


def test_a_lasting_reason_is_a_warning_every_interval_and_recovery_is_said(caplog):
    w = StallWatch(0.0, t0=0.0, interval=60.0)
    caplog.set_level(logging.INFO, logger="consumers.sync.stall")
    down = _stats("disconnected")
    for now in range(0, 200, 1):  # checked every second, as the daemon does
        w.check(float(now), down, "connection refused", "h:1")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3  # at 60, 120 and 180 s
    assert all("connection refused" in r.getMessage() for r in warnings)
    assert "not syncing for 180 s" in warnings[-1].getMessage()
    w.check(200.0, _stats(applied=3), "", "h:1")
    assert caplog.records[-1].levelno == logging.INFO
    assert "syncing after 200 s" in caplog.records[-1].getMessage()


@pytest.mark.parametrize("stats, kind", [(_stats("topic_missing"), "unavailable"),
                                         (_stats(foreign=2, lag=5), "model")])
def test_the_startup_deadline_raises_with_the_reason(stats, kind):
    w = StallWatch(10.0, t0=0.0)
    w.check(9.0, stats, "", "h:1")  # not yet
    with pytest.raises(StartupTimeout, match="not syncing after 10 s") as e:
        w.check(10.0, stats, "", "h:1")
    assert e.value.kind == kind


def test_no_deadline_once_syncing_nor_while_catching_up():
    w = StallWatch(10.0, t0=0.0)
    w.check(11.0, _stats(lag=100), "", "h:1")  # connected, reading, no other model yet
    w.check(12.0, _stats(applied=1), "", "h:1")
    w.check(500.0, _stats("disconnected"), "", "h:1")  # later trouble: retried, not fatal
    assert StallWatch(0.0, t0=0.0).check(1e6, _stats("disconnected"), "", "h:1") is None
