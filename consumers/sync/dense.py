"""The sync daemon's dense side: assembled versions, shared, checkpointed, measured, paired.

:class:`DenseSide` holds the daemon's :class:`~consumers.dense_assembly.DenseAssembler`
(restored from the checkpoint), shares each newly served version with other processes
(:mod:`consumers.serving.dense_shm`) once the daemon shares its tables, gives the
checkpoint the assembler's state (serialized again only when a chunk changed it), and
computes the dense gauges and the consistent view.

**The consistent view** (:meth:`DenseSide.consistent`, ``SyncDaemon.consistent``): the
dense version served and, per trainer shard, the trainer step of the newest row message
applied to its tables (rows carry their step since wire v2), read at **one instant of
the apply loop**: the dense reference is read before and after the steps, and the read is
retried when a version was switched in between — so the pair describes a state the
daemon really held, never a dense version with the row steps of another moment.
Policies:

* ``max_ahead=None`` ("newest of each"): the newest complete dense version and the newest
  rows; ``within`` is True.
* ``max_ahead=N``: the same pair, and ``within`` tells whether every shard's sparse step is
  at most N steps ahead of the dense version's step (a shard without rows counts as
  within). ``timeout`` > 0 waits (polling, no buffering) up to that many seconds for a pair
  within the bound. The daemon never holds rows back to make it true: rows of a shard and
  its dense chunks share a partition, in publish order, so holding rows would also hold
  the dense version they wait for. Tables are live: a lookup made after the call may see
  rows newer than the steps returned (never older).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

from consumers.dense_assembly import DenseAssembler, DenseView
from consumers.sequencing import SeqTracker
from consumers.serving.dense_shm import remove_dense, share_dense

__all__ = ["DenseSide", "ConsistentView"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsistentView:
    """Dense version and sparse state of one instant (see the module docstring).

    dense: the served dense version (None before the first). sparse_steps: trainer shard
    -> trainer step of the newest row message applied to its tables. ahead_steps: the
    largest ``sparse step - dense step`` over shards (None without both). within: the
    policy holds (always True for ``max_ahead=None``).
    """

    dense: Optional[DenseView]
    sparse_steps: dict[int, int] = field(default_factory=dict)
    ahead_steps: Optional[int] = None
    within: bool = True


def sparse_steps(seqs: SeqTracker) -> dict[int, int]:
    """Trainer shard -> step of the newest row message applied (over its tables)."""
    out: dict[int, int] = {}
    for (_table, shard), step in seqs.steps().items():
        out[shard] = max(step, out.get(shard, step))
    return out


class DenseSide:
    """The dense versions of one daemon (its loop thread calls :meth:`served` and
    :meth:`state`; any thread the readers)."""

    def __init__(self, model: str, state: Optional[bytes], state_dir: os.PathLike,
                 shm_dir: Optional[os.PathLike | str]) -> None:
        self.model, self.state_dir, self.shm_dir = model, state_dir, shm_dir
        self.assembler = DenseAssembler.from_state(state)
        self._sharing = False
        self._blob: tuple[int, Optional[bytes]] = (self.assembler.generation, state)

    def share(self) -> None:
        """Share every served version now and each new one from now on (once: the daemon
        calls this every round while it shares)."""
        if self._sharing:
            return
        self._sharing = True
        for shard in self.assembler.views():
            self.served(shard)

    def unshare(self) -> None:
        """Stop sharing (a clean stop): the shared files go, as the tables' do; readers
        that mapped a version keep it."""
        if self._sharing:
            remove_dense(self.state_dir, self.shm_dir)
        self._sharing = False

    @staticmethod
    def reset(state_dir: os.PathLike, shm_dir: Optional[os.PathLike | str]) -> None:
        """Remove the shared dense files of an old state (``reset_state``)."""
        remove_dense(state_dir, shm_dir)

    def served(self, shard: int) -> None:
        """Shard ``shard`` switched to a new version: share it when sharing."""
        view = self.assembler.view(shard)
        if not self._sharing or view is None:
            return
        try:
            share_dense(self.state_dir, self.model, view, self.shm_dir)
        except OSError as e:  # /dev/shm full: in-process serving goes on
            log.error("sharing dense version %s of shard %d failed (the next version is "
                      "shared again): %s", view.version, shard, e)

    def state(self) -> Optional[bytes]:
        """The assembler's state for a checkpoint (None: no dense message ever applied);
        the same bytes object while no chunk changed it."""
        gen, blob = self._blob
        if gen != self.assembler.generation:
            blob = self.assembler.state()
            self._blob = (self.assembler.generation, blob)
        return blob

    def consistent(self, seqs: SeqTracker, *, shard: Optional[int] = None,
                   max_ahead: Optional[int] = None, timeout: float = 0.0) -> ConsistentView:
        """The dense version and each shard's sparse step at one instant; see the module
        docstring for ``max_ahead`` and ``timeout``."""
        if max_ahead is not None and (isinstance(max_ahead, bool)
                                      or not isinstance(max_ahead, int) or max_ahead < 0):
            raise ValueError(f"max_ahead: expected None or an int ≥ 0, got {max_ahead!r}")
        deadline = time.monotonic() + max(0.0, float(timeout))
        while True:
            view = self._instant(seqs, shard, max_ahead)
            if view.within or time.monotonic() >= deadline:
                return view
            time.sleep(0.01)

    def _instant(self, seqs: SeqTracker, shard: Optional[int],
                 max_ahead: Optional[int]) -> ConsistentView:
        while True:
            before = self.assembler.view(shard)
            steps = sparse_steps(seqs)
            if self.assembler.view(shard) is before:  # no switch while reading the steps
                break
        ahead = None if before is None or not steps else \
            max(s - before.step for s in steps.values())
        within = max_ahead is None or ahead is None or ahead <= max_ahead
        return ConsistentView(before, steps, ahead, within)

    def stats(self, seqs: SeqTracker, now: Optional[float] = None) -> dict:
        """Dense counters and gauges: ``dense_versions`` (served, total), ``dense_incomplete``
        (versions never served: chunks missing), ``dense_unbased``, ``dense_gaps``,
        ``dense_missing_chunks``, ``dense_duplicates``, and for the newest served version
        ``dense_version`` [epoch, step], ``dense_age_s`` (now − its trainer ts),
        ``dense_age_steps`` (newest trainer step applied, rows or dense, − its step) and
        ``dense_sparse_steps`` (the consistent view's ``ahead_steps``); None before one."""
        c = self.assembler.counters
        out = {"dense_versions": c["versions"], "dense_incomplete": c["incomplete"],
               "dense_unbased": c["unbased"], "dense_gaps": c["gaps"],
               "dense_missing_chunks": c["missing_chunks"], "dense_duplicates": c["duplicates"],
               "dense_version": None, "dense_age_s": None, "dense_age_steps": None,
               "dense_sparse_steps": None}
        views = self.assembler.views()
        if not views:
            return out
        newest = max(views.values(), key=lambda v: v.version)
        steps = sparse_steps(seqs)
        seen = max([newest.step, *steps.values(),
                    *(s for _k, s in self.assembler.seqs.steps().items())])
        now = time.time() if now is None else now
        out.update(dense_version=list(newest.version),
                   dense_age_s=max(0.0, now - newest.ts / 1e9),
                   dense_age_steps=seen - newest.step,
                   dense_sparse_steps=max(steps.values()) - newest.step if steps else None)
        return out
