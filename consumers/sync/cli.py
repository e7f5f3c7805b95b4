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
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, Optional

from consumers.cpus import cpu_list_arg
from consumers.errors import ConsumerError, SnapshotError
from consumers.sync.daemon import SyncDaemon
from deltastream.cliargs import (
    EXIT_CODES,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    EnvArgumentParser,
    ListAction,
    add_kafka_arguments,
    add_logging_arguments,
    comma_list,
    existing_dir,
    kafka_settings,
    non_negative_float,
    port,
    positive_float,
    positive_int,
)
from deltastream.clilog import setup_logging
from deltastream.kafka_config import redacted, secret_values, tls_probe

__all__ = ["main", "build_parser", "parse_shards", "parse_tables"]

log = logging.getLogger(__name__)

#: prefix of this tool's environment variables
ENV_PREFIX = "DELTASTREAM_SYNC_"
#: Test hook: seconds to sleep after each record, so kill -9 tests land mid-stream.
DEBUG_DELAY_ENV = "DELTASTREAM_SYNC_DEBUG_APPLY_DELAY"


def parse_shards(text: str) -> list[int]:
    """``"0,2,5"`` -> ``[0, 2, 5]`` (non-negative ints, no repeats)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of shard numbers ≥ 0 like '0,2,5', got "
                f"{text!r}")
        if int(part) in out:
            raise argparse.ArgumentTypeError(f"shard {part} listed twice in {text!r}")
        out.append(int(part))
    return out


def parse_tables(text: str) -> dict[str, int]:
    """``"user:64,item:32"`` -> ``{"user": 64, "item": 32}``."""
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, dim = part.strip().rpartition(":")
        if not sep or not name or not dim.strip().isdigit() or int(dim) < 1:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated name:dim pairs like 'user:64,item:32', got "
                f"{text!r}")
        if name in out:
            raise argparse.ArgumentTypeError(f"table {name!r} listed twice in {text!r}")
        out[name] = int(dim)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``deltastream-sync``."""
    p = EnvArgumentParser(
        prog="deltastream-sync", env_prefix=ENV_PREFIX,
        description="Keep a predictor's serving tables in sync with a deltastream topic: "
                    "read the deltas a trainer publishes, apply them in partition order, and "
                    "checkpoint tables + offsets atomically so a restart resumes exactly "
                    "where it stopped. SIGTERM/SIGINT write a final checkpoint and exit 0.",
        epilog=EXIT_CODES + "; deltastream-sync exits 0 when stopped by SIGTERM/SIGINT.")
    add_kafka_arguments(p)
    p.add_argument("--model", required=True,
                   help="Model name; messages of other models are skipped and counted "
                        "(logged once per model).")
    p.add_argument("--topic", default=None,
                   help="Topic to read (default: deltas.<model>).")
    p.add_argument("--state-dir", required=True, metavar="DIR",
                   help="Directory for the checkpoint (tables + offsets + seq state) and the "
                        "quarantine file; created if missing. Restarts resume from it.")
    p.add_argument("--shards", type=parse_shards, default=None, metavar="N[,N...]",
                   help="Trainer shards to serve, comma-separated; only their partitions "
                        "(shard %% partitions) are read (default: all shards).")
    p.add_argument("--tables", type=parse_tables, default=None, metavar="NAME:DIM[,...]",
                   help="Serve only these tables with these row widths; messages of other "
                        "tables or dims are quarantined (default: every table of the model, "
                        "created on its first message).")
    p.add_argument("--dtype", choices=("f32", "f16"), default="f32",
                   help="Storage dtype of the serving tables.")
    p.add_argument("--checkpoint-interval", type=positive_float, default=5.0, metavar="S",
                   help="Seconds between checkpoints while new records arrive.")
    p.add_argument("--checkpoint-messages", type=positive_int, default=1000, metavar="N",
                   help="Also checkpoint after this many records.")
    p.add_argument("--checkpoint-max-segments", type=positive_int, default=128, metavar="N",
                   help="A checkpoint writes only the rows changed since the previous one (a "
                        "segment); after this many segments the full tables are rewritten.")
    p.add_argument("--checkpoint-segment-fraction", type=positive_float, default=0.5,
                   metavar="X",
                   help="Also rewrite the full tables when the segments add up to this "
                        "fraction of the full tables' size.")
    p.add_argument("--base", action=ListAction, type=comma_list, default=None,
                   metavar="DIR[,DIR...]",
                   help="Snapshot to start from when --state-dir holds no checkpoint (a "
                        "checkpoint, a `deltastream-replay rebuild` output, a trainer's "
                        "snapshot or a ServingTable.save directory): its tables, offsets and "
                        "seq state. Several (repeat the flag or separate with commas, e.g. "
                        "one per trainer shard) are merged; they must not overlap. A snapshot "
                        "of another topic than --topic is refused.")
    p.add_argument("--base-any-topic", action="store_true",
                   help="Start from a --base snapshot that records another topic anyway.")
    p.add_argument("--reset-state", action="store_true",
                   help="Remove the checkpoint in --state-dir (e.g. a damaged one, which "
                        "otherwise stops the daemon from starting) and start over from "
                        "--base or empty. Removes only what deltastream wrote. Use once, "
                        "not in a unit file: every start with it re-reads the topic.")
    p.add_argument("--group-id", default=None, metavar="GROUP",
                   help="Consumer group the next offsets are committed to after each "
                        "checkpoint, without joining it, so Kafka lag tools see this "
                        "predictor (default: deltastream-sync.<model>; '' disables). Give "
                        "replicas that serve the same shards distinct groups.")
    p.add_argument("--share-tables", action="store_true",
                   help="Share the tables with model-server processes of this host: they "
                        "read them from shared memory (/dev/shm) with "
                        "consumers.serving.TableReader.open(STATE_DIR, TABLE).")
    p.add_argument("--shm-dir", type=existing_dir, default=None, metavar="DIR",
                   help="Where shared tables live (default: $DELTASTREAM_SHM_DIR, else "
                        "/dev/shm), e.g. a tmpfs mounted with huge=within_size: lookups of "
                        "random ids get faster. Readers must be given the same DIR.")
    p.add_argument("--cpus", type=cpu_list_arg, default=None, metavar="LIST",
                   help="Run the apply loop and the checkpoint writer only on these CPUs "
                        "(e.g. 3 or 2-3,6; Linux), leaving the others to the model "
                        "servers: their lookups then seldom wait behind the daemon for a "
                        "CPU (default: any CPU).")
    p.add_argument("--metrics-port", type=port, default=None, metavar="PORT",
                   help="Serve Prometheus metrics on http://ADDR:PORT/metrics (0 = a free "
                        "port, logged; default: no endpoint).")
    p.add_argument("--metrics-addr", default="0.0.0.0", metavar="ADDR",
                   help="Address the metrics endpoint binds.")
    p.add_argument("--summary-interval", type=non_negative_float, default=30.0, metavar="S",
                   help="Seconds between one-line INFO summaries (0 = none).")
    p.add_argument("--quarantine-max-bytes", type=positive_int, default=64 << 20,
                   metavar="BYTES",
                   help="Size at which quarantine.jsonl is rotated to quarantine.jsonl.1.")
    p.add_argument("--request-timeout", type=positive_float, default=5.0, metavar="S",
                   help="Seconds a broker request may take before the broker counts as down.")
    p.add_argument("--backoff-max", type=positive_float, default=5.0, metavar="S",
                   help="Cap of the exponential reconnect backoff.")
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
    setup_logging(args.log_level, verbose=args.verbose, secrets=secret_values(kafka))
    topic = args.topic or f"deltas.{args.model}"
    problem = tls_probe(args.bootstrap_servers, kafka, args.request_timeout)
    if problem:  # a broker that is down is waited for; one that refuses TLS is not
        print(f"deltastream-sync: error: {problem}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        daemon = SyncDaemon(
            args.bootstrap_servers, topic, model=args.model, state_dir=args.state_dir,
            tables=args.tables, shards=args.shards, dtype=args.dtype,
            checkpoint_interval=args.checkpoint_interval,
            checkpoint_messages=args.checkpoint_messages, base=args.base,
            base_any_topic=args.base_any_topic,
            checkpoint_max_segments=args.checkpoint_max_segments,
            checkpoint_segment_fraction=args.checkpoint_segment_fraction,
            quarantine_max_bytes=max(1024, args.quarantine_max_bytes),
            request_timeout=args.request_timeout, backoff_max=args.backoff_max,
            summary_interval=args.summary_interval, metrics_port=args.metrics_port,
            metrics_addr=args.metrics_addr, reset_state=args.reset_state,
            group_id=args.group_id, share_tables=args.share_tables, shm_dir=args.shm_dir,
            cpus=args.cpus, **kafka)
    except SnapshotError as e:
        hint = "" if args.reset_state else " (--reset-state starts over, removing only what " \
            "deltastream wrote)"
        print(f"deltastream-sync: error: cannot load the state: {e}{hint}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, TypeError, OSError, ConsumerError) as e:
        print(f"deltastream-sync: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if signalled:
        daemon.request_stop()
    delay = os.environ.get(DEBUG_DELAY_ENV)
    if delay:
        daemon.debug_apply_delay = float(delay)
    log.info("deltastream-sync: model %s, topic %s on %s%s, state %s (%s)%s", args.model,
             topic, args.bootstrap_servers,
             f" ({redacted(kafka)})" if kafka else "", args.state_dir, daemon.source,
             f", metrics on port {daemon.metrics_port}" if daemon.metrics_port is not None
             else "")
    daemon.run()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
