"""``deltastream-replay``: rebuild, dump, stats and diff over a deltas topic.

Subcommands::

    deltastream-replay rebuild --bootstrap-servers kafka:9092 --model ranker --out snap/
    deltastream-replay rebuild ... --base snap/ --out snap2/        # continue a snapshot
    deltastream-replay rebuild ... --to-time 2024-05-01T12:00:00Z --out at-noon/
    deltastream-replay dump    ... --table user --seq-range 10:20 --rows
    deltastream-replay stats   ... [--json]
    deltastream-replay diff    A B [--tolerance 1e-6] [--json]
    deltastream-replay diff    A --rebuild --bootstrap-servers kafka:9092

A subcommand's flag also reads ``DELTASTREAM_REPLAY_<SUBCOMMAND>_<FLAG>``, then the
tool-wide ``DELTASTREAM_REPLAY_<FLAG>`` (``--out`` only the former: it means a directory to
``rebuild`` and a file to ``dump``); the shared settings (``DELTASTREAM_BOOTSTRAP_SERVERS``,
``DELTASTREAM_KAFKA_*``, ``DELTASTREAM_LOG_LEVEL``) come last. Names are in ``--help``; the
command line wins. A progress bar is drawn on stderr when it is a terminal.

Exit codes (one table for all tools): 0 success (for ``diff``: no differences), 1 ``diff``
found differences, 2 usage or input error (bad arguments, bad offsets, a damaged snapshot,
an ``--out`` that holds anything but a deltastream snapshot — never replaced —, a topic
range holding records of other models only — the message names them), 3 broker or topic
unavailable (unreachable, TLS/SASL refused, no such topic), 130 interrupted; errors are one
line on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, TextIO

from consumers.errors import (
    BrokerUnavailable,
    ReplayError,
    SnapshotError,
    TopicError,
    TopicNotFound,
)
from consumers.files import MANIFEST
from consumers.replay.diff import diff_snapshots, diff_with_rebuild
from consumers.replay.inspect import dump, dumps_line, stats
from consumers.replay.options import (
    DIFF_SOURCE_HELP,
    DiffFlags,
    DumpFlags,
    ReadRange,
    RebuildFlags,
    Source,
    StatsFlags,
    StreamFilter,
)
from consumers.replay.rebuild import rebuild
from deltastream.cliargs import (
    EXIT_CODES,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ONE_SHOT,
    EnvArgumentParser,
    add_field_flags,
    add_kafka_arguments,
    add_logging_arguments,
    field_values,
    kafka_settings,
)
from deltastream.clilog import kafka_hint, setup_cli_logging
from deltastream.errors import error_text
from deltastream.kafka_config import REFUSED_GRACE_S, refused_everywhere, secret_values

__all__ = ["main", "build_parser"]

log = logging.getLogger(__name__)

PROG = "deltastream-replay"
ENV_PREFIX = "DELTASTREAM_REPLAY_"
EXIT_DIFF = EXIT_FAILED


def _add_source(p: argparse.ArgumentParser, *, for_diff: bool = False) -> None:
    """The Kafka connection flags and :class:`Source`'s (``diff``: only with --rebuild)."""
    add_kafka_arguments(p, required=False, help_suffix=" (only with --rebuild)" if for_diff
                        else "")
    add_field_flags(p, Source, DIFF_SOURCE_HELP if for_diff else None)


def _add_read(p: argparse.ArgumentParser) -> None:
    """The flags of a subcommand that reads a range of the topic."""
    _add_source(p)
    add_field_flags(p, ReadRange)


def _add_rebuild(command: Any) -> None:
    """The ``rebuild`` subcommand and its flags (``command``: makes a subparser)."""
    r = command("rebuild", help="apply a range of the topic into tables and write a "
                       "snapshot", description="Read the topic from the earliest offsets "
                       "(or --from-offsets / --base) up to the end (or --to-offsets), apply "
                       "the messages through the same Applier as deltastream-sync, and write "
                       "a snapshot directory usable as deltastream-sync --base. With "
                       "--from-time/--to-time only messages whose ts lies in the window are "
                       "applied.")
    _add_read(r)
    add_field_flags(r, RebuildFlags)


def _add_dump(command: Any) -> None:
    """The ``dump`` subcommand and its flags (``command``: makes a subparser)."""
    d = command("dump", help="print decoded messages as JSON lines",
                       description="Print one JSON object per message: partition, offset, "
                       "model, table, shard, epoch, seq, step, ts, n, dim, dtype, tombstones "
                       "(count), bytes; with --rows also ids, rows and deleted ids. A record "
                       "that does not decode prints as {\"error\": ...} with the first bytes "
                       "in hex.")
    _add_read(d)
    add_field_flags(d, StreamFilter)
    add_field_flags(d, DumpFlags)


