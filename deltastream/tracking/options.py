"""Argument checks of :class:`~deltastream.DeltaTracker`: its tracking mode and consumer
names (``ValueError``/``TypeError`` naming what was expected)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional, Union

from deltastream.types import TrackingMode

__all__ = ["tracking_mode", "consumer_names", "resolve_consumer"]


def tracking_mode(mode: Union[TrackingMode, str]) -> TrackingMode:
    """``mode`` (a TrackingMode or its value, any case) as a TrackingMode."""
    if isinstance(mode, str):
        try:
            return TrackingMode(mode.lower())
        except ValueError:
            raise ValueError(f"mode must be one of {[m.value for m in TrackingMode]}, "
                             f"got {mode!r}") from None
    if not isinstance(mode, TrackingMode):
        raise TypeError(f"mode must be a TrackingMode, got {mode!r}")
    return mode


def consumer_names(consumers: Optional[Iterable[str]], default: str) -> list[str]:
    """Consumer names: ``[default]`` for None, a str as one name; unique, non-empty."""
    out = [default] if consumers is None else [consumers] if isinstance(consumers, str) \
        else list(consumers)
    if not out or any(not isinstance(c, str) or not c for c in out):
        raise ValueError(f"consumers must be a non-empty list of non-empty str, got {out!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"consumers must be unique, got {out!r}")
    return out


def resolve_consumer(consumer: Optional[str], consumers: list[str], default: str) -> str:
    """The consumer a call means: ``consumer``, or for None the only one (or ``default``
    when it is one of several). Raises ``ValueError`` for None among several without
    ``default``, or an unknown name."""
    if consumer is None:
        if len(consumers) == 1:
            return consumers[0]
        if default in consumers:
            return default
        raise ValueError(f"consumer is required: this tracker has consumers {consumers}")
    if consumer not in consumers:
        raise ValueError(f"unknown consumer {consumer!r}; consumers: {consumers}")
    return consumer
