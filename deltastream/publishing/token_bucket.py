"""A byte budget as a token bucket: refills at a rate, holds at most a burst.

:class:`TokenBucket` counts bytes. ``refill(units)`` adds ``rate × units`` (units are
seconds or steps, whichever the rate is given in) up to ``burst``; ``spend(nbytes)`` takes
what was actually sent and may leave the bucket in debt (negative) when the estimate before
sending was short, so the long-run rate is exact. Over any run of refills totalling ``U``
units the bytes spent are at most ``burst + rate × U`` plus the last overshoot.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["TokenBucket"]


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not (math.isfinite(float(value)) and float(value) > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


class TokenBucket:
    """Bytes that may be sent now.

    Args:
        rate: bytes added per unit (per second or per step), ``> 0``.
        burst: most bytes the bucket holds (the largest single spend after idling),
            ``> 0``.
        tokens: bytes in the bucket at the start (default 0: nothing before the first
            refill), at most ``burst``.
    """

    def __init__(self, rate: float, burst: float, *, tokens: float = 0.0) -> None:
        self.rate = _positive("rate", rate)
        self.burst = _positive("burst", burst)
        if isinstance(tokens, bool) or not isinstance(tokens, numbers.Real) \
                or not math.isfinite(float(tokens)):
            raise ValueError(f"tokens must be a finite number, got {tokens!r}")
        self.tokens = min(float(tokens), self.burst)
        self.added = 0.0  #: bytes added by refills (after the burst cap)
        self.spent = 0  #: bytes spent

    def refill(self, units: float, over: float = 0.0) -> float:
        """Add ``rate × units`` bytes (``units >= 0``), capped at ``burst`` plus the refill
        of ``over`` units (``0 <= over``: of ``units``, those a caller was busy through, not
        idle: a hand-off read over several ticks); the tokens now."""
        for what, x in (("units", units), ("over", over)):
            if isinstance(x, bool) or not isinstance(x, numbers.Real) \
                    or not (math.isfinite(float(x)) and float(x) >= 0.0):
                raise ValueError(f"{what} must be a finite number >= 0, got {x!r}")
        before = self.tokens
        self.tokens = min(self.burst + self.rate * float(over),
                          self.tokens + self.rate * float(units))
        self.added += max(0.0, self.tokens - before)
        return self.tokens

    def spend(self, nbytes: int) -> float:
        """Take ``nbytes`` (``>= 0``) that were sent; the tokens left (negative = debt)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        self.tokens -= int(nbytes)
        self.spent += int(nbytes)
        return self.tokens