def _add_stats(command: Any) -> None:
    """The ``stats`` subcommand and its flags (``command``: makes a subparser)."""
    s = command("stats", help="per table and shard: messages, rows, ids, bytes, "
                       "epochs, seq gaps, duplicates, time span",
                       description="Count, per (table, shard) stream of the range: messages, "
                       "rows, unique ids, tombstones, bytes, epochs, seq gaps (count and "
                       "ranges), duplicates, stale-epoch messages, first and last ts; plus "
                       "undecodable records.")
    _add_read(s)
    add_field_flags(s, StreamFilter)
    add_field_flags(s, StatsFlags)


def _add_diff(command: Any) -> None:
    """The ``diff`` subcommand and its flags (``command``: makes a subparser)."""
    f = command("diff", help="compare two snapshots, or a snapshot with a rebuild",
                       description="Compare the tables of snapshot A with snapshot B (or, "
                       "with --rebuild, with a fresh rebuild of the topic from the earliest "
                       "offsets up to A's offsets): per table, ids only in A, only in B, rows "
                       "that differ by more than --tolerance, and the largest difference. "
                       "Exit code 1 when anything differs.")
    f.add_argument("a", metavar="A", help="Snapshot directory.")
    f.add_argument("b", metavar="B", nargs="?", default=None,
                   help="Second snapshot directory (omit with --rebuild).")
    add_field_flags(f, DiffFlags)
    _add_source(f, for_diff=True)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``deltastream-replay``."""
    p = EnvArgumentParser(prog=PROG, env_prefix=ENV_PREFIX,
                          description="Replay a deltastream topic: rebuild serving tables at "
                          "an offset or a point in time, dump decoded messages, count "
                          "per-stream stats, diff snapshots.",
                          epilog=EXIT_CODES + " (diff: 1 when the snapshots differ).")
    add_logging_arguments(p, kind=ONE_SHOT)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def command(name: str, **kw: Any) -> EnvArgumentParser:
        sp = sub.add_parser(name, env_prefix=f"{ENV_PREFIX}{name.upper()}_",
                            env_parent=ENV_PREFIX, epilog=EXIT_CODES, **kw)
        add_logging_arguments(sp, kind=ONE_SHOT, again=p)
        return sp

    for add in (_add_rebuild, _add_dump, _add_stats, _add_diff):
        add(command)
    return p


class _Usage(Exception):
    """A usage error found after parsing (missing combination of flags)."""


def _check_broker(args: argparse.Namespace, what: str = "") -> None:
    """A usage error without ``--bootstrap-servers``; :class:`BrokerUnavailable` when
    nothing listens there, after :data:`REFUSED_GRACE_S` (a broker started just before)
    or ``--timeout`` if shorter, not after ``--timeout`` of retries."""
    if not args.bootstrap_servers:
        raise _Usage(f"{what}no broker given: pass --bootstrap-servers HOST:PORT or set "
                     f"{ENV_PREFIX}BOOTSTRAP_SERVERS or DELTASTREAM_BOOTSTRAP_SERVERS")
    problem = refused_everywhere(args.bootstrap_servers,
                                 grace=min(REFUSED_GRACE_S, args.timeout))
    if problem:
        raise BrokerUnavailable(problem)


def _topic_model(args: argparse.Namespace, *, need_model: bool) -> tuple[str, Optional[str]]:
    _check_broker(args)
    topic, model = args.topic, args.model
    if not topic:
        if not model:
            raise _Usage("give --topic or --model (the topic defaults to deltas.<model>)")
        topic = f"deltas.{model}"
    if need_model and not model:
        if topic.startswith("deltas.") and len(topic) > len("deltas."):
            model = topic[len("deltas."):]
        else:
            raise _Usage(f"give --model: topic {topic!r} is not named deltas.<model>")
    return topic, model


def _progress(args: argparse.Namespace) -> bool:
    return not args.no_progress and sys.stderr.isatty()


def _range_kwargs(args: argparse.Namespace) -> dict:
    """The keywords of rebuild/dump/stats that :class:`ReadRange` names."""
    return field_values(args, ReadRange)


def _cmd_rebuild(args: argparse.Namespace) -> int:
    topic, model = _topic_model(args, need_model=True)
    res = rebuild(args.bootstrap_servers, topic, model=model, out=args.out, base=args.base,
                  to_step=args.to_step, table_dims=args.tables, shards=args.shards,
                  dtype=args.dtype,
                  progress=_progress(args), timeout=args.timeout, kafka_config=args.kafka,
                  **_range_kwargs(args))
    c = res.counters
    rows = {name: len(t) for name, t in sorted(res.tables.items())}
    if args.json:
        print(json.dumps({"out": str(res.path), "topic": topic, "model": model,
                          "offsets": {str(p): o for p, o in res.offsets.items()},
                          "range": res.plan.to_json()["partitions"], "counters": c,
                          "tables": rows, "digests": {n: t.digest() for n, t in
                                                      sorted(res.tables.items())}}))
    sizes = ", ".join(f"{n}: {k} ids" for n, k in rows.items()) or "none"
    print(f"{PROG}: rebuilt {len(rows)} tables ({sizes}) from {c['records']} records into "
          f"{res.path}; applied "
          f"{c['applied']}, quarantined {c['quarantined']}, duplicates {c['duplicates']}, "
          f"gaps {c['gaps']}, stale {c['stale']}, outside time {c['outside_time']}; resume "
          f"offsets {res.offsets}", file=sys.stderr)
    return EXIT_OK


def _open_out(path: str) -> TextIO:
    """``dump --out``'s file, opened before anything is read; a usage error naming it."""
    if Path(path).is_dir():
        raise _Usage(f"--out {path}: is a directory; give a file path, or - for stdout")
    try:
        return open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by _cmd_dump
    except OSError as e:
        raise _Usage(f"--out {path}: cannot write there ({e.strerror})") from None


