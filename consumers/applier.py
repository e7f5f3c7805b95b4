"""The one place that turns raw Kafka record values into serving-table changes.

The sync daemon and the replay tool both feed records through :class:`Applier`, so the same
records in the same order give bit-identical tables in both. :meth:`Applier.process` never
raises on bad data and never applies part of a message:

1. headers (optional, untrusted) let a record of a shard we do not serve be skipped without
   decoding;
2. :func:`deltastream.wire.decode` validates the message (``WireError`` -> quarantined);
3. model, headers-vs-body agreement, shard filter, a valid column range (a wire-v2 column
   slice from a column-wise shard is applied to those columns of its rows,
   :mod:`consumers.serving.columns`), known table and dim (a slice's ``width``) are checked; a
   message of another model is not corrupt — it is skipped and counted by model name
   (``foreign_model``, :attr:`Applier.models`; ``Outcome.model`` names it), never
   quarantined;
4. :class:`~consumers.sequencing.SeqTracker` classifies (epoch, seq): duplicates and stale
   epochs are skipped, gaps and new epochs are applied and reported;
5. :meth:`ServingTable.apply` trusts the decoded batch, checks what is the table's (dim, a
   wire-v2 column slice's ``width``; finite values in its storage range) and applies
   atomically (``ApplyError`` -> quarantined; a table first seen is only created when its
   first batch applies);
6. the seq is committed.

A quarantined message's seq is not committed: its data never reached the table, so the next
message of that stream reports the gap.

Dense chunks (:mod:`deltastream.dense_wire`, told apart by their Kafka headers, or by how
their body begins when a record has none) go to the :class:`~consumers.dense_assembly.DenseAssembler`
given as ``dense``: same model and shard policy, a damaged chunk quarantined like a damaged
row message; ``Outcome.dense`` carries the assembler's verdict (``served``: a new complete
version is served). Without ``dense`` they are quarantined (the row decoder refuses them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from consumers.dense_assembly import DenseAssembler
from consumers.errors import ApplyError
from consumers.sequencing import SeqTracker
from consumers.serving.dtypes import STORAGE_DTYPES
from consumers.serving.table import ServingTable
from deltastream.dense_wire import decode_dense, is_dense, is_dense_payload
from deltastream.wire import DecodedBatch, WireError, decode, parse_headers

__all__ = ["Applier", "Outcome", "OUTCOME_KINDS"]

log = logging.getLogger(__name__)

OUTCOME_KINDS = ("applied", "duplicate", "stale", "skipped", "quarantined")
_COUNTERS = ("messages", "applied", "rows", "deleted", "bytes", "duplicates", "stale",
             "skipped", "foreign_model", "quarantined", "gaps", "missing_seqs", "new_epochs",
             "tables_created")


@dataclass
class Outcome:
    """What :meth:`Applier.process` did with one record.

    kind: ``applied`` | ``duplicate`` | ``stale`` (older trainer epoch) | ``skipped`` (a shard
    not served here, or a message of another model: ``model`` says which) |
    ``quarantined`` (undecodable or invalid; ``reason`` says why).
    rows/deleted: rows upserted and ids deleted (applied only); bytes: record size.
    gap: inclusive range of seqs never seen before this one, or None.
    dense: for a dense chunk, the assembler's verdict (``taken``, ``served``, …; see
    :mod:`consumers.dense_assembly`); "" for row messages. ``table`` is None for it.
    Fields of the message are None when it could not be decoded.
    """

    kind: str
    reason: str = ""
    table: Optional[str] = None
    shard: Optional[int] = None
    epoch: Optional[int] = None
    seq: Optional[int] = None
    step: Optional[int] = None
    ts: Optional[int] = None
    model: Optional[str] = None
    rows: int = 0
    deleted: int = 0
    bytes: int = 0
    gap: Optional[tuple[int, int]] = None
    dense: str = ""


class Applier:
    """Decode, validate, sequence-check and apply records into ``tables``.

    Args:
        model: the model whose messages are applied; messages of other models are skipped
            and counted (``counters["foreign_model"]``, :attr:`models`).
        tables: name -> :class:`ServingTable`, updated in place (new tables are added when
            ``table_dims`` is None).
        seqs: sequence state, updated in place.
        table_dims: None = accept any table of ``model``, creating a table with the first
            batch's dim; a dict = only these tables with these dims (others quarantined).
        shards: None = all shards; a set = apply only these trainer shards (others skipped).
        dtype: storage dtype of tables this applier creates (``"f32"`` or ``"f16"``).
        dense: where dense chunks go (None: they are quarantined).

    One thread calls :meth:`process` (counters are plain ints); other threads may read the
    tables meanwhile (:class:`ServingTable` is safe for that).
    """

    def __init__(self, model: str, tables: dict[str, ServingTable], seqs: SeqTracker, *,
                 table_dims: Optional[dict[str, int]] = None,
                 shards: Optional[set[int]] = None, dtype: str = "f32",
                 dense: Optional[DenseAssembler] = None):
        if not isinstance(model, str) or not model:
            raise ValueError(f"model: expected a non-empty str, got {model!r}")
        if not isinstance(tables, dict):
            raise TypeError(f"tables: expected a dict name -> ServingTable, got "
                            f"{type(tables).__name__}")
        if not isinstance(seqs, SeqTracker):
            raise TypeError(f"seqs: expected a SeqTracker, got {type(seqs).__name__}")
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(STORAGE_DTYPES)}, got {dtype!r}")
        if table_dims is not None:
            if not isinstance(table_dims, dict):
                raise TypeError(f"table_dims: expected a dict name -> dim or None, got "
                                f"{type(table_dims).__name__}")
            for name, dim in table_dims.items():
                if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                    raise ValueError(f"table_dims[{name!r}]: expected a positive int, "
                                     f"got {dim!r}")
                t = tables.get(name)
                if t is not None and t.dim != dim:
                    raise ValueError(f"table_dims[{name!r}] = {dim} but the given table has "
                                     f"dim {t.dim}")
        if shards is not None:
            shards = set(shards)
            if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shards):
                raise ValueError(f"shards: expected non-negative ints, got {sorted(shards)!r}")
        for name, t in tables.items():
            if not isinstance(t, ServingTable) or t.name != name:
                raise ValueError(f"tables[{name!r}]: expected a ServingTable named {name!r}")
        self.model = model
        self.tables = tables
        self.seqs = seqs
        self.table_dims = None if table_dims is None else dict(table_dims)
        self.shards = shards
        self.dtype = dtype
        self.dense = dense
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        #: model name -> records seen of it (this model's included; undecodable ones not)
        self.models: dict[str, int] = {}
        self._stale_warned: set[tuple[str, int, int]] = set()

    def _foreign(self, b: Any, size: int, fields: dict) -> Outcome:
        """A message of another model: skipped and counted (the caller says so once)."""
        self.counters["skipped"] += 1
        self.counters["foreign_model"] += 1
        return Outcome("skipped", reason=f"model {b.model!r} is not {self.model!r}",
                       model=b.model, bytes=size, **fields)

    def _quarantine(self, reason: str, size: int, **fields: Any) -> Outcome:
        self.counters["quarantined"] += 1
        log.debug("quarantined message (%d bytes): %s", size, reason)
        return Outcome("quarantined", reason=reason, bytes=size, **fields)

    def process(self, value: Any, headers: Any = None, *,
                decoded: Optional[DecodedBatch] = None) -> Outcome:
        """Apply one record ``value`` (bytes) with its Kafka ``headers`` (optional list of
        (key, bytes)). Returns an :class:`Outcome`; never raises on bad data.

        ``decoded``: ``decode(value)``, when the caller already decoded the record (the
        replay tool reads its ``ts`` first); it is not decoded again."""
        self.counters["messages"] += 1
        try:
            size = len(value)
        except TypeError:
            size = 0
        if self.dense is not None and decoded is None \
                and (is_dense(headers) or is_dense_payload(value)):
            return self._dense(value, size)
        hdr = _headers(headers)
        if hdr is not None and self.shards is not None and hdr["shard"] not in self.shards \
                and hdr["model"] == self.model:
            self.models[self.model] = self.models.get(self.model, 0) + 1
            self.counters["skipped"] += 1
            return Outcome("skipped", reason=f"shard {hdr['shard']} not served",
                           table=hdr["table"], shard=hdr["shard"], epoch=hdr["epoch"],
                           seq=hdr["seq"], model=hdr["model"], bytes=size)
        try:
            b = decode(value) if decoded is None else decoded
        except WireError as e:
            return self._quarantine(f"decode: {e}", size)
        fields = {"table": b.table, "shard": b.shard, "epoch": b.epoch, "seq": b.seq,
                  "step": b.step, "ts": b.ts}
        self.models[b.model] = self.models.get(b.model, 0) + 1
        if b.model != self.model:
            return self._foreign(b, size, fields)
        fields["model"] = b.model
        refused = self._refusal(b, hdr, size, fields)
        if refused is not None:
            return refused
        verdict = self.seqs.check(b.table, b.shard, b.epoch, b.seq)
        if verdict.kind in ("duplicate", "stale_epoch"):
            return self._skip_seq(b, verdict.kind, size, fields)
        return self._apply(b, verdict, size, fields)

    def _dense(self, value: Any, size: int) -> Outcome:
        """A dense chunk: decoded, checked against model and shards, handed to the
        assembler. A damaged one is quarantined; its seq is never committed."""
        assert self.dense is not None
        try:
            c = decode_dense(value)
        except WireError as e:
            return self._quarantine(f"decode dense: {e}", size)
        fields = {"shard": c.shard, "epoch": c.epoch, "seq": c.seq, "step": c.step,
                  "ts": c.ts}
        self.models[c.model] = self.models.get(c.model, 0) + 1
        if c.model != self.model:
            return self._foreign(c, size, fields)
        fields["model"] = c.model
        if self.shards is not None and c.shard not in self.shards:
            self.counters["skipped"] += 1
            return Outcome("skipped", reason=f"shard {c.shard} not served", bytes=size,
                           **fields)
        verdict, why = self.dense.offer(c)
        if verdict == "refused":
            return self._quarantine(f"dense: {why}", size, dense=verdict, **fields)
        kind = {"taken": "applied", "served": "applied", "duplicate": "duplicate",
                "stale": "stale"}.get(verdict, "skipped")
        if kind == "duplicate":
            self.counters["duplicates"] += 1
        elif kind == "stale":
            self.counters["stale"] += 1
        elif kind == "skipped":
            self.counters["skipped"] += 1
        return Outcome(kind, reason=why, bytes=size, dense=verdict, **fields)

    def _refusal(self, b: DecodedBatch, hdr: Optional[dict], size: int,
                 fields: dict) -> Optional[Outcome]:
        """The policy checks of a batch of this model: headers agree with the body, a shard
        served here, a table known (when ``table_dims`` names them). None when it passes.
        The batch itself was validated by ``decode``; its dim is the table's to check."""
        if hdr is not None:
            body = {"model": b.model, "table": b.table, "shard": b.shard, "epoch": b.epoch,
                    "seq": b.seq}
            if hdr != body:
                return self._quarantine(f"headers {hdr} disagree with the message body {body}",
                                        size, **fields)
        if self.shards is not None and b.shard not in self.shards:
            self.counters["skipped"] += 1
            return Outcome("skipped", reason=f"shard {b.shard} not served", bytes=size,
                           **fields)
        if self.table_dims is not None and b.table not in self.table_dims:
            return self._quarantine(f"unknown table {b.table!r} (known: "
                                    f"{sorted(self.table_dims)})", size, **fields)
        return None

    def _skip_seq(self, b: DecodedBatch, kind: str, size: int, fields: dict) -> Outcome:
        """A duplicate or a message of a stale trainer epoch: counted, skipped."""
        if kind == "duplicate":
            self.counters["duplicates"] += 1
            return Outcome("duplicate", reason=f"seq {b.seq} already applied", bytes=size,
                           **fields)
        self.counters["stale"] += 1
        key = (b.table, b.shard, b.epoch)
        if key not in self._stale_warned:
            self._stale_warned.add(key)
            log.warning("table %r shard %d: skipping messages of stale epoch %d (a newer "
                        "trainer epoch is already applied)", b.table, b.shard, b.epoch)
        return Outcome("stale", reason=f"epoch {b.epoch} is older than the current one",
                       bytes=size, **fields)

    def _apply(self, b: DecodedBatch, verdict: Any, size: int, fields: dict) -> Outcome:
        """Apply ``b`` to its table (created with its first batch), commit its seq, count."""
        table = self.tables.get(b.table)
        created = table is None
        try:
            if created:
                dim = b.width if self.table_dims is None else self.table_dims[b.table]
                table = ServingTable(b.table, dim, dtype=self.dtype,
                                     capacity=max(1024, b.n))
            res = table.apply(b)
        except (ApplyError, ValueError, TypeError) as e:
            return self._quarantine(f"apply: {e}", size, **fields)
        if created:
            self.tables[b.table] = table
            self.counters["tables_created"] += 1
            log.info("table %r created (dim %d, %s)", b.table, table.dim, table.dtype)
        first = self.seqs.get(b.table, b.shard) is None
        self.seqs.commit(b.table, b.shard, b.epoch, b.seq, b.step)
        c = self.counters
        c["applied"] += 1
        c["rows"] += res.upserted
        c["deleted"] += res.deleted
        c["bytes"] += size
        if verdict.kind == "new_epoch":
            c["new_epochs"] += 1
            log.info("table %r shard %d: new trainer epoch %d", b.table, b.shard, b.epoch)
        elif first and b.seq:
            log.info("table %r shard %d: first message seen has seq %d (starting mid-stream)",
                     b.table, b.shard, b.seq)
        if verdict.missing is not None:
            lo, hi = verdict.missing
            c["gaps"] += 1
            c["missing_seqs"] += hi - lo + 1
            log.warning("table %r shard %d epoch %d: seq gap, missing %d..%d (%d messages)",
                        b.table, b.shard, b.epoch, lo, hi, hi - lo + 1)
        return Outcome("applied", rows=res.upserted, deleted=res.deleted, bytes=size,
                       gap=verdict.missing, **fields)


def _headers(headers: Any) -> Optional[dict]:
    """Parsed Kafka headers, or None when absent or malformed (they are only a hint)."""
    if not headers:
        return None
    try:
        return parse_headers(headers)
    except WireError as e:
        log.debug("ignoring malformed headers: %s", e)
        return None
