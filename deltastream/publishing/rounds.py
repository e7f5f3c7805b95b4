"""One publish round: read a tracker consumer's delta, select, retain the rest, publish.

:func:`publish_delta` is the loop every trainer writes around the library::

    for fqn, delta in tracker.get_delta(consumer).items():
        sel = select_changed(delta, table, **policy)      # what goes out now
        tracker.retain(consumer, fqn, sel.leftover)       # the rest stays tracked
        publisher.publish(name, sel.ids, sel.rows, tombstones=sel.tombstones, ...)

with the bookkeeping done once: table names, the wire dtype the byte budget is counted in,
counters per table and in total, and no row lost when publishing fails part-way (the rows
not handed to the publisher go back to the tracker before the error propagates). It runs
on the calling thread; :class:`~deltastream.RoundPublisher` runs the same rounds
(:func:`run_round`) off the training loop.

Carried rows: re-reading and re-scoring the whole leftover every round costs O(rows
carried). Where it pays (a budget that takes a small share of its candidates, the usual
case with a large carried set), the leftover is not handed back with ``retain`` but kept
by ``publish_delta`` itself, per tracker and consumer, scored and ordered
(:mod:`~deltastream.publishing.carried`, :mod:`~deltastream.publishing.carried_select`):
a round then reads the rows changed since the last round plus the rows it takes, and
makes the same choice as the loop above (``tests/deltastream/publishing/
test_rounds_carried.py`` compares them on random sequences). Other rounds run the loop
above, the carried rows joining their delta first (older FIRST state and age win, as with
``retain``). So ``tracker.get_delta(consumer)`` called by someone else between rounds does
not see the rows ``publish_delta`` carries, and ``tracker.clear(consumer)`` does not drop
them; they still go out in a later round.

:class:`SelectionPolicy` holds ``select_changed``'s budget arguments, checked when it is
built, so a bad policy fails at start-up rather than at the first round.

The publisher is anything with a ``dtype`` (wire dtype name) and
``publish(table, ids, rows, *, step, tombstones, ts)`` returning counters like
:class:`~deltastream.PublishResult` (``rows``, ``tombstones``, ``messages``, ``bytes``):
usually a :class:`~deltastream.DeltaPublisher`.

Column shards: a table module with ``full_width`` (and ``column_offset``, ``shard_id``), as
the shards of :class:`~deltastream.ShardedEmbeddingCollection` have, holds columns
``[column_offset, column_offset + embedding_dim)`` of rows ``full_width`` wide; its rows
go out with ``publish(..., col=, width=, shard=)`` (:func:`shard_publish_kwargs`), one seq
stream per column shard.

Selection on a column shard scores the drift of **its own columns** (the shard's rows are
those columns): the column shards of one row are selected independently, so they may go out
at different rounds, and a predictor may briefly serve a row whose columns come from
different rounds (each column shard's part is a value the trainer really held). How long at
most, per policy, in rounds after the round in which the first part went out:

* no budget (every changed row) or ``final=True``: 0 — every shard publishes its changed
  rows in the same round, so the row is whole again when that round's messages apply;
* ``k`` / ``fraction`` (count budgets): about ``max_age + ceil(R / k)`` rounds (``R``
  candidates per shard), the bound of :func:`~deltastream.select_changed` for a carried
  row, applied per column shard;
* ``threshold``: unbounded in rounds, bounded in error — a shard's columns are held back
  only while they are within ``threshold`` of what the predictor serves, so every column
  shard of the row is within the threshold (the row within ``threshold × √shards``);
* ``max_bytes`` on top of a threshold: as the threshold, plus the count-budget delay for
  eligible rows over the byte cap.

A final flush ends every mix: after it, predictors hold the trainer's full rows.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from deltastream.errors import PublishError
from deltastream.publishing.carried import CarriedTable, carried_state
from deltastream.publishing.carried_select import carries, drop_gone, select_carried
from deltastream.publishing.redelivery import hand_back_undelivered
from deltastream.publishing.selection import NEW_ROW_POLICIES, Selection, select_changed
from deltastream.publishing.selection_rules import Budget
from deltastream.tracking.rows import merge_carry
from deltastream.types import DeltaRows

if TYPE_CHECKING:
    from deltastream.publishing.dense import DensePublisher
    from deltastream.tracking.tracker import DeltaTracker

__all__ = ["SelectionPolicy", "TableRound", "PublishRound", "RowPublisher", "publish_delta",
           "run_round", "hand_back_failed", "table_name", "shard_publish_kwargs"]

log = logging.getLogger(__name__)

#: ``weights`` hook of a policy: ``(fqn, candidate ids [n]) -> float weights [n]``.
WeightsFn = Callable[[str, torch.Tensor], torch.Tensor]


class RowPublisher(Protocol):
    """What :func:`publish_delta` needs of a publisher (a :class:`~deltastream.DeltaPublisher`)."""

    dtype: str

    def publish(self, table: str, ids: Any, rows: Any, *, step: int,
                tombstones: Any = None, ts: Optional[int] = None) -> Any:
        """Send ``rows`` ``[n, dim]`` of ``ids`` ``[n]``; return ``rows``/``tombstones``/
        ``messages``/``bytes`` counters (a :class:`~deltastream.PublishResult`)."""


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"SelectionPolicy.{name} must be an int, got "
                        f"{type(value).__name__} {value!r}")
    if value < lo:
        raise ValueError(f"SelectionPolicy.{name} must be >= {lo}, got {value}")


@dataclass(frozen=True)
class SelectionPolicy:
    """How many of a round's changed rows go out: ``select_changed``'s keyword arguments.

    At most one of ``k`` (rows per table), ``fraction`` (of the finite candidates, in
    ``(0, 1]``) and ``threshold`` (drift, L2 in embedding units; relative to ``‖row‖`` with
    ``relative``); none of them = every finite row. ``max_bytes`` caps the wire payload per
    table and round (bytes, counted in the publisher's wire dtype). ``max_age``, ``new_rows``
    as in :func:`~deltastream.select_changed`. ``weights``, if given, is called as
    ``weights(fqn, ids)`` with the candidate ids ``[n]`` of a table and returns float
    importance weights ``[n]`` (e.g. ``LookupRate.rate(ids).sqrt()``).

    Raises:
        TypeError / ValueError: naming the bad field and what was expected.
    """

    k: Optional[int] = None
    fraction: Optional[float] = None
    threshold: Optional[float] = None
    max_bytes: Optional[int] = None
    max_age: Optional[int] = 16
    relative: bool = False
    new_rows: str = "first"
    weights: Optional[WeightsFn] = None

    def __post_init__(self) -> None:
        given = [n for n in ("k", "fraction", "threshold") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"SelectionPolicy: give at most one of k, fraction, threshold; "
                             f"got {', '.join(given)}")
        if self.k is not None:
            _check_int("k", self.k, 0)
        if self.fraction is not None:
            f = self.fraction
            if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0.0 < f <= 1.0:
                raise ValueError(f"SelectionPolicy.fraction must be a number in (0, 1], "
                                 f"got {f!r}")
        if self.threshold is not None:
            t = self.threshold
            if isinstance(t, bool) or not isinstance(t, numbers.Real) \
                    or not (math.isfinite(t) and t >= 0.0):
                raise ValueError(f"SelectionPolicy.threshold must be a finite number >= 0, "
                                 f"got {t!r}")
        if self.max_bytes is not None:
            _check_int("max_bytes", self.max_bytes, 0)
        if self.max_age is not None:
            _check_int("max_age", self.max_age, 0)
        if not isinstance(self.relative, bool):
            raise TypeError(f"SelectionPolicy.relative must be a bool, got {self.relative!r}")
        if self.relative and self.threshold is None:
            raise ValueError("SelectionPolicy.relative=True needs a threshold (it makes the "
                             "threshold relative to the row norm)")
        if self.new_rows not in NEW_ROW_POLICIES:
            raise ValueError(f"SelectionPolicy.new_rows must be one of "
                             f"{list(NEW_ROW_POLICIES)}, got {self.new_rows!r}")
        if self.weights is not None and not callable(self.weights):
            raise TypeError(f"SelectionPolicy.weights must be callable (fqn, ids) -> weights, "
                            f"got {type(self.weights).__name__}")

    def budget(self, wire_dtype: str) -> Budget:
        """This policy's budget arguments, rows costed in ``wire_dtype``."""
        return Budget(self.k, self.fraction, self.threshold, self.max_bytes, wire_dtype,
                      self.max_age, self.relative, self.new_rows)

    def select(self, delta: DeltaRows, table: torch.nn.Module, *, fqn: str,
               wire_dtype: str) -> Selection:
        """``select_changed(delta, table, ...)`` with this policy's arguments."""
        weights = None if self.weights is None else self.weights(fqn, delta.ids)
        return select_changed(delta, table, k=self.k, fraction=self.fraction,
                              threshold=self.threshold, max_bytes=self.max_bytes,
                              wire_dtype=wire_dtype, max_age=self.max_age,
                              relative=self.relative, new_rows=self.new_rows, weights=weights)


@dataclass(frozen=True)
class TableRound:
    """What one round did for one table (counts in rows, ``bytes`` in encoded bytes).

    Attributes:
        fqn: the tracker's key of the table. table: the name rows were published under.
        tracked: candidate rows read from the tracker. published: rows handed to the
            publisher. tombstones: evicted ids published. carried: rows retained for the
            next round (tracked, not lost). rejected: rows skipped as non-finite.
        messages, bytes: what the publisher sent (0 when nothing was published).
        ids: int64 ``[published]`` ascending ids published (the delta's device).
        result: the publisher's return value (a :class:`~deltastream.PublishResult`), or
            ``None`` when there was nothing to publish.
    """

    fqn: str
    table: str
    tracked: int
    published: int
    tombstones: int
    carried: int
    rejected: int
    messages: int
    bytes: int
    ids: torch.Tensor
    result: Any = None


_COUNTERS = ("tracked", "published", "carried", "rejected", "tombstones", "messages", "bytes")


@dataclass(frozen=True)
class PublishRound:
    """One call of :func:`publish_delta`: per-table records and their totals.

    ``ts`` is the wall clock (ns) when the delta was read, carried by every message;
    ``seconds`` the round's duration. Tables with nothing to publish or carry are left out.
    """

    step: int
    ts: int
    final: bool
    seconds: float
    tables: tuple[TableRound, ...]

    def _sum(self, name: str) -> int:
        return sum(getattr(t, name) for t in self.tables)

    @property
    def tracked(self) -> int:
        return self._sum("tracked")

    @property
    def published(self) -> int:
        return self._sum("published")

    @property
    def tombstones(self) -> int:
        return self._sum("tombstones")

    @property
    def carried(self) -> int:
        return self._sum("carried")

    @property
    def rejected(self) -> int:
        return self._sum("rejected")

    @property
    def messages(self) -> int:
        return self._sum("messages")

    @property
    def bytes(self) -> int:
        return self._sum("bytes")

    def totals(self) -> dict[str, int]:
        """``{tracked, published, carried, rejected, tombstones, messages, bytes}`` summed."""
        return {k: self._sum(k) for k in _COUNTERS}


def table_name(fqn: str, module: torch.nn.Module) -> str:
    """The name a tracked table's rows are published under.

    A table that carries its own name (:class:`~deltastream.HashTable`, a
    :class:`~deltastream.ShardedEmbedding` shard: ``module.name``) is published under it, so
    every shard of a table agrees whatever its module path; any other module (a
    ``torch.nn.Embedding`` or ``EmbeddingBag``) under its fqn — the tracker's key, the same
    whether the model is wrapped in DDP, DataParallel or ``torch.compile`` or not. A column
    shard of a :class:`~deltastream.ShardedEmbeddingCollection` is published under its
    ``plan_table``.
    """
    name = getattr(module, "plan_table", None) or getattr(module, "name", None)
    return name if isinstance(name, str) and name else fqn


def shard_publish_kwargs(module: torch.nn.Module) -> dict[str, int]:
    """``{"col", "width", "shard"}`` for a column shard (a module with ``full_width``,
    ``column_offset`` and ``shard_id``), else ``{}`` (whole rows, the publisher's shard)."""
    width = getattr(module, "full_width", None)
    if width is None:
        return {}
    kw = {"col": int(getattr(module, "column_offset", 0)), "width": int(width)}
    shard = getattr(module, "shard_id", None)
    if shard is not None:
        kw["shard"] = int(shard)
    return kw


def _table_names(modules: Mapping[str, torch.nn.Module]) -> dict[str, str]:
    """``{fqn: published name}``; raises ``ValueError`` when two tables share a name and a
    shard (their rows would overwrite each other on the predictors). Column shards of one
    table share its name with distinct shard ids: each is its own sequence stream."""
    names = {fqn: table_name(fqn, m) for fqn, m in modules.items()}
    by_name: dict[tuple, list[str]] = {}
    for fqn, name in names.items():
        by_name.setdefault((name, shard_publish_kwargs(modules[fqn]).get("shard")),
                           []).append(fqn)
    clash = {n: f for (n, _), f in by_name.items() if len(f) > 1}
    if clash:
        raise ValueError(f"publish_delta: tables publish under the same name: {clash}; give "
                         f"each HashTable a unique name (nn.Embedding tables publish under "
                         f"their fqn)")
    return names


def _as_float(rows: torch.Tensor) -> torch.Tensor:
    """Rows as a float dtype every publisher reads (bfloat16 and float64 as float32)."""
    return rows if rows.dtype in (torch.float32, torch.float16) else rows.float()


def _rows_at(delta: DeltaRows, ids: torch.Tensor) -> DeltaRows:
    """The rows of ``delta`` for ``ids`` (a subset of ``delta.ids``, ascending), every column."""
    pos = torch.searchsorted(delta.ids, ids.to(delta.ids.device))

    def pick(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if x is None else x.index_select(0, pos.to(x.device))

    return DeltaRows(ids=pick(delta.ids), states=pick(delta.states), new=pick(delta.new),
                     age=pick(delta.age))


def publish_delta(tracker: DeltaTracker, publisher: RowPublisher, consumer: str,
                  policy: Optional[SelectionPolicy] = None, *, step: int, final: bool = False,
                  tables: Optional[Mapping[str, torch.nn.Module]] = None,
                  ts: Optional[int] = None,
                  dense: Optional[DensePublisher] = None) -> PublishRound:
    """Run one publish round of ``consumer``: select, retain the leftover, publish.

    For every table in ``tracker.get_delta(consumer)`` with changed rows or tombstones:
    ``policy.select`` picks the rows (current values read from the table: a HashTable, a
    ShardedEmbedding shard, an ``nn.Embedding`` or ``nn.EmbeddingBag``), the leftover is
    carried to the next round (older FIRST state, ``age + 1``: kept by this function, or
    handed back with ``tracker.retain``; see the module docstring), and the selected rows
    (``[n, dim]`` in the table's width, float32/float16; other float dtypes as float32)
    and the delta's tombstones are published under :func:`table_name`.

    Args:
        tracker: a :class:`~deltastream.DeltaTracker` with ``consumer``.
        publisher: a :class:`~deltastream.DeltaPublisher` (or any :class:`RowPublisher`);
            its ``dtype`` is the wire dtype ``policy.max_bytes`` is counted in.
        policy: the selection budget; ``None`` = every finite row.
        step: trainer global step carried by the messages (>= 0).
        final: a final flush: publish every finite row whatever ``policy`` says, retain
            nothing, then ``publisher.flush()`` (when it has one) so that what failed is
            known and handed back: repeat a final round until it returns.
        tables: ``{fqn: module}`` where rows are read; default
            ``tracker.get_tracked_modules()``.
        ts: wall clock in ns stamped on the messages; default when the delta is read.
        dense: a :class:`~deltastream.publishing.dense.DensePublisher` ticked after the
            rows (a version when its cadence says so; ``final``: a full version, sent
            before this returns).

    Returns:
        A :class:`PublishRound` with per-table counts, published ids and publisher results.

    Raises:
        ValueError: two tables would publish under the same name (before anything is read).
        PublishError: from the publisher. Before it propagates, the rows that were not
            handed to the publisher (the failing table's selection and every later table's
            candidates) are retained, so the next round publishes them again; the failing
            table's selection may then go out twice (upserts are idempotent). Tombstones
            cannot be retained (``retain`` keeps rows): the error's notes name the tables
            whose tombstones were not published. Messages of earlier rounds that failed
            after they were handed over are named in ``PublishError.undelivered``, and
            their ids are retained too (FIRST state zeros, ``age`` ``policy.max_age``:
            :mod:`~deltastream.publishing.redelivery`), so a later round sends their
            current value; the trainer only has to go on.
        Any error of ``select_changed`` or the tracker, after the same hand-back.
    """
    policy = SelectionPolicy() if policy is None else policy
    if not isinstance(policy, SelectionPolicy):
        raise TypeError(f"policy must be a SelectionPolicy or None, got "
                        f"{type(policy).__name__}")
    modules = tracker.get_tracked_modules() if tables is None else tables
    names = _table_names(modules)  # checked before the delta is read: nothing is consumed
    t0 = time.monotonic()
    ts = time.time_ns() if ts is None else ts
    done = run_round(tracker, consumer, publisher, policy, modules, names,
                     lambda: tracker.get_delta(consumer), step=step, ts=ts, final=final)
    if dense is not None:  # before the final flush below, which then covers it too
        (dense.flush if final else dense.tick)(step, ts=ts)
    flush = getattr(publisher, "flush", None) if final else None
    if callable(flush):
        try:  # a final round ends with every message acknowledged, or handed back
            flush()
        except PublishError as e:
            hand_back_failed(tracker, consumer, e, names, modules, policy)
            raise
    return PublishRound(step=step, ts=ts, final=final, seconds=time.monotonic() - t0,
                        tables=tuple(done))


def run_round(tracker: Any, consumer: str, publisher: RowPublisher, policy: SelectionPolicy,
              modules: Mapping[str, torch.nn.Module], names: Mapping[str, str],
              read: Callable[[], Mapping[str, DeltaRows]], *, step: int, ts: int,
              final: bool) -> list[TableRound]:
    """The tables of one round (:func:`publish_delta` without its read, dense tick and
    final flush): ``read()`` gives the deltas once the round is numbered; rows are read
    from ``modules``, carried between rounds per ``tracker`` and ``consumer``, and handed
    back with ``tracker.retain`` (``tracker``: a :class:`~deltastream.DeltaTracker`, or
    anything with its ``retain``: :class:`~deltastream.publishing.round_engine.RoundEngine`
    runs rounds on the rows a worker holds). ``names``: ``{fqn: published name}``."""
    rnd = _Round(tracker, consumer, publisher, policy, modules, names, step=step, ts=ts,
                 final=final)
    return rnd.run(read())


# (fqn, rows, ids of the rows still at stake: None = all of them): what is left of a
# round's tables when an error propagates goes back to the tracker
_Pending = list[tuple[str, DeltaRows, Optional[torch.Tensor]]]


class _Round:
    """The tables of one :func:`publish_delta` call: select, carry or retain the rest,
    publish. Rows a budget carries stay in the consumer's
    :class:`~deltastream.publishing.carried.CarriedTable` s between rounds (scored and
    ordered: a round reads what changed and what it takes), except where
    :func:`~deltastream.publishing.carried_select.carries` says a round needs every
    candidate: then the carried rows join the delta and the leftover goes back to the
    tracker with ``retain``, as it always did."""

    def __init__(self, tracker: DeltaTracker, consumer: str, publisher: RowPublisher,
                 policy: SelectionPolicy, modules: Mapping[str, torch.nn.Module],
                 names: Mapping[str, str], *, step: int, ts: int, final: bool) -> None:
        self.tracker, self.consumer, self.publisher = tracker, consumer, publisher
        self.policy, self.modules, self.names = policy, modules, names
        self.step, self.ts, self.final = step, ts, final
        self.budget = policy.budget(publisher.dtype)
        self.state = carried_state(tracker)
        self.number = self.state.next_round(consumer)
        self.carried = self.state.of(consumer)

    def run(self, deltas: Mapping[str, DeltaRows]) -> list[TableRound]:
        """Every table of ``deltas`` (and every table with carried rows) in turn; on an
        error the rows not handed to the publisher go back to the tracker first."""
        pending: _Pending = [(fqn, d, None) for fqn, d in deltas.items()]
        pending += [(fqn, DeltaRows(ids=torch.empty(0, dtype=torch.int64)), None)
                    for fqn, c in self.carried.items() if len(c) and fqn not in deltas]
        done: list[TableRound] = []
        while pending:
            try:
                rec = self._table(pending)
            except BaseException as e:
                _hand_back(self.tracker, self.consumer, pending, e)
                hand_back_failed(self.tracker, self.consumer, e, self.names, self.modules,
                                 self.policy)
                raise
            pending.pop(0)
            if rec is not None:
                done.append(rec)
        return done

    def _table(self, pending: _Pending) -> Optional[TableRound]:
        """The round of ``pending[0]``'s table; ``pending[0]`` narrows to the rows at stake."""
        fqn, delta, _ = pending[0]
        n_tomb = 0 if delta.tombstones is None else int(delta.tombstones.numel())
        carried = self.carried.get(fqn)
        if len(delta) == 0 and n_tomb == 0 and not (carried is not None and len(carried)):
            return None
        if fqn not in self.modules:
            raise KeyError(f"table {fqn!r} of the delta is not in tables {sorted(self.modules)}")
        module = self.modules[fqn]
        seen = (self.consumer, fqn)
        if carries(self.budget, delta, carried, final=self.final,
                   weighted=self.policy.weights is not None,
                   changed_before=self.state.changed.get(seen, 0)):
            self.state.changed[seen] = len(delta)
            if carried is None or not len(carried):  # (re)made for this policy's rules
                carried = self.carried[fqn] = CarriedTable(
                    int(delta.states.shape[1]), delta.states.dtype, self.budget.new_rows)
            sel, taken, tracked = select_carried(carried, delta, module, self.budget,
                                                 self.number)
            pending[0] = (fqn, taken, None)
            left = len(carried)
        else:
            delta = self._with_carried(fqn, delta)
            pending[0] = (fqn, delta, None)
            sel = (select_changed(delta, module, wire_dtype=self.publisher.dtype)
                   if self.final else self.policy.select(delta, module, fqn=fqn,
                                                         wire_dtype=self.publisher.dtype))
            if len(sel.leftover):
                self.tracker.retain(self.consumer, fqn, sel.leftover)
            # from here on only the selection is at stake: the leftover is in the tracker
            pending[0] = (fqn, delta, sel.ids)
            tracked, left = len(delta), len(sel.leftover)
        res = None
        if len(sel) or n_tomb:
            res = self.publisher.publish(self.names[fqn], sel.ids, _as_float(sel.rows),
                                         step=self.step, ts=self.ts,
                                         tombstones=sel.tombstones if n_tomb else None,
                                         **shard_publish_kwargs(module))
        return TableRound(
            fqn=fqn, table=self.names[fqn], tracked=tracked,
            published=0 if res is None else int(res.rows),
            tombstones=0 if res is None else int(res.tombstones), carried=left,
            rejected=sel.n_rejected, messages=0 if res is None else int(res.messages),
            bytes=0 if res is None else int(res.bytes), ids=sel.ids, result=res)

    def _with_carried(self, fqn: str, delta: DeltaRows) -> DeltaRows:
        """``delta`` united with the table's carried rows (which then end: the full path
        retains its leftover in the tracker); the carried rows are older, their state wins."""
        carried = self.carried.pop(fqn, None)
        if carried is None or not len(carried):
            return delta
        drop_gone(carried, delta)
        rows, _ = carried.take(carried.live_slots(), self.number)
        if not len(rows):
            return delta
        if not len(delta) and delta.states is None and delta.tombstones is None:
            return rows  # a table with carried rows only
        return merge_carry(rows, delta)


def hand_back_failed(tracker: Any, consumer: str, error: BaseException,
                     names: Mapping[str, str], modules: Mapping[str, torch.nn.Module],
                     policy: SelectionPolicy) -> None:
    """After a ``PublishError``: retain the ids of the messages it names as undelivered
    (sent by this or an earlier round), so a later round publishes their current value."""
    undelivered = getattr(error, "undelivered", None) if isinstance(error, PublishError) \
        else None
    if not undelivered:
        return
    streams = {(name, shard_publish_kwargs(modules[fqn]).get("shard")): fqn
               for fqn, name in names.items()}
    try:
        rows = hand_back_undelivered(tracker, consumer, undelivered, streams, modules,
                                     age=policy.max_age or 0)
    except Exception:  # keep the original error; this one is logged
        log.exception("publish round: could not hand back undelivered rows")
        return
    if rows:
        error.add_note(f"publish_delta: {rows} rows of undelivered messages handed back to "
                       f"consumer {consumer!r}: a later round sends their current value")


def _hand_back(tracker: DeltaTracker, consumer: str,
               pending: list[tuple[str, DeltaRows, Optional[torch.Tensor]]],
               error: BaseException) -> None:
    """After ``error``: retain the rows of ``pending`` (not handed to the publisher)."""
    rows = 0
    lost: list[str] = []
    for fqn, delta, ids in pending:
        if delta.tombstones is not None and delta.tombstones.numel():
            lost.append(f"{fqn} ({int(delta.tombstones.numel())})")
        if ids is not None:
            delta = _rows_at(delta, ids)
        if not len(delta):
            continue
        try:
            tracker.retain(consumer, fqn, delta)
            rows += len(delta)
        except Exception:  # keep the original error; this one is logged
            log.exception("publish round: could not retain %d rows of %s", len(delta), fqn)
    text = (f"publish_delta: {rows} unpublished rows of consumer {consumer!r} retained for "
            f"the next round" + (f"; tombstones not published: {', '.join(lost)}" if lost
                                 else ""))
    log.warning("%s (after %s)", text, type(error).__name__)
    error.add_note(text)