def _snapshot_arg(path: Optional[str]) -> Optional[str]:
    """A snapshot path for ``diff``; a daemon's state dir gets a hint to its checkpoint."""
    if path is not None and not (Path(path) / MANIFEST).exists() \
            and (Path(path) / "checkpoint" / MANIFEST).exists():
        raise _Usage(f"{path} is a daemon's state dir, not a snapshot: give "
                     f"{Path(path) / 'checkpoint'}")
    return path


def _cmd_dump(args: argparse.Namespace) -> int:
    out = sys.stdout if args.out == "-" else _open_out(args.out)
    try:
        return _dump_to(args, out)
    finally:
        if out is not sys.stdout:
            out.close()


def _dump_to(args: argparse.Namespace, out: TextIO) -> int:
    topic, model = _topic_model(args, need_model=False)
    lines = dump(args.bootstrap_servers, topic, model=model, tables=args.table,
                 shards=args.shard, seq_range=args.seq_range, rows=args.rows,
                 progress=_progress(args), timeout=args.timeout, kafka_config=args.kafka,
                 **_range_kwargs(args))
    n = 0
    try:
        for line in lines:
            out.write(dumps_line(line) + "\n")
            n += 1
            if args.limit is not None and n >= args.limit:
                break
        out.flush()
    except BrokenPipeError:
        # `dump | head`: the reader has what it wanted; exit quietly
        try:
            sys.stdout = open("/dev/null", "w")  # noqa: SIM115 - replaces a closed stdout
        except OSError:
            pass
        return EXIT_OK
    finally:
        lines.close()
    return EXIT_OK


def _cmd_stats(args: argparse.Namespace) -> int:
    topic, model = _topic_model(args, need_model=False)
    st = stats(args.bootstrap_servers, topic, model=model, tables=args.table,
               shards=args.shard, progress=_progress(args), timeout=args.timeout,
               kafka_config=args.kafka, **_range_kwargs(args))
    if args.json:
        print(json.dumps(st.to_json(), indent=1))
    else:
        print(st.format_table())
    return EXIT_OK


def _cmd_diff(args: argparse.Namespace) -> int:
    if args.rebuild:
        if args.b is not None:
            raise _Usage("diff: give either two snapshots or one snapshot with --rebuild")
        _check_broker(args, "diff --rebuild: ")
        rep = diff_with_rebuild(_snapshot_arg(args.a), bootstrap_servers=args.bootstrap_servers,
                                topic=args.topic, model=args.model, tolerance=args.tolerance,
                                progress=_progress(args), timeout=args.timeout,
                                kafka_config=args.kafka)
    else:
        if args.b is None:
            raise _Usage("diff: give two snapshots A B, or one snapshot with --rebuild")
        rep = diff_snapshots(_snapshot_arg(args.a), _snapshot_arg(args.b),
                             tolerance=args.tolerance)
    print(json.dumps(rep.to_json(), indent=1) if args.json else rep.format_text())
    return EXIT_OK if rep.equal else EXIT_DIFF


_COMMANDS = {"rebuild": _cmd_rebuild, "dump": _cmd_dump, "stats": _cmd_stats,
             "diff": _cmd_diff}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``deltastream-replay``; returns the process exit code."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.kafka = kafka_settings(args, parser, ENV_PREFIX)
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    setup_cli_logging(args, fmt=f"{PROG}: %(levelname)s: %(message)s",
                      secrets=secret_values(args.kafka))
    where = f"{PROG} {args.command}: error"
    try:
        return _COMMANDS[args.command](args)
    except _Usage as e:
        print(f"{where}: {e} (see {PROG} {args.command} --help)", file=sys.stderr)
    except (BrokerUnavailable, TopicNotFound) as e:
        print(f"{where}: {e}{kafka_hint(str(e))}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (TopicError, ReplayError, SnapshotError) as e:
        print(f"{where}: {e}", file=sys.stderr)
    except (OSError, ValueError) as e:
        print(f"{where}: {error_text(e)}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
