"""The flags of ``deltastream-replay``, each spelled once as a dataclass field.

The read side its subcommands share: :class:`Source` (topic, model, broker timeout,
progress bar: every subcommand, ``diff`` only with ``--rebuild``), :class:`ReadRange`
(partitions and the offset/time window: ``rebuild``, ``dump``, ``stats``; its field names
are the keywords of :func:`~consumers.replay.rebuild.rebuild`,
:func:`~consumers.replay.inspect.dump` and :func:`~consumers.replay.inspect.stats`) and
:class:`StreamFilter` (tables and shards shown: ``dump``, ``stats``); then one class per
subcommand for its own flags. ``consumers.replay.cli`` generates the flags from them
(:func:`deltastream.cliargs.add_field_flags`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

from consumers.replay.plan import parse_offsets, parse_seq_range, parse_time
from consumers.sync.options import parse_shards, parse_tables
from deltastream.cliargs import (
    BROKER_TIMEOUT_S,
    non_negative_float,
    option,
    positive_float,
    positive_int,
)

__all__ = ["Source", "ReadRange", "StreamFilter", "RebuildFlags", "DumpFlags", "StatsFlags",
           "DiffFlags", "DIFF_SOURCE_HELP"]


class _BadValue(argparse.ArgumentTypeError, ValueError):
    """A bad flag value: argparse reports ArgumentTypeError; EnvArgumentParser catches
    ValueError for values from the environment. Both then print one line and exit 2."""


def _typed(fn: Any, what: str) -> Any:
    def conv(text: str) -> Any:
        try:
            return fn(text)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise _BadValue(str(e)) from None
    conv.__name__ = what
    return conv


def _int_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"expected comma-separated ints ≥ 0 like '0,2', got {text!r}")
        if int(part) not in out:
            out.append(int(part))
    return out


def _step(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"expected a trainer step, an int ≥ 0, got {text!r}")
    return int(text)


def _name_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"expected comma-separated names, got {text!r}")
    return names


@dataclass
class Source:
    """Where the records come from (besides the Kafka connection flags)."""

    topic: Optional[str] = option(None, "Deltas topic (default: deltas.<model>).", flag={})
    model: Optional[str] = option(
        None, "Model name: rebuild applies only its messages, dump/stats show only its "
        "messages (default: from a topic named deltas.<model>; dump/stats: all models).",
        flag={})
    timeout: float = option(
        BROKER_TIMEOUT_S, "Seconds to wait for the broker to answer (as deltastream topic).",
        flag={"type": _typed(positive_float, "seconds"), "metavar": "S"})
    no_progress: bool = option(
        False, "Never draw a progress bar (it is drawn only when stderr is a terminal "
        "anyway).", flag={"action": "store_true"})


#: ``diff``'s help for the :class:`Source` fields that mean something else there
DIFF_SOURCE_HELP = {
    "topic": "Deltas topic (default: deltas.<model>). (only with --rebuild; default: the "
             "snapshot's meta)",
    "model": "With --rebuild: the model whose messages the rebuild compared with A applies "
             "(default: the snapshot's meta).",
}


@dataclass
class ReadRange:
    """Which part of the topic is read: partitions, offsets, and a trainer-clock window."""

    partitions: Optional[list[int]] = option(
        None, "Read only these partitions (default: all).",
        flag={"type": _typed(_int_list, "partitions"), "metavar": "P[,P...]"})
    from_offsets: Optional[dict[int, int]] = option(
        None, "Start offset per partition, e.g. 0=10,1=5; unlisted partitions start at the "
        "earliest offset.", flag={"type": _typed(parse_offsets, "offsets"),
                                  "metavar": "P=OFF[,...]"})
    to_offsets: Optional[dict[int, int]] = option(
        None, "Stop offset (exclusive) per partition; unlisted partitions are read to their "
        "end.", flag={"type": _typed(parse_offsets, "offsets"), "metavar": "P=OFF[,...]"})
    from_time: Optional[int] = option(
        None, "Use only messages whose ts (trainer clock) is at or after TIME: ns since the "
        "epoch or ISO-8601 (UTC unless a zone is given). The whole offset range is still "
        "read, since ts is not monotonic along a partition.",
        flag={"type": _typed(parse_time, "time"), "metavar": "TIME"})
    to_time: Optional[int] = option(
        None, "Use only messages whose ts is at or before TIME (inclusive); format as "
        "--from-time.", flag={"type": _typed(parse_time, "time"), "metavar": "TIME"})


@dataclass
class StreamFilter:
    """Which (table, shard) streams ``dump`` and ``stats`` show."""

    table: Optional[list[str]] = option(
        None, "Only messages of these tables.",
        flag={"type": _typed(_name_list, "tables"), "metavar": "NAME[,NAME...]"})
    shard: Optional[list[int]] = option(
        None, "Only messages of these trainer shards.",
        flag={"type": _typed(_int_list, "shards"), "metavar": "N[,N...]"})


@dataclass
class RebuildFlags:
    """``rebuild``'s own flags."""

    to_step: Optional[int] = option(
        None, "Use only messages of trainer step STEP or earlier (the state the trainers had "
        "published at that step, dense versions included).",
        flag={"type": _typed(_step, "step"), "metavar": "STEP"})
    out: Optional[str] = option(
        None, "Snapshot directory to write (replaced atomically).",
        flag={"required": True, "metavar": "DIR", "env_local": True})
    base: Optional[str] = option(
        None, "Start from this snapshot (tables, seq state) at its offsets instead of empty "
        "tables at the earliest offsets.", flag={"metavar": "DIR"})
    tables: Optional[dict[str, int]] = option(
        None, "Apply only these tables with these dims (others are quarantined), as "
        "deltastream-sync --tables; default: every table of the model.",
        flag={"type": _typed(parse_tables, "tables"), "metavar": "NAME:DIM[,...]"})
    shards: Optional[frozenset[int]] = option(
        None, "Apply only these trainer shards (and read their partitions).",
        flag={"type": _typed(parse_shards, "shards"), "metavar": "N[,N...]"})
    dtype: str = option("f32", "Storage dtype of the rebuilt tables.",
                        flag={"choices": ("f32", "f16")})
    json: bool = option(False, "Print a JSON summary (offsets, counters, tables) on stdout.",
                        flag={"action": "store_true"})


