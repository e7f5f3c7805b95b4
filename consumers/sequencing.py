"""Per-(table, shard) sequence bookkeeping: duplicates, gaps, trainer restarts.

Every message of one (model, table, shard, epoch) carries ``seq`` 0, 1, 2, … A consumer
remembers, per (table, shard), the current epoch and the last seq it applied, and classifies
each new message (:meth:`SeqTracker.check`, no state change) before applying it and
recording it (:meth:`SeqTracker.commit`):

==============  ========================================================  ===============
verdict         when                                                      consumer does
==============  ========================================================  ===============
``ok``          first message of the stream (any seq: a predictor may      apply
                start from a snapshot or after retention), or seq = last+1
``duplicate``   same epoch, seq ≤ last (a producer retry, a replay)        skip, count
``gap``         same epoch, seq > last + 1; ``missing`` = (last+1, seq-1)  apply, count, log
``new_epoch``   epoch > current (trainer restarted; seq restarts at 0);    apply; a gap if
                ``missing`` = (0, seq-1) when seq > 0                      missing is set
``stale_epoch`` epoch < current (a zombie trainer still publishing)        skip, count
==============  ========================================================  ===============

:meth:`SeqTracker.commit` also records the trainer ``step`` of the message when given
(rows carry it since wire v2): :meth:`SeqTracker.steps` is the step each stream's state
is at, checkpointed with the seqs (the consistent view of dense and sparse state uses it).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["SeqVerdict", "SeqTracker", "VERDICTS"]

log = logging.getLogger(__name__)

VERDICTS = ("ok", "duplicate", "gap", "new_epoch", "stale_epoch")
_STATE_VERSION = 1


@dataclass(frozen=True)
class SeqVerdict:
    """How a message's (epoch, seq) relates to what was applied before.

    ``missing``: inclusive range of seqs never seen, for ``gap`` and a ``new_epoch`` that does
    not start at 0; otherwise None.
    """

    kind: str
    missing: Optional[tuple[int, int]] = None

    @property
    def accept(self) -> bool:
        """True when the message should be applied (ok, gap, new_epoch)."""
        return self.kind in ("ok", "gap", "new_epoch")


_OK = SeqVerdict("ok")
_DUP = SeqVerdict("duplicate")
_STALE = SeqVerdict("stale_epoch")


def _check_int(what: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{what}: expected a non-negative int, got {v!r}")
    return v


class SeqTracker:
    """Current epoch and last applied seq per (table, shard). Thread-safe."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], tuple[int, int]] = {}
        self._steps: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._last)

    def check(self, table: str, shard: int, epoch: int, seq: int) -> SeqVerdict:
        """Classify message (epoch, seq) of (table, shard); changes nothing."""
        _check_int("shard", shard)
        _check_int("epoch", epoch)
        _check_int("seq", seq)
        with self._lock:
            cur = self._last.get((table, shard))
        if cur is None:
            return _OK
        cur_epoch, last = cur
        if epoch < cur_epoch:
            return _STALE
        if epoch > cur_epoch:
            return SeqVerdict("new_epoch", (0, seq - 1) if seq > 0 else None)
        if seq <= last:
            return _DUP
        if seq > last + 1:
            return SeqVerdict("gap", (last + 1, seq - 1))
        return _OK

    def commit(self, table: str, shard: int, epoch: int, seq: int,
               step: Optional[int] = None) -> None:
        """Record (epoch, seq) of (table, shard) as applied; ``step``: the message's trainer
        step (None: unknown, the recorded one is kept)."""
        _check_int("shard", shard)
        _check_int("epoch", epoch)
        _check_int("seq", seq)
        if step is not None:
            _check_int("step", step)
        with self._lock:
            self._last[(table, shard)] = (epoch, seq)
            if step is not None:
                self._steps[(table, shard)] = step

    def steps(self) -> dict[tuple[str, int], int]:
        """(table, shard) -> trainer step of the last message applied (where known)."""
        with self._lock:
            return dict(self._steps)

    def get(self, table: str, shard: int) -> Optional[tuple[int, int]]:
        """(epoch, last seq) of (table, shard), or None when nothing was applied."""
        with self._lock:
            return self._last.get((table, shard))

    def state(self) -> dict:
        """JSON-able state: ``{"version": 1, "streams": [{table, shard, epoch, seq[, step]},
        ...]}``."""
        with self._lock:
            items = sorted(self._last.items())
            steps = dict(self._steps)
        return {"version": _STATE_VERSION,
                "streams": [{"table": t, "shard": s, "epoch": e, "seq": q,
                             **({"step": steps[(t, s)]} if (t, s) in steps else {})}
                            for (t, s), (e, q) in items]}

    @classmethod
    def from_state(cls, d: Any) -> SeqTracker:
        """Rebuild from :meth:`state` (an empty dict gives an empty tracker)."""
        tr = cls()
        if d in (None, {}):
            return tr
        if not isinstance(d, dict) or d.get("version") != _STATE_VERSION \
                or not isinstance(d.get("streams"), list):
            raise ValueError(f"seq state: expected {{'version': {_STATE_VERSION}, "
                             f"'streams': [...]}}, got {d!r:.200}")
        for s in d["streams"]:
            if not isinstance(s, dict) or not isinstance(s.get("table"), str):
                raise ValueError(f"seq state: malformed stream entry {s!r}")
            tr.commit(s["table"], s.get("shard"), s.get("epoch"), s.get("seq"), s.get("step"))
        return tr
