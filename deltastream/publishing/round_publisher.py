""":func:`~deltastream.publish_delta`'s rounds off the training loop.

``publish_delta`` runs on the thread that calls it: it reads the tracker, scores, selects,
encodes and sends before it returns its :class:`~deltastream.PublishRound` — at B = 4096
about 20 ms every round (``BENCHMARKS.md``). :class:`RoundPublisher` makes the same rounds
from :meth:`~RoundPublisher.tick`, called after every step, with the threads of
:class:`~deltastream.BudgetPublisher`: the training thread's part is the hand-off (the
rows changed since the last round, a copy of their current values taken at the step
boundary — on the CPU owed and copied over the next ticks, on CUDA copied asynchronously,
:mod:`~deltastream.publishing.handoff`), and every ``policy.every`` steps one goes to the
worker (a process where a core is spare, else a thread), which runs the round on the rows
the hand-offs copied (:mod:`~deltastream.publishing.round_engine`) and never reads the live
table.

What reaches predictors is what ``publish_delta`` called at the same steps with
``policy.select`` publishes, as long as the worker keeps up. When it falls behind, the
next round's rows wait and coalesce — in the tracker, or merged in the worker while a
round is sent — so a later round covers more steps (the newest value of each row, its
oldest FIRST state); ``stats()["pending"]`` counts them, ``held_rows`` the row copies the
worker keeps for its rounds (at most the tables' rows). Errors, ``flush``, ``drain``,
``close`` and ``stats()`` are the budget publisher's; a round's record is a
:class:`~deltastream.publishing.budget_engine.BudgetTick` whose ``round`` is the
``PublishRound`` (``bound`` NaN: rounds keep no serving-error bound).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Optional

from deltastream.publishing.budget import BudgetPublisher, BudgetTick
from deltastream.publishing.round_engine import RoundPolicy
from deltastream.publishing.rounds import RowPublisher

if TYPE_CHECKING:
    from deltastream.publishing.dense import DensePublisher
    from deltastream.tracking.tracker import DeltaTracker

__all__ = ["RoundPolicy", "RoundPublisher"]

log = logging.getLogger(__name__)


class RoundPublisher(BudgetPublisher):
    """Run ``publish_delta(tracker, publisher, consumer, policy.select)`` every
    ``policy.every`` steps, off the training thread (see the module docstring).

    Args:
        tracker: a :class:`~deltastream.DeltaTracker` in EMBEDDING mode with ``consumer``
            (read by this publisher only: it keeps the rows a round carries).
        publisher: a :class:`~deltastream.DeltaPublisher` (any
            :class:`~deltastream.publishing.rounds.RowPublisher`).
        consumer: the tracker consumer.
        policy: the rounds' selection and cadence (:class:`RoundPolicy`).
        tables, start_step, threaded, worker, on_round, dense: as for
            :class:`~deltastream.BudgetPublisher` (``start_step``: rounds fall due at the
            steps ``start_step + k × every``, k ≥ 1). A ``policy.select.weights`` function
            stays in this process: ``worker="auto"`` then runs rounds on a thread.

    A round that waits (the worker behind, or the last hand-off's rows still being copied:
    ``stats()["deferred_ticks"]``) runs at a later tick; the next one is due on the
    schedule all the same, so the rounds keep to ``publish_delta``'s steps.
    """

    policy_type = RoundPolicy
    #: a round publishes the delta of one step: its tables are read at once
    in_parts = False

    def __init__(self, tracker: DeltaTracker, publisher: RowPublisher, consumer: str,
                 policy: RoundPolicy, *, tables: Optional[Mapping[str, Any]] = None,
                 start_step: int = 0, threaded: bool = True, worker: str = "auto",
                 on_round: Optional[Callable[[BudgetTick], None]] = None,
                 dense: Optional[DensePublisher] = None) -> None:
        if worker == "auto" and isinstance(policy, RoundPolicy) \
                and policy.select.weights is not None:
            log.info("round publisher: a weights function is not sent to a worker "
                     "process; rounds run on a thread")
            worker = "thread"
        self._start_step = int(start_step)
        super().__init__(tracker, publisher, consumer, policy, tables=tables,
                         start_step=start_step, threaded=threaded, worker=worker,
                         on_round=on_round, dense=dense)

    def _due(self, step: int, now: float) -> bool:
        """A round every ``policy.every`` steps."""
        return step - self._last_round_step >= self.policy.every

    def _round_step(self, step: int) -> int:
        """The step on the schedule a round at ``step`` was due (``step`` itself unless it
        waited): a round that waited does not move the ones after it."""
        return step - (step - self._start_step) % self.policy.every