@dataclass
class DumpFlags:
    """``dump``'s own flags."""

    seq_range: Optional[tuple[Optional[int], Optional[int]]] = option(
        None, "Only seqs in this inclusive range (either end may be left out: '10:', ':20').",
        flag={"type": _typed(parse_seq_range, "seq range"), "metavar": "FIRST:LAST"})
    rows: bool = option(False, "Include ids, row values (float32) and tombstone ids.",
                        flag={"action": "store_true"})
    limit: Optional[int] = option(None, "Stop after N lines.",
                                  flag={"type": _typed(positive_int, "count"), "metavar": "N"})
    out: str = option("-", "Write the lines to FILE instead of stdout ('-').",
                      flag={"metavar": "FILE", "env_local": True})


@dataclass
class StatsFlags:
    """``stats``' own flags."""

    json: bool = option(False, "Print JSON instead of a table.", flag={"action": "store_true"})


@dataclass
class DiffFlags:
    """``diff``'s own flags (besides the snapshots A and B)."""

    rebuild: bool = option(False, "Compare A with a rebuild of the topic up to A's offsets.",
                           flag={"action": "store_true"})
    tolerance: float = option(
        0.0, "Largest absolute element difference still counted as equal.",
        flag={"type": _typed(non_negative_float, "tolerance"), "metavar": "X"})
    json: bool = option(False, "Print the report as JSON.", flag={"action": "store_true"})
