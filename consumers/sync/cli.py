"""``deltastream-sync``: run a :class:`~consumers.sync.daemon.SyncDaemon` as a process.

Every flag also reads a ``DELTASTREAM_SYNC_*`` environment variable (named in ``--help``;
the shared ``DELTASTREAM_BOOTSTRAP_SERVERS``, ``DELTASTREAM_KAFKA_*`` and
``DELTASTREAM_LOG_LEVEL`` come after the tool's own); the command line wins. SIGTERM and
SIGINT stop the daemon, which writes its final checkpoint; the process then exits 0.
Exit codes (all tools): 0 stopped cleanly, 2 bad arguments or unusable state/base (a
damaged checkpoint — the message names the path; ``--reset-state`` starts over —, another
model or topic), 3 the broker refuses the TLS/SASL settings. A full or read-only state disk
is not fatal: write failures are counted and logged and the daemon keeps serving.

Example::

    deltastream-sync --bootstrap-servers kafka:9092 --model ranker \\
        --state-dir /var/lib/deltastream/ranker --shards 0,1 --metrics-port 9464
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from consumers.errors import ConsumerError, SnapshotError
from consumers.sync.daemon import SyncDaemon
from consumers.sync.options import SyncOptions, parse_shards, parse_tables
from consumers.sync.stall import StartupTimeout
from deltastream.cliargs import (
    EXIT_CODES,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    EnvArgumentParser,
    add_field_flags,
    add_kafka_arguments,
    add_logging_arguments,
    field_values,
    kafka_settings,
)
from deltastream.clilog import setup_cli_logging
from deltastream.kafka_config import redacted, secret_values, tls_probe

# parse_shards / parse_tables: from options
__all__ = ["main", "build_parser", "parse_shards", "parse_tables", "os_error_line"]

log = logging.getLogger(__name__)

#: prefix of this tool's environment variables
ENV_PREFIX = "DELTASTREAM_SYNC_"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``deltastream-sync``: the shared Kafka and logging flags,
    and one flag per :class:`~consumers.sync.options.SyncOptions` field that has one
    (its help, default and type are the field's)."""
    p = EnvArgumentParser(
        prog="deltastream-sync", env_prefix=ENV_PREFIX, brief=True,
        description="Keep a predictor's serving tables in sync with a deltastream topic: "
                    "read the deltas a trainer publishes, apply them in partition order, and "
                    "checkpoint tables + offsets atomically so a restart resumes exactly "
                    "where it stopped. SIGTERM/SIGINT write a final checkpoint and exit 0. "
                    "Each flag also reads a variable (--help-env); the full text of each "
                    "option is in the SyncOptions documentation.",
        epilog=EXIT_CODES + "; deltastream-sync exits 0 when stopped by SIGTERM/SIGINT.")
    add_kafka_arguments(p)
    add_field_flags(p, SyncOptions)
    add_logging_arguments(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``deltastream-sync``; returns the process exit code."""
    # Handlers first: a SIGTERM that arrives while the state loads must still end in a
    # clean stop (final checkpoint, exit 0), not in the default kill.
    daemon: Any = None
    signalled: list[int] = []

    def _on_signal(signum: int, _frame: Any) -> None:
        signalled.append(signum)
        log.info("%s received: stopping after the current record", signal.Signals(signum).name)
        if daemon is not None:
            daemon.request_stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    parser = build_parser()
    args = parser.parse_args(argv)
    kafka = kafka_settings(args, parser, ENV_PREFIX)
    # kafka-python logs every failed reconnect; the daemon logs each state change once
    setup_cli_logging(args, secrets=secret_values(kafka))
    settings = field_values(args, SyncOptions)
    topic = settings["topic"] = args.topic or f"deltas.{args.model}"
    problem = tls_probe(args.bootstrap_servers, kafka, args.request_timeout)
    if problem:  # a broker that is down is waited for; one that refuses TLS is not
        print(f"deltastream-sync: error: {problem}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        daemon = SyncDaemon(SyncOptions(args.bootstrap_servers, consumer_config=kafka,
                                        **settings))
    except SnapshotError as e:
        hint = "" if args.reset_state else " (--reset-state starts over, removing only what " \
            "deltastream wrote)"
        print(f"deltastream-sync: error: cannot load the state: {e}{hint}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"deltastream-sync: error: {os_error_line(e, args)}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, TypeError, ConsumerError) as e:
        print(f"deltastream-sync: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if signalled:
        daemon.request_stop()
    log.info("deltastream-sync: model %s, topic %s on %s%s, state %s (%s)%s", args.model,
             topic, args.bootstrap_servers,
             f" ({redacted(kafka)})" if kafka else "", args.state_dir, daemon.source,
             f", metrics on port {daemon.metrics_port}" if daemon.metrics_port is not None
             else "")
    try:
        daemon.run()
    except StartupTimeout as e:
        print(f"deltastream-sync: error: {e}", file=sys.stderr)
        return EXIT_USAGE if e.kind == "model" else EXIT_UNAVAILABLE
    return EXIT_OK


def os_error_line(e: OSError, args: argparse.Namespace) -> str:
    """One plain line for an ``OSError`` met while starting: the flag and the path or port
    it is about, what is wrong, no ``[Errno N]``."""
    what = e.strerror or str(e)
    if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES) and not e.filename:
        return (f"--metrics-port {args.metrics_port}: cannot listen on "
                f"{args.metrics_addr}:{args.metrics_port}: {what.lower()} (another process "
                f"holds it? pick another port, or 0 for any free one)")
    path = str(e.filename) if e.filename else None
    if path is not None:
        state = Path(args.state_dir)
        inside = Path(path) == state or state in Path(path).parents \
            or Path(path) in state.parents
        if inside and e.errno in (errno.EEXIST, errno.ENOTDIR):
            return (f"--state-dir {args.state_dir}: {path} exists and is not a directory "
                    f"(the state dir must be a directory, or a path that does not exist yet)")
        return f"--state-dir {args.state_dir}: {path}: {what.lower()}" if inside \
            else f"{path}: {what.lower()}"
    return what


if __name__ == "__main__":
    sys.exit(main())
